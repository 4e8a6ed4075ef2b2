"""Checkpoints that survive interruption, resume exactly, resume at another SP/DP layout, and export:
`protocol` (the files a checkpoint adds to DeepSpeed's, the atomic commit, the manifest), `resume`
(`StrategyCheckpoints`, the strategy's side: staged saves, exact resumes, evaluation loads of ZeRO-3 checkpoints),
`command_line` (`python -m lightning_ulysses checkpoint {inspect,export}`: the weights and Hugging Face folders of a
checkpoint)."""
