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

We do not use DeepSpeed's `UlyssesSPAttentionHF`: it registers process-wide, fixes the batch size at
construction, can be set up once per process and drops padding masks.
"""

from __future__ import annotations

import copy
import functools
import inspect
import re
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
from transformers import AttentionInterface, PreTrainedConfig, PreTrainedModel
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from lightning_ulysses.attention.backends import BACKENDS, check_backend
from lightning_ulysses.attention.core import ProcessGroupHandle, ulysses_attention, validate_head_counts
from lightning_ulysses.attention.masks import reject_unsupported_pattern, reject_window
from lightning_ulysses.attention.rows import BatchRowsSlot

ULYSSES_ATTENTION = "ulysses"
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
    # K/V blocks pass around this group (hybrid Ulysses × ring); of one rank (no group) for pure Ulysses.
    ring: ProcessGroupHandle = field(default_factory=lambda: ProcessGroupHandle(None))
    # Where the sharder publishes each batch's whole rows (attention/rows.py); None: gathered in every layer.
    batch_rows: Optional[BatchRowsSlot] = None
    # Head groups whose all-to-alls are pipelined with their attention (core.exchange_and_attend).
    head_groups: int = 1

    @property
    def sharded(self) -> bool:
        """Whether the sequence is cut at all (SP > 1); at SP 1 the binding only keeps packed documents apart."""
        return self.group.world_size * self.ring.world_size > 1

    def __deepcopy__(self, memo):
        return self


def _reject_unsupported(module, attention_mask, kwargs, row_length: int) -> None:
    """Fail, the same way on every rank and before any collective, on inputs the Ulysses core would get wrong."""
    if any(name in kwargs for name in ("cu_seq_lens_q", "cu_seq_lens_k")):
        raise ValueError(
            "cu_seq_lens_q/cu_seq_lens_k describe documents of the whole (unsharded) row. Under sequence parallelism"
            " lightning_ulysses reads packed documents from position_ids restarting at 0 instead: drop the flash"
            " kwargs from the batch (e.g. DataCollatorWithFlattening(return_flash_attn_kwargs=False))."
        )
    if attention_mask is not None and attention_mask.dim() != 2:
        raise ValueError(
            f"{type(module).__name__} got a {attention_mask.dim()}-D attention mask; under sequence parallelism only"
            " 2-D padding masks ([batch, seq]) and packed position_ids can be cut along the sequence."
        )
    sliding_window = kwargs.get("sliding_window")
    if sliding_window is not None:  # the same rule as for a window the mask function carries (attention/masks.py)
        reject_window(type(module).__name__, "a sliding window", sliding_window, row_length)
    for name in ("softcap", "s_aux"):
        if kwargs.get(name) is not None:
            raise NotImplementedError(f"{type(module).__name__} passes {name}, which Ulysses attention does not apply yet.")


def _unsupported(module, attention_mask, kwargs, row_length: int) -> bool:
    try:
        _reject_unsupported(module, attention_mask, kwargs, row_length)
    except (ValueError, NotImplementedError):
        return True
    return False


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
        return ALL_ATTENTION_FUNCTIONS[binding.backend](module, query, key, value, attention_mask, **kwargs)
    if binding.decode is not None and binding.decode.prefilled:
        return _decode_attention(query, key, value, binding.decode, group, kwargs.get("scaling")), None
    _reject_unsupported(module, attention_mask, kwargs, row_length)
    is_causal = kwargs.get("is_causal")
    output = ulysses_attention(
        query, key, value, group, binding.backend,
        position_ids=kwargs.get("position_ids"),  # global positions: packed documents are read from them
        padding_mask=attention_mask,  # this shard's 2-D padding mask (see _shard_padding_mask)
        is_causal=getattr(module, "is_causal", True) if is_causal is None else is_causal,
        scale=kwargs.get("scaling"),
        dropout_p=kwargs.get("dropout", 0.0),
        ring_group=binding.ring.group,  # with a ring, ring attention replaces the backend
        batch_rows=binding.batch_rows,
        head_groups=binding.head_groups,
    )
    return output, None  # [batch, seq/P, heads, dim], the layout the model expects back


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
            # Called with this shard's length: the whole row spans every shard of the SP group (and ring).
            row_length = q_length * binding.group.world_size * binding.ring.world_size
        elif not decode.prefilled:
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
    hooks: list = field(default_factory=list)
    mask_configs: list[int] = field(default_factory=list)

    def restore(self) -> None:
        for hook in self.hooks:
            hook.remove()
        self.hooks = []
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
# (what the "ulysses" key replaces). Every other kind (linear attention, Mamba, short convolutions, kinds added
# after this list was written) mixes tokens some other way and is refused.
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
    " transformers' attention interface is exchanged between the slices: this layer would run over each rank's"
    " slice as if it were the whole sequence (silently wrong losses and gradients). Train this model without"
    " sequence parallelism (sequence_parallel_size=1), or use a model whose layers all mix tokens by attention."
)


def find_token_mixers(model: torch.nn.Module) -> list[str]:
    """Layers of `model` that mix tokens without transformers' attention interface, as "path (Class)" (outermost
    ones only: a Mamba mixer's convolution is not listed again)."""
    found: list[str] = []

    def by_name(module: torch.nn.Module) -> bool:  # (MambaForCausalLM names a model, MambaRMSNorm a norm)
        name = type(module).__name__
        return not isinstance(module, PreTrainedModel) and "Norm" not in name and bool(_TOKEN_MIXER_NAMES.search(name))

    def visit(module: torch.nn.Module, path: str) -> None:
        children = [(f"{path}.{name}" if path else name, child) for name, child in module.named_children()]
        # A block named like a mixer (MambaBlock) that holds the mixer itself (MambaMixer) is named by the latter.
        if isinstance(module, torch.nn.Conv1d) or by_name(module) and not any(
                by_name(m) for _, child in children for m in child.modules()):
            found.append(f"{path or '<model>'} ({type(module).__name__})")
            return
        for child_path, child in children:
            visit(child, child_path)

    visit(model, "")
    return found


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
    """Refuse (before any collective) models with layers the Ulysses exchange does not reach."""
    name = type(model).__name__
    mixers = find_token_mixers(model)
    if mixers:
        listed = ", ".join(mixers[:3]) + (f" and {len(mixers) - 3} more" if len(mixers) > 3 else "")
        raise NotImplementedError(f"{name} mixes tokens outside attention in {listed}. {_TOKEN_MIXER_ADVICE}")
    for config in _configs_of(model):  # kinds whose modules have names this check does not know yet
        layer_types = getattr(config, "layer_types", None) or []
        unknown = [(i, kind) for i, kind in enumerate(layer_types) if kind not in _ATTENTION_LAYER_TYPES]
        if unknown:
            listed = ", ".join(f"layer {i} is {kind!r}" for i, kind in unknown[:3])
            raise NotImplementedError(
                f"{name} has layers that are not attention ({listed} in config.layer_types), so they mix tokens"
                f" some other way. {_TOKEN_MIXER_ADVICE}"
            )
    for path, module in model.named_modules():
        # Llama-4's NoPE layers scale queries by a temperature of the position they compute as `arange` over the
        # tokens they hold: under SP, each shard's positions would restart at 0.
        if getattr(module, "attn_temperature_tuning", False) and not getattr(module, "use_rope", True):
            raise NotImplementedError(
                f"{name}'s {path} ({type(module).__name__}) tunes its attention temperature by positions it numbers"
                " from 0 on every sequence shard, so under sequence parallelism each rank would scale its queries"
                " as if its shard started the sequence. Build the model with attn_temperature_tuning=False in its"
                " (text) config, or train it without sequence parallelism (sequence_parallel_size=1)."
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
    if sharded and backend not in BACKENDS:
        raise ValueError(
            f"{type(model).__name__} uses attn_implementation={backend!r}, which sequence parallelism cannot wrap"
            f" (supported: {', '.join(BACKENDS)}). Load or build the model with"
            " attn_implementation='sdpa' (e.g. AutoModelForCausalLM.from_config(cfg, attn_implementation='sdpa'))."
        )
    if sharded:
        check_backend(backend)  # installed and usable here, checked before any collective
        _reject_unswitchable(model)
    validate_head_counts(*hf_head_counts(model), sequence_parallel_size)
    return backend


def hf_head_counts(model: PreTrainedModel) -> tuple[int, int]:
    """(attention heads, KV heads) of a Hugging Face model."""
    text_config = model.config.get_text_config()
    num_heads = text_config.num_attention_heads
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
    binding = _Binding(group=group, backend=backend, ring=ring, batch_rows=batch_rows, head_groups=head_groups)
    for module in model.modules():
        module.__dict__[_BINDING_ATTRIBUTE] = binding
    if sharded and batch_rows is not None:
        prepared.hooks.append(model.register_forward_pre_hook(_PositionCheck(model, binding), with_kwargs=True))
    for private in memo.values():
        if isinstance(private, PreTrainedConfig):
            _MASK_CONFIGS[id(private)] = (weakref.ref(private), type(model).__name__, binding)
            prepared.mask_configs.append(id(private))
    return prepared


def watch_positions(model: torch.nn.Module, batch_rows: BatchRowsSlot, sequence_parallel_group, ring_group=None):
    """Refuse `model`'s sharded forwards whose positions are not the batch's (see `_PositionCheck`); for models
    other than Hugging Face's (the native GPT), which `prepare_hf_model` does not see. Returns the hook's handle."""
    binding = _Binding(group=ProcessGroupHandle(sequence_parallel_group), backend="", ring=ProcessGroupHandle(ring_group),
                       batch_rows=batch_rows)
    return model.register_forward_pre_hook(_PositionCheck(model, binding), with_kwargs=True)


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
