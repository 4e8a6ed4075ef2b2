"""Worker: hybrid Ulysses × ring attention and the zig-zag layout against full attention, without Lightning.

World 4; each layout is `[sequence_parallel_size, ring_size]`: U2×R2 (hybrid), U1×R4 (pure ring) and U1×R2
(an SP group of 2 inside world 4). Every rank builds the same full inputs, keeps its zig-zag shard and measures
the largest deviation from the unsharded fp32 computation.
"""

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

from lightning_ulysses import SequenceSharder, UlyssesAttention, prepare_hf_model
from lightning_ulysses.attention.all_to_all import all_gather_sequence
from lightning_ulysses.attention.rows import BatchRowsSlot
from lightning_ulysses.integration.inference import sequence_outputs
from lightning_ulysses.parallel.layout import ParallelLayout, SequenceParallelGroups
from lightning_ulysses.training.loss import SequenceParallelCausalLMLoss
from lightning_ulysses.training.metrics import SequenceParallel
from tests.distributed.common import VOCAB, summed_gradient_error, tiny_llama
from tests.distributed.families import tiny_model

# (query heads, KV heads, causal): GQA with 2 KV heads, 2 heads in total (fewer than SP 4), MQA, non-causal MHA.
ATTENTION_CASES = [(4, 2, True), (2, 2, True), (2, 1, True), (4, 1, True), (4, 4, False)]
SEQ_LEN = 16


def max_error(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a - b).abs().max().item()


def compare_with_full_attention(attention, heads, kv_heads, causal, order, rank, results, name):
    """Run `attention` on this rank's shard of random q/k/v; record output and gradient errors."""
    generator = torch.Generator().manual_seed(heads * 10 + kv_heads)
    q = torch.randn(2, heads, SEQ_LEN, 8, generator=generator, requires_grad=True)
    k = torch.randn(2, kv_heads, SEQ_LEN, 8, generator=generator, requires_grad=True)
    v = torch.randn(2, kv_heads, SEQ_LEN, 8, generator=generator, requires_grad=True)
    grad_out = torch.randn(2, heads, SEQ_LEN, 8, generator=generator)
    reference = F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True)
    reference.backward(grad_out)
    local = [order.shard(t.detach(), rank, dim=2).requires_grad_() for t in (q, k, v)]
    out = attention(*local)
    out.backward(order.shard(grad_out, rank, dim=2))
    results[f"out_{name}"] = max_error(out, order.shard(reference, rank, dim=2))
    for label, mine, full in zip("qkv", local, (q, k, v)):
        results[f"grad_{label}_{name}"] = max_error(mine.grad, order.shard(full.grad, rank, dim=2))


def check_attention(groups, results):
    for heads, kv_heads, causal in ATTENTION_CASES:
        attention = UlyssesAttention(causal=causal)
        attention.bind_parallel_groups(groups)
        compare_with_full_attention(attention, heads, kv_heads, causal, groups.shard_order,
                                    groups.sequence_parallel_rank, results,
                                    f"h{heads}_kv{kv_heads}_{'causal' if causal else 'full'}")


def padded_batch(left_padding: bool = False) -> dict:
    generator = torch.Generator().manual_seed(7)
    input_ids = torch.randint(0, VOCAB, (2, SEQ_LEN), generator=generator)
    attention_mask = torch.ones(2, SEQ_LEN, dtype=torch.long)
    attention_mask[0, -3:] = 0  # right padding: exact with the ring
    if left_padding:
        attention_mask[1, :2] = 0
    labels = input_ids.masked_fill(attention_mask == 0, -100)
    return {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels}


def check_hf_model(groups, results):
    """Llama (4 heads/2 KV heads, and 2 heads/1 KV head) with a right-padded row: loss, gradients, outputs."""
    sp, rank, order = groups.sequence_parallel_world_size, groups.sequence_parallel_rank, groups.shard_order
    sp_group = groups.sequence_parallel_group
    slot = BatchRowsSlot()  # the whole rows the sharder publishes (positions, padding, unpadded length)
    sharder = SequenceSharder(sp, rank, ring_size=groups.ring_size, batch_rows=slot)
    for heads, kv_heads in ((4, 2), (2, 1)):
        name = f"h{heads}_kv{kv_heads}"
        batch = padded_batch()
        reference = tiny_llama(kv_heads, num_heads=heads)
        reference_out = reference(**batch)
        reference_out.loss.backward()

        model = tiny_llama(kv_heads, num_heads=heads)
        prepared = prepare_hf_model(model, groups.ulysses_group, SequenceParallelCausalLMLoss(sp_group, 1.0, batch_rows=slot, order=order),
                                    ring_group=groups.ring_group)
        shard = sharder(batch)
        out = model(**shard)
        out.loss.backward()
        results[f"hf_loss_{name}"] = abs(out.loss.item() - reference_out.loss.item())
        results[f"hf_grad_relative_{name}"] = summed_gradient_error(model, reference, sp_group)

        # Everything that gathers the zig-zag shards back must restore the natural order.
        logits, full_logits = out.logits.detach(), reference_out.logits.detach()
        real = batch["attention_mask"].bool()
        results[f"full_logits_{name}"] = max_error(
            sequence_outputs(logits, "full", sp_group, order=order)[real], full_logits[real])
        shifted = torch.cat([batch["labels"][:, 1:], torch.full((2, 1), -100)], dim=1)
        valid = shifted != -100
        expected = torch.log_softmax(full_logits, -1).gather(-1, shifted.clamp(min=0).unsqueeze(-1)).squeeze(-1) * valid
        results[f"log_probs_{name}"] = max_error(
            sequence_outputs(logits, "log_probs", sp_group, labels=shard["labels"], order=order), expected)
        last = sequence_outputs(logits, "last", sp_group, attention_mask=shard["attention_mask"], order=order)
        results[f"last_{name}"] = max_error(last, torch.stack([full_logits[0, SEQ_LEN - 4], full_logits[1, -1]]))
        prepared.restore()

    # Falcon's attention is computed inline (adapters/falcon.py: multi-query, sdpa): the ring runs it too.
    reference, model = tiny_model("falcon"), tiny_model("falcon")
    reference_out = reference(**padded_batch())
    reference_out.loss.backward()
    prepared = prepare_hf_model(model, groups.ulysses_group, SequenceParallelCausalLMLoss(sp_group, 1.0, batch_rows=slot, order=order),
                                ring_group=groups.ring_group)
    out = model(**sharder(padded_batch()))
    out.loss.backward()
    results["hf_loss_falcon"] = abs(out.loss.item() - reference_out.loss.item())
    results["hf_grad_relative_falcon"] = summed_gradient_error(model, reference, sp_group)
    prepared.restore()

    # Left padding is refused on every rank alike (the decision is taken on the gathered mask).
    model = tiny_llama(2)
    prepare_hf_model(model, groups.ulysses_group, ring_group=groups.ring_group)
    results["left_padding_error"] = _error_of(lambda: model(**sharder(padded_batch(left_padding=True))))

    # Packed rows (positions restarting inside a row) too: the ring masks by position only.
    packed = dict(padded_batch(), position_ids=torch.arange(SEQ_LEN).remainder(5).expand(2, -1))
    results["packed_hf_error"] = _error_of(lambda: model(**sharder(packed)))
    attention = UlyssesAttention()
    attention.bind_parallel_groups(groups)
    shard = sharder(packed)
    q = torch.randn(2, 4, SEQ_LEN // sp, 8)
    results["packed_native_error"] = _error_of(lambda: attention(q, q, q, shard["position_ids"]))
    # Positions restarting only inside the right padding separate no real tokens: accepted.
    padded = dict(padded_batch(), position_ids=torch.arange(SEQ_LEN).expand(2, -1).clone())
    padded["position_ids"][0, -3:] = 0
    shard = sharder(padded)
    results["padding_restart_error"] = _error_of(
        lambda: attention(q, q, q, shard["position_ids"], shard["attention_mask"]))


def _error_of(run) -> str | None:
    """The message of the NotImplementedError `run()` raises (None if it returns)."""
    try:
        run()
    except NotImplementedError as error:
        return str(error)
    return None


def check_gathers(groups, results):
    sp, rank, order = groups.sequence_parallel_world_size, groups.sequence_parallel_rank, groups.shard_order
    positions = torch.arange(SEQ_LEN).expand(3, -1)
    shard = SequenceSharder(sp, rank, ring_size=groups.ring_size)({"input_ids": positions})
    results["shard_positions"] = shard["position_ids"][0].tolist()
    results["gather_restores_order"] = torch.equal(
        all_gather_sequence(shard["input_ids"], groups.sequence_parallel_group, 1, order), positions)
    metric = SequenceParallel(torch.nn.Identity())  # only its gather is under test here
    metric.bind_parallel_groups(groups)
    results["metric_rows_in_order"] = torch.equal(metric._whole_rows((shard["input_ids"],))[0], positions)


def main():
    spec = json.loads(Path(sys.argv[1]).read_text())
    if not dist.is_initialized():  # a part of a shared launch (workers/parts.py) may find it set up
        dist.init_process_group("gloo")
    base = {}
    output = {}
    for sp, ring in spec["layouts"]:
        if sp not in base:  # the SP/DP groups of one SP size, split differently by each ring size
            base[sp] = SequenceParallelGroups.build(ParallelLayout(dist.get_world_size(), sp))
        groups = base[sp].with_ring_size(ring)
        results = {"ulysses_size": groups.ulysses_size, "ring_size": groups.ring_size,
                   "sequence_parallel_rank": groups.sequence_parallel_rank}
        check_attention(groups, results)
        check_hf_model(groups, results)
        check_gathers(groups, results)
        output[f"sp{sp}_ring{ring}"] = results
    for groups in base.values():
        groups.release()
    torch.save(output, Path(sys.argv[2]) / f"result_{dist.get_rank()}.pt")


if __name__ == "__main__":
    main()
