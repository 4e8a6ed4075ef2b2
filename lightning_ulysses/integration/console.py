"""The quiet console: what third-party libraries print that nobody can act on is hidden at its source, each message
matched by its own text (or its logger), so that their other warnings, every error and everything of ours still show.

`UlyssesDeepSpeedStrategy(quiet_third_party=True)` (the default) installs the process-wide part, `quiet_third_party`,
when it is created: before Lightning's `Trainer` prints its start-up notes and before DeepSpeed is first imported, and
in every rank (the ranks Lightning re-runs the script for, torchrun's and SLURM's create the strategy again; the
ranks `strategy="ulysses_notebook"` forks inherit it). `recipes/train.py` installs it before it builds anything.
Three are hidden only where they say nothing (see each): DeepSpeed's "untested optimizer" for an optimizer the
project's tests run under ZeRO (`verified_optimizer`), Lightning's "dataloader is not resumable" while a resume that
continues exactly starts (`SuspendedWarning`), the linker's errors of DeepSpeed's op probe around that probe
(`quiet_compiler_probes`).

Each text below is verbatim from the module named beside it, as of the versions in docs/internals.md;
`tests/unit/test_console.py` fails when an installed library no longer has it.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import sys
import tempfile
import warnings
from typing import Any, Iterator, Optional

from typing_extensions import override

# -- process-wide: warnings (module that emits it, message start, category, emitting module's name pattern) --------
_WARNINGS: tuple[tuple[str, str, type[Warning], Optional[str]], ...] = (
    # torch deprecates the two collectives DeepSpeed's ZeRO calls for every bucket (`deepspeed/comm/torch.py`):
    # dozens per step, attributed to torch's own wrapper (`c10d_logger.py`), so matched by their exact names only.
    ("torch.distributed.distributed_c10d", "`torch.distributed.all_gather_into_tensor` is deprecated", FutureWarning,
     None),
    ("torch.distributed.distributed_c10d", "`torch.distributed.reduce_scatter_tensor` is deprecated", FutureWarning,
     None),
    # torch deprecates `LeafSpec`, which Lightning's own `utilities/_pytree.py` builds for every step's outputs.
    ("torch.utils._pytree", "`isinstance(treespec, LeafSpec)` is deprecated", FutureWarning, None),
    # Lightning's note at ZeRO-3 saves, pointing to its own single-file conversion; the project's checkpoints export
    # with `python -m lightning_ulysses checkpoint export` (the strategy's docstring, the recipe's summary).
    ("lightning.pytorch.strategies.deepspeed", "When saving the DeepSpeed Stage 3 checkpoint",
     UserWarning, None),
    # Lightning's migration note of v1.9 on its default logger (CSV when TensorBoard is not installed): nothing wrong.
    ("lightning.pytorch.trainer.connectors.logger_connector.logger_connector",
     "Starting from v1.9.0, `tensorboardX` has been removed as a dependency", UserWarning, None),
    # peft initialising LoRA weights that ZeRO-3 has already partitioned (empty): torch's warning, attributed to peft's
    # call (`stacklevel=2`). `models.lora.with_lora` / `add_adapter` then give them peft's values, and adapters made
    # otherwise are refused at setup naming the fix (`preparation.check_adapters_initialised`). Only peft's calls:
    # the same warning for a user's own `nn.init` on a partitioned weight still shows.
    ("torch.nn.init", "Initializing zero-element tensors is a no-op", UserWarning, r"peft\."),
)

# -- process-wide: log records (module that logs it, logger, message start) ---------------------------------------
_LOG_RECORDS: tuple[tuple[str, str, str], ...] = (
    # Lightning's advertisements for its cloud products, through its rank-zero logger, at every Trainer and fit.
    ("lightning.pytorch.trainer.connectors.logger_connector.logger_connector", "lightning.pytorch.utilities.rank_zero",
     "💡 Tip:"),
    ("lightning.pytorch.trainer.connectors.callback_connector", "lightning.pytorch.utilities.rank_zero", "💡 Tip:"),
    # DeepSpeed's accelerator detection finding no GPU, at its first import in every rank; Lightning's own
    # "GPU available: False" and the preflight report say the same.
    ("deepspeed.accelerator.real_accelerator", "DeepSpeed", "Setting accelerator to CPU."),
)
# setuptools' compilers echo every command at INFO (shown wherever the root logger is at INFO, e.g. Hydra's job
# logging): the commands of DeepSpeed's op probes (`gcc ... -laio`). Warnings and errors still show.
COMPILERS_LOGGER = "compilers"

# -- scoped (see each function) -------------------------------------------------------------------------------------
UNTESTED_OPTIMIZER = ("deepspeed.runtime.engine", "DeepSpeed", "**** You are using ZeRO with an untested optimizer")
NOT_RESUMABLE = ("lightning.pytorch.loops.training_epoch_loop",
                 "You're resuming from a checkpoint that ended before the epoch ended")


class DropMessages(logging.Filter):
    """A logging filter that drops the records whose message starts with one of `prefixes`."""

    def __init__(self, *prefixes: str) -> None:
        super().__init__()
        self.prefixes = prefixes

    @override
    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(self.prefixes)

    def __eq__(self, other: object) -> bool:  # one per logger and set of messages, however often installed
        return isinstance(other, DropMessages) and other.prefixes == self.prefixes

    def __hash__(self) -> int:
        return hash(self.prefixes)


def _warning_filter(text: str, category: type[Warning], module: Optional[str]) -> tuple[Any, ...]:
    """The entry `warnings.filterwarnings("ignore", ...)` makes for `text` (matched from its start, literally)."""
    return ("ignore", re.compile(re.escape(text), re.I), category, re.compile(module) if module else None, 0)


def quiet_third_party() -> None:
    """Install the process-wide filters above. Idempotent: a filter already installed is left where it is (a filter
    the user added later, e.g. `warnings.simplefilter("default")`, keeps its precedence)."""
    for _, text, category, module in _WARNINGS:
        entry = _warning_filter(text, category, module)
        if entry not in warnings.filters:
            warnings.filterwarnings("ignore", message=re.escape(text), category=category, module=module or "")
    prefixes: dict[str, tuple[str, ...]] = {}
    for _, logger, text in _LOG_RECORDS:
        prefixes[logger] = tuple(dict.fromkeys(prefixes.get(logger, ()) + (text,)))
    for logger, texts in prefixes.items():
        drop = DropMessages(*texts)
        if drop not in logging.getLogger(logger).filters:  # `getLogger` before the library: its logger is this one
            logging.getLogger(logger).addFilter(drop)
    compilers = logging.getLogger(COMPILERS_LOGGER)
    if compilers.level == logging.NOTSET:  # a level set on purpose (to debug a build) stays
        compilers.setLevel(logging.WARNING)


@contextlib.contextmanager
def dropped_log_messages(logger: str, *prefixes: str) -> Iterator[None]:
    """The records of `logger` starting with one of `prefixes` dropped for the duration."""
    drop = DropMessages(*prefixes)
    logging.getLogger(logger).addFilter(drop)
    try:
        yield
    finally:
        logging.getLogger(logger).removeFilter(drop)


def _verified_optimizers() -> tuple[type, ...]:
    import torch

    # Run through ZeRO 0/1/2/3 at SP 1, 2 and 4 against plain torch SGD in one process, weights within 1e-4 of the
    # update (tests/distributed/test_parity.py); with momentum and a schedule across checkpoints (test_checkpoints.py).
    return (torch.optim.SGD,)


def verified_optimizer(optimizer: Any) -> contextlib.AbstractContextManager:
    """Around `deepspeed.initialize`: DeepSpeed's "untested optimizer" warning dropped for an optimizer of a type the
    project's parity tests run under ZeRO (`torch.optim.SGD`; Adam and AdamW are on DeepSpeed's own list). For any
    other it stays: an optimizer whose update is not element-wise (factored or matrix preconditioners) is not exact
    on ZeRO's flat partitions, which is what DeepSpeed's caution is about."""
    if type(optimizer) in _verified_optimizers():
        return dropped_log_messages(UNTESTED_OPTIMIZER[1], UNTESTED_OPTIMIZER[2])
    return contextlib.nullcontext()


@contextlib.contextmanager
def quiet_compiler_probes() -> Iterator[None]:
    """File descriptor 2 sent to a scratch file for the duration: around DeepSpeed's op-compatibility probe, which
    compiles and links test programs and means to discard their errors (`/usr/bin/ld: cannot find -laio` where
    libaio is not installed) by redirecting `sys.stderr.fileno()`. In a Jupyter kernel that is not where the
    linker writes (ipykernel forwards descriptor 2 to the notebook through a pipe; its `sys.stderr.fileno()` is a
    copy of the original terminal), so the errors reached the notebook. Python's own `sys.stderr` is untouched
    there; in a script, output of this process written to descriptor 2 meanwhile is discarded too (the probe takes
    a fraction of a second, before training starts)."""
    try:
        saved = os.dup(2)
    except OSError:  # no descriptor 2 (a process started without stderr): nothing to keep quiet
        yield
        return
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    try:
        with tempfile.TemporaryFile() as scratch:
            os.dup2(scratch.fileno(), 2)
            try:
                yield
            finally:
                os.dup2(saved, 2)
    finally:
        os.close(saved)


class SuspendedWarning:
    """One third-party warning ignored between `suspend` and `resume`, e.g. while a message that is false for this
    run would be emitted; `resume` removes exactly the filter `suspend` added (none when an identical one was
    already there: that one is someone else's)."""

    def __init__(self, text: str, category: type[Warning] = Warning) -> None:
        self.text, self.category = text, category
        self._entry: Optional[tuple[Any, ...]] = None

    def suspend(self) -> None:
        entry = _warning_filter(self.text, self.category, None)
        if self._entry is None and entry not in warnings.filters:
            warnings.filterwarnings("ignore", message=re.escape(self.text), category=self.category)
            self._entry = entry

    def resume(self) -> None:
        if self._entry is not None:
            # An "ignore" entry records nothing in the modules' warning registries, so removing it restores the
            # previous behaviour exactly.
            with contextlib.suppress(ValueError):
                warnings.filters.remove(self._entry)
            self._entry = None


def silenced_texts() -> list[tuple[str, str]]:
    """(module that has the text, text) of every message this module hides: what the tests check against the
    installed libraries."""
    return ([(source, text) for source, text, _, _ in _WARNINGS] + [(source, text) for source, _, text in _LOG_RECORDS]
            + [(UNTESTED_OPTIMIZER[0], UNTESTED_OPTIMIZER[2]), NOT_RESUMABLE])
