"""`logged_values.SameValueCheck`'s own rules (the check over an SP group: tests/distributed/test_value_check.py)."""

import lightning as L
import pytest
import torch
from lightning.fabric.utilities.exceptions import MisconfigurationException
from torch.utils.data import DataLoader

from lightning_ulysses.integration import logged_values
from lightning_ulysses.integration.logged_values import SameValueCheck, check_per_rank_values


def test_per_rank_values_are_names_or_patterns():
    assert check_per_rank_values(None) == ()
    assert check_per_rank_values("time/step") == ("time/step",)  # one name, not its letters
    assert check_per_rank_values(["time/*", "bytes"]) == ("time/*", "bytes")
    with pytest.raises(TypeError, match="per_rank_values must be logged names"):
        SameValueCheck("first", [3])
    with pytest.raises(ValueError, match="check_batches must be"):
        SameValueCheck("sometimes")


def test_tolerance_forgives_float32_rounding_and_not_a_shard():
    same = logged_values._same
    assert same([2.5, 2.5]) and same([float("nan"), float("nan")])
    assert same([4.172830104827881, 4.172830104827881 * (1 + 4 * 2 ** -23)])  # a few float32 ulps
    assert not same([4.17283, 4.1465])  # two shards' losses of one row (the hand-written loss at SP 2)
    assert not same([float("nan"), 5.69])  # a shard without targets next to one with them


def test_the_loss_is_read_as_lightning_reads_it():
    loss = torch.tensor(1.0)
    assert logged_values._loss_of(loss) is loss and logged_values._loss_of({"loss": loss}) is loss
    assert logged_values._loss_of(None) is None and logged_values._loss_of({"log": 1}) is None


def test_names_digest_alike_in_every_process():
    # Python's hash() is salted per process; the digest every rank sends must not be.
    assert logged_values._digest(["a", "b"]) == logged_values._digest(["a", "b"]) != logged_values._digest(["ab"])
    assert logged_values._digest(["train/loss"]) == 66499432479598.0  # fixed: any other process computes this too
    assert logged_values._digest(["x" * 100] * 50) < 2 ** 48  # exact in a float64


def test_lightning_refuses_self_log_in_predict_step():
    """Why predict_step has no value check: Lightning 2.6 refuses `self.log` there itself (the predict loop registers
    no result collection; its `_FxValidator` lists `predict_step` as allowing no logging)."""

    class Logs(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.layer = torch.nn.Linear(2, 2)

        def predict_step(self, batch, batch_idx):
            self.log("predicted", self.layer(batch).sum())

    trainer = L.Trainer(accelerator="cpu", devices=1, logger=False, enable_progress_bar=False,
                        enable_model_summary=False)
    with pytest.raises(MisconfigurationException, match=r"log in a `predict` hook, but it doesn't support logging"):
        trainer.predict(Logs(), DataLoader(torch.ones(2, 2)))
