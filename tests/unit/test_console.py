"""The quiet console (`lightning_ulysses.integration.console`) without processes: each hidden text is still the installed
library's, the filters drop exactly those messages (theirs, not ours, not errors, not look-alikes), are installed
once, and the scoped ones hold only where they should. Whole consoles: tests/test_user_script.py (a user's script),
tests/test_notebook.py, tests/recipes/test_recipes.py (the main job)."""

from __future__ import annotations

import importlib.util
import logging
import os
import sys
import warnings
from pathlib import Path

import pytest
import torch

from lightning_ulysses.integration import console
from lightning_ulysses.integration.strategy import UlyssesDeepSpeedStrategy


@pytest.mark.parametrize("module, text", console.silenced_texts(), ids=lambda value: str(value)[:40])
def test_every_hidden_text_is_still_in_its_library(module, text):
    """A library that rewords a message makes its filter stale: the message would show again, unnoticed."""
    assert text in Path(importlib.util.find_spec(module).origin).read_text(), f"{module} no longer says {text!r}"


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


@pytest.fixture
def records():
    """What the loggers of Lightning, DeepSpeed (which does not propagate) and setuptools' compilers pass on."""
    handler = _Records()
    loggers = [logging.getLogger(name) for name in ("lightning.pytorch.utilities.rank_zero", "DeepSpeed", "compilers")]
    for logger in loggers:
        logger.addHandler(handler)
    yield handler.messages
    for logger in loggers:
        logger.removeHandler(handler)


def test_log_records_are_dropped_by_their_own_text_only(records):
    console.quiet_third_party()
    logging.getLogger("compilers.C.base").info("gcc /tmp/x/test.o -laio -o /tmp/x/a.out")
    logging.getLogger("compilers.C.base").error("gcc failed")
    rank_zero = logging.getLogger("lightning.pytorch.utilities.rank_zero")
    rank_zero.info("💡 Tip: For seamless cloud logging, try installing litlogger")
    rank_zero.info("lightning_ulysses: dp(1) × sp(2) = world_size(2)")
    deepspeed = logging.getLogger("DeepSpeed")
    deepspeed.warning("Setting accelerator to CPU. If you have GPU or other accelerator, we were unable to detect it.")
    deepspeed.warning("**** You are using ZeRO with an untested optimizer, proceed with caution *****")
    deepspeed.error("a DeepSpeed error")
    assert records == ["gcc failed", "lightning_ulysses: dp(1) × sp(2) = world_size(2)",
                       "**** You are using ZeRO with an untested optimizer, proceed with caution *****",
                       "a DeepSpeed error"]


def _shown(emit) -> list[str]:
    """The warnings `emit` raises that the quiet console lets through, with Python's defaults otherwise (pytest's
    own filters, which ignore FutureWarning, set aside)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.resetwarnings()
        warnings.simplefilter("always")
        console.quiet_third_party()
        emit()
    return [str(w.message) for w in caught]


def test_warnings_are_dropped_by_their_own_text_only():
    def emit():
        warnings.warn("`torch.distributed.all_gather_into_tensor` is deprecated. Please use ...", FutureWarning)
        warnings.warn("`torch.distributed.reduce_scatter_tensor` is deprecated. Please use ...", FutureWarning)
        warnings.warn("`torch.distributed.reduce_op` is deprecated, use ReduceOp instead", FutureWarning)  # not ours
        warnings.warn("`isinstance(treespec, LeafSpec)` is deprecated, use ...", FutureWarning)
        warnings.warn("When saving the DeepSpeed Stage 3 checkpoint, each worker will save a shard ...", UserWarning)
        warnings.warn("Starting from v1.9.0, `tensorboardX` has been removed as a dependency of ...", UserWarning)
        warnings.warn("The number of training batches (8) is smaller than the logging interval", UserWarning)
        warnings.warn("lightning_ulysses: a warning of ours", UserWarning)

    assert _shown(emit) == ["`torch.distributed.reduce_op` is deprecated, use ReduceOp instead",
                            "The number of training batches (8) is smaller than the logging interval",
                            "lightning_ulysses: a warning of ours"]


def test_peft_initialising_partitioned_weights_is_hidden_and_nobody_elses():
    """Under ZeRO-3 peft initialises LoRA weights that are already partitioned (empty): torch's warning, attributed to
    peft's line. The same warning for anyone else's `nn.init` on an empty tensor (a no-op init, e.g. of a partitioned
    weight in `configure_model`) still shows."""
    from peft import LoraConfig, get_peft_model

    peft_model = get_peft_model(torch.nn.Sequential(torch.nn.Linear(4, 4)), LoraConfig(r=2, target_modules=["0"]))
    layer = peft_model.base_model.model[0]
    layer.lora_A["default"].weight.data = torch.empty(0)  # what a partitioned parameter holds on its rank

    def emit():
        layer.reset_lora_parameters("default", True)
        torch.nn.init.kaiming_uniform_(torch.empty(0, 3))

    assert _shown(emit) == ["Initializing zero-element tensors is a no-op"]  # the second call's


def test_installed_once_however_often_asked():
    with warnings.catch_warnings():
        warnings.resetwarnings()
        console.quiet_third_party()
        installed = list(warnings.filters)
        filters = {name: list(logging.getLogger(name).filters)
                   for name in ("lightning.pytorch.utilities.rank_zero", "DeepSpeed")}
        console.quiet_third_party()
        UlyssesDeepSpeedStrategy()  # creates them too
        assert warnings.filters == installed and len(installed) == 6
        assert {name: logging.getLogger(name).filters for name in filters} == filters
        warnings.simplefilter("default")  # the user's, later: keeps its precedence
        console.quiet_third_party()
        assert warnings.filters[0][0] == "default" and warnings.filters[1:] == installed


def test_a_strategy_told_not_to_installs_nothing():
    with warnings.catch_warnings():
        warnings.resetwarnings()
        UlyssesDeepSpeedStrategy(quiet_third_party=False)
        assert warnings.filters == []
        UlyssesDeepSpeedStrategy()
        assert len(warnings.filters) == 6


def test_the_untested_optimizer_note_is_dropped_for_sgd_only(records):
    note = "**** You are using ZeRO with an untested optimizer, proceed with caution *****"
    parameters = [torch.nn.Parameter(torch.zeros(2))]

    class Preconditioned(torch.optim.SGD):  # a subclass is another optimizer: DeepSpeed checks the exact type
        pass

    for optimizer in (torch.optim.SGD(parameters, lr=0.1), Preconditioned(parameters, lr=0.1)):
        with console.verified_optimizer(optimizer):
            logging.getLogger("DeepSpeed").warning(note)
    logging.getLogger("DeepSpeed").warning(note)  # the filter left with the `with`
    assert records == [note, note]


class _KernelStderr:
    """`sys.stderr` in a Jupyter kernel (ipykernel's `OutStream`): its `fileno()` is a copy of the original
    descriptor, while descriptor 2 itself goes to the notebook."""

    def __init__(self, descriptor: int) -> None:
        self.descriptor = descriptor

    def fileno(self) -> int:
        return self.descriptor

    def write(self, text: str) -> int:
        return len(text)

    def flush(self) -> None:
        pass


def test_the_linker_errors_of_deepspeeds_op_probes_stay_out_of_a_notebook(capfd, monkeypatch):
    """DeepSpeed's probe discards its compiler's errors by redirecting `sys.stderr.fileno()`, which in a kernel is not
    descriptor 2, where the linker writes (`cannot find -laio` in every rank of the notebook)."""
    from deepspeed.ops.op_builder.cpu.async_io import AsyncIOBuilder

    copy = os.dup(2)
    monkeypatch.setattr(sys, "stderr", _KernelStderr(copy))
    try:
        probe = AsyncIOBuilder()
        assert not probe.has_function("io_submit", ("ulysses_missing",))  # a library no machine has
        assert "cannot find -lulysses_missing" in capfd.readouterr().err  # what reached the notebook
        with console.quiet_compiler_probes():
            assert not probe.has_function("io_submit", ("ulysses_missing",))
        assert capfd.readouterr().err == ""
    finally:
        os.close(copy)
