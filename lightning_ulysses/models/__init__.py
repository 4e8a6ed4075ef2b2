from lightning_ulysses.models.causal_lm import CausalLMModule

__all__ = ["CausalLMModule"]
