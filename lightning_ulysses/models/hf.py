"""Hugging Face causal LMs for the recipes: built from a config (random init, no download) or loaded from a
pretrained folder (`save_pretrained`'s, or a Hub name)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping, Optional

import torch
import torch.distributed as dist
from transformers import AutoConfig, AutoModelForCausalLM

from lightning_ulysses.fences import _transformers_private as transformers_private
from lightning_ulysses.integration.pretrained import (MAKE_AN_EXAMPLE, check_pretrained_folder,
                                                      transformers_initialises_partitioned_weights)


class HuggingFaceCausalLM:
    """`HuggingFaceCausalLM("llama", hidden_size=4096, ...)`: a buildable model spec, like `GPTConfig`.

    Args:
        model_type: a transformers model type (`llama`, `mistral`, `qwen2`, ...).
        attn_implementation: the local backend Ulysses wraps (`sdpa`, `flash_attention_2`, `flash_attention_3`).
        **config: keyword arguments of that model type's config.
    """

    def __init__(self, model_type: str, attn_implementation: str = "sdpa", **config: Any):
        self.model_type = model_type
        self.attn_implementation = attn_implementation
        self.config = AutoConfig.for_model(model_type, **config)

    def build(self) -> torch.nn.Module:
        model = AutoModelForCausalLM.from_config(self.config, attn_implementation=self.attn_implementation)
        if not transformers_initialises_partitioned_weights():  # the strategy's configure_model under ZeRO-3 does
            _initialize_partitioned_weights(model)
        return model

    def num_parameters(self) -> int:
        return _count_parameters(self.config, self.attn_implementation)


class PretrainedCausalLM:
    """`PretrainedCausalLM("/models/llama-3-8b", rope_scaling={"rope_type": "yarn", "factor": 4.0, ...})`: the
    causal LM saved in a folder, loaded by `build()` with `from_pretrained`, i.e. in `configure_model` by
    `CausalLMModule`: under the strategy's ZeRO-3 straight into the partitions (`lightning_ulysses.integration.pretrained`).

    Args:
        pretrained: a `save_pretrained` folder (config and weights) or a Hugging Face Hub name.
        attn_implementation: the local backend Ulysses wraps (`sdpa`, `flash_attention_2`, `flash_attention_3`).
        torch_dtype: the dtype the weights are loaded in (`"bfloat16"`, `"float32"`, `"auto"`: the checkpoint's;
            None: transformers' default, `"auto"`). Under ZeRO-3 DeepSpeed's partitions take the Trainer's
            precision (bf16 with `bf16-*`, else fp32) whatever is loaded.
        rope_scaling: RoPE scaling for a longer context (`{"rope_type": "yarn", "factor": 4.0,
            "original_max_position_embeddings": 8192}`; `linear`, `dynamic`, `llama3`, `longrope` alike): merged into
            the checkpoint's `rope_parameters`, which keeps its `rope_theta` unless this sets one (transformers
            replaces the whole dict and falls back to theta 10000 otherwise).
        config: other settings of the checkpoint's config to change, e.g. `{"max_position_embeddings": 131072}`.
    """

    def __init__(self, pretrained: str, attn_implementation: str = "sdpa", torch_dtype: Optional[str] = None,
                 rope_scaling: Optional[Mapping[str, Any]] = None, config: Optional[Mapping[str, Any]] = None):
        check_pretrained_folder(str(pretrained))
        self.pretrained = str(pretrained)
        self.attn_implementation = attn_implementation
        self.torch_dtype = torch_dtype
        changes = dict(config or {})
        if rope_scaling:
            changes["rope_parameters"] = _with_rope_scaling(_pretrained_config(self.pretrained), rope_scaling)
        self.config = _pretrained_config(self.pretrained, **changes)

    def build(self) -> torch.nn.Module:
        model = AutoModelForCausalLM.from_pretrained(self.pretrained, config=self.config, dtype=self.torch_dtype,
                                                     attn_implementation=self.attn_implementation)
        return model.train()  # from_pretrained returns it in eval mode (dropout off), and Lightning keeps modes

    def num_parameters(self) -> int:
        return _count_parameters(self.config, self.attn_implementation)


def _pretrained_config(pretrained: str, **changes: Any):
    try:
        return AutoConfig.from_pretrained(pretrained, **changes)
    except OSError as error:  # a Hub name (check_pretrained_folder refused missing paths) that did not load
        raise OSError(f"{pretrained!r} is no folder here ({Path(pretrained).expanduser().resolve()} does not exist),"
                      f" and transformers could not load it as a Hugging Face Hub model either: {error}"
                      f" {MAKE_AN_EXAMPLE}") from error


def _with_rope_scaling(config, rope_scaling: Mapping[str, Any]) -> dict[str, Any]:
    """The checkpoint's RoPE parameters with a new scaling: its base (`rope_theta`, `partial_rotary_factor`) kept,
    its old scaling keys dropped (a `llama3` checkpoint extended with `yarn` must not keep `low_freq_factor`)."""
    current = dict(getattr(config, "rope_parameters", None) or {})
    base = {key: current[key] for key in ("rope_theta", "partial_rotary_factor") if key in current}
    return {**base, **dict(rope_scaling)}


def _count_parameters(config, attn_implementation: str) -> int:
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, attn_implementation=attn_implementation)
    return sum(p.numel() for p in model.parameters())


def _initialize_partitioned_weights(model) -> None:
    """Re-run Hugging Face's weight init when the model was built partitioned under ZeRO-3 without transformers
    knowing (Lightning's own DeepSpeedStrategy; this strategy tells it, see `lightning_ulysses.integration.pretrained`).

    Inside `deepspeed.zero.Init` HF's `_init_weights` then never sees the real tensors: embeddings came out with
    std 1.0 instead of 0.02. One module at a time is gathered, initialised
    on rank 0 and re-partitioned, so no rank ever holds the whole model.
    """
    parameters = list(model.parameters())
    if not parameters or not hasattr(parameters[0], "ds_id"):
        return
    import deepspeed

    rank = dist.get_rank() if dist.is_initialized() else 0
    for module in model.modules():
        own = list(module.parameters(recurse=False))
        if own:
            with deepspeed.zero.GatheredParameters(own, modifier_rank=0):
                if rank == 0:
                    transformers_private.init_weights(model, module)
