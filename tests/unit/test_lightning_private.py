"""Every private Lightning name the package uses (`lightning_ulysses.fences._lightning_private`) still exists and behaves as
the accessor expects. A failure here means the installed Lightning changed one: re-check the reason given in
`_lightning_private` and adapt the accessor (not its callers)."""

import hashlib
import inspect
import json
import signal
import textwrap
import warnings
from types import SimpleNamespace

import lightning
import lightning as L
import pytest
import torch
from lightning.fabric.plugins.environments import LightningEnvironment
from lightning.pytorch.strategies import DDPStrategy, DeepSpeedStrategy
from lightning.pytorch.trainer.states import RunningStage
from torch.utils.data import DataLoader, SequentialSampler

from lightning_ulysses import UlyssesDeepSpeedStrategy
from lightning_ulysses.fences import _lightning_private as private


def test_checked_version_is_recorded():
    assert private.LIGHTNING_CHECKED.count(".") == 2
    if lightning.__version__ != private.LIGHTNING_CHECKED:
        warnings.warn(f"lightning {lightning.__version__} is installed; _lightning_private was checked against"
                      f" {private.LIGHTNING_CHECKED}: the tests below say whether anything it uses changed.")


@pytest.mark.parametrize("owner, name, parameters", private.OVERRIDDEN,
                         ids=[f"{owner.__name__}.{name}" for owner, name, _ in private.OVERRIDDEN])
def test_overridden_private_methods_keep_their_name_and_parameters(owner, name, parameters):
    method = getattr(owner, name, None)
    assert callable(method), f"{owner.__name__}.{name} is gone: Lightning no longer calls our override"
    assert tuple(inspect.signature(method).parameters) == parameters


@pytest.mark.parametrize("owner, name", list(private.MIRRORED), ids=[f"{o.__name__}.{n}" for o, n in private.MIRRORED])
def test_mirrored_methods_are_unchanged(owner, name):
    source = textwrap.dedent(inspect.getsource(getattr(owner, name)))
    digest = hashlib.sha256(source.encode()).hexdigest()[:16]
    assert digest == private.MIRRORED[(owner, name)], (
        f"{owner.__name__}.{name} changed in lightning {lightning.__version__}; UlyssesDeepSpeedStrategy re-states"
        " it: bring its copy up to date, then the digest in _lightning_private.MIRRORED."
    )


def test_launch_internals():
    strategy = DDPStrategy()
    launcher = private.MultiProcessingLauncher(strategy, start_method="fork")
    assert private.launcher_strategy(launcher) is strategy
    assert set(private.WorkerOutput._fields) >= {"weights_path", "trainer_state", "trainer_results", "extra"}
    private.set_launcher(strategy, launcher)
    assert strategy.launcher is launcher
    environment = LightningEnvironment()
    first = environment.main_port
    private.forget_main_port(environment)
    assert environment._main_port == -1 and isinstance(first, int)
    assert isinstance(private.is_interactive(), bool)


def test_device_index_validation():
    private.validate_device_index_selection([torch.device("cuda", 0), torch.device("cuda", 1)])
    with pytest.raises(RuntimeError, match="CUDA_VISIBLE_DEVICES"):
        private.validate_device_index_selection([torch.device("cuda", 1)])


def test_deepspeed_strategy_internals(tmp_path):
    strategy = DeepSpeedStrategy()
    assert callable(strategy._init_deepspeed_distributed)
    assert tuple(inspect.signature(strategy._init_deepspeed_distributed).parameters) == ()
    assert tuple(inspect.signature(strategy._restore_zero_state).parameters) == ("ckpt", "strict")
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"zero_optimization": {"stage": 2}}))
    assert private.load_deepspeed_config(strategy, str(path)) == {"zero_optimization": {"stage": 2}}
    assert private.load_deepspeed_config(strategy, {"a": 1}) == {"a": 1}
    module = torch.nn.Linear(2, 2)
    module.register_forward_hook(lambda *args: None)
    private.remove_module_hooks(module)
    assert not module._forward_hooks


def test_dataloader_and_random_state():
    loader = DataLoader(list(range(8)), batch_size=2, shuffle=True)
    sampler = SequentialSampler(range(8))
    updated = private.update_dataloader(loader, sampler, mode=RunningStage.TRAINING)
    assert updated.sampler is sampler and updated.batch_size == 2 and list(updated)[0].tolist() == [0, 1]
    states = private.collect_rng_states(include_cuda=False)
    expected = torch.rand(3)
    private.set_rng_states(states)
    assert torch.equal(torch.rand(3), expected)


class _Tiny(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.layer = torch.nn.Linear(2, 1)

    def training_step(self, batch, batch_idx):
        return self.layer(batch).sum()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


class _Probe(L.Callback):
    """Reads every fit-loop accessor at each training batch, on the main thread with Lightning's handlers in place."""

    def __init__(self):
        self.seen = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        collective = private.collective_signal_handlers(trainer)
        handlers = private.composed_signal_handlers(signal.SIGTERM) or []
        self.seen.append(SimpleNamespace(
            accumulate=private.should_accumulate(trainer),
            progress=private.epoch_batch_progress(trainer),
            epoch=private.epochs_processed(trainer),
            notifier_installed=any(getattr(h, "__func__", None) in collective for h in handlers),
            hpc_path=private.hpc_save_path(trainer),
        ))


def test_fit_loop_and_signal_internals(tmp_path):
    probe = _Probe()
    trainer = L.Trainer(accelerator="cpu", devices=1, max_epochs=2, limit_train_batches=2, accumulate_grad_batches=2,
                        logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, callbacks=[probe], default_root_dir=tmp_path)
    trainer.fit(_Tiny(), DataLoader(torch.randn(4, 2), batch_size=1))
    assert [s.accumulate for s in probe.seen] == [True, False, True, False]
    # `is_last_batch` is set right after the fetch (the fetcher looks one batch ahead), before the batch's hooks.
    assert [s.progress for s in probe.seen] == [(0, False), (1, True), (0, False), (1, True)]
    assert [s.epoch for s in probe.seen] == [0, 0, 1, 1]
    assert all(s.notifier_installed for s in probe.seen)
    assert probe.seen[0].hpc_path == str(tmp_path / "hpc_ckpt_1.ckpt")
    fit = trainer.fit_loop.state_dict()
    for key in (private.FIT_LOOP_EPOCH_PROGRESS, private.FIT_LOOP_BATCH_PROGRESS):
        for scope in ("total", "current"):
            assert set(fit[key][scope]) == set(private.PROGRESS_COUNTERS), key
    assert "is_last_batch" in fit[private.FIT_LOOP_BATCH_PROGRESS]
    # The epoch's position counted in other batches: every counter moved alike (a resume's translation, FSDP2).
    progress = trainer.fit_loop.epoch_loop.batch_progress
    progress.current.completed -= 1  # as a save in on_train_batch_end leaves it
    before = {scope: vars(getattr(progress, scope)).copy() for scope in ("current", "total")}
    private.count_epoch_batches_as(trainer, progress.current.processed + 3)
    for scope in ("current", "total"):
        assert vars(getattr(progress, scope)) == {name: value + 3 for name, value in before[scope].items()}, scope
    assert not trainer.received_sigterm
    private.flag_sigterm(trainer)
    assert trainer.received_sigterm


def test_inference_and_training_engines_get_lightnings_arguments_plus_mpu(monkeypatch):
    """The strategy's two `deepspeed.initialize` calls pass what Lightning's pass, plus `mpu` and a device rank."""
    import deepspeed

    calls = []
    monkeypatch.setattr(deepspeed, "initialize", lambda **kwargs: calls.append(kwargs) or (kwargs["model"], "opt", 0, 0))
    ours = UlyssesDeepSpeedStrategy(sequence_parallel_size=1, stage=3)
    ours.runtime.parallel.groups = SimpleNamespace(sequence_parallel_world_size=1)
    lightnings = DeepSpeedStrategy(stage=3)
    for strategy in (lightnings, ours):
        strategy.parallel_devices = [torch.device("cpu")]
        model = torch.nn.Linear(2, 2)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        strategy._setup_model_and_optimizer(model, optimizer)
        strategy._initialize_deepspeed_inference(model)
    (lightning_train, lightning_eval), (our_train, our_eval) = calls[:2], calls[2:]
    for theirs, mine in ((lightning_train, our_train), (lightning_eval, our_eval)):
        assert set(mine) == set(theirs) | {"mpu"} and mine["mpu"] is None
        assert theirs["args"].device_rank is None and mine["args"].device_rank == 0  # CPU: the local rank
        for key in set(theirs) - {"args", "model", "optimizer", "model_parameters"}:
            assert mine[key] == theirs[key], key
        assert len(list(mine["model_parameters"])) == len(list(theirs["model_parameters"]))
    assert our_eval["config"]["zero_optimization"]["stage"] == 3
