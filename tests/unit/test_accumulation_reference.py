"""The reference the accumulation parity cases are held to follows Lightning's own rules.

tests/distributed/test_parity.py compares `accumulate_grad_batches` runs whose windows the epoch does not fill
(`*-epochs-accumulate3`, `-limit-batches5-`, `-max-steps3`) with `reference_training(..., micro_batch_size=...)`:
windows of k micro-batches that restart at every epoch, the epoch's last (partial) window stepping too, each
micro-batch's loss divided by k. Here the same module trains under Lightning's own loop in one process (no DeepSpeed,
no sequence parallelism: the strategy whose accumulation Lightning itself runs), and the reference must reproduce its
weights — so the parity cases hold the strategy to what Lightning does, not to our reading of it.
"""

from __future__ import annotations

import lightning as L
import pytest
import torch
from torch.utils.data import DataLoader

from tests.distributed.common import CausalLM, UnevenlyMaskedTokens, collate
from tests.distributed.reference import assert_weights_match, reference_training

SEQ_LEN, KV_HEADS, K = 16, 2, 3


@pytest.mark.parametrize(("epochs", "batches", "limit", "max_steps", "windows"), [
    (2, 4, None, -1, [3, 1, 3, 1]),   # two epochs with a partial window each
    (1, 6, 5, -1, [3, 2]),            # limit_train_batches ends the epoch inside a window
    (2, 4, None, 3, [3, 1, 3]),       # max_steps ends the run after the second epoch's first window
], ids=["two-epochs", "limit-train-batches", "max-steps"])
def test_reference_matches_lightning_own_accumulation(epochs, batches, limit, max_steps, windows):
    torch.manual_seed(0)
    module = CausalLM(num_key_value_heads=KV_HEADS)
    initial = {name: p.detach().clone() for name, p in module.model.named_parameters()}
    trainer = L.Trainer(accelerator="cpu", devices=1, max_epochs=epochs, max_steps=max_steps,
                        accumulate_grad_batches=K, limit_train_batches=limit, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(module, DataLoader(UnevenlyMaskedTokens(batches, SEQ_LEN), batch_size=1, collate_fn=collate))
    assert trainer.global_step == len(windows)  # Lightning stepped once per window, the partial ones included
    samples = [record["sample_index"] for record in module.records]
    assert len(samples) == sum(windows)
    steps, start = [], 0
    for size in windows:
        steps.append([sum(samples[start:start + size], [])])  # one DP replica
        start += size
    reference = reference_training(KV_HEADS, SEQ_LEN, steps, micro_batches=K, micro_batch_size=1)
    for name, value in initial.items():  # both start from the same model (the reference builds it the same way)
        assert torch.equal(value, reference["initial"][name]), name
    trained = {name: p.detach() for name, p in module.model.named_parameters()}
    assert_weights_match(trained, reference)
    assert [record["loss"] for record in module.records] == pytest.approx(
        [loss[0] for loss in reference["losses"]], abs=1e-5)


def test_weights_match_forgives_one_rounding_per_element_and_nothing_more():
    """`assert_weights_match` counts each weight's difference beyond one fp32 rounding of that weight: a one-ulp
    flip of one element passes; an update off by 1% (a scaling bug) fails, also on a weight whose update is a few
    hundred ulps."""
    initial = torch.linspace(0.2, 0.3, 64)
    update = torch.full((64,), 2.4e-4 / 8)  # norm 2.4e-4, ~1000 ulps of a weight of 0.25
    reference = {"initial": {"w": initial}, "final": {"w": initial - update}}
    flipped = (initial - update).clone()
    flipped[5] = torch.nextafter(flipped[5], torch.tensor(1.0))
    assert_weights_match({"w": flipped}, reference)
    with pytest.raises(AssertionError, match="beyond fp32 rounding"):
        assert_weights_match({"w": initial - 1.01 * update}, reference)
