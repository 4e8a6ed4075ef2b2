"""Worker: packed rows under sequence parallelism, against every document run alone without sharding.

World 4. First the strategy cases (Trainer + SGD, see test_packing.py), then, on the same process group, SP 2
(two groups inside the world) and SP 4: the attention core (sdpa with gradients, with and without padding;
flex_attention forward), and an HF Llama and the native GPT on packed rows (loss, logits, gradients).
Documents cross shard boundaries at both SP sizes and the two rows of each batch are packed differently.
"""

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

from lightning_ulysses import SequenceSharder, UlyssesAttention, prepare_hf_model
from lightning_ulysses.attention.core import ulysses_attention
from lightning_ulysses.attention.rows import BatchRowsSlot
from lightning_ulysses.parallel.layout import ParallelLayout, SequenceParallelGroups
from lightning_ulysses.training.loss import SequenceParallelCausalLMLoss
from tests.distributed.common import VOCAB, summed_gradient_error, tiny_gpt, tiny_llama
from tests.distributed.packed import per_document_forward, spans_from_lengths
from tests.distributed.workers.train_parity import run_case

SEQ_LEN = 16
# Row 0: documents of 5, 7, 4 tokens; row 1: 3, 9, 1, 3. At SP 4 (shards of 4) and SP 2 (shards of 8) documents
# cross shard boundaries, and one document spans three shards at SP 4.
LENGTHS = [[5, 7, 4], [3, 9, 1, 3]]
SPANS = [spans_from_lengths(lengths) for lengths in LENGTHS]


def max_error(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a - b).abs().max().item()


def packed_positions() -> torch.Tensor:
    return torch.stack([torch.cat([torch.arange(n) for n in lengths]) for lengths in LENGTHS])


def reference_attention(q, k, v, real_spans):
    """SDPA on every (real part of a) document alone; zeros elsewhere. q, k, v: [batch, heads, seq, dim]."""
    output = torch.zeros(q.size(0), q.size(2), q.size(1), q.size(3))
    for row, spans in enumerate(real_spans):
        for start, end in spans:
            piece = F.scaled_dot_product_attention(q[row:row + 1, :, start:end], k[row:row + 1, :, start:end],
                                                   v[row:row + 1, :, start:end], is_causal=True, enable_gqa=True)
            output[row, start:end] = piece[0].transpose(0, 1)
    return output  # [batch, seq, heads, dim]


def check_core(groups, results):
    sp, rank, group = groups.sequence_parallel_world_size, groups.sequence_parallel_rank, groups.sequence_parallel_group
    window = slice(rank * SEQ_LEN // sp, (rank + 1) * SEQ_LEN // sp)
    positions = packed_positions()
    padding = torch.ones(2, SEQ_LEN, dtype=torch.long)
    padding[0, -3:] = 0  # right padding inside the last document of row 0
    padding[1, :2] = 0  # left padding inside the first document of row 1
    padded_spans = [[s for s in SPANS[0] if s[1] <= 12] + [(12, 13)], [(2, 3)] + SPANS[1][1:]]
    for kv_heads in (4, 2):
        for name, mask, spans in (("packed", None, SPANS), ("packed_padded", padding, padded_spans)):
            generator = torch.Generator().manual_seed(kv_heads)
            q = torch.randn(2, 4, SEQ_LEN, 8, generator=generator, requires_grad=True)
            k = torch.randn(2, kv_heads, SEQ_LEN, 8, generator=generator, requires_grad=True)
            v = torch.randn(2, kv_heads, SEQ_LEN, 8, generator=generator, requires_grad=True)
            real = torch.zeros(2, SEQ_LEN, dtype=torch.bool)
            for row, row_spans in enumerate(spans):
                for start, end in row_spans:
                    real[row, start:end] = True
            # Outputs of padding positions are not defined (no loss reads them): compare and back-propagate real ones.
            grad_out = torch.randn(2, SEQ_LEN, 4, 8, generator=generator) * real[:, :, None, None]
            reference = reference_attention(q, k, v, spans)
            reference.backward(grad_out)

            local = [t.detach()[:, :, window].requires_grad_() for t in (q, k, v)]
            out = ulysses_attention(*local, group, "sdpa", position_ids=positions[:, window],
                                    padding_mask=None if mask is None else mask[:, window])
            out.backward(grad_out[:, window])
            key = f"{name}_kv{kv_heads}"
            results[f"core_out_{key}"] = max_error(out * real[:, window, None, None], reference[:, window])
            for tensor_name, mine, full in zip("qkv", local, (q, k, v)):
                grad = full.grad[:, :, window]
                results[f"core_grad_{tensor_name}_{key}"] = max_error(mine.grad, grad)
            if name == "packed":
                # GQA replication and documents with a backend that has no backward on CPU: forward only.
                with torch.no_grad():
                    flex = ulysses_attention(*[t.detach() for t in local], group, "flex_attention",
                                             position_ids=positions[:, window])
                results[f"flex_out_kv{kv_heads}"] = max_error(flex, reference[:, window])


def packed_batch():
    generator = torch.Generator().manual_seed(11)
    input_ids = torch.randint(0, VOCAB, (2, SEQ_LEN), generator=generator)
    positions = packed_positions()
    return {"input_ids": input_ids, "labels": input_ids.masked_fill(positions == 0, -100), "position_ids": positions}


def check_model(kind, kv_heads, groups, results):
    sp, rank, group = groups.sequence_parallel_world_size, groups.sequence_parallel_rank, groups.sequence_parallel_group
    window = slice(rank * SEQ_LEN // sp, (rank + 1) * SEQ_LEN // sp)
    batch = packed_batch()
    if kind == "llama":
        reference, model = tiny_llama(kv_heads, attn_implementation="eager"), tiny_llama(kv_heads)
    else:
        reference, model = tiny_gpt(kv_heads), tiny_gpt(kv_heads)
    reference_loss, reference_logits = per_document_forward(reference, batch["input_ids"], SPANS)
    reference_loss.backward()

    slot = BatchRowsSlot()  # the whole rows the sharder publishes (positions, padding, unpadded length)
    loss_function = SequenceParallelCausalLMLoss(group, gradient_scale=1.0, batch_rows=slot)
    if kind == "llama":
        prepare_hf_model(model, group, loss_function)
    else:
        for attention in model.modules():
            if isinstance(attention, UlyssesAttention):
                attention.bind(group)
        model.loss_function = loss_function
    output = model(**SequenceSharder(sp, rank, batch_rows=slot)(batch))
    output.loss.backward()
    key = f"{kind}_kv{kv_heads}"
    results[f"model_loss_{key}"] = abs(output.loss.item() - reference_loss.item())
    results[f"model_logits_{key}"] = max_error(output.logits, reference_logits[:, window])
    results[f"model_grad_relative_{key}"] = summed_gradient_error(model, reference, group)


def main():
    spec = json.loads(Path(sys.argv[1]).read_text())
    workdir = Path(sys.argv[2])
    output = {"strategy": {case["name"]: run_case(dict(case, workdir=str(workdir)), spec["world_size"])
                           for case in spec["strategy_cases"]}}
    for sp in spec["sequence_parallel_sizes"]:
        groups = SequenceParallelGroups.build(ParallelLayout(dist.get_world_size(), sp))
        results = {}
        check_core(groups, results)
        for kind, kv_heads in (("llama", 4), ("llama", 1), ("gpt", 2)):
            check_model(kind, kv_heads, groups, results)
        output[sp] = results
        groups.release()
    torch.save(output, workdir / f"result_{dist.get_rank()}.pt")


if __name__ == "__main__":
    main()
