"""Ulysses attention for Hugging Face models, switched on per model instance.

`transformers` picks attention and mask functions by the name in the config's attention implementation. We register
`"ulysses"` and, for each prepared model while it is prepared, a name of its own (`"ulysses-<n>"`, whose mask
function is bound to that model; registration is the only process-wide step, and it changes no existing name), and
switch a model to its name on a *private copy* of its config: `from_config(cfg)` models share the caller's config object, and
flipping the shared one would silently change every other model built from it. The model's own backend
(sdpa, flash-attention 2/3, flex) and its SP group live on its modules (`_lightning_ulysses`), so two models in
one process can use different backends and groups, and `restore()` gives the model back exactly as it was.

The "ulysses" function runs the same core as native models (`core.ulysses_attention`), with the model's
`attn_implementation` as the backend name. Packed rows: transformers detects them from `position_ids` that do
not continue by one, but only when no `attention_mask` is given (then its mask function, ours included, gets
`None`); we read documents from the gathered global `position_ids` in every case, so with an `attention_mask`
too, packed documents stay apart under SP where the unsharded transformers model would let them see each other.
With a ring (hybrid Ulysses × ring, `prepare_hf_model(..., ring_group=...)`) the same function runs ring
attention in place of the backend (see `core.ulysses_attention` for what the ring refuses).

Beyond plain causal attention: sliding windows and chunks reach the attention through our mask interface (a
marker carrying the pattern, applied on whole rows by the core); eager attention and arguments only the model's own
attention function applies (soft-capping, sinks) run that function on whole rows of each rank's heads
(`_OwnAttention`); token mixers that are not attention run on whole rows (`mixers/`); per-family
corrections of positions a module counts itself are declared in `lightning_ulysses/families/` (read through the
registry, `lightning_ulysses.adapters`), and so are the families whose modules compute attention inline (BLOOM,
MPT, Falcon, GPT-Neo, XGLM), taken over module by module (attention/inline.py) instead of switched.

We do not use DeepSpeed's `UlyssesSPAttentionHF`: it registers process-wide, fixes the batch size at
construction, can be set up once per process and drops padding masks.

The integration, one concern a file: `binding.py` (what a prepared model's modules share), `prepare.py`
(`prepare_hf_model` and its undo), `forward.py` (the "ulysses" attention function), `own_attention.py` (the model's
own attention on whole rows), `mask_interface.py` (the "ulysses" mask function), `decoding.py` (decoding from an SP
prefill), `validation.py` (what is refused before anything is touched) and `positions.py` (the position hooks).
"""

from lightning_ulysses.hf.binding import ULYSSES_ATTENTION, binding_of
from lightning_ulysses.hf.decoding import DecodeState
from lightning_ulysses.hf.positions import watch_positions
from lightning_ulysses.hf.prepare import PreparedHFModel, find_hf_models, prepare_hf_model
from lightning_ulysses.hf.validation import find_token_mixers, hf_head_counts, token_mixer_modules, validate_hf_model

__all__ = [
    "DecodeState",
    "PreparedHFModel",
    "ULYSSES_ATTENTION",
    "binding_of",
    "find_hf_models",
    "find_token_mixers",
    "hf_head_counts",
    "prepare_hf_model",
    "token_mixer_modules",
    "validate_hf_model",
    "watch_positions",
]
