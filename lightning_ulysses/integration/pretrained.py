"""Pretrained Hugging Face models loaded in `configure_model` under ZeRO-3, straight into the partitions.

Lightning builds the model of `configure_model` inside `deepspeed.zero.Init` under ZeRO-3 (its
`model_sharded_context`), so every parameter is partitioned the moment it is created. A plain `from_pretrained`
builds on the meta device and copies whole checkpoint tensors into those empty partitions: transformers raises
"You set `ignore_mismatched_sizes` to `False`". transformers has a ZeRO-3 loading path of its own
(`modeling_utils` + `integrations/deepspeed.py: _load_state_dict_into_zero3_model`), taken only while
`is_deepspeed_zero3_enabled()`, i.e. while an `HfDeepSpeedConfig` of a ZeRO-3 config is alive. `zero3_loading`
keeps one alive around `configure_model` (the strategy's `model_sharded_context`), and nowhere else.

What transformers then does, verified by reading it (5.24) and by the parity tests: it builds the model in a
nested `deepspeed.zero.Init` (a no-op inside Lightning's: the outer context's settings apply); global rank 0 reads
the checkpoint files to host memory, the other ranks only their keys and shapes (meta tensors); module by module,
`GatheredParameters(modifier_rank=0)` gathers that module's partitions, rank 0 copies the checkpoint values in,
and the exit re-partitions them (a broadcast from rank 0); buffers are broadcast from rank 0; the keys the
checkpoint lacks are initialised on rank 0 and scattered the same way; tied weights are tied afterwards; its
checkpoint conversions (renamed keys, fused MoE experts) apply as in a plain load. Host memory: one full state
dict on global rank 0 only (the others hold none), plus one module's whole parameters on every rank at a time.

Why this rather than a load and scatter of our own: it is the same algorithm (rank 0 reads, one module gathered
at a time), and transformers' copy also knows its checkpoint formats, tying and missing-key initialisation, which
a copy here would have to follow release by release. Reading each rank's partition straight from sharded
safetensors would keep less on rank 0, but ZeRO-3 partitions are flat slices across tensor boundaries, and the
checkpoint conversions work on whole tensors.

ZeRO 0/1/2 build the model unpartitioned (no `zero.Init`): `from_pretrained` in `configure_model` is a plain
load on every rank (every rank holds the whole model anyway), and this module does nothing.
"""

from __future__ import annotations

import contextlib
import re
from pathlib import Path
from typing import Any, Iterator, Mapping, Optional


@contextlib.contextmanager
def zero3_loading(config: Optional[Mapping[str, Any]]) -> Iterator[None]:
    """Within this context, transformers sees DeepSpeed ZeRO-3 as enabled (`is_deepspeed_zero3_enabled()`), so that
    `from_pretrained` / `from_config` build and load into partitioned parameters. `config`: the DeepSpeed config
    the strategy builds the model under, or None (not ZeRO-3: nothing to do).

    A config a user registered themselves (their own live `HfDeepSpeedConfig`) is left as it is.
    """
    if config is None:
        yield
        return
    from transformers.integrations import deepspeed as hf_deepspeed

    if hf_deepspeed.deepspeed_config() is not None:  # the user's own HfDeepSpeedConfig: theirs to manage
        yield
        return
    # Registered as a weak reference by its constructor: it counts only while this frame holds it.
    registered = hf_deepspeed.HfDeepSpeedConfig(dict(config))
    try:
        yield
    finally:
        hf_deepspeed.unset_hf_deepspeed_config()
        del registered


def transformers_initialises_partitioned_weights() -> bool:
    """Whether transformers initialises the weights of a model it builds partitioned (`from_config` under
    `zero3_loading`: `initialize_weights_zero3`), so that the recipes' own re-initialisation is not needed."""
    from transformers.integrations import is_deepspeed_zero3_enabled

    return is_deepspeed_zero3_enabled()


# A Hugging Face Hub name: `name` or `namespace/name` (letters, digits, `_`, `-`, `.`), the form transformers accepts.
_HUB_NAME = re.compile(r"[A-Za-z0-9_][\w.-]*(/[A-Za-z0-9_][\w.-]*)?")
MAKE_AN_EXAMPLE = ("To try the recipes without a model of your own, `python -m lightning_ulysses example-finetune"
                   " <folder>` writes a tiny one with data files, offline, and prints the command that fine-tunes it.")


def check_pretrained_folder(pretrained: str, setting: str = "pretrained") -> None:
    """Refuse, naming the path, a model folder that does not exist or is not one `save_pretrained` wrote (no
    `config.json`), before transformers reads it as a Hub name ("Repo id must be in the form ..."). A name that can
    only be a Hub name (`name` or `namespace/name`, not an existing path) is left to transformers. `setting` names the
    option in the messages (the recipes': `model.pretrained`)."""
    path = Path(pretrained).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise FileNotFoundError(
                f"{setting}={pretrained}: {path.resolve()} holds no config.json, so it is not a model folder"
                f" `save_pretrained` wrote (config.json, weights, tokenizer). {MAKE_AN_EXAMPLE}")
        return
    if path.exists():
        raise NotADirectoryError(f"{setting}={pretrained}: {path.resolve()} is a file; name the model's folder (the"
                                 f" one holding config.json and the weights). {MAKE_AN_EXAMPLE}")
    first = Path(pretrained.split("/")[0]).expanduser()
    if not _HUB_NAME.fullmatch(pretrained) or ".." in pretrained or first.is_dir():
        raise FileNotFoundError(f"{setting}={pretrained}: the folder {path.resolve()} does not exist. Name a model"
                                f" folder `save_pretrained` wrote (config.json, weights, tokenizer). {MAKE_AN_EXAMPLE}")
