"""Hugging Face causal LMs built from a config (random init, no download) for the recipes."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from transformers import AutoConfig, AutoModelForCausalLM


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
        _initialize_partitioned_weights(model)
        return model

    def num_parameters(self) -> int:
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(self.config, attn_implementation=self.attn_implementation)
        return sum(p.numel() for p in model.parameters())


def _initialize_partitioned_weights(model) -> None:
    """Re-run Hugging Face's weight init when the model was built partitioned under ZeRO-3.

    Inside `deepspeed.zero.Init` (Lightning's `configure_model` under ZeRO-3) HF's `_init_weights` never sees the
    real tensors: embeddings came out with std 1.0 instead of 0.02. One module at a time is gathered, initialised
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
                    model._init_weights(module)
