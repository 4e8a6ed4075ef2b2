"""memory="auto" predicts step times with the constants of the device it runs on: the measured cards' own (H200,
H100), an unknown card the nearest measured one's, said in one log line."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest
import torch

from lightning_ulysses.parallel.run_spec import RunSpec
from lightning_ulysses.planning import auto
from lightning_ulysses.planning.auto import AutoMemory, choose, device_speeds
from lightning_ulysses.planning.planner import GIB, MODELS
from lightning_ulysses.planning.step_time import H100, H200, speeds_for


def test_measured_cards_get_their_own_speeds():
    assert speeds_for("NVIDIA H100 80GB HBM3", (9, 0), 79.2 * GIB, 132) == (H100, None)
    assert speeds_for("NVIDIA H200", (9, 0), 139.8 * GIB, 132) == (H200, None)
    assert H100 != H200 and H100.name != H200.name


@pytest.mark.parametrize("name, capability, memory_gib, sms, nearest", [
    ("NVIDIA H800", (9, 0), 79.2, 132, H100),            # Hopper, 80 GB
    ("NVIDIA H100 PCIe", (9, 0), 79.2, 114, H100),       # another H100: not the measured SXM part
    ("NVIDIA GH200 480GB", (9, 0), 94.5, 132, H100),     # Hopper, 96 GB: closer to 80 than to 141
    ("NVIDIA H20", (9, 0), 95.0, 78, H100),
    ("NVIDIA B200", (10, 0), 179.0, 148, H200),          # no Blackwell measured: the larger memory is nearer
    ("NVIDIA A100-SXM4-80GB", (8, 0), 79.2, 108, H100),
])
def test_an_unknown_card_gets_the_nearest_measured_ones_speeds_and_a_line_saying_so(name, capability, memory_gib,
                                                                                    sms, nearest):
    speeds, note = speeds_for(name, capability, memory_gib * GIB, sms)
    assert speeds is nearest
    assert name in note and nearest.name in note and "\n" not in note


def _fake_cuda(monkeypatch, name, capability, memory_gib, sms=132):
    props = SimpleNamespace(major=capability[0], minor=capability[1], total_memory=int(memory_gib * GIB),
                            multi_processor_count=sms)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: name)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device=None: props)
    return torch.device("cuda")


def test_device_speeds_reads_the_device(monkeypatch, caplog):
    device = _fake_cuda(monkeypatch, "NVIDIA H100 80GB HBM3", (9, 0), 79.2)
    with caplog.at_level(logging.INFO, logger=auto._log.name):
        assert device_speeds(device) is H100
    assert not caplog.records  # a measured card: nothing to say
    device = _fake_cuda(monkeypatch, "NVIDIA H800", (9, 0), 79.2)
    with caplog.at_level(logging.INFO, logger=auto._log.name):
        assert device_speeds(device) is H100
    assert len(caplog.records) == 1 and "NVIDIA H800" in caplog.records[0].getMessage()
    assert device_speeds(torch.device("cpu")) is H200  # no GPU: the default constants, silently


def test_the_choice_is_predicted_and_reported_with_the_speeds_given():
    """The 8B shape at 8K on one H100 (the free memory measured there: 78.0 GiB device, 125.7 GiB host): the
    optimizer's host share dominates the step, and the report names whose speeds predicted it."""
    run = RunSpec(precision="bf16-mixed", device="cuda")
    request = AutoMemory(seq_len=8192)
    free = (78.0 * GIB, 125.7 * GIB)
    on_h100 = choose(MODELS["llama3-8b"], request, run, free, kernel="cudnn", fused_elementwise=True, speeds=H100)
    on_h200 = choose(MODELS["llama3-8b"], request, run, free, kernel="cudnn", fused_elementwise=True)
    assert on_h100.speeds is H100 and on_h200.speeds is H200
    assert "NVIDIA H100 80GB HBM3's speeds" in on_h100.report()
    assert on_h100.as_dict()["speeds"] == H100.name
    assert on_h100.offload_optimizer == pytest.approx(0.6)
    # H100's CPU Adam (fit to the H100's steps) is faster per element than the H200's fit
    cpu_adam = "optimizer: CPU Adam (offloaded share)"
    assert on_h100.best.time.terms[cpu_adam] < on_h200.best.time.terms[cpu_adam]
