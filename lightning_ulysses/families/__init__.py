"""One module per model family: what every layer needs to know about it, one `Family` record
(`lightning_ulysses.adapters.registry`), registered on import.

A family module declares only what is particular to its family: its inline attention (a module that computes
attention itself), its query correction, its position rule, the kinds of mixer its token mixers split by and their
class names, what validation refuses of it, its layers' kinds for the planner. It may import the mechanisms it
declares (a mixer kind of `mixers/`, the planner's cost parts of `planning/layer_kinds.py`); no layer imports a
family module, they read the registry. Most families need no module: their attention dispatches through
transformers' interfaces, and a mixer of a known structure is recognised by its kind (`Family.token_mixers`).

Adding a family: a module here, imported below, and its entry in the model-family matrix
(tests/distributed/families.py); docs/adding-a-family.md says how, step by step.
"""

from lightning_ulysses.families import (  # noqa: F401  (they register themselves)
    bamba, bert_generation, bloom, doge, dory, falcon, falcon_h1, falcon_mamba, gpt_neo, granitemoehybrid,
    jamba, kimi_linear, lfm2, llama4, mamba, mamba2, minimax, mpt, nemotron_h, olmo_hybrid, opt, qwen3_5,
    qwen3_next, recurrent_gemma, rwkv, trocr, xglm, xlnet, xlstm, zamba2)
