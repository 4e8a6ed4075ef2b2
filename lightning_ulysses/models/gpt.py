"""A GPT-3-style decoder written for sequence parallelism.

- Attention goes through `UlyssesAttention` (the strategy binds the SP group), with a fused QKV projection and
  the backend named by `GPTConfig.attention_backend` (the same core and backends as Hugging Face models).
- Packed rows: the `position_ids` passed to `forward` reach every attention, which keeps documents apart where
  positions restart (sharded or not); without them each row is one sequence.
- Positions are rotary (RoPE) computed from the *global* `position_ids` the strategy puts in each sharded batch,
  so a token's encoding does not depend on which shard it landed in, and sequences can grow past the training
  length. We use RoPE for the BLOOM shape too (BLOOM used ALiBi): ALiBi is an additive attention bias, which
  rules out the causal fast paths of SDPA/flash-attention on the gathered sequence and would have to be rebuilt
  from global positions after every all-to-all; RoPE needs nothing after the all-to-all at all.
- Weights are initialised inside each layer's own constructor (`_Linear`, `_Embedding`), so under
  `deepspeed.zero.Init` (Lightning's `configure_model` with ZeRO-3) every tensor is initialised before it is
  partitioned and no rank ever holds the whole model.
- `forward(input_ids, labels=None, position_ids=None)` returns `.loss` and `.logits` like a Hugging Face causal
  LM; `loss_function` is swappable (the strategy swaps it for the sequence-parallel one).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, NamedTuple, Optional

import torch
import torch.nn.functional as F
from torch import nn

from lightning_ulysses.adapters.native_model import NativeCausalLM
from lightning_ulysses.attention.core import UlyssesAttention
from lightning_ulysses.planning.planner import ModelShape
from lightning_ulysses.training.loss import IGNORE_INDEX, LossFunctionHost


@dataclass
class GPTConfig:
    """Shape of a GPT. `build()` makes the module (call it on the meta device to count parameters for free)."""

    vocab_size: int = 50257
    hidden_size: int = 768
    num_layers: int = 12
    num_heads: int = 12
    num_key_value_heads: Optional[int] = None  # None: as many as query heads (MHA)
    intermediate_size: Optional[int] = None  # None: 4 × hidden_size
    rope_theta: float = 10000.0
    layer_norm_eps: float = 1e-5
    bias: bool = True  # GPT-3 and BLOOM use biases
    tie_word_embeddings: bool = True
    initializer_range: float = 0.02
    attention_backend: str = "sdpa"  # sdpa, flash_attention_2, flash_attention_3 or flex_attention

    def __post_init__(self) -> None:
        if self.hidden_size % self.num_heads:
            raise ValueError(f"hidden_size({self.hidden_size}) must be divisible by num_heads({self.num_heads})")
        self.num_key_value_heads = self.num_key_value_heads or self.num_heads
        self.intermediate_size = self.intermediate_size or 4 * self.hidden_size
        if self.num_heads % self.num_key_value_heads:
            raise ValueError(f"num_heads({self.num_heads}) must be a multiple of num_key_value_heads({self.num_key_value_heads})")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    def build(self) -> "GPT":
        return GPT(self)

    def planner_shape(self, name: str = "gpt") -> ModelShape:
        """The shape the planner counts (`recipe.plan`, `memory="auto"`, `ThroughputCallback`)."""
        return ModelShape.from_gpt_config(self, name=name)

    def num_parameters(self) -> int:
        with torch.device("meta"):
            return sum(p.numel() for p in self.build().parameters())


class _Linear(nn.Linear):
    """`nn.Linear` initialised N(0, std) with zero bias *inside its own constructor*.

    `deepspeed.zero.Init` partitions a module's parameters as soon as that module's `__init__` returns, so an
    `nn.init` call made afterwards by the parent writes into an empty partition and is silently lost (the
    default init stays). `nn.Linear.__init__` calls `reset_parameters()`, so overriding it runs in time.
    """

    def __init__(self, fan_in: int, fan_out: int, bias: bool, std: float):
        object.__setattr__(self, "_std", std)  # read by reset_parameters() during nn.Linear.__init__
        super().__init__(fan_in, fan_out, bias=bias)

    def reset_parameters(self) -> None:
        nn.init.normal_(self.weight, std=self._std)
        if self.bias is not None:
            nn.init.zeros_(self.bias)


class _Embedding(nn.Embedding):
    """`nn.Embedding` initialised N(0, std) inside its own constructor (see `_Linear`)."""

    def __init__(self, num_embeddings: int, dim: int, std: float):
        object.__setattr__(self, "_std", std)
        super().__init__(num_embeddings, dim)

    def reset_parameters(self) -> None:
        nn.init.normal_(self.weight, std=self._std)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    first, second = x.chunk(2, dim=-1)
    return x * cos + torch.cat([-second, first], dim=-1) * sin


class RotaryEmbedding(nn.Module):
    def __init__(self, head_dim: int, theta: float):
        super().__init__()
        self.register_buffer(
            "inverse_frequency", 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim),
            persistent=False,
        )

    def forward(self, position_ids: torch.Tensor, dtype: torch.dtype):
        # [batch, seq] global positions → cos/sin [batch, 1, seq, head_dim], computed in fp32
        angles = position_ids[..., None].float() * self.inverse_frequency.to(position_ids.device)
        angles = torch.cat([angles, angles], dim=-1)[:, None]
        return angles.cos().to(dtype), angles.sin().to(dtype)


class Attention(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.config = config
        std, depth_std = config.initializer_range, config.initializer_range / math.sqrt(2 * config.num_layers)
        kv = config.num_key_value_heads
        self.qkv = _Linear(config.hidden_size, (config.num_heads + 2 * kv) * config.head_dim, config.bias, std)
        self.out = _Linear(config.hidden_size, config.hidden_size, config.bias, depth_std)
        self.attention = UlyssesAttention(config.attention_backend, causal=True, num_heads=config.num_heads,
                                          num_key_value_heads=config.num_key_value_heads)

    def forward(self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                position_ids: Optional[torch.Tensor] = None) -> torch.Tensor:
        batch, seq, _ = hidden.shape
        c = self.config
        qkv = self.qkv(hidden).view(batch, seq, c.num_heads + 2 * c.num_key_value_heads, c.head_dim).transpose(1, 2)
        q, k, v = qkv.split([c.num_heads, c.num_key_value_heads, c.num_key_value_heads], dim=1)
        q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
        out = self.attention(q, k, v, position_ids)  # [batch, heads, seq, head_dim], all-to-all inside under SP
        return self.out(out.transpose(1, 2).reshape(batch, seq, c.hidden_size))


class MLP(nn.Module):
    """Position-wise GELU MLP; its own module (as in Hugging Face decoder layers) so it can be tiled as a whole."""

    def __init__(self, config: GPTConfig):
        super().__init__()
        depth_std = config.initializer_range / math.sqrt(2 * config.num_layers)
        self.up = _Linear(config.hidden_size, config.intermediate_size, config.bias, config.initializer_range)
        self.down = _Linear(config.intermediate_size, config.hidden_size, config.bias, depth_std)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.down(F.gelu(self.up(hidden), approximate="tanh"))


class Block(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.attention_norm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.attention = Attention(config)
        self.mlp_norm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.mlp = MLP(config)

    def forward(self, hidden, cos, sin, position_ids=None):
        hidden = hidden + self.attention(self.attention_norm(hidden), cos, sin, position_ids)
        return hidden + self.mlp(self.mlp_norm(hidden))


class CausalLMOutput(NamedTuple):
    """`.loss` and `.logits`, like a Hugging Face output. A named tuple, because ZeRO-3 finds the tensors of a
    module's output to hook its backward, and it looks inside tuples and dicts but not inside dataclasses."""

    loss: Optional[torch.Tensor]
    logits: torch.Tensor


def shifted_cross_entropy(logits, labels, vocab_size=None, ignore_index=IGNORE_INDEX, **kwargs):
    """The usual causal-LM loss on unshifted labels (position t predicts label t+1), token mean."""
    return F.cross_entropy(logits[:, :-1].reshape(-1, logits.size(-1)).float(), labels[:, 1:].reshape(-1),
                           ignore_index=ignore_index)


class GPT(nn.Module, LossFunctionHost, NativeCausalLM):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.config = config
        self.embed = _Embedding(config.vocab_size, config.hidden_size, config.initializer_range)
        self.rotary = RotaryEmbedding(config.head_dim, config.rope_theta)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.num_layers))
        self.final_norm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.lm_head = _Linear(config.hidden_size, config.vocab_size, False, config.initializer_range)
        if config.tie_word_embeddings:
            # A shared Parameter used by two modules: ZeRO-3 gathers it in either module's forward, whereas
            # reading `embed.weight` outside the embedding's forward would see an empty partition.
            self.lm_head.weight = self.embed.weight
        self.loss_function = shifted_cross_entropy
        self.gradient_checkpointing = False
        self.logits_loss = None  # set by lightning_ulysses.memory (tiled logits + loss); see use_logits_loss

    def gradient_checkpointing_enable(self) -> None:
        """Recompute each block in backward (the same switch name as Hugging Face models)."""
        self.gradient_checkpointing = True

    def decoder_layers(self) -> list[nn.Module]:
        return list(self.blocks)

    def planner_shape(self) -> ModelShape:
        return self.config.planner_shape(name=type(self).__name__)

    def use_logits_loss(self, logits_loss) -> Callable[[], None]:
        """Training forwards with labels return `logits_loss(hidden, lm_head, labels, loss_function)` and no
        logits (see `lightning_ulysses.memory`); returns the callable that switches back."""
        self.logits_loss = logits_loss

        def restore() -> None:
            self.logits_loss = None

        return restore

    def forward(self, input_ids: torch.Tensor, labels: Optional[torch.Tensor] = None,
                position_ids: Optional[torch.Tensor] = None, **unused) -> CausalLMOutput:
        hidden = self.final_hidden_states(input_ids, position_ids)
        if labels is not None and self.training and self.logits_loss is not None:
            return CausalLMOutput(loss=self.logits_loss(hidden, self.lm_head, labels, self.loss_function), logits=None)
        logits = self.lm_head(hidden)
        loss = None if labels is None else self.loss_function(logits, labels, vocab_size=self.config.vocab_size)
        return CausalLMOutput(loss=loss, logits=logits)

    def final_hidden_states(self, input_ids: torch.Tensor, position_ids: Optional[torch.Tensor] = None):
        """The last block's output after the final norm: what the output head reads."""
        # Given positions may describe packed documents: the attention reads them (None: one sequence per row).
        given_positions = position_ids
        if position_ids is None:
            position_ids = torch.arange(input_ids.size(1), device=input_ids.device).expand(input_ids.size(0), -1)
        hidden = self.embed(input_ids)
        cos, sin = self.rotary(position_ids, hidden.dtype)
        for block in self.blocks:
            if self.gradient_checkpointing and self.training:
                hidden = torch.utils.checkpoint.checkpoint(block, hidden, cos, sin, given_positions, use_reentrant=False)
            else:
                hidden = block(hidden, cos, sin, given_positions)
        return self.final_norm(hidden)
