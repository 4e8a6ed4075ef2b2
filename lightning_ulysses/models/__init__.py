from lightning_ulysses.models.causal_lm import CausalLMModule
from lightning_ulysses.models.gpt import GPT, GPTConfig
from lightning_ulysses.models.hf import HuggingFaceCausalLM, PretrainedCausalLM

__all__ = ["GPT", "CausalLMModule", "GPTConfig", "HuggingFaceCausalLM", "PretrainedCausalLM"]
