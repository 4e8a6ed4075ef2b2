"""Dropout under sequence parallelism (world 4, SP 2 × DP 2; in the shared 4-rank launch): each SP rank draws its own
masks, the same ones again for the same seed, and the loss is the whole model's under the masks drawn.

A GPT-2 with dropout 0.2 on its embeddings, attention probabilities, attention output and MLP trains 2 SGD steps;
every mask a step draws is recorded (`workers/dropout.py`). No reference from the seed exists (one process draws
other masks than the ranks do), but one from the masks does: the single-process fp32 model on whole rows, with each
draw replaced by the SP ranks' masks put together (tokens for hidden dropout, heads for attention dropout), gives
every rank's loss and the final weights as without dropout (1e-5; 1e-4 of the update).
"""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from tests.distributed.common import UnevenlyMaskedTokens, collate
from tests.distributed.harness import ROOT
from tests.distributed.pool import shared
from tests.distributed.reference import assert_weights_match

WORKER = ROOT / "tests" / "distributed" / "workers" / "dropout.py"
STEPS, WORLD = 2, 4
CASES = [
    {"name": "seed7", "seed": 7, "stage": 3, "steps": STEPS},
    {"name": "seed7_again", "seed": 7, "stage": 3, "steps": STEPS},  # a fresh Trainer, seeded alike
    # the memory engine: both layers in one checkpointed stretch (the second's input recomputed in backward)
    {"name": "seed7_checkpointed", "seed": 7, "stage": 2, "steps": STEPS,
     "memory": {"activation_checkpointing": True, "checkpoint_interval": 2}},
]
JOB = shared(WORLD, "dropout", WORKER, {"cases": CASES})  # in the shared 4-rank launch (pool.py)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return {case["name"]: {(rank[case["name"]]["sequence_parallel_rank"], rank[case["name"]]["data_parallel_rank"]):
                           rank[case["name"]] for rank in JOB.ranks(tmp_path_factory)} for case in CASES}


def _masks(rank: dict) -> list[list[torch.Tensor]]:
    return [record["masks"] for record in rank["records"]]


def _same_masks(rank: dict, other: dict) -> bool:
    """Every step drew the same masks, bit for bit, in the same order."""
    steps = list(zip(_masks(rank), _masks(other), strict=True))
    return all(len(a) == len(b) and all(map(torch.equal, a, b)) for a, b in steps)


def test_sp_ranks_draw_their_own_masks(runs):
    """The bug: SP ranks seeded alike dropped token i of every shard (and head group 0 like head group 1) alike."""
    for dp in range(2):
        first, second = _masks(runs["seed7"][(0, dp)]), _masks(runs["seed7"][(1, dp)])
        for step, (ours, theirs) in enumerate(zip(first, second)):
            assert ours and [m.shape for m in ours] == [m.shape for m in theirs]
            same = [k for k, (a, b) in enumerate(zip(ours, theirs)) if torch.equal(a, b)]
            assert not same, f"step {step}, DP rank {dp}: SP ranks 0 and 1 drew identical masks in draws {same}"


def test_the_same_seed_draws_the_same_masks_and_data_parallel_replicas_share_them(runs):
    for key, rank in runs["seed7"].items():
        again = runs["seed7_again"][key]
        assert _same_masks(rank, again)
        assert [r["loss"] for r in rank["records"]] == [r["loss"] for r in again["records"]]
    # Decided (rng.py): DP replicas of one SP rank draw alike, as Lightning's DDP replicas do (other samples).
    for sp in range(2):
        assert _same_masks(runs["seed7"][(sp, 0)], runs["seed7"][(sp, 1)])


class ReplayMasks(TorchDispatchMode):
    """Every Bernoulli draw of the reference takes the next of the given masks instead."""

    def __init__(self, masks: list[torch.Tensor]):
        super().__init__()
        self.masks = list(masks)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten.bernoulli_.float:
            mask = self.masks.pop(0)
            assert mask.shape == args[0].shape, (mask.shape, args[0].shape)
            return args[0].copy_(mask)
        return func(*args, **(kwargs or {}))


def _reference_with_masks(ranks: dict) -> dict:
    """One process, whole rows, eager attention, plain SGD: each DP replica's step with its SP ranks' masks put
    together along dimension 1 (tokens of hidden states [batch, tokens, hidden]; heads of attention probabilities
    [batch, heads, tokens, tokens], rank s holding head group s)."""
    from tests.distributed.workers.dropout import SEQ_LEN, dropout_gpt2

    model = dropout_gpt2("eager").train()
    initial = {name: p.detach().clone() for name, p in model.named_parameters()}
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    dataset = UnevenlyMaskedTokens(STEPS * 2, SEQ_LEN)
    losses = []
    for step in range(STEPS):
        optimizer.zero_grad()
        replicas = []
        for dp in range(2):
            shards = [ranks[(sp, dp)]["records"][step] for sp in range(2)]
            assert shards[0]["sample_index"] == shards[1]["sample_index"]
            masks = [torch.cat(parts, dim=1).float() for parts in zip(*(shard["masks"] for shard in shards))]
            batch = collate([dataset[i] for i in shards[0]["sample_index"]])
            replay = ReplayMasks(masks)
            with replay:
                replicas.append(model(input_ids=batch["input_ids"], labels=batch["labels"]).loss)
            assert not replay.masks, f"the reference drew {len(masks) - len(replay.masks)} of {len(masks)} masks"
        torch.stack(replicas).mean().backward()
        optimizer.step()
        losses.append([loss.item() for loss in replicas])
    final = {name: p.detach().clone() for name, p in model.named_parameters()}
    return {"losses": losses, "initial": initial, "final": final}


@pytest.mark.parametrize("name", ["seed7", "seed7_checkpointed"])
def test_the_loss_is_the_whole_models_under_the_masks_drawn(runs, name):
    """Every rank returns the whole sequence's loss with dropout (its SP partner's equal), and the single-process
    model with the same masks gives it; so do the weights after the steps. With the memory engine the forward draws
    what the plain run drew and the recomputes replay it (else the gradients, hence the weights, would differ)."""
    ranks = runs[name]
    reference = _reference_with_masks(ranks)
    for (sp, dp), rank in ranks.items():
        for step, record in enumerate(rank["records"]):
            assert abs(record["loss"] - reference["losses"][step][dp]) < 1e-5, (sp, dp, step)
    weights = next(rank["weights"] for rank in ranks.values() if rank["weights"] is not None)
    assert_weights_match(weights, reference)
    assert all(not mask.all() for rank in ranks.values() for mask in _masks(rank)[0])  # dropout is really on
    if name != "seed7":  # the checkpointed layers' forwards drew what the plain run drew
        assert all(_same_masks(rank, runs["seed7"][key]) for key, rank in ranks.items())
