"""Which attention pattern a Hugging Face mask function asks for: windows and chunks for the Ulysses core to apply
on whole rows (`attention_pattern`), every other pattern refused.

transformers builds some attention patterns only through the `mask_function` it hands the mask interface
(`masking_utils.create_causal_mask` and its siblings): the sliding windows of PhiMoE and of Qwen2-MoE's sliding
layers (their attention gets no `sliding_window` kwarg), Llama-4's chunked attention, and the `or_mask_function` /
`and_mask_function` / `block_sequence_ids` overlays (Gemma 3's bidirectional image tokens and bidirectional mode).
Our mask interface hands the attention the 2-D padding mask (with the window or chunk size the function asks for,
hf `_mark`), and the Ulysses core applies causal attention, padding, packed documents (read from the global
`position_ids`), windows and chunks on whole rows after the exchange. Every other pattern is refused here. (At
SP 1, and while decoding from a sequence-parallel KV cache, `reject_unsupported_pattern` decides instead: what is
not exactly causal at that row length runs through the model's own attention, or is refused while decoding.)

The function is read by its structure, not by probing it: transformers composes it from closures of a few
factories (`and_masks`, `or_masks`, `sliding_window_overlay`, ...), each recognised by its code object, with the
window or chunk size read from the closure. Probing (q, kv) pairs would index tensors of this shard's length with
whole-row positions, and would miss an overlay that no token of this batch (or of this shard) triggers. Structure
is also what every SP rank shares: only the packed-sequence wrapping transformers adds itself differs from shard
to shard (it looks for restarting `position_ids` in the shard alone), and that wrapping is stripped, because our
documents from the global positions replace it exactly. So the refusal is raised alike on every rank of the SP
group, in the model's forward before its first attention layer, hence before the first all-to-all.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

from transformers import masking_utils as hf_masks

from lightning_ulysses.attention.documents import AttentionPattern

_PROBE = hf_masks.causal_mask_function
_NO_CODE = object()


def _factory_code(name: str, *args):
    """The code object of the closures transformers' factory `name` makes; None where this transformers has no such
    factory (its closures are then unknown functions, refused rather than misread)."""
    factory = getattr(hf_masks, name, None)
    try:
        return None if factory is None else factory(*args).__code__
    except Exception:  # noqa: BLE001 - another signature in another release: treat as absent
        return None


# Closures made by one factory share its code object: these identify the pieces transformers composes masks from.
_AND = _factory_code("and_masks", _PROBE)
_OR = _factory_code("or_masks", _PROBE)
_SLIDING = _factory_code("sliding_window_overlay", 1)
_CHUNKED = _factory_code("chunked_overlay", 1, None)
_PACKED = _factory_code("packed_sequence_mask_function", None)
_REMAP = _factory_code("remap_positions_for_packed_sequence", _PROBE, None)
_BLOCKWISE = _factory_code("blockwise_overlay", None)


@dataclass(frozen=True)
class MaskPattern:
    """What a mask function restricts causal attention to: windows and chunks (None: the function is not causal
    attention restricted by them; `unsupported` then says what it is)."""

    sliding_windows: tuple[int, ...] = ()
    chunk_sizes: tuple[int, ...] = ()
    unsupported: Optional[str] = None


def read_mask_function(mask_function: Callable) -> MaskPattern:
    """The pattern of a transformers mask function (see the module docstring)."""
    causal, windows, chunks, unsupported = False, [], [], []

    def visit(function: Callable) -> None:
        nonlocal causal
        code = getattr(function, "__code__", None) or _NO_CODE  # never equal to an absent factory's None
        if function is hf_masks.causal_mask_function:
            causal = True
        elif function is getattr(hf_masks, "bidirectional_mask_function", None):
            unsupported.append("bidirectional attention (config.is_causal=False)")
        elif code is _AND:
            for member in _free(function, "mask_functions"):
                visit(member)
        elif code is _OR:
            # Only transformers' overlays are or-ed onto the causal mask (Gemma 3's bidirectional tokens, ...).
            members = _free(function, "mask_functions")
            unsupported.append("an overlay that lets tokens attend beyond the causal mask (or_mask_function"
                               + (", block_sequence_ids)" if any(_code(m) is _BLOCKWISE for m in members) else ")"))
        elif code is _SLIDING:
            windows.append(int(_free(function, "sliding_window")))
        elif code is _CHUNKED:
            chunks.append(int(_free(function, "chunk_size")))
        elif code is _REMAP:
            # Packed rows: causal, windows and chunks measured within each document. Documents are applied from
            # the global positions; a window or chunk no shorter than the row is causal within a document too.
            visit(_free(function, "mask_function"))
        elif code is _PACKED:
            pass  # documents kept apart: the Ulysses core does this from the global position_ids
        else:
            name = getattr(function, "__qualname__", type(function).__name__)
            unsupported.append(f"a mask function lightning_ulysses does not know ({name})")

    visit(mask_function)
    if not causal and not unsupported:
        unsupported.append("a mask without the causal mask function")
    return MaskPattern(tuple(windows), tuple(chunks), "; ".join(unsupported) or None)


def attention_pattern(mask_function: Callable, model_name: str) -> AttentionPattern:
    """The sliding window and chunks `mask_function` narrows causal attention to (applied on whole rows by the
    Ulysses core); raises for every other pattern (see `read_mask_function`)."""
    pattern = read_mask_function(mask_function)
    _raise_unsupported(pattern, model_name)
    if len(set(pattern.chunk_sizes)) > 1:
        raise NotImplementedError(f"{model_name} builds its attention mask with chunks of several sizes"
                                  f" {sorted(set(pattern.chunk_sizes))}, which Ulysses attention does not apply.")
    return AttentionPattern(min(pattern.sliding_windows, default=None), min(pattern.chunk_sizes, default=None))


def _raise_unsupported(pattern: MaskPattern, model_name: str) -> None:
    if pattern.unsupported is not None:
        raise NotImplementedError(
            f"{model_name} builds its attention mask with {pattern.unsupported}, which Ulysses attention does not"
            " apply yet (it applies causal attention with padding, packed documents, sliding windows and chunks)."
            " Switch it off in the config (e.g. use_bidirectional_attention=False), use a model without it, or"
            " train without sequence parallelism."
        )


def reject_unsupported_pattern(mask_function: Callable, row_length: int, model_name: str,
                               layer_types: Optional[list] = None) -> None:
    """Raise unless `mask_function` is exactly causal (with padding and packed documents) over rows of
    `row_length` tokens (the whole row: this shard's length × the SP size).

    `layer_types` (the config's): models build their sliding-window (chunked) mask even when no layer is of the
    "sliding_attention" ("chunked_attention") kind — Qwen2-MoE without `use_sliding_window` builds one of window 0 —
    and a mask no layer reads changes nothing."""
    pattern = read_mask_function(mask_function)
    if pattern.unsupported is None and layer_types is not None:
        windows = pattern.sliding_windows if "sliding_attention" in layer_types else ()
        chunks = pattern.chunk_sizes if "chunked_attention" in layer_types else ()
        pattern = MaskPattern(windows, chunks)
    _raise_unsupported(pattern, model_name)
    for window in pattern.sliding_windows:
        reject_window(model_name, "a sliding window", window, row_length)
    for chunk in pattern.chunk_sizes:
        reject_window(model_name, "chunked attention with chunks", chunk, row_length)


def reject_window(model_name: str, pattern: str, size: int, row_length: int) -> None:
    """Raise when a window (or chunk) of `size` tokens cuts rows of `row_length` tokens (at least as long is
    plain causal attention: every earlier token of the row is inside it)."""
    if size < row_length:
        raise NotImplementedError(
            f"{model_name} uses {pattern} of {size} tokens, shorter than its rows of {row_length} tokens (the whole"
            f" row, all sequence-parallel shards together); Ulysses attention does not apply that yet. Use rows of at"
            f" most {size} tokens, or a model without it."
        )


def _code(function: Callable):
    return getattr(function, "__code__", None)


def _free(function: Callable, name: str):
    """The value a closure captured under `name`."""
    return function.__closure__[function.__code__.co_freevars.index(name)].cell_contents
