"""What a causal LM that is not a Hugging Face model tells the core, so that the core never imports it.

The memory engine needs a model's decoder layers and its output head (to fuse the head with the loss), and the
planner (`memory="auto"`, `ThroughputCallback`) needs its shape. Hugging Face models say all of this through
transformers' own types and configs; any other model (the example `models.gpt.GPT`) inherits `NativeCausalLM`
and answers the three questions below. The check is nominal (`isinstance`), as for `loss.LossFunctionHost`: a
wrapper that forwards attribute reads to the model inside (peft's) is not taken for the model itself.
"""

from __future__ import annotations

from typing import Any, Callable

from torch import nn


class NativeCausalLM:
    """Marks a causal LM (an `nn.Module`) the memory engine and the planner serve without knowing its class.

    `lm_head`: the output projection from the final hidden states to the vocabulary (`tiled_logits_loss` computes
    the loss through it tile by tile)."""

    lm_head: nn.Module

    def decoder_layers(self) -> list[nn.Module]:
        """The decoder layers in order: what activation checkpointing, the tiled MLP and ZeRO-3 leaves apply to."""
        raise NotImplementedError(f"{type(self).__name__} inherits NativeCausalLM: define decoder_layers()")

    def planner_shape(self) -> Any:
        """The model's shape for the planner (parameter and activation counts): a `planner.ModelShape` (not imported
        here: the planner depends on the memory engine, which depends on this module)."""
        raise NotImplementedError(f"{type(self).__name__} inherits NativeCausalLM: define planner_shape()")

    def use_logits_loss(self, logits_loss: Callable) -> Callable[[], None]:
        """Training forwards with labels return `logits_loss(hidden, lm_head, labels, loss_function)` and no
        logits; returns the callable that switches back."""
        raise NotImplementedError(f"{type(self).__name__} inherits NativeCausalLM: define use_logits_loss()")
