"""Both strategies are adapters of one runtime: the collaborators are built once (`runtime.UlyssesRuntime`), the shared
hooks live in `SequenceParallelHooks`, and each strategy class holds only its backend's own code."""

from __future__ import annotations

import pytest

from lightning_ulysses import UlyssesDeepSpeedStrategy
from lightning_ulysses.integration import runtime as runtime_module
from lightning_ulysses.integration.fsdp_strategy import UlyssesFSDPStrategy
from lightning_ulysses.integration.sequence_parallel_hooks import SequenceParallelHooks

STRATEGIES = (UlyssesDeepSpeedStrategy, UlyssesFSDPStrategy)
# Lightning hooks whose backend parents differ (DeepSpeedStrategy, ModelParallelStrategy): each strategy writes its own.
BACKEND_HOOKS = {"__init__", "setup", "setup_environment", "model_sharded_context", "register_strategies",
                 "strategy_name"}


@pytest.mark.parametrize("strategy_class", STRATEGIES, ids=lambda cls: cls.__name__)
def test_one_runtime_owns_the_collaborators(strategy_class, monkeypatch):
    built = []
    original = runtime_module.UlyssesRuntime.__init__

    def counting(self, *args, **kwargs):
        built.append(self)
        original(self, *args, **kwargs)

    monkeypatch.setattr(runtime_module.UlyssesRuntime, "__init__", counting)
    strategy = strategy_class(2, check_batches="every", sequence_parallel_in_evaluation=False)
    assert built == [strategy.runtime]
    assert strategy.runtime.batch_check.mode == strategy.runtime.value_check.mode == "every"
    assert strategy.check_batches == "every" and strategy.sequence_parallel_in_evaluation is False
    # No collaborator is kept on the strategy beside the runtime's.
    assert not {"_parallel", "_auto", "_batch_check", "_value_check", "_random_streams", "_checkpoints",
                "_faults"} & set(vars(strategy))


def test_nothing_is_written_in_both_strategies():
    shared = {name for name in set(vars(UlyssesDeepSpeedStrategy)) & set(vars(UlyssesFSDPStrategy))
              if not name.startswith("__") or name == "__init__"} - {"_abc_impl"}
    assert shared <= BACKEND_HOOKS, f"written in both strategies, not in SequenceParallelHooks: {shared - BACKEND_HOOKS}"


@pytest.mark.parametrize("hook", ["teardown", "backward", "_prepare_modules", "training_step", "batch_to_device"])
def test_the_run_hooks_are_written_once(hook):
    assert hook in vars(SequenceParallelHooks)
    for strategy_class in STRATEGIES:
        assert hook not in vars(strategy_class)
