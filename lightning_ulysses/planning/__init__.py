"""What a run will need and how to run it fastest, before it runs: `planner` (GPU and host bytes by term, the longest
sequence that fits), `step_time` (seconds of a step by term) and `calibration` (the measurements it is fit to),
`auto` (`memory="auto"`: the fastest configuration that fits), `preflight` (this machine's checks, with advice) and
`plan` (`python -m lightning_ulysses plan`)."""
