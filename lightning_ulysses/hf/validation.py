"""What `prepare_hf_model` checks before it touches a model (no communication, so a refusal happens on every rank
alike before any collective): the backend, the heads, and token mixing that neither the Ulysses exchange nor a
whole-rows mixer (attention/mixers.py) would reach."""

from __future__ import annotations

import importlib.metadata
import inspect
import re
from typing import Any, Optional

import torch
from packaging.version import Version
from transformers import PreTrainedModel

from lightning_ulysses.adapters.registry import (attention_the_exchange_cannot_carry, encoder_model_types,
                                                 token_mixer_names)
from lightning_ulysses.attention import inline
from lightning_ulysses.attention.backends import BACKENDS, check_backend
from lightning_ulysses.attention.core import validate_head_counts
from lightning_ulysses.fences._transformers_private import attention_implementation, can_set_attention_implementation
from lightning_ulysses.hf.binding import ULYSSES_ATTENTION, is_ulysses_attention
from lightning_ulysses.mixers import left_on_whole_rows
from lightning_ulysses.mixers.arguments import CACHE_ARGUMENTS


# Layer kinds of `config.layer_types` whose token mixing (if any) is attention through transformers' attention interface
# (what the "ulysses" key replaces). Layers of other kinds (linear attention, Mamba, short convolutions) must hold a
# token mixer `token_mixer_modules` finds (run on whole rows, attention/mixers.py); a kind without one is refused.
# MLP kinds ("mlp", "moe", "dense", "sparse") appear in the same lists of some families and mix no tokens.
_ATTENTION_LAYER_TYPES = frozenset({"attention", "full_attention", "sliding_attention", "chunked_attention",
                                    "mlp", "moe", "dense", "sparse"})
# The class names of the token mixers transformers' hybrid and recurrent families use instead of (or beside)
# attention are declared by the families (`Family.token_mixer_names`: Mamba/Mamba2 mixers, Gated DeltaNet, LFM2's
# short convolution, RWKV time mixing, ...). Those holding a causal `nn.Conv1d` are found without their name.
_TOKEN_MIXER_ADVICE = (
    "Under sequence parallelism every rank holds a slice of the sequence, and only attention that dispatches through"
    " transformers' attention interface, or a token mixer lightning_ulysses runs on whole rows, is exchanged between"
    " the slices: this layer would run over each rank's slice as if it were the whole sequence (silently wrong losses"
    " and gradients). Train this model without sequence parallelism (sequence_parallel_size=1), or use a model whose"
    " layers all mix tokens by attention."
)


_POSITIONAL = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
_WHOLE_ROW_ARGUMENTS = frozenset({"attention_mask", "position_ids", "cache_position", "position_embeddings", "use_cache",
                                  *CACHE_ARGUMENTS})


def _mixer_by_name(module: torch.nn.Module) -> bool:  # (MambaForCausalLM names a model, MambaRMSNorm a norm)
    name = type(module).__name__
    return not isinstance(module, PreTrainedModel) and "Norm" not in name and bool(token_mixer_names().search(name))


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
        # The arguments a mixer on whole rows can be handed besides the hidden states are those it makes whole
        # (mixers/arguments.py); one that takes other per-token tensors (xLSTM's cell: query, key, value and gates
        # from its layer) would meet them shaped like the shard in training.
        other = [name for name, parameter in list(inspect.signature(type(module).forward).parameters.items())[2:]
                 if parameter.default is inspect.Parameter.empty and parameter.kind in _POSITIONAL
                 and name not in _WHOLE_ROW_ARGUMENTS]
        if other:
            raise NotImplementedError(
                f"{name} mixes tokens outside attention in {path} ({type(module).__name__}), which takes per-token"
                f" inputs besides the hidden states ({', '.join(other)}), so it cannot run on whole rows."
                f" {_TOKEN_MIXER_ADVICE}")
        # A mixer inside an attention module (Inkling's short convolutions over the keys) is handed the shard's
        # rows by that attention, before the exchange: it cannot run on whole rows either.
        outer = [other for other, parent in model.named_modules() if path.startswith(f"{other}.")
                 and type(parent).__name__.endswith("Attention") and not _mixer_by_name(parent)]
        if outer:
            raise NotImplementedError(
                f"{name} mixes tokens outside attention in {path} ({type(module).__name__}), inside the attention"
                f" {outer[-1]}, which hands it this rank's shard only, so it cannot run on whole rows."
                f" {_TOKEN_MIXER_ADVICE}")
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

def _reject_attention_the_exchange_cannot_carry(model: PreTrainedModel) -> None:
    """Attention classes that dispatch through transformers' attention interface (so transformers switches them)
    but work on the rank's shard in a way the exchange does not carry (declared by their families:
    `Family.attention_the_exchange_cannot_carry`)."""
    for path, module in model.named_modules():
        why = attention_the_exchange_cannot_carry(type(module).__name__)
        if why is not None:
            raise NotImplementedError(
                f"{type(model).__name__}'s attention {path} ({type(module).__name__}) {why}, which the Ulysses"
                " exchange of each rank's shard cannot reproduce (silently wrong losses and gradients, or a crash)."
                " Train this model without sequence parallelism (sequence_parallel_size=1).")


# Encoder and encoder-decoder families whose causal-LM heads transformers' causal-LM mapping lists beside the
# decoders (BertLMHeadModel, BartForCausalLM, ...): known by their masked-LM or sequence-to-sequence heads, and those
# the families declare encoders (`Family.encoder`: they have neither). Their attention (bidirectional unless
# `is_decoder`, cross-attention, relative or permuted positions) is outside what the family matrix holds exact
# (decoder-only families: docs/model-families.md).
def _encoder_family(model: PreTrainedModel) -> Optional[str]:
    from transformers.models.auto import modeling_auto

    encoders = (set(modeling_auto.MODEL_FOR_MASKED_LM_MAPPING_NAMES)
                | set(modeling_auto.MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES)
                | set(modeling_auto.MODEL_FOR_SPEECH_SEQ_2_SEQ_MAPPING_NAMES) | encoder_model_types())
    for config in (model.config, model.config.get_text_config()):
        if getattr(config, "model_type", None) in encoders:
            return config.model_type
    return None


def _reject_encoder_families(model: PreTrainedModel) -> None:
    family = _encoder_family(model)
    if family is not None:
        raise NotImplementedError(
            f"{type(model).__name__} is the causal-LM head of {family!r}, an encoder (or encoder-decoder) family:"
            " lightning_ulysses holds decoder-only families exact under sequence parallelism (docs/model-families.md)"
            " and has not verified this one's attention on shards (bidirectional or cross-attention, its own"
            " positions). Train it with sequence_parallel_size=1, or use a decoder-only family.")


def _unswitchable_submodel(model: PreTrainedModel) -> Optional[PreTrainedModel]:
    """transformers only logs a warning when it cannot switch a model's attention (its source heuristic
    `_can_set_attn_implementation`: attention classes that do not dispatch through the interface, classes defined
    in `__main__`, sources `inspect` cannot read), and the model keeps its own attention on each shard."""
    for module in model.modules():
        if isinstance(module, PreTrainedModel) and not can_set_attention_implementation(type(module)):
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


# The oldest transformers the suite has run on (pyproject.toml's floor, docs/versions.md). Below it the package's
# swaps are not all reached: on 5.17 Nemotron-H's Mamba2 mixer calls transformers' own scan (quadratic in the row)
# through its kernel wrapper while ours reports itself bound (measured on an H100, 2026-12-07); on 5.24 a split
# Falcon-H1 mixer fails in transformers' own reshape.
VERIFIED_TRANSFORMERS = "5.25"


def refuse_unverified_transformers(installed: str) -> None:
    """Refuse a transformers older than `VERIFIED_TRANSFORMERS` (the same answer on every rank: one installation)."""
    if Version(installed).release[:2] < Version(VERIFIED_TRANSFORMERS).release:
        raise RuntimeError(
            f"lightning_ulysses prepares Hugging Face models on transformers>={VERIFIED_TRANSFORMERS} only; this"
            f" process has transformers {installed}, on which some families' layers are not where the package"
            f" replaces them (they would run transformers' own: on 5.17 a state-space scan quadratic in the row)."
            f" Install the verified version: pip install 'transformers>={VERIFIED_TRANSFORMERS},<5.26'.")


def validate_hf_model(model: PreTrainedModel, sequence_parallel_size: int, ring_size: int = 1) -> str:
    """Check that `model` can run Ulysses attention at this SP size (`sequence_parallel_size` ranks splitting heads,
    times `ring_size` in a ring); returns its attention backend.

    Everything here reads the model and its config only (no communication), so a refusal happens on every rank
    alike before any collective."""
    refuse_unverified_transformers(importlib.metadata.version("transformers"))  # the installed distribution's
    backend = attention_implementation(model.config)
    sharded = sequence_parallel_size * ring_size > 1
    if sharded:
        _reject_encoder_families(model)
        # First: for a Mamba or RWKV model "build it with sdpa" (below) would be no advice at all.
        _reject_token_mixing_outside_attention(model)
        _reject_attention_the_exchange_cannot_carry(model)
        # On a ring, a mixer runs split by its own heads over every SP rank; whole rows are for pure Ulysses only.
        whole_rows = [f"{path} ({type(module).__name__})" for path, module
                      in left_on_whole_rows(token_mixer_modules(model), sequence_parallel_size * ring_size)]
        if ring_size > 1 and whole_rows:
            raise NotImplementedError(
                f"{type(model).__name__} has token mixers that are not attention ({whole_rows[0]}) and cannot split by"
                f" their heads over {sequence_parallel_size * ring_size} SP ranks (fewer heads than ranks, or no"
                " declared split); such mixers run on whole rows under pure Ulysses only: use ring_size=1, fewer SP"
                " ranks than the mixer has heads, or train with sequence_parallel_size=1.")
    if sharded and backend not in (*BACKENDS, "eager"):
        raise ValueError(
            f"{type(model).__name__} uses attn_implementation={backend!r}, which sequence parallelism cannot wrap"
            f" (supported: {', '.join(BACKENDS)}, eager). Load or build the model with"
            " attn_implementation='sdpa' (e.g. AutoModelForCausalLM.from_config(cfg, attn_implementation='sdpa'))."
        )
    if sharded and hf_head_counts(model) is not None:  # (a model without attention has nothing to switch)
        if backend != "eager":
            check_backend(backend)  # installed and usable here, checked before any collective
        if inline.covers(model):  # attention computed inline, taken over module by module (families/)
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
                not is_ulysses_attention(attention_implementation(config, ULYSSES_ATTENTION)):
            return module
    return None
