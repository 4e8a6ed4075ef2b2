"""Head-count validation, backend selection and the document segments of the shared attention core (one process)."""

import importlib
import importlib.util

import pytest
import torch
import torch.nn.functional as F

from lightning_ulysses import UlyssesAttention
from lightning_ulysses.attention import backends
from lightning_ulysses.attention.core import valid_sequence_parallel_sizes, validate_head_counts
from lightning_ulysses.attention.documents import DocumentMask


def test_head_counts_that_divide_are_accepted():
    validate_head_counts(112, 112, 16)  # BLOOM: 7 heads per rank
    validate_head_counts(32, 8, 32)  # Llama 3 8B: KV heads replicated 4 times


def test_uneven_heads_fail_naming_valid_sizes_and_the_ring_alternative():
    with pytest.raises(ValueError) as error:
        validate_head_counts(96, 96, 64)
    message = str(error.value)
    assert "num_attention_heads(96) is not divisible by sequence_parallel_size(64)" in message
    assert "[1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 96]" in message
    assert "ring attention" in message


def test_valid_sizes_respect_the_kv_heads():
    assert valid_sequence_parallel_sizes(12, 3) == [1, 3, 6, 12]
    with pytest.raises(ValueError, match=r"must divide one another.*\[1, 3, 6, 12\]"):
        validate_head_counts(12, 3, 2)


def test_unknown_backend_names_the_choices():
    with pytest.raises(ValueError, match="Choose one of sdpa, flash_attention_2, flash_attention_3, flex_attention"):
        UlyssesAttention("xformers")


def test_unavailable_flash_backend_is_a_clear_error():
    # This machine's answer depends on what is installed; each branch asserts the message that fits it.
    if importlib.util.find_spec("flash_attn") is None:
        with pytest.raises(ImportError, match="needs the flash-attn package"):
            backends.check_backend("flash_attention_2")
    elif not torch.cuda.is_available():
        with pytest.raises(RuntimeError, match="needs a CUDA GPU"):
            backends.check_backend("flash_attention_2")
    else:
        assert backends.check_backend("flash_attention_2") == "flash_attention_2"


def test_custom_callable_rejects_document_inputs():
    attention = UlyssesAttention(lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True))
    q = torch.randn(1, 2, 4, 8)
    assert attention(q, q, q).shape == q.shape
    with pytest.raises(TypeError, match="pass a backend name"):
        attention(q, q, q, position_ids=torch.arange(4)[None])


def test_plain_rows_have_no_document_mask():
    assert DocumentMask.from_rows(2, torch.arange(8).expand(2, -1)) is None
    assert DocumentMask.from_rows(2, torch.arange(3, 11)[None], torch.ones(2, 8)) is None
    assert DocumentMask.from_rows(2) is None


PACKED = torch.tensor([[0, 1, 2, 0, 1, 0], [0, 1, 2, 3, 4, 5]])
PADDED = torch.tensor([[1, 1, 1, 1, 1, 1], [0, 0, 1, 1, 1, 0]])


def test_documents_of_packed_and_padded_rows():
    documents = DocumentMask.from_rows(2, PACKED, PADDED)
    assert documents.document_ids.tolist() == [[0, 0, 0, 1, 1, 2], [0, 0, 0, 0, 0, 0]]
    kept, cu_seqlens, longest = documents.varlen_layout()
    assert kept.tolist() == [0, 1, 2, 3, 4, 5, 8, 9, 10]  # row 1's padding (flat 6, 7, 11) is dropped
    assert cu_seqlens.tolist() == [0, 3, 5, 6, 9] and cu_seqlens.dtype == torch.int32 and longest == 3
    mask = documents.dense_mask(is_causal=True)[:, 0]
    for row in range(2):
        for query in range(6):
            for key in range(6):
                expected = (documents.document_ids[row, query] == documents.document_ids[row, key] and key <= query
                            and PADDED[row, key] == 1)
                assert bool(mask[row, query, key]) == bool(expected)


def _per_document_attention(q, k, v, documents):
    """[b, h, s, d] → [b, s, h, d]: SDPA on the real tokens of every document alone, zeros on padding."""
    output = torch.zeros(q.size(0), q.size(2), q.size(1), q.size(3), dtype=q.dtype)
    ids = documents.document_ids if documents.document_ids is not None else torch.zeros(q.size(0), q.size(2))
    real = documents.real_tokens if documents.real_tokens is not None else torch.ones(q.size(0), q.size(2), dtype=torch.bool)
    for row in range(q.size(0)):
        for document in ids[row].unique():
            index = ((ids[row] == document) & real[row]).nonzero().flatten()
            piece = F.scaled_dot_product_attention(q[row:row + 1, :, index].float(), k[row:row + 1, :, index].float(),
                                                   v[row:row + 1, :, index].float(), is_causal=True, enable_gqa=True)
            output[row, index] = piece[0].transpose(0, 1).to(q.dtype)
    return output


class _ReferenceFlashKernels:
    """Stands in for flash_attn on CPU with the documented semantics of its functions (fp32 math)."""

    @staticmethod
    def flash_attn_func(q, k, v, softmax_scale=None, causal=False):
        out = F.scaled_dot_product_attention(*(t.transpose(1, 2).float() for t in (q, k, v)), is_causal=causal,
                                             scale=softmax_scale, enable_gqa=True)
        return out.transpose(1, 2).to(q.dtype)

    @staticmethod
    def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale=None,
                               causal=False):
        assert torch.equal(cu_seqlens_q, cu_seqlens_k) and max_seqlen_q == int(cu_seqlens_q.diff().max())
        out = torch.empty_like(q)
        for start, end in zip(cu_seqlens_q[:-1].tolist(), cu_seqlens_q[1:].tolist()):
            piece = F.scaled_dot_product_attention(*(t[start:end].transpose(0, 1)[None].float() for t in (q, k, v)),
                                                   is_causal=causal, scale=softmax_scale, enable_gqa=True)
            out[start:end] = piece[0].transpose(0, 1).to(q.dtype)
        return out


@pytest.mark.parametrize("padding", [None, PADDED], ids=["packed", "packed-padded"])
@pytest.mark.parametrize("backend", ["sdpa", "flash_attention_2"])
def test_backends_keep_documents_apart(monkeypatch, backend, padding):
    """sdpa for real; the flash path's layout, unpadding and cu_seqlens glue against a reference kernel (no flash
    on CPU). Padding queries are compared where both backends define them: right padding differs (sdpa attends,
    flash gives zeros) and no loss reads it."""
    real_import = importlib.import_module
    monkeypatch.setattr(backends.importlib, "import_module",
                        lambda name: _ReferenceFlashKernels if name == "flash_attn" else real_import(name))
    dtype = torch.float32 if backend == "sdpa" else torch.bfloat16
    generator = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, 6, 8, generator=generator).to(dtype)
    k, v = (torch.randn(2, 2, 6, 8, generator=generator).to(dtype) for _ in range(2))
    documents = DocumentMask.from_rows(2, PACKED, padding)
    out = backends.local_attention(q, k, v, backend, documents)
    assert out.shape == (2, 6, 4, 8)
    compared = torch.ones(2, 6, dtype=torch.bool) if padding is None else PADDED.bool()
    compared[1, :2] = True  # left padding: zeros on both backends
    tolerance = 1e-5 if dtype == torch.float32 else 1e-2
    error = (out.float() - _per_document_attention(q, k, v, documents).float())[compared]
    assert error.abs().max() < tolerance
    plain = backends.local_attention(q, k, v, backend, None)
    reference = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), is_causal=True, enable_gqa=True)
    assert (plain.float() - reference.transpose(1, 2)).abs().max() < tolerance


def test_flash_backends_refuse_fp32_without_autocast():
    q = torch.randn(1, 2, 4, 8)
    with pytest.raises(TypeError, match="fp16/bf16 only"):
        backends._flash(q, q, q, "flash_attention_2", None, True, None, 0.0)
