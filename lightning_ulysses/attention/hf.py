"""Ulysses attention for Hugging Face models, switched on per model instance.

`transformers` picks an attention function by the name in `config._attn_implementation`. We register one name,
`"ulysses"` (registration is the only process-wide step, and it changes no existing name), and switch a model
to it on a *private copy* of its config: `from_config(cfg)` models share the caller's config object, and
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
(`_OwnAttention`); token mixers that are not attention run on whole rows (attention/mixers.py); per-family
corrections of positions a module counts itself live in `lightning_ulysses/adapters/`, and so do the families whose
modules compute attention inline (BLOOM, MPT, Falcon, GPT-Neo, XGLM), taken over module by module
(attention/inline.py) instead of switched.

We do not use DeepSpeed's `UlyssesSPAttentionHF`: it registers process-wide, fixes the batch size at
construction, can be set up once per process and drops padding masks.
"""

from __future__ import annotations

import copy
import functools
import inspect
import re
import warnings
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
from transformers import AttentionInterface, PreTrainedConfig, PreTrainedModel
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from lightning_ulysses.adapters import adapters_for
from lightning_ulysses.attention.backends import BACKENDS, check_backend
from lightning_ulysses.attention import inline
from lightning_ulysses.attention.core import ProcessGroupHandle, local_heads, ulysses_attention, validate_head_counts
from lightning_ulysses.attention.documents import AttentionPattern, allowed_mask, mask_mod
from lightning_ulysses.attention.mixers import MASK_MARKER, WholeRowsMixer
from lightning_ulysses.attention.masks import attention_pattern, reject_unsupported_pattern, reject_window
from lightning_ulysses.attention.rows import BatchRowsSlot
from lightning_ulysses.layout import ShardOrder

ULYSSES_ATTENTION = "ulysses"
_BINDING_ATTRIBUTE = "_lightning_ulysses"


@dataclass
class DecodeState:
    """Set by `lightning_ulysses.inference.generate` while it decodes from a sequence-parallel prefill.

    After the prefill, every rank's KV cache holds its own shard of the prompt (`shard_length` positions starting
    at `first_position`, as `ShardOrder` cut it; the last ones padding beyond `prompt_length`), followed by every
    generated token (appended on all ranks alike, so they are counted on SP rank 0 only).
    """

    prompt_length: int
    shard_length: int
    first_position: int
    rank: int
    prefilled: bool = False


@dataclass
class _Binding:
    group: ProcessGroupHandle
    backend: str
    decode: Optional[DecodeState] = None
    # K/V blocks pass around this group (hybrid Ulysses × ring); of one rank (no group) for pure Ulysses.
    ring: ProcessGroupHandle = field(default_factory=lambda: ProcessGroupHandle(None))
    # Where the sharder publishes each batch's whole rows (attention/rows.py); None: gathered in every layer.
    batch_rows: Optional[BatchRowsSlot] = None
    # Head groups whose all-to-alls are pipelined with their attention (core.exchange_and_attend).
    head_groups: int = 1
    # The position_ids of the model's latest forward (`_ForwardPositions`), for attention modules whose layer does
    # not hand them on (Llama 4): without them packed documents would not be kept apart.
    forward_positions: Optional[torch.Tensor] = None
    # The 2-D attention_mask of the model's latest forward, for attention computed inline (attention/inline.py),
    # which no mask interface hands the shard's padding.
    forward_padding_mask: Optional[torch.Tensor] = None

    @property
    def sharded(self) -> bool:
        """Whether the sequence is cut at all (SP > 1); at SP 1 the binding only keeps packed documents apart."""
        return self.group.world_size * self.ring.world_size > 1

    def __deepcopy__(self, memo):
        return self


def _unsupported(module, attention_mask, kwargs, row_length: int) -> bool:
    """SP 1: whether these inputs ask for what the core does not apply to unsharded rows (a window shorter than the
    row, soft-capping, sinks, another mask format), which the model's own attention then computes as unprepared."""
    try:
        _reject_unsharded_inputs(module, attention_mask, kwargs)
    except ValueError:
        return True
    sliding_window = kwargs.get("sliding_window")
    return (sliding_window is not None and sliding_window < row_length) or any(
        kwargs.get(name) is not None for name in _OWN_ATTENTION_KWARGS)


def _ulysses_attention_forward(module, query, key, value, attention_mask, **kwargs):
    binding: _Binding | None = getattr(module, _BINDING_ATTRIBUTE, None)
    if binding is None:
        raise RuntimeError(
            f"{type(module).__name__} runs with attn_implementation='{ULYSSES_ATTENTION}' but was not prepared by"
            " lightning_ulysses (prepare_hf_model). Switch it back with model.set_attn_implementation('sdpa')."
        )
    group = binding.group.group
    row_length = query.size(2) * binding.group.world_size * binding.ring.world_size
    if not binding.sharded and (binding.decode is not None or key.size(2) != query.size(2)
                                or _unsupported(module, attention_mask, kwargs, row_length)):
        # SP 1: what the core does not apply (decoding from a KV cache, sliding windows, soft-capping, sinks,
        # masks built from other mask functions) runs through the model's own attention, exactly as unprepared.
        return _own_attention_function(module, binding.backend)(module, query, key, value, attention_mask, **kwargs)
    adapters = adapters_for(module)
    if binding.decode is not None and binding.decode.prefilled:
        if adapters:
            raise NotImplementedError(
                f"{type(module).__name__} needs {adapters[0].name} from global positions, which decoding from a"
                " sequence-parallel KV cache does not give it yet: generate with sequence_parallel_size=1.")
        return _decode_attention(query, key, value, binding.decode, group, kwargs.get("scaling")), None
    if adapters:  # positions the module counted from this shard's start (adapters/): corrected to the global ones
        order, rank = ShardOrder.of_groups(binding.group.group, binding.ring.group)
        local = torch.arange(query.size(2), device=query.device)
        global_ = order.positions(row_length, rank, device=query.device)
        for adapter in adapters:
            query = adapter.adjust_query(module, query, local, global_)
    padding_mask, pattern = _unmark(attention_mask)
    _reject_unsharded_inputs(module, padding_mask, kwargs)
    if binding.backend in _FLASH_BACKENDS:  # flash reads its window from the kwarg (its mask is 2-D padding only)
        pattern = AttentionPattern(kwargs.get("sliding_window"), pattern.chunk_size if pattern else None)
    if binding.decode is not None:  # the prefill of `inference.generate`: windows are not applied while decoding
        for size in (pattern.sliding_window, pattern.chunk_size) if pattern else ():
            if size is not None:
                reject_window(type(module).__name__, "a sliding window or chunked attention", size, row_length)
        pattern = None
    is_causal = kwargs.get("is_causal")
    is_causal = getattr(module, "is_causal", True) if is_causal is None else is_causal
    own = None
    if binding.backend not in BACKENDS or any(kwargs.get(name) is not None for name in _OWN_ATTENTION_KWARGS):
        own = _OwnAttention(module, binding, kwargs, is_causal, query.size(1))
    position_ids = kwargs.get("position_ids")
    if position_ids is None:
        position_ids = binding.forward_positions
    output = ulysses_attention(
        query, key, value, group, binding.backend,
        position_ids=position_ids,  # global positions: packed documents are read from them
        padding_mask=padding_mask,  # this shard's 2-D padding mask (see _shard_padding_mask)
        is_causal=is_causal,
        scale=kwargs.get("scaling"),
        dropout_p=kwargs.get("dropout", 0.0),
        ring_group=binding.ring.group,  # with a ring, ring attention replaces the backend
        batch_rows=binding.batch_rows,
        head_groups=binding.head_groups,
        pattern=pattern or None,
        local=own,
    )
    return output, None  # [batch, seq/P, heads, dim], the layout the model expects back


_FLASH_BACKENDS = ("flash_attention_2", "flash_attention_3")
# Attention arguments only the model's own attention function applies (the backends of backends.py do not):
# Gemma 2's logit soft-capping, GPT-OSS's sinks.
_OWN_ATTENTION_KWARGS = ("softcap", "s_aux")


def _reject_unsharded_inputs(module, attention_mask, kwargs) -> None:
    """Refuse (alike on every rank, before any collective) inputs that describe the whole row unsharded."""
    if any(name in kwargs for name in ("cu_seq_lens_q", "cu_seq_lens_k")):
        raise ValueError(
            "cu_seq_lens_q/cu_seq_lens_k describe documents of the whole (unsharded) row. Under sequence parallelism"
            " lightning_ulysses reads packed documents from position_ids restarting at 0 instead: drop the flash"
            " kwargs from the batch (e.g. DataCollatorWithFlattening(return_flash_attn_kwargs=False))."
        )
    if attention_mask is not None and (not isinstance(attention_mask, torch.Tensor) or attention_mask.dim() != 2):
        # A flex BlockMask: at SP 1 the model's own mask of a windowed layer (see _shard_padding_mask).
        form = f"{attention_mask.dim()}-D" if isinstance(attention_mask, torch.Tensor) else type(attention_mask).__name__
        raise ValueError(
            f"{type(module).__name__} got a {form} attention mask; under sequence parallelism only"
            " 2-D padding masks ([batch, seq]) and packed position_ids can be cut along the sequence."
        )


class _LocalHeads:
    """The attention module as its own attention function sees it after the exchange: whole rows of heads/P heads.

    Attributes that count heads are this rank's (`num_key_value_groups` after KV replication, `sinks` sliced to
    its heads, so that their gradients land on the heads this rank attended over); everything else is the
    module's own."""

    def __init__(self, module, heads: slice, query_heads: int, key_heads: int, total_heads: int):
        self._module = module
        self.num_key_value_groups = query_heads // key_heads
        sinks = getattr(module, "sinks", None)
        if isinstance(sinks, torch.Tensor) and sinks.dim() >= 1 and sinks.size(0) == total_heads:
            self.sinks = sinks[heads]

    def __getattr__(self, name):
        return getattr(self._module, name)


class _OwnAttention:
    """The model's own attention function (eager, or a backend given arguments ours do not apply) on whole rows of
    this rank's heads: `ulysses_attention(..., local=...)`.

    Its mask is built from the whole rows in the format that function reads: eager adds a float mask, sdpa takes
    a boolean one, flex a block mask, flash a 2-D padding mask (with its window from the `sliding_window` kwarg).
    """

    def __init__(self, module, binding: "_Binding", kwargs: dict, is_causal: bool, total_heads: int):
        self.module, self.backend, self.is_causal, self.total_heads = module, binding.backend, is_causal, total_heads
        self.function = _own_attention_function(module, binding.backend)
        self.rank = dist.get_rank(binding.group.group) if binding.group.world_size > 1 else 0
        self.sp = binding.group.world_size
        heads = local_heads(total_heads, self.sp, self.rank)
        # Positions and flash's document kwargs describe this shard, not the whole rows the function now sees.
        self.kwargs = {name: value for name, value in kwargs.items() if name not in ("position_ids", "is_causal")}
        s_aux = self.kwargs.get("s_aux")
        if isinstance(s_aux, torch.Tensor) and s_aux.dim() >= 1 and s_aux.size(0) == total_heads:
            self.kwargs["s_aux"] = s_aux[heads]
        self.heads = heads

    def __call__(self, query, key, value, documents, pattern):
        view = _LocalHeads(self.module, self.heads, query.size(1), key.size(1), self.total_heads)
        mask = self._mask(query, documents, pattern)
        output, _ = self.function(view, query, key, value, mask, **self.kwargs)
        return output

    def _mask(self, query, documents, pattern):
        batch, seq = query.size(0), query.size(2)
        if self.backend in _FLASH_BACKENDS:
            if (pattern and pattern.chunk_size is not None) or (documents is not None and documents.document_ids is not None):
                raise NotImplementedError(
                    f"{type(self.module).__name__} under sequence parallelism with {self.backend} and its own attention"
                    " arguments (sinks or soft-capping) cannot keep packed documents or chunks apart here: use unpacked"
                    " rows, or attn_implementation='eager'."
                )
            return None if documents is None else documents.real_tokens.long()
        if self.backend == "flex_attention":
            from torch.nn.attention.flex_attention import create_block_mask

            rule = mask_mod(documents, self.is_causal, pattern or None, seq, query.device)
            return create_block_mask(rule, batch if documents is not None else None, None, seq, seq, device=query.device)
        if self.backend == "sdpa" and documents is None and not pattern:
            return None  # sdpa's causal fast path (the module's is_causal)
        allowed = allowed_mask(batch, seq, documents, self.is_causal, pattern or None, query.device)
        if self.backend == "sdpa":
            return allowed
        return torch.where(allowed, 0.0, torch.finfo(query.dtype).min).to(query.dtype)  # eager adds it


def _own_attention_function(module, backend: str) -> Callable:
    """The function `module` would attend with unprepared: transformers' registered one, or (eager) the
    `eager_attention_forward` of the module's own modeling file."""
    if backend != "eager":
        return ALL_ATTENTION_FUNCTIONS[backend]
    function = getattr(inspect.getmodule(type(module)), "eager_attention_forward", None)
    if function is None:
        raise NotImplementedError(
            f"{type(module).__name__} uses eager attention, but its modeling module has no eager_attention_forward"
            " for lightning_ulysses to run on whole rows: build the model with attn_implementation='sdpa'."
        )
    return function


_PATTERN_ATTRIBUTE = MASK_MARKER


def _mark(attention_mask: Optional[torch.Tensor], pattern: AttentionPattern) -> torch.Tensor:
    """What our mask interface hands a windowed/chunked layer: an empty tensor carrying the shard's 2-D padding
    mask and the pattern. The model passes it to exactly the layers it built that mask for (`layer_types`); a
    layer that got it through a copy (the attribute lost) sees an empty 1-D mask and is refused, never misread."""
    marker = torch.empty(0)
    setattr(marker, _PATTERN_ATTRIBUTE, (attention_mask, pattern))
    return marker


def _unmark(attention_mask) -> tuple[Optional[torch.Tensor], Optional[AttentionPattern]]:
    marked = getattr(attention_mask, _PATTERN_ATTRIBUTE, None) if attention_mask is not None else None
    return (attention_mask, None) if marked is None else marked


# The private configs of prepared models (every sub-config too) → (the config, the model's name, its binding): the
# mask interface is handed only the config, and needs the SP size to know how long the whole row is.
_MASK_CONFIGS: dict[int, tuple[weakref.ref, str, "_Binding"]] = {}


def _shard_padding_mask(*args, attention_mask=None, mask_function=None, config=None, q_length=None,
                        kv_length=None, kv_offset=0, **kwargs):
    """Mask function for the "ulysses" key: hand the attention this shard's 2-D padding mask as it is.

    A 4-D mask built at shard length would be wrong after the all-to-all, so the attention gathers the 2-D mask
    and builds its own. The mask is kept even when this shard holds no padding (flash's mask function would
    drop it): gathering is a collective, so the decision must be the same on every rank of the SP group, and
    only "the batch has an attention_mask" is.

    Every pattern in `mask_function` other than causal attention (with padding and packed documents, which the
    attention applies itself) would be dropped, so it is refused here (attention/masks.py), before the model's
    first attention layer and so alike on every SP rank before any all-to-all of this forward.
    """
    entry = _MASK_CONFIGS.get(id(config))
    if mask_function is not None and entry is not None and entry[0]() is config:
        _, model_name, binding = entry
        decode = binding.decode
        if not binding.sharded:
            # SP 1: the model's own mask for what the core does not apply (see _ulysses_attention_forward).
            own_mask = functools.partial(ALL_MASK_ATTENTION_FUNCTIONS[binding.backend], *args,
                                         attention_mask=attention_mask, mask_function=mask_function, config=config,
                                         q_length=q_length, kv_length=kv_length, kv_offset=kv_offset, **kwargs)
            if decode is not None or q_length != kv_length:  # decoding from a KV cache
                return own_mask()
            try:
                reject_unsupported_pattern(mask_function, q_length, model_name, getattr(config, "layer_types", None))
            except NotImplementedError:
                return own_mask()
            return attention_mask
        if decode is None:
            # Windows and chunks cross shard boundaries: the attention applies them on whole rows after the exchange.
            pattern = attention_pattern(mask_function, model_name)
            if not pattern:
                return attention_mask
            return _mark(attention_mask, pattern)
        if not decode.prefilled:
            row_length = decode.prompt_length
        else:  # each rank's cache: its prompt shard, then every generated token, this one included
            row_length = decode.prompt_length + kv_length + kv_offset - decode.shard_length
        reject_unsupported_pattern(mask_function, row_length, model_name, getattr(config, "layer_types", None))
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
    prompt = (index < state.shard_length) & (state.first_position + index < state.prompt_length)
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
    hooks: list = field(default_factory=list)
    mask_configs: list[int] = field(default_factory=list)
    inline_modules: list = field(default_factory=list)

    def restore(self) -> None:
        for hook in self.hooks:
            hook.remove()
        self.hooks = []
        for module in self.inline_modules:
            module.__dict__.pop("forward", None)
        self.inline_modules = []
        for key in self.mask_configs:
            _MASK_CONFIGS.pop(key, None)
        self.mask_configs = []
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


# Layer kinds of `config.layer_types` whose token mixing (if any) is attention through transformers' attention interface
# (what the "ulysses" key replaces). Layers of other kinds (linear attention, Mamba, short convolutions) must hold a
# token mixer `token_mixer_modules` finds (run on whole rows, attention/mixers.py); a kind without one is refused.
# MLP kinds ("mlp", "moe", "dense", "sparse") appear in the same lists of some families and mix no tokens.
_ATTENTION_LAYER_TYPES = frozenset({"attention", "full_attention", "sliding_attention", "chunked_attention",
                                    "mlp", "moe", "dense", "sparse"})
# Class names of the token mixers transformers' hybrid and recurrent families use instead of (or beside) attention:
# Mamba/Mamba2 mixers, Gated DeltaNet and Kimi's delta attention, LFM2's short convolution, MiniMax's lightning
# attention, RG-LRU, RWKV time mixing, xLSTM cells. Those holding a causal `nn.Conv1d` are found without their name.
_TOKEN_MIXER_NAMES = re.compile(
    r"Mamba|Mixer|DeltaNet|DeltaAttention|ShortConv|LightningAttention|Rglru|RecurrentBlock|Rwkv|[xm]LSTM"
)
_TOKEN_MIXER_ADVICE = (
    "Under sequence parallelism every rank holds a slice of the sequence, and only attention that dispatches through"
    " transformers' attention interface, or a token mixer lightning_ulysses runs on whole rows, is exchanged between"
    " the slices: this layer would run over each rank's slice as if it were the whole sequence (silently wrong losses"
    " and gradients). Train this model without sequence parallelism (sequence_parallel_size=1), or use a model whose"
    " layers all mix tokens by attention."
)


def _mixer_by_name(module: torch.nn.Module) -> bool:  # (MambaForCausalLM names a model, MambaRMSNorm a norm)
    name = type(module).__name__
    return not isinstance(module, PreTrainedModel) and "Norm" not in name and bool(_TOKEN_MIXER_NAMES.search(name))


def token_mixer_modules(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    """The layers of `model` that mix tokens without transformers' attention interface, outermost ones only (a
    Mamba mixer's convolution is not listed again): `(path, module)`. A bare `nn.Conv1d` is listed by the module
    that calls it (its parent), the unit `WholeRowsMixer` runs on whole rows."""
    found: list[tuple[str, torch.nn.Module]] = []

    def visit(module: torch.nn.Module, path: str, parent: tuple[str, torch.nn.Module] | None) -> None:
        children = [(f"{path}.{name}" if path else name, child) for name, child in module.named_children()]
        # A block named like a mixer (MambaBlock) that holds the mixer itself (MambaMixer) is named by the latter.
        if isinstance(module, torch.nn.Conv1d) or _mixer_by_name(module) and not any(
                _mixer_by_name(m) for _, child in children for m in child.modules()):
            unit = parent if isinstance(module, torch.nn.Conv1d) and parent is not None else (path or "<model>", module)
            if all(unit[1] is not other for _, other in found):
                found.append(unit)
            return
        for child_path, child in children:
            visit(child, child_path, (path or "<model>", module))

    visit(model, "", None)
    return found


def find_token_mixers(model: torch.nn.Module) -> list[str]:
    """`token_mixer_modules` as "path (Class)"."""
    return [f"{path} ({type(module).__name__})" for path, module in token_mixer_modules(model)]


def _configs_of(model: PreTrainedModel) -> list[Any]:
    """The model's config and every sub-config (text, vision, ...), each once."""
    configs, pending, seen = [], [model.config], set()
    while pending:
        config = pending.pop()
        if id(config) in seen:
            continue
        seen.add(id(config))
        configs.append(config)
        pending += [getattr(config, key) for key in getattr(config, "sub_configs", {}) if getattr(config, key, None)]
    return configs


def _reject_token_mixing_outside_attention(model: PreTrainedModel) -> None:
    """Refuse (before any collective) models with layers neither the Ulysses exchange nor a whole-rows mixer reaches."""
    name = type(model).__name__
    mixers = token_mixer_modules(model)
    for path, module in mixers:
        # A unit that also holds attention would run that attention on whole rows as if they were a shard.
        inner = [f"{path}.{child_path}" for child_path, child in module.named_modules()
                 if child_path and "Attention" in type(child).__name__ and not _mixer_by_name(child)]
        if inner:
            raise NotImplementedError(
                f"{name} mixes tokens outside attention in {path} ({type(module).__name__}), which also holds"
                f" attention ({inner[0]}), so it cannot run on whole rows. {_TOKEN_MIXER_ADVICE}")
    covered = {int(match.group(1)) for path, _ in mixers for match in [re.search(r"layers\.(\d+)\.", path + ".")] if match}
    for config in _configs_of(model):  # kinds whose modules have names this check does not know yet
        layer_types = getattr(config, "layer_types", None) or []
        unknown = [(i, kind) for i, kind in enumerate(layer_types) if kind not in _ATTENTION_LAYER_TYPES
                   and i not in covered]
        if unknown:
            listed = ", ".join(f"layer {i} is {kind!r}" for i, kind in unknown[:3])
            raise NotImplementedError(
                f"{name} has layers that are not attention ({listed} in config.layer_types), so they mix tokens"
                f" some other way. {_TOKEN_MIXER_ADVICE}"
            )

def _unswitchable_submodel(model: PreTrainedModel) -> Optional[PreTrainedModel]:
    """transformers only logs a warning when it cannot switch a model's attention (its source heuristic
    `_can_set_attn_implementation`: attention classes that do not dispatch through the interface, classes defined
    in `__main__`, sources `inspect` cannot read), and the model keeps its own attention on each shard."""
    for module in model.modules():
        if isinstance(module, PreTrainedModel) and not type(module)._can_set_attn_implementation():
            return module
    return None


def _reject_unswitchable(model: PreTrainedModel) -> None:
    module = _unswitchable_submodel(model)
    if module is not None:
        raise ValueError(_unswitchable_message(model, module))


def _unswitchable_message(model: PreTrainedModel, module: torch.nn.Module) -> str:
    where = "" if module is model else f" (its sub-model {type(module).__name__})"
    return (
        f"transformers cannot switch the attention of {type(model).__name__}{where}: its attention does not dispatch"
        " through transformers' AttentionInterface (or its class is defined where transformers cannot read its source,"
        " e.g. a notebook's __main__), so lightning_ulysses cannot swap in the sequence-parallel exchange and the"
        " model would attend within each rank's shard only. Define the model class in an importable module, or wrap"
        " its attention in lightning_ulysses.UlyssesAttention."
    )


def validate_hf_model(model: PreTrainedModel, sequence_parallel_size: int, ring_size: int = 1) -> str:
    """Check that `model` can run Ulysses attention at this SP size (`sequence_parallel_size` ranks splitting heads,
    times `ring_size` in a ring); returns its attention backend.

    Everything here reads the model and its config only (no communication), so a refusal happens on every rank
    alike before any collective."""
    backend = model.config._attn_implementation
    sharded = sequence_parallel_size * ring_size > 1
    if sharded:
        # First: for a Mamba or RWKV model "build it with sdpa" (below) would be no advice at all.
        _reject_token_mixing_outside_attention(model)
        mixers = find_token_mixers(model)
        if ring_size > 1 and mixers:
            raise NotImplementedError(
                f"{type(model).__name__} has token mixers that are not attention ({mixers[0]}), which run on whole rows"
                " under pure Ulysses only: use ring_size=1 (a sequence_parallel_size the heads divide), or train with"
                " sequence_parallel_size=1.")
    if sharded and backend not in (*BACKENDS, "eager"):
        raise ValueError(
            f"{type(model).__name__} uses attn_implementation={backend!r}, which sequence parallelism cannot wrap"
            f" (supported: {', '.join(BACKENDS)}, eager). Load or build the model with"
            " attn_implementation='sdpa' (e.g. AutoModelForCausalLM.from_config(cfg, attn_implementation='sdpa'))."
        )
    if sharded and hf_head_counts(model) is not None:  # (a model without attention has nothing to switch)
        if backend != "eager":
            check_backend(backend)  # installed and usable here, checked before any collective
        if inline.covers(model):  # attention computed inline, taken over module by module (adapters/)
            refusal = inline.inline_refusal(model, backend, ring_size)
            if refusal is not None:
                raise NotImplementedError(refusal)
        else:
            _reject_unswitchable(model)
    head_counts = hf_head_counts(model)
    if head_counts is not None:
        validate_head_counts(*head_counts, sequence_parallel_size)
    return backend


def hf_head_counts(model: PreTrainedModel) -> Optional[tuple[int, int]]:
    """(attention heads, KV heads) of a Hugging Face model; None for a model without attention (Mamba, RWKV), whose
    token mixers run on whole rows (attention/mixers.py) at any SP size."""
    text_config = model.config.get_text_config()
    num_heads = getattr(text_config, "num_attention_heads", None)
    if num_heads is None:
        return None
    return num_heads, getattr(text_config, "num_key_value_heads", None) or num_heads


def _unswitched_module(model: PreTrainedModel, private_configs: dict[int, Any]) -> Optional[torch.nn.Module]:
    """The first sub-model, or module holding one of our private configs, that still uses another attention after
    `set_attn_implementation` (which only warns when it cannot switch); None when the switch took everywhere."""
    ours = {id(config) for config in private_configs.values()}
    for module in model.modules():
        config = module.__dict__.get("config")
        if (isinstance(module, PreTrainedModel) or id(config) in ours) and \
                getattr(config, "_attn_implementation", ULYSSES_ATTENTION) != ULYSSES_ATTENTION:
            return module
    return None


def prepare_hf_model(
    model: PreTrainedModel, sequence_parallel_group, loss_function: Callable | None = None, *, ring_group=None,
    batch_rows: BatchRowsSlot | None = None, head_groups: int = 1,
) -> PreparedHFModel:
    """Switch one model to Ulysses attention over `sequence_parallel_group` (and optionally swap its loss).

    With `ring_group` (hybrid Ulysses × ring, `SequenceParallelGroups.ulysses_group`/`.ring_group`), heads are
    scattered over `sequence_parallel_group` only and ring attention spans `ring_group`; batches must then be
    sharded in the zig-zag layout (`SequenceSharder(..., ring_size=...)`).

    `batch_rows`: the slot a `SequenceSharder(..., batch_rows=...)` publishes each batch's whole rows into; the
    attention then reads packed documents and padding from it instead of gathering them in every layer.

    `head_groups`: pipeline the all-to-alls with the attention of this many head groups (`overlap_head_groups`).
    """
    group = ProcessGroupHandle(sequence_parallel_group)
    ring = ProcessGroupHandle(ring_group)
    backend = validate_hf_model(model, group.world_size, ring.world_size)
    if model.config._attn_implementation == ULYSSES_ATTENTION:
        raise RuntimeError(f"{type(model).__name__} is already prepared for sequence parallelism: restore() it first.")
    prepared = PreparedHFModel(model=model, backend=backend)
    if backend == "eager" and group.world_size > 1 and hf_head_counts(model) is not None:
        heads = hf_head_counts(model)[0] // group.world_size
        warnings.warn(
            f"{type(model).__name__} attends with eager attention: under sequence parallelism every rank runs it on"
            f" whole rows of its {heads} heads, materialising {heads} x seq x seq scores per layer"
            f" ({heads * 32768 ** 2 * 4 / 2 ** 30:.0f} GiB at 32K tokens in fp32). Use sdpa, flash or flex attention"
            " where the model supports them.", stacklevel=2)
    if loss_function is not None:
        prepared.original_loss_function = model.__dict__.get("_loss_function", _NOT_SET)
        prepared.loss_swapped = True
        model.loss_function = loss_function
    sharded = group.world_size > 1 or ring.world_size > 1
    if not sharded and (backend not in BACKENDS or _unswitchable_submodel(model) is not None):
        # SP 1 with a backend we do not wrap (eager) or a model transformers cannot switch (Falcon): the model keeps
        # its own attention, exactly as unprepared (packed rows then follow transformers' own rules).
        return prepared
    # Switched at SP 1 too: one attention for every SP size, so packed rows (position_ids restarting per document)
    # keep their documents apart at SP 1 exactly as at SP 8. Hugging Face's own sdpa path detects packing only
    # without an attention mask and without a KV cache, which its default `use_cache=True` creates even in training.
    binding = _Binding(group=group, backend=backend, ring=ring, batch_rows=batch_rows, head_groups=head_groups)
    takes_over = sharded and inline.covers(model)
    if takes_over:  # attention computed inline: each module's own forward around the exchange (attention/inline.py)
        prepared.inline_modules = inline.install(model, binding)
        for module in model.modules():
            module.__dict__[_BINDING_ATTRIBUTE] = binding
    elif hf_head_counts(model) is not None:
        _switch_attention(model, prepared, binding)
    if "position_ids" in inspect.signature(model.forward).parameters or takes_over:
        recorder = _ForwardPositions(model, binding)
        prepared.hooks.append(model.register_forward_pre_hook(recorder, with_kwargs=True))
    if sharded and batch_rows is not None:
        prepared.hooks.append(model.register_forward_pre_hook(_PositionCheck(model, binding), with_kwargs=True))
    if sharded:
        mixers = token_mixer_modules(model)
        for path, module in mixers:
            prepared.hooks += WholeRowsMixer(module, path, group.group, ring.group).attach(module)
        if mixers:
            kinds = sorted({type(module).__name__ for _, module in mixers})
            warnings.warn(
                f"{type(model).__name__}: {len(mixers)} token-mixing layers that are not attention ({', '.join(kinds)})"
                f" run on whole rows on every one of the {group.world_size * ring.world_size} sequence-parallel ranks"
                " (exact; their compute and activations do not shrink with the SP size, the attention layers' do).",
                stacklevel=2)
    return prepared


def _switch_attention(model: PreTrainedModel, prepared: PreparedHFModel, binding: _Binding) -> None:
    """Switch `model` to the "ulysses" attention on a private config copy, its modules bound to `binding`."""
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
    unswitched = _unswitched_module(model, memo)
    if unswitched is not None:
        prepared.restore()
        raise ValueError(_unswitchable_message(model, unswitched))
    for module in model.modules():
        module.__dict__[_BINDING_ATTRIBUTE] = binding
    for private in memo.values():
        if isinstance(private, PreTrainedConfig):
            _MASK_CONFIGS[id(private)] = (weakref.ref(private), type(model).__name__, binding)
            prepared.mask_configs.append(id(private))


def watch_positions(model: torch.nn.Module, batch_rows: BatchRowsSlot, sequence_parallel_group, ring_group=None):
    """Refuse `model`'s sharded forwards whose positions are not the batch's (see `_PositionCheck`); for models
    other than Hugging Face's (the native GPT), which `prepare_hf_model` does not see. Returns the hook's handle."""
    binding = _Binding(group=ProcessGroupHandle(sequence_parallel_group), backend="", ring=ProcessGroupHandle(ring_group),
                       batch_rows=batch_rows)
    return model.register_forward_pre_hook(_PositionCheck(model, binding), with_kwargs=True)


class _ForwardPositions:
    """Keeps the `position_ids` (and the `attention_mask`) of the model's latest forward on the binding (a
    pre-hook). Kept after the forward: layers recomputed in backward (activation checkpointing) must see the
    positions their forward saw."""

    def __init__(self, model: torch.nn.Module, binding: _Binding) -> None:
        self.binding = binding
        self.signature = inspect.signature(model.forward)

    def __call__(self, module, args, kwargs):
        try:
            arguments = self.signature.bind_partial(*args, **kwargs).arguments
        except TypeError:
            arguments = {}
        self.binding.forward_positions = arguments.get("position_ids")
        mask = arguments.get("attention_mask")
        self.binding.forward_padding_mask = mask if isinstance(mask, torch.Tensor) else None
        return None


class _PositionCheck:
    """Refuses a sharded forward whose positions are not the batch's global ones (a forward pre-hook).

    Left without `position_ids`, a model numbers every shard from 0: wrong rotary/learned positions, and the
    gathered positions restart at each shard boundary, so attention silently becomes block-diagonal. Positions
    are checked against the shard the sharder published (metadata only); a different tensor is compared by value
    before it is refused. Raised in the model's forward, before its first all-to-all, on every rank alike.
    """

    def __init__(self, model: torch.nn.Module, binding: _Binding) -> None:
        self.binding = binding
        self.name = type(model).__name__
        self.signature = inspect.signature(model.forward)
        self.takes_positions = "position_ids" in self.signature.parameters

    def _same_values_on_every_rank(self, position_ids: torch.Tensor, expected: torch.Tensor | None) -> bool:
        """Whether `position_ids` hold the batch's positions on every rank of the SP group. One rank's shard may
        match by chance (local 0..n-1 are rank 0's global ones), so the ranks agree (MIN all-reduce) before any
        of them raises or goes on: the path here is taken by every rank alike (it follows metadata only)."""
        same = (expected is not None and position_ids.shape[-1] == expected.shape[-1]
                and torch.equal(position_ids.expand_as(expected).to(expected.device), expected))
        flag = torch.tensor([int(same)], device=position_ids.device)
        for handle in (self.binding.group, self.binding.ring):
            if handle.world_size > 1:
                dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=handle.group)
        return bool(flag.item())

    def __call__(self, module, args, kwargs):
        rows = None if self.binding.batch_rows is None else self.binding.batch_rows.rows
        if rows is None or (self.binding.decode is not None) or not self.takes_positions:
            return None
        try:
            bound = self.signature.bind_partial(*args, **kwargs).arguments
        except TypeError:
            return None  # the model's own call raises its own error
        input_ids, position_ids = bound.get("input_ids"), bound.get("position_ids")
        if rows.holds_position_ids(position_ids):
            return None
        if position_ids is not None and self._same_values_on_every_rank(position_ids, rows.shard_position_ids):
            return None
        if position_ids is None and input_ids is not None and not rows.holds_input_ids(input_ids):
            return None  # not this batch's tokens: nothing to check them against
        what = "no position_ids" if position_ids is None else "position_ids that are not the batch's global ones"
        raise ValueError(
            f"{self.name} was called under sequence parallelism with {what}: each rank holds only its shard of the"
            " sequence, so the model would number it from 0 (wrong positions, and attention that stops at every shard"
            " boundary). Pass the batch's global positions: model(**batch), or model(input_ids=batch['input_ids'],"
            " labels=..., position_ids=batch['position_ids']) — the strategy fills them in when the batch has none."
        )
