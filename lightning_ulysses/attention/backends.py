"""The local attention that runs on whole rows after the all-to-all, one function per backend.

Native models and Hugging Face models both end here (through `core.ulysses_attention`), so packed documents,
padding and GQA mean the same thing whichever model family or backend is used. The backend is chosen by name:

- `sdpa`: `F.scaled_dot_product_attention`; the causal fast path for plain rows, a dense `[batch, 1, seq, seq]`
  boolean mask for packed or padded rows (quadratic memory: at long lengths pack with a flash backend).
- `flash_attention_2` / `flash_attention_3`: the `flash_attn` / `flash_attn_interface` (FA3, Hopper) kernels;
  packed or padded rows run the variable-length kernel over the whole-row `cu_seqlens` (padding dropped).
  CUDA, fp16/bf16 only.
- `flex_attention`: `torch.nn.attention.flex_attention` with a block mask from the same documents (compiled on
  CUDA; on CPU torch runs it uncompiled and without backward, enough for inference and checks).

All take `[batch, heads, seq, dim]` query/key/value (fewer KV heads than query heads allowed) and return
`[batch, seq, heads, dim]`, the layout both Hugging Face attention modules and output projections want.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import importlib.util
import types
from typing import Optional

import torch
import torch.nn.functional as F

from lightning_ulysses.attention import fa4
from lightning_ulysses.attention.documents import AttentionPattern, DocumentMask, allowed_mask, mask_mod
from lightning_ulysses.fences import _torch_private as torch_private

BACKENDS = ("sdpa", "flash_attention_2", "flash_attention_3", "flex_attention")
_FLASH_MODULES = {"flash_attention_2": "flash_attn", "flash_attention_3": "flash_attn_interface"}


def check_backend(name: object) -> str:
    """Raise a fix-naming error unless `name` is a backend that can run in this environment; return it."""
    if name not in BACKENDS:
        raise ValueError(
            f"attention backend {name!r} is not one lightning_ulysses runs under sequence parallelism. Choose one of"
            f" {', '.join(BACKENDS)} (Hugging Face: attn_implementation=...; native GPT: GPTConfig(attention_backend=...))."
        )
    module = _FLASH_MODULES.get(name)
    if module is not None:
        if importlib.util.find_spec(module) is None:
            package = "flash-attn" if name == "flash_attention_2" else "flash-attn-3 (flash_attn_interface, built from hopper/)"
            raise ImportError(
                f"attention backend {name!r} needs the {package} package, which is not installed. Install it, or"
                " use 'sdpa' (or 'flex_attention')."
            )
        if not torch.cuda.is_available():
            raise RuntimeError(f"attention backend {name!r} needs a CUDA GPU; use 'sdpa' on this machine.")
    if name == "flex_attention" and importlib.util.find_spec("torch.nn.attention.flex_attention") is None:
        raise ImportError(f"attention backend 'flex_attention' needs torch >= 2.5 (found {torch.__version__}); use 'sdpa'.")
    return name


def local_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    backend: str,
    documents: Optional[DocumentMask] = None,
    is_causal: bool = True,
    scale: Optional[float] = None,
    dropout_p: float = 0.0,
    pattern: Optional[AttentionPattern] = None,
) -> torch.Tensor:
    """Attention over whole rows within `documents` (None: one unpadded sequence per row), narrowed by `pattern`
    (sliding windows, chunks); `[b, s, h, d]` out."""
    pattern = pattern or None
    if backend == "sdpa":
        return _sdpa(query, key, value, documents, is_causal, scale, dropout_p, pattern)
    if backend in _FLASH_MODULES:
        return _flash(query, key, value, backend, documents, is_causal, scale, dropout_p, pattern)
    if backend == "flex_attention":
        return _flex(query, key, value, documents, is_causal, scale, dropout_p, pattern)
    check_backend(backend)  # raises the fix-naming error
    raise AssertionError(backend)


def _sdpa(query, key, value, documents, is_causal, scale, dropout_p, pattern=None):
    if fa4_first_for(query, dropout_p, pattern):
        return _flash(query, key, value, _FA4_BACKEND, documents, is_causal, scale, dropout_p, pattern)
    # Left-padding queries get an empty row: SDPA (torch >= 2.5) returns zeros there, with finite gradients.
    if pattern is not None:  # a dense mask, as transformers' own sdpa mask for windows and chunks
        mask = allowed_mask(query.size(0), query.size(2), documents, is_causal, pattern, query.device)
    else:
        mask = None if documents is None else documents.dense_mask(is_causal)
    output = F.scaled_dot_product_attention(
        query, key, value, attn_mask=mask, dropout_p=dropout_p, is_causal=is_causal and mask is None, scale=scale,
        enable_gqa=key.size(1) != query.size(1),
    )
    return output.transpose(1, 2)


def _flash(query, key, value, backend, documents, is_causal, scale, dropout_p, pattern=None):
    # Written against flash_attn 2.x and FA3's flash_attn_interface; not exercised by the CPU test suite.
    if pattern is not None and pattern.chunk_size is not None:
        raise NotImplementedError(
            f"{backend} has no chunked attention (Llama-4's attention_chunk_size) under sequence parallelism here:"
            " use attn_implementation='sdpa' or 'flex_attention' for this model."
        )
    dtype = query.dtype
    if dtype not in (torch.float16, torch.bfloat16):
        if not torch.is_autocast_enabled(query.device.type):
            raise TypeError(
                f"{backend} runs in fp16/bf16 only, got {dtype} inputs: train with precision='bf16-mixed' (or"
                " bf16-true), or use the 'sdpa' backend."
            )
        query, key, value = (t.to(torch.get_autocast_dtype(query.device.type)) for t in (query, key, value))
    kernels = _FA4_KERNELS if backend == _FA4_BACKEND else importlib.import_module(_FLASH_MODULES[backend])
    options = {"softmax_scale": scale, "causal": is_causal}
    if pattern is not None and pattern.sliding_window is not None:
        # kv > q - window: the window_size (left, right) of the kernels, as transformers' flash path passes it
        options["window_size"] = (pattern.sliding_window - 1, pattern.sliding_window - 1)
    if dropout_p:
        if backend != "flash_attention_2":
            raise ValueError(f"{backend} has no attention dropout: set the model's attention dropout to 0.")
        options["dropout_p"] = dropout_p
    # The kernels take [batch, seq, heads, dim] (and handle GQA themselves).
    query, key, value = (t.transpose(1, 2) for t in (query, key, value))
    batch, seq = query.shape[:2]
    if documents is None:
        output = kernels.flash_attn_func(query, key, value, **options)
        output = output[0] if isinstance(output, tuple) else output  # some FA3 builds also return the log-sum-exp
        return output.to(dtype)
    kept, cu_seqlens, longest = documents.varlen_layout()
    flat = [t.reshape(batch * seq, *t.shape[2:]) for t in (query, key, value)]
    if kept is not None:
        flat = [t.index_select(0, kept) for t in flat]
    output = kernels.flash_attn_varlen_func(*flat, cu_seqlens_q=cu_seqlens, cu_seqlens_k=cu_seqlens,
                                            max_seqlen_q=longest, max_seqlen_k=longest, **options)
    output = output[0] if isinstance(output, tuple) else output
    if kept is not None:  # padding positions: zeros, as in transformers' flash path
        output = output.new_zeros(batch * seq, *output.shape[1:]).index_copy(0, kept, output)
    return output.reshape(batch, seq, *output.shape[1:]).to(dtype)


@functools.cache
def _flex_functions(compiled: bool):
    """flex_attention (compiled once per process on CUDA, where the uncompiled one materialises the scores)."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    return (torch.compile(flex_attention) if compiled else flex_attention), create_block_mask


def _flex(query, key, value, documents, is_causal, scale, dropout_p, pattern=None):
    if dropout_p:
        raise ValueError("flex_attention has no attention dropout: set the model's attention dropout to 0.")
    flex_attention, create_block_mask = _flex_functions(query.is_cuda)
    batch, seq = query.size(0), query.size(2)
    block_mask = None
    if documents is not None or pattern is not None:
        rule = mask_mod(documents, is_causal, pattern, seq, query.device)
        block_mask = create_block_mask(rule, batch if documents is not None else None, None, seq, seq,
                                       device=query.device)
    elif is_causal:
        block_mask = create_block_mask(lambda b, h, q, k: q >= k, None, None, seq, seq, device=query.device)
    output = flex_attention(query, key, value, block_mask=block_mask, scale=scale,
                            enable_gqa=key.size(1) != query.size(1))
    return output.transpose(1, 2)


# SDPA's kernels by the names `sdpa_kernel_priority` takes.
SDPA_KERNELS = {"cudnn": "CUDNN_ATTENTION", "flash": "FLASH_ATTENTION", "efficient": "EFFICIENT_ATTENTION",
                "math": "MATH"}
# Besides SDPA's own kernels, `sdpa_kernel_priority` takes "fa4": FlashAttention's CuTe kernels (the `flash-attn-4`
# wheel's `flash_attn.cute`) for the calls they serve exactly (`fa4_serves`); every other call goes to SDPA in the
# order of the other names. On one H200, causal GQA forward + backward at 128K: 515 TFLOP/s against cuDNN's 455
# (benchmarks/results/2026-12-04-h200-attention-kernels/). Held for the duration of `sdpa_priority`, as SDPA's own
# order is, so that a recompute in the backward takes the kernel its forward took.
FA4 = "fa4"
_FA4_BACKEND = "flash_attention_4"  # how `_flash` names it (not a backend users choose: SDPA's calls go to it)
# FA4 through its one operator (attention/fa4.py), with the flash modules' two entry points
_FA4_KERNELS = types.SimpleNamespace(
    flash_attn_func=lambda q, k, v, softmax_scale, causal, window_size=None: fa4.attend(
        q, k, v, None, 0, softmax_scale, causal, window_size),
    flash_attn_varlen_func=lambda q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale,
    causal, window_size=None: fa4.attend(q, k, v, cu_seqlens_q, max_seqlen_q, softmax_scale, causal, window_size),
)
# Process-wide, as torch's own SDPA priority is, and for the same reason: autograd runs the backward (and with it a
# checkpointed layer's recompute) in threads of its own, which a thread's or a context's setting would not reach.
_fa4_first = [False]


def fa4_installed() -> bool:
    """Whether FlashAttention's CuTe kernels can be imported (`pip install flash-attn-4`)."""
    try:
        return importlib.util.find_spec("flash_attn.cute") is not None
    except ModuleNotFoundError:  # no `flash_attn` package at all
        return False


def fa4_serves(query: torch.Tensor, dropout_p: float, pattern: Optional[AttentionPattern]) -> bool:
    """Whether the FA4 kernels compute this call exactly as SDPA would: a CUDA GPU, fp16/bf16 inputs (or under
    autocast), no dropout, no chunked attention (sliding windows they take), a head dim they take (8-256, a multiple
    of 8). Otherwise the call stays with SDPA."""
    if not query.is_cuda or dropout_p or (pattern is not None and pattern.chunk_size is not None):
        return False
    if query.dtype not in (torch.float16, torch.bfloat16) and not torch.is_autocast_enabled(query.device.type):
        return False
    head_dim = query.size(-1)
    return 8 <= head_dim <= 256 and head_dim % 8 == 0


def fa4_first_for(query: torch.Tensor, dropout_p: float = 0.0, pattern: Optional[AttentionPattern] = None) -> bool:
    """Whether the kernel order in force (`sdpa_priority`) puts FA4 first and FA4 serves this call: then FA4
    computes it (the Ulysses attention's SDPA calls, and ring attention's blocks)."""
    return _fa4_first[0] and fa4_serves(query, dropout_p, pattern)


def check_sdpa_kernel_priority(names) -> Optional[tuple[str, ...]]:
    """Validate a preference order of SDPA kernels (`None`: torch's own order); return it as a tuple."""
    if names is None:
        return None
    names = (names,) if isinstance(names, str) else tuple(names)
    unknown = [name for name in names if name not in SDPA_KERNELS and name != FA4]
    if not names or unknown or len(set(names)) != len(names):
        raise ValueError(f"sdpa_kernel_priority must list distinct SDPA kernels from {[FA4, *SDPA_KERNELS]} in order"
                         f" of preference (or be None for torch's order), got {list(names)}.")
    if FA4 in names and not fa4_installed():
        raise ImportError("sdpa_kernel_priority names 'fa4', whose kernels are not installed: `pip install"
                          " flash-attn-4`, or leave 'fa4' out.")
    return names


def sdpa_priority(names: Optional[tuple[str, ...]]):
    """F.scaled_dot_product_attention tries `names` first, in this order, then torch's other kernels.

    torch 2.11 tries flash first; on an H200 cuDNN's causal GQA kernels run forward + backward at ~465 TFLOP/s against
    flash's ~280 (benchmarks/attention_kernels.py), so `("cudnn",)` pays on Hopper. Forward and backward must run
    under the same order when layers are recomputed with `keep_attention_outputs` (the strategy wraps both).
    """
    if names is None:
        return contextlib.nullcontext()
    if FA4 in names:  # FA4 before SDPA's kernels (wherever it is named: it is not one of SDPA's to order)
        rest = tuple(name for name in names if name != FA4)
        return _fa4_before(sdpa_priority(rest or None))
    from torch.nn.attention import SDPBackend, sdpa_kernel

    # The kernels not named follow, as far as they are enabled: a kernel switched off process-wide (e.g.
    # torch.backends.cuda.enable_flash_sdp(False)) stays off.
    enabled = {"cudnn": torch.backends.cuda.cudnn_sdp_enabled, "flash": torch.backends.cuda.flash_sdp_enabled,
               "efficient": torch.backends.cuda.mem_efficient_sdp_enabled, "math": torch.backends.cuda.math_sdp_enabled}
    order = [*names, *(name for name in SDPA_KERNELS if name not in names and enabled[name]())]
    return _restoring_priority(sdpa_kernel([getattr(SDPBackend, SDPA_KERNELS[name]) for name in order],
                                           set_priority=True))


@contextlib.contextmanager
def _fa4_before(context):
    previous, _fa4_first[0] = _fa4_first[0], True
    try:
        with context:
            yield
    finally:
        _fa4_first[0] = previous


@contextlib.contextmanager
def _restoring_priority(context):
    # torch's `sdpa_kernel(..., set_priority=True)` restores on exit only the order of the kernels enabled at entry
    # and appends the disabled ones: with flash switched off process-wide, flash stays last (behind math) for the
    # rest of the process, also after the user switches it back on. Put the whole previous order back.
    previous = torch_private.sdp_priority_order()
    try:
        with context:
            yield
    finally:
        torch_private.set_sdp_priority_order(previous)
