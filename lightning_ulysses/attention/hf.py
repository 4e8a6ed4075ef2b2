"""Ulysses attention for Hugging Face models, switched on per model instance.

`transformers` picks an attention function by the name in `config._attn_implementation`. We register one name,
`"ulysses"` (registration is the only process-wide step, and it changes no existing name), and switch a model
to it on a *private copy* of its config: `from_config(cfg)` models share the caller's config object, and
flipping the shared one would silently change every other model built from it. The model's own backend
(sdpa, flash-attention 2/3) and its SP group live on its modules (`_lightning_ulysses`), so two models in one
process can use different backends and groups, and `restore()` gives the model back exactly as it was.

We do not use DeepSpeed's `UlyssesSPAttentionHF`: it registers process-wide, fixes the batch size at
construction, can be set up once per process and drops padding masks.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
from transformers import AttentionInterface, PreTrainedModel
from transformers.masking_utils import AttentionMaskInterface
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from lightning_ulysses.attention.all_to_all import (
    all_gather_sequence,
    heads_to_sequence,
)
from lightning_ulysses.attention.core import (
    ProcessGroupHandle,
    hybrid_attention,
    scatter_heads_gather_sequence,
    validate_head_counts,
)
from lightning_ulysses.layout import ShardOrder

ULYSSES_ATTENTION = "ulysses"
SUPPORTED_BACKENDS = ("sdpa", "flash_attention_2", "flash_attention_3")
_BINDING_ATTRIBUTE = "_lightning_ulysses"


@dataclass
class DecodeState:
    """Set by `lightning_ulysses.inference.generate` while it decodes from a sequence-parallel prefill.

    After the prefill, every rank's KV cache holds its own shard of the prompt (`shard_length` positions starting
    at `rank * shard_length`, the last ones padding beyond `prompt_length`), followed by every generated token
    (appended on all ranks alike, so they are counted on SP rank 0 only).
    """

    prompt_length: int
    shard_length: int
    rank: int
    prefilled: bool = False


@dataclass
class _Binding:
    group: ProcessGroupHandle
    backend: str
    decode: Optional[DecodeState] = None
    ring: Optional[ProcessGroupHandle] = None  # K/V blocks pass around this group (hybrid Ulysses × ring)

    def __deepcopy__(self, memo):
        return self


class _Overlay:
    """Reads through to `target` except for a few overridden attributes (no copy of the target)."""

    def __init__(self, target: Any, **overrides: Any):
        self.__dict__["_target"] = target
        self.__dict__.update(overrides)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.__dict__["_target"], name)


def _causal_padding_mask(padding_mask: torch.Tensor, is_causal: bool) -> torch.Tensor:
    """`[batch, seq]` key-padding mask → `[batch, 1, seq, seq]` boolean mask for SDPA (True = attend).

    Rows of left-padding queries come out empty; SDPA (torch >= 2.5) returns zeros for them with finite
    gradients, which is also what Hugging Face's own SDPA path computes, so padded outputs match it exactly.
    """
    seq = padding_mask.size(-1)
    allowed = padding_mask[:, None, None, :].expand(-1, 1, seq, -1)
    if is_causal:
        allowed = allowed & torch.ones(seq, seq, dtype=torch.bool, device=padding_mask.device).tril()
    return allowed


def _ulysses_attention_forward(module, query, key, value, attention_mask, **kwargs):
    binding: _Binding | None = getattr(module, _BINDING_ATTRIBUTE, None)
    if binding is None:
        raise RuntimeError(
            f"{type(module).__name__} runs with attn_implementation='{ULYSSES_ATTENTION}' but was not prepared by"
            " lightning_ulysses (prepare_hf_model). Switch it back with model.set_attn_implementation('sdpa')."
        )
    group = binding.group.group
    if binding.decode is not None and binding.decode.prefilled:
        return _decode_attention(query, key, value, binding.decode, group, kwargs.get("scaling")), None
    if any(name in kwargs for name in ("cu_seq_lens_q", "cu_seq_lens_k")):
        raise NotImplementedError("Packed sequences (cu_seq_lens) are not supported under sequence parallelism yet.")
    if binding.ring is not None:
        return _ring_attention_forward(module, query, key, value, attention_mask, binding, **kwargs), None

    # q, k, v: [batch, heads, seq/P, dim] -> [batch, heads/P, seq, dim]
    query, key, value = scatter_heads_gather_sequence(query, key, value, group, head_dim=1, seq_dim=2)
    # The local backend sees whole sequences, so shard-local position ids would describe the wrong tokens; the
    # strategy rejects packed rows, so positions carry no masking information the causal flag does not.
    kwargs.pop("position_ids", None)
    if attention_mask is not None:
        # This shard's 2-D padding mask (see _shard_padding_mask): gather it whole, on every SP rank alike.
        attention_mask = all_gather_sequence(attention_mask.bool(), group, seq_dim=1)
        if bool(attention_mask.all()):
            attention_mask = None  # nothing padded: keep the backends' fast causal path
        elif binding.backend == "sdpa":
            attention_mask = _causal_padding_mask(attention_mask, getattr(module, "is_causal", True))
    # After replication each rank may hold fewer query heads per KV head than the model's configuration says.
    local_module = _Overlay(
        module,
        num_key_value_groups=query.size(1) // key.size(1),
        config=_Overlay(module.config, _attn_implementation=binding.backend),
    )
    output, _ = ALL_ATTENTION_FUNCTIONS[binding.backend](local_module, query, key, value, attention_mask, **kwargs)
    # output: [batch, seq, heads/P, dim] -> [batch, seq/P, heads, dim], the layout the model expects back
    return heads_to_sequence(output, group, head_dim=2, seq_dim=1), None


def _ring_attention_forward(module, query, key, value, attention_mask, binding: _Binding, dropout=0.0, scaling=None,
                            sliding_window=None, softcap=None, **unused):
    """Hybrid Ulysses × ring attention for one HF attention module: q/k/v `[batch, heads, tokens, dim]` →
    `[batch, tokens, heads, dim]`. The ring computes plain softmax attention itself (the backend is not called)."""
    if dropout or sliding_window is not None or softcap is not None:
        raise NotImplementedError(
            f"{type(module).__name__} asks for attention dropout, a sliding window or logit soft-capping, which ring"
            " attention does not implement. Use ring_size=1 (pure Ulysses), or set attention_dropout=0."
        )
    is_causal = getattr(module, "is_causal", True)
    if attention_mask is not None:
        _check_right_padding(attention_mask, binding, is_causal)
    output = hybrid_attention(query, key, value, binding.group.group, binding.ring.group, is_causal, scaling)
    return output.transpose(1, 2)


def _check_right_padding(shard_mask: torch.Tensor, binding: _Binding, is_causal: bool) -> None:
    """Ring attention masks by position only. That is exact for padding at the end of causal rows: no real token
    attends to a later one, and padded positions carry ignored labels. Anything else is refused."""
    mask = shard_mask.bool()
    for group in (binding.group, binding.ring):  # Ulysses pieces, then ring portions: SP-rank (shard) order
        mask = all_gather_sequence(mask, group.group, seq_dim=1)
    mask = ShardOrder(binding.group.world_size * binding.ring.world_size, binding.ring.world_size).restore(mask, dim=1)
    right_padded = bool((mask[:, :-1] >= mask[:, 1:]).all())  # the same on every SP rank: all raise or none
    if not (right_padded and is_causal) and not bool(mask.all()):
        raise NotImplementedError(
            "Ring attention (ring_size > 1) supports padding only at the end of rows of causal models; this batch"
            " has left or inner padding. Pad on the right (tokenizer.padding_side='right'), or use ring_size=1."
        )


def _shard_padding_mask(*args, attention_mask=None, **kwargs):
    """Mask function for the "ulysses" key: hand the attention this shard's 2-D padding mask as it is.

    A 4-D mask built at shard length would be wrong after the all-to-all, so the attention gathers the 2-D mask
    and builds its own. The mask is kept even when this shard holds no padding (flash's mask function would
    drop it): gathering is a collective, so the decision must be the same on every rank of the SP group, and
    only "the batch has an attention_mask" is.
    """
    return attention_mask


def _decode_attention(query, key, value, state: DecodeState, group, scaling: Optional[float]) -> torch.Tensor:
    """One new token attending to a KV cache that is split over the SP group: exact softmax across ranks.

    Each rank scores the query against the keys it owns, then the per-rank maxima, normalisers and weighted
    values are combined (the log-sum-exp merge of flash-decoding), so no rank ever gathers the cache.
    query: [batch, heads, 1, dim]; key/value: [batch, kv_heads, shard + generated, dim] → [batch, 1, heads, dim].
    """
    heads, cached = query.size(1), key.size(2)
    key = key.repeat_interleave(heads // key.size(1), dim=1).float()
    value = value.repeat_interleave(heads // value.size(1), dim=1).float()
    scaling = scaling if scaling is not None else query.size(-1) ** -0.5
    scores = (query.float() @ key.transpose(-1, -2)) * scaling  # [batch, heads, 1, cached]
    index = torch.arange(cached, device=query.device)
    prompt = (index < state.shard_length) & (state.rank * state.shard_length + index < state.prompt_length)
    generated = (index >= state.shard_length) & (state.rank == 0)
    scores = scores.masked_fill(~(prompt | generated), float("-inf"))
    local_max = scores.amax(dim=-1, keepdim=True)
    safe_max = torch.where(torch.isinf(local_max), torch.zeros_like(local_max), local_max)
    weights = torch.exp(scores - safe_max)
    pieces = [weights.sum(dim=-1, keepdim=True), weights @ value, local_max]
    gathered = [[torch.empty_like(t) for _ in range(dist.get_world_size(group))] for t in pieces]
    for out, piece in zip(gathered, pieces):
        dist.all_gather(out, piece.contiguous(), group=group)
    sums, outputs, maxima = (torch.stack(g) for g in gathered)
    global_max = maxima.amax(dim=0)
    scale = torch.where(torch.isinf(maxima), torch.zeros_like(maxima), torch.exp(maxima - global_max))
    output = (scale * outputs).sum(dim=0) / (scale * sums).sum(dim=0)
    return output.to(query.dtype).transpose(1, 2)


def binding_of(model) -> Optional[_Binding]:
    """The Ulysses binding of a prepared model (None when it was not switched to Ulysses attention)."""
    return model.__dict__.get(_BINDING_ATTRIBUTE)


def _register_attention() -> None:
    if ULYSSES_ATTENTION not in ALL_ATTENTION_FUNCTIONS.valid_keys():
        AttentionInterface.register(ULYSSES_ATTENTION, _ulysses_attention_forward)
        AttentionMaskInterface.register(ULYSSES_ATTENTION, _shard_padding_mask)


_NOT_SET = object()


@dataclass
class PreparedHFModel:
    """What `prepare_hf_model` changed on one model; `restore()` undoes it."""

    model: PreTrainedModel
    backend: str
    original_configs: dict[int, Any] = field(default_factory=dict)
    original_loss_function: Any = _NOT_SET
    loss_swapped: bool = False

    def restore(self) -> None:
        for module in self.model.modules():
            if _BINDING_ATTRIBUTE in module.__dict__:
                del module.__dict__[_BINDING_ATTRIBUTE]
            original = self.original_configs.get(id(module))
            if original is not None:
                module.config = original
        if not self.loss_swapped:
            return
        if self.original_loss_function is _NOT_SET:
            self.model.__dict__.pop("_loss_function", None)
        else:
            self.model.loss_function = self.original_loss_function


def find_hf_models(root: torch.nn.Module) -> list[PreTrainedModel]:
    """The outermost `PreTrainedModel`s inside `root` (a `LlamaModel` inside a `LlamaForCausalLM` is not listed)."""
    found: list[PreTrainedModel] = []

    def visit(module: torch.nn.Module) -> None:
        if isinstance(module, PreTrainedModel):
            found.append(module)
            return
        for child in module.children():
            visit(child)

    visit(root)
    return found


def validate_hf_model(model: PreTrainedModel, sequence_parallel_size: int) -> str:
    """Check that `model` can run Ulysses attention at this SP size; returns its attention backend."""
    backend = model.config._attn_implementation
    if sequence_parallel_size > 1 and backend not in SUPPORTED_BACKENDS:
        raise ValueError(
            f"{type(model).__name__} uses attn_implementation={backend!r}, which sequence parallelism cannot wrap"
            f" (supported: {', '.join(SUPPORTED_BACKENDS)}). Load or build the model with"
            " attn_implementation='sdpa' (e.g. AutoModelForCausalLM.from_config(cfg, attn_implementation='sdpa'))."
        )
    validate_head_counts(*hf_head_counts(model), sequence_parallel_size)
    return backend


def hf_head_counts(model: PreTrainedModel) -> tuple[int, int]:
    """(attention heads, KV heads) of a Hugging Face model."""
    text_config = model.config.get_text_config()
    num_heads = text_config.num_attention_heads
    return num_heads, getattr(text_config, "num_key_value_heads", None) or num_heads


def prepare_hf_model(
    model: PreTrainedModel, sequence_parallel_group, loss_function: Callable | None = None, *, ring_group=None
) -> PreparedHFModel:
    """Switch one model to Ulysses attention over `sequence_parallel_group` (and optionally swap its loss).

    With `ring_group` (hybrid Ulysses × ring, `SequenceParallelGroups.ulysses_group`/`.ring_group`), heads are
    scattered over `sequence_parallel_group` only and ring attention spans `ring_group`; batches must then be
    sharded in the zig-zag layout (`SequenceSharder(..., ring_size=...)`).
    """
    group = ProcessGroupHandle(sequence_parallel_group)
    ring = ProcessGroupHandle(ring_group) if ring_group is not None else None
    backend = validate_hf_model(model, group.world_size)
    if model.config._attn_implementation == ULYSSES_ATTENTION:
        raise RuntimeError(f"{type(model).__name__} is already prepared for sequence parallelism: restore() it first.")
    prepared = PreparedHFModel(model=model, backend=backend)
    if loss_function is not None:
        prepared.original_loss_function = model.__dict__.get("_loss_function", _NOT_SET)
        prepared.loss_swapped = True
        model.loss_function = loss_function
    if group.world_size == 1 and ring is None:
        return prepared  # nothing to exchange: the model keeps its own attention untouched
    _register_attention()
    # Private config copy, installed on every module that referenced the shared one (or a sub-config of it).
    memo: dict[int, Any] = {}
    copy.deepcopy(model.config, memo)
    for module in model.modules():
        shared = module.__dict__.get("config")
        if shared is not None and id(shared) in memo:
            prepared.original_configs[id(module)] = shared
            module.config = memo[id(shared)]
    try:
        model.set_attn_implementation(ULYSSES_ATTENTION)
    except (ValueError, NotImplementedError) as error:
        prepared.restore()
        raise ValueError(
            f"{type(model).__name__} does not dispatch attention through transformers' AttentionInterface, so"
            " lightning_ulysses cannot swap it. Wrap its attention in lightning_ulysses.UlyssesAttention."
        ) from error
    binding = _Binding(group=group, backend=backend, ring=ring)
    for module in model.modules():
        module.__dict__[_BINDING_ATTRIBUTE] = binding
    return prepared
