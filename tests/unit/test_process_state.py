"""What a run replaces for the whole process is put back at its end (`integration/process_state.py`); the runs
themselves: `tests/distributed/test_process_state.py`."""

import os

import torch

from lightning_ulysses.integration.process_state import ProcessWideState
from lightning_ulysses.memory import MemoryOptions, apply_allocator_settings
from tests.unit.test_lora import zero3_init  # noqa: F401 - the fixture

TORCHS_LINEAR = torch._C._nn.linear


def test_zero_init_leaves_its_linear_and_the_state_puts_torchs_back(zero3_init):  # noqa: F811
    """DeepSpeed's `zero.Init` (ZeRO-3's `configure_model`) still leaves its linear behind on exit (if this stops
    failing without the restore, DeepSpeed fixed it: re-check process_state.py); the state taken before puts torch's
    back, and a later `zero.Init` replaces it again as in a fresh process."""
    assert torch.nn.functional.linear is TORCHS_LINEAR
    state = ProcessWideState()
    for _ in range(2):
        state.take()
        with zero3_init():
            torch.nn.Linear(2, 2)
        assert torch.nn.functional.linear is not TORCHS_LINEAR
        assert "ZeroStage3" in type(torch.nn.functional.linear(torch.ones(1, 2, requires_grad=True),
                                                               torch.ones(2, 2)).grad_fn).__name__
        state.restore()
        assert torch.nn.functional.linear is TORCHS_LINEAR


def test_a_run_whose_teardown_never_came_is_put_back_by_the_next(monkeypatch):
    state = ProcessWideState()
    monkeypatch.setattr(torch.nn.functional, "linear", torch.nn.functional.linear)
    state.take()
    torch.nn.functional.linear = lambda *args: None
    undone = []
    state.add_undo(lambda: undone.append(1))
    state.take()
    assert torch.nn.functional.linear is TORCHS_LINEAR and undone == [1]
    state.restore()
    state.restore()  # once only
    assert undone == [1]


def test_expandable_segments_are_undone(monkeypatch):
    """The variable goes, and the allocator's setting is put back where CUDA runs already (faked here: CPU)."""
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
    settings = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda.memory, "_set_allocator_settings", settings.append)
    undo = apply_allocator_settings(MemoryOptions(expandable_segments=True))
    assert os.environ["PYTORCH_CUDA_ALLOC_CONF"] == "expandable_segments:True"
    undo()
    assert "PYTORCH_CUDA_ALLOC_CONF" not in os.environ
    assert settings == ["expandable_segments:True", "expandable_segments:False"]


def test_a_variable_the_user_set_is_left_alone(monkeypatch):
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:False")
    apply_allocator_settings(MemoryOptions(expandable_segments=True))()
    assert os.environ["PYTORCH_CUDA_ALLOC_CONF"] == "expandable_segments:False"
