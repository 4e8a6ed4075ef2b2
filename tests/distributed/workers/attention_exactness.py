"""Worker: exactness of the all-to-all, of UlyssesAttention and of Ulysses HF models, without Lightning.

Runs on 4 ranks with SP 2 (two SP groups: a group smaller than the world) and SP 4. Every rank builds the same
full-sequence inputs, keeps its shard, and measures the largest deviation from the unsharded computation.
"""

import json
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

from lightning_ulysses import SequenceSharder, UlyssesAttention, prepare_hf_model
from lightning_ulysses.attention import all_to_all, heads_to_sequence, sequence_to_heads
from lightning_ulysses.attention import copy_engine
from lightning_ulysses.attention.all_to_all import InFlightExchange
from lightning_ulysses.attention.core import usable_head_groups
from lightning_ulysses.attention.documents import DocumentMask
from lightning_ulysses.attention.rows import BatchRowsSlot
from lightning_ulysses.parallel.layout import ParallelLayout, SequenceParallelGroups
from lightning_ulysses.training.loss import SequenceParallelCausalLMLoss
from lightning_ulysses.training.moe import SequenceParallelRouterLoss, batch_padding, exact_router_loss
from tests.distributed.common import relative_gradient_error, summed_gradient_error, tiny_llama


def max_error(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a - b).abs().max().item()


def check_all_to_all(groups, results):
    sp, rank = groups.sequence_parallel_world_size, groups.sequence_parallel_rank
    full = torch.randn(2, 8, 12, 3, generator=torch.Generator().manual_seed(1))  # [batch, heads, seq, dim]
    shard = full.chunk(sp, dim=2)[rank]
    heads = sequence_to_heads(shard, groups.sequence_parallel_group, head_dim=1, seq_dim=2)
    results["seq_to_heads_vs_slice"] = max_error(heads, full.chunk(sp, dim=1)[rank])
    back = heads_to_sequence(heads, groups.sequence_parallel_group, head_dim=1, seq_dim=2)
    results["round_trip"] = max_error(back, shard)


def check_ulysses_attention(groups, results):
    sp, rank = groups.sequence_parallel_world_size, groups.sequence_parallel_rank
    attention = UlyssesAttention(lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True))
    attention.bind(groups.sequence_parallel_group)
    for kv_heads in (4, 2, 1):
        generator = torch.Generator().manual_seed(kv_heads)
        q = torch.randn(2, 4, 16, 8, generator=generator, requires_grad=True)
        k = torch.randn(2, kv_heads, 16, 8, generator=generator, requires_grad=True)
        v = torch.randn(2, kv_heads, 16, 8, generator=generator, requires_grad=True)
        grad_out = torch.randn(2, 4, 16, 8, generator=generator)
        reference = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        reference.backward(grad_out)

        local = [t.detach().chunk(sp, dim=2)[rank].requires_grad_() for t in (q, k, v)]
        out = attention(*local)
        out.backward(grad_out.chunk(sp, dim=2)[rank])
        results[f"ulysses_out_kv{kv_heads}"] = max_error(out, reference.chunk(sp, dim=2)[rank])
        for name, mine, full in zip("qkv", local, (q, k, v)):
            results[f"ulysses_grad_{name}_kv{kv_heads}"] = max_error(mine.grad, full.grad.chunk(sp, dim=2)[rank])


def check_head_groups(groups, results):
    """Pipelined head groups: exact for every grouping (incl. KV replication) and packed rows; and the schedule
    the pipelining exists for (exchanges launched ahead of the attention that overlaps them)."""
    sp, rank, group = groups.sequence_parallel_world_size, groups.sequence_parallel_rank, groups.sequence_parallel_group
    position_ids = torch.cat([torch.arange(11), torch.arange(13)]).unsqueeze(0)  # two documents, crossing shards
    for kv_heads in (8, 4, 2, 1):
        generator = torch.Generator().manual_seed(10 + kv_heads)
        q = torch.randn(2, 8, 24, 8, generator=generator, requires_grad=True)
        k = torch.randn(2, kv_heads, 24, 8, generator=generator, requires_grad=True)
        v = torch.randn(2, kv_heads, 24, 8, generator=generator, requires_grad=True)
        grad_out = torch.randn(2, 8, 24, 8, generator=generator)
        mask = DocumentMask.from_rows(2, position_ids, None).dense_mask(True)
        reference = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
        reference.backward(grad_out)
        for requested in (2, 4):
            attention = UlyssesAttention("sdpa", overlap_head_groups=requested)
            attention.bind(group)
            local = [t.detach().chunk(sp, dim=2)[rank].requires_grad_() for t in (q, k, v)]
            out = attention(*local, position_ids=position_ids.chunk(sp, dim=1)[rank])
            out.backward(grad_out.chunk(sp, dim=2)[rank])
            key = f"kv{kv_heads}_groups{requested}"
            results[f"head_groups_used_{key}"] = usable_head_groups(8, kv_heads, sp, requested)
            error = max_error(out, reference.chunk(sp, dim=2)[rank])
            for mine, full in zip(local, (q, k, v)):
                error = max(error, max_error(mine.grad, full.grad.chunk(sp, dim=2)[rank]))
            results[f"head_groups_error_{key}"] = error
    results["head_groups_schedule"] = head_group_schedule(group, sp, rank)


class _Recorded(torch.autograd.Function):
    """Identity that logs when its backward runs (i.e. when a head group's attention backward starts)."""

    @staticmethod
    def forward(ctx, tensor, log, name):
        ctx.log, ctx.name = log, name
        return tensor.view_as(tensor)

    @staticmethod
    def backward(ctx, grad):
        ctx.log.append(f"{ctx.name} backward")
        return grad, None, None


def head_group_schedule(group, sp, rank):
    """The order of all-to-all launches and attention calls with 2 head groups, forward then backward."""
    log = []
    launch = dist.all_to_all_single

    def recording_launch(output, tensor, *args, **kwargs):
        log.append("exchange")
        return launch(output, tensor, *args, **kwargs)

    def attend(q, k, v):
        name = f"attend{len([e for e in log if e.startswith('attend') and 'backward' not in e])}"
        log.append(name)
        return _Recorded.apply(F.scaled_dot_product_attention(q, k, v, is_causal=True), log, name)

    attention = UlyssesAttention(attend, overlap_head_groups=2)
    attention.bind(group)
    q, k, v = (torch.randn(1, 4 * sp, 4, 8, requires_grad=True) for _ in range(3))
    dist.all_to_all_single = recording_launch
    try:
        out = attention(q, k, v)
        log.append("backward")
        out.sum().backward()
    finally:
        dist.all_to_all_single = launch
    return log


def check_exchange_edges(groups, results):
    """Review regressions of the start/finish exchange: anomaly mode, buffers released, in-place on the output."""
    sp, rank, group = groups.sequence_parallel_world_size, groups.sequence_parallel_rank, groups.sequence_parallel_group
    # Anomaly mode checks every gradient the engine is handed for NaN; a receive buffer still being written
    # (here: NaN-filled, as reused memory can be, and filled late because rank 1 starts its backward late) must
    # never be one of them.
    x = torch.randn(1, 2 * sp, 4 * sp, 3, requires_grad=True)
    empty_like = torch.empty_like
    torch.empty_like = lambda *args, **kwargs: empty_like(*args, **kwargs).fill_(float("nan"))
    try:
        with torch.autograd.set_detect_anomaly(True):
            y = all_to_all(x, group, 1, 2)
            if rank == 1:
                time.sleep(0.3)
            y.backward(torch.full_like(y, 3.0))
        results["anomaly_mode"] = torch.equal(x.grad, torch.full_like(x, 3.0))
    except RuntimeError as error:
        results["anomaly_mode"] = str(error)
    finally:
        torch.empty_like = empty_like
    # In-place on the output, in the shape whose layout needs no copy (one head per rank, batch 1).
    x = torch.randn(1, sp, 4 * sp, 3, requires_grad=True)
    y = all_to_all(x, group, 1, 2)
    y.mul_(2)
    y.sum().backward()
    results["in_place_on_output"] = torch.equal(x.grad, torch.full_like(x, 2.0))
    # Once laid out, a receive buffer is garbage: no finished exchange holds one while the attention runs (the
    # handles of q, k and v live on in the caller's list until it returns).
    finished, finish = [], InFlightExchange.finish

    def recording_finish(self):
        finished.append(self)
        return finish(self)

    def attend(q, k, v):
        results["finished_exchanges_holding_buffers"] = sum(handle._payload is not None for handle in finished)
        results["exchanges_finished_before_attention"] = len(finished)
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)

    attention = UlyssesAttention(attend)
    attention.bind(group)
    InFlightExchange.finish = recording_finish
    try:
        attention(*(torch.randn(2, 2 * sp, 4, 8) for _ in range(3)))
    finally:
        InFlightExchange.finish = finish


def padded_batch(seq_len=16):
    generator = torch.Generator().manual_seed(7)
    input_ids = torch.randint(0, 64, (2, seq_len), generator=generator)
    attention_mask = torch.ones(2, seq_len, dtype=torch.long)
    attention_mask[0, :5] = 0  # left padding
    attention_mask[1, -3:] = 0  # right padding
    labels = input_ids.masked_fill(attention_mask == 0, -100)
    return {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels}


def check_copy_engine_plan(groups, results):
    """The copy-engine plan run through its CPU emulation equals the collective exchange bit for bit: both
    directions, batch > 1, a strided head group, forward and backward, and pipelined head groups (several exchanges
    in flight at once); and the agreed selection refuses on every rank alike when one rank cannot."""
    sp, rank, group = groups.sequence_parallel_world_size, groups.sequence_parallel_rank, groups.sequence_parallel_group

    def run(transport):
        generator = torch.Generator().manual_seed(30)
        x = torch.randn(3, 4 * sp, 5, 6, generator=generator).chunk(2, dim=1)[1].requires_grad_()  # strided
        heads = sequence_to_heads(x, group, head_dim=1, seq_dim=2, transport=transport)
        back = heads_to_sequence(heads * 2, group, head_dim=1, seq_dim=2, transport=transport)
        back.backward(torch.randn(back.shape, generator=generator))
        q, k, v = (torch.randn(2, 4 * sp, 6, 8, generator=generator, requires_grad=True) for _ in range(3))
        out = UlyssesAttention("sdpa", overlap_head_groups=2)
        out.bind(group)
        out.bind_transport(transport)
        y = out(q, k, v)
        y.backward(torch.randn(y.shape, generator=generator))
        return [heads, back, x.grad, y, q.grad, k.grad, v.grad]

    class Counted(copy_engine.EmulatedCopyTransport):
        launches = 0

        def launch(self, *args):
            Counted.launches += 1
            return super().launch(*args)

    expected = run(None)
    got = run(Counted())
    results["copy_engine_launches"] = Counted.launches
    run(None)  # the transport was handed to that run only: the same group exchanges collectively again
    results["copy_engine_launches_after"] = Counted.launches
    results["copy_engine_bit_identical"] = [torch.equal(a, b) for a, b in zip(got, expected)]
    probe = dict(cuda=True, group_on_one_host=True, peer_access=True, symmetric_memory=True, multicast_off=True)
    probe["peer_access"] = rank != sp - 1  # one rank lacks it: every rank must refuse
    failure = copy_engine.agreed_failure(copy_engine.CopyEngineProbe(**probe), group, "cpu")
    try:
        copy_engine.choose_exchange("copy_engine", failure)
        results["copy_engine_refusal"] = None
    except RuntimeError as error:
        results["copy_engine_refusal"] = str(error)
    results["copy_engine_auto"] = copy_engine.choose_exchange("auto", failure)


def check_hf_model(groups, results):
    sp, group = groups.sequence_parallel_world_size, groups.sequence_parallel_group
    for kv_heads in (4, 1):
        batch = padded_batch()
        reference = tiny_llama(kv_heads)  # sdpa with Hugging Face's own padding mask, full sequence
        reference_loss = reference(**batch).loss
        reference_loss.backward()

        model = tiny_llama(kv_heads)
        bystander = type(model)(model.config)  # built from the same config object, never prepared
        slot = BatchRowsSlot()  # the whole rows the sharder publishes (positions, padding, unpadded length)
        prepared = prepare_hf_model(model, group, SequenceParallelCausalLMLoss(group, 1.0, batch_rows=slot))
        results[f"bystander_keeps_sdpa_kv{kv_heads}"] = bystander.config._attn_implementation == "sdpa" and all(
            getattr(m, "config", bystander.config)._attn_implementation == "sdpa" for m in bystander.modules()
        )
        shard = SequenceSharder(sp, groups.sequence_parallel_rank, batch_rows=slot)(batch)
        loss = model(**shard).loss
        loss.backward()
        results[f"hf_loss_kv{kv_heads}"] = abs(loss.item() - reference_loss.item())
        results[f"hf_grad_relative_kv{kv_heads}"] = summed_gradient_error(model, reference, group)
        prepared.restore()
        results[f"restored_kv{kv_heads}"] = (
            model.config._attn_implementation == "sdpa" and "_loss_function" not in model.__dict__
            and abs(model(**batch).loss.item() - reference_loss.item()) < 1e-6
        )


def tiny_hf(family: str, seed: int = 0, **config):
    """A 2-layer model of `family` (4 heads, 2 KV heads: replicated at SP 4), fp32, sdpa."""
    import transformers

    config_class, model_class = {
        "mistral": ("MistralConfig", "MistralForCausalLM"),
        "phimoe": ("PhimoeConfig", "PhimoeForCausalLM"),
        "llama4": ("Llama4TextConfig", "Llama4ForCausalLM"),
        "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM"),
        "mixtral": ("MixtralConfig", "MixtralForCausalLM"),
        "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM"),
    }[family]
    shape = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=8, max_position_embeddings=128, tie_word_embeddings=False)
    if family in ("phimoe", "mixtral", "qwen3_moe", "llama4"):
        shape.update(num_local_experts=4, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
                     intermediate_size_mlp=48)
    cfg = getattr(transformers, config_class)(**{**shape, **config}, attn_implementation="sdpa")
    torch.manual_seed(seed)
    return getattr(transformers, model_class)(cfg).float()


def check_mask_refusals(groups, results):
    """Patterns transformers builds only through mask functions and Ulysses does not apply (overlays) are refused
    alike on every rank, before any all-to-all (a rank that went on would hang the next collective of this worker)."""
    sp, group = groups.sequence_parallel_world_size, groups.sequence_parallel_group
    cases = {"gemma3_overlay": ("gemma3", {"use_bidirectional_attention": True, "sliding_window": 64})}
    for name, (family, config) in cases.items():
        model = tiny_hf(family, **config)
        prepared = prepare_hf_model(model, group, SequenceParallelCausalLMLoss(group, gradient_scale=1.0))
        shard = SequenceSharder(sp, groups.sequence_parallel_rank)(padded_batch())
        try:
            model(**shard)
            results[f"refused_{name}"] = None
        except NotImplementedError as error:
            results[f"refused_{name}"] = str(error)
        finally:
            prepared.restore()


# Windows and chunks, from a window as long as the row (plain causal attention) to windows and chunks shorter than
# a shard at SP 4 (4 tokens of 16): applied on whole rows after the exchange, exact.
PATTERN_CASES = {
    "mistral_window16": ("mistral", {"sliding_window": 16}),  # also passed on as a kwarg
    "mistral_window3": ("mistral", {"sliding_window": 3}),
    "phimoe_window4": ("phimoe", {"sliding_window": 4}),  # the window lives in the mask only
    "llama4_chunks4": ("llama4", {"attention_chunk_size": 4, "no_rope_layers": [1, 0]}),  # + NoPE temperature
}


def check_attention_patterns(groups, results):
    sp, group = groups.sequence_parallel_world_size, groups.sequence_parallel_group
    batch = padded_batch()
    for name, (family, config) in PATTERN_CASES.items():
        reference = tiny_hf(family, **config)
        if family == "phimoe":
            reference.eval()  # its router samples experts at random in training
        reference_loss = reference(**batch).loss
        reference_loss.backward()
        model = tiny_hf(family, **config)
        model.train(reference.training)
        slot = BatchRowsSlot()  # the whole rows the sharder publishes (positions, padding, unpadded length)
        prepared = prepare_hf_model(model, group, SequenceParallelCausalLMLoss(group, 1.0, batch_rows=slot),
                                    batch_rows=slot)
        loss = model(**SequenceSharder(sp, groups.sequence_parallel_rank, batch_rows=slot)(batch)).loss
        loss.backward()
        results[f"{name}_loss"] = abs(loss.item() - reference_loss.item())
        # (floored: experts no token of this batch routes to have no gradient at all)
        results[f"{name}_grad_relative"] = relative_gradient_error(model, reference, group)
        prepared.restore()


def check_router_loss(groups, results, swap: bool = True):
    """MoE load-balancing loss (output_router_logits=True): the whole sequence's value and gradient at every SP size,
    with a padding mask, and without one on a row the sharder pads to a multiple of the SP size."""
    sp, group = groups.sequence_parallel_world_size, groups.sequence_parallel_group
    unmasked = padded_batch(seq_len=14)
    del unmasked["attention_mask"]
    for family in ("mixtral", "qwen3_moe"):
        for rows, batch in (("padded", padded_batch()), ("unmasked", unmasked)):
            config = dict(output_router_logits=True, router_aux_loss_coef=0.5)
            reference = tiny_hf(family, seed=3, **config)
            expected = reference(**batch)
            expected.loss.backward()
            model = tiny_hf(family, seed=3, **config)
            bystander = tiny_hf(family, seed=3, **config)  # same family, same process, never prepared
            slot = BatchRowsSlot()  # the whole rows the sharder publishes (positions, padding, unpadded length)
            prepared = prepare_hf_model(model, group, SequenceParallelCausalLMLoss(group, 1.0, batch_rows=slot))
            sharder = SequenceSharder(sp, groups.sequence_parallel_rank, batch_rows=slot)
            undo = (exact_router_loss(model, SequenceParallelRouterLoss(group, 1.0, batch_padding(slot, sharder.order, sharder.sequence_parallel_rank)))
                    if swap else lambda: None)
            output = model(**sharder(batch))
            output.loss.backward()
            key = f"{family}_{rows}"
            results[f"router_aux_{key}"] = abs(output.aux_loss.item() - expected.aux_loss.item())
            results[f"router_loss_{key}"] = abs(output.loss.item() - expected.loss.item())
            results[f"router_grad_relative_{key}"] = summed_gradient_error(model, reference, group)
            results[f"router_bystander_{key}"] = abs(bystander(**batch).aux_loss.item() - expected.aux_loss.item())
            undo()
            prepared.restore()
            results[f"router_restored_{key}"] = abs(model(**batch).aux_loss.item() - expected.aux_loss.item())


def main():
    spec = json.loads(Path(sys.argv[1]).read_text())
    if not dist.is_initialized():  # a part of a shared launch (workers/parts.py) may find it set up
        dist.init_process_group("gloo")
    output = {}
    for sp in spec["sequence_parallel_sizes"]:
        groups = SequenceParallelGroups.build(ParallelLayout(dist.get_world_size(), sp))
        results = {}
        check_all_to_all(groups, results)
        check_ulysses_attention(groups, results)
        check_head_groups(groups, results)
        check_exchange_edges(groups, results)
        check_copy_engine_plan(groups, results)
        check_hf_model(groups, results)
        if sp == 2:
            check_mask_refusals(groups, results)
        check_attention_patterns(groups, results)
        check_router_loss(groups, results, swap=spec.get("swap_router_loss", True))
        output[sp] = results
        groups.release()  # in a shared launch the parts after this one keep no groups (nor gloo threads) of it
    torch.save(output, Path(sys.argv[2]) / f"result_{dist.get_rank()}.pt")


if __name__ == "__main__":
    main()
