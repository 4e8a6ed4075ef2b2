"""The recipes' training setup without processes: learning-rate schedules, weight-decay groups, the progress bar's
totals, auto-resume and loggers (the quiet console: tests/unit/test_console.py)."""

from __future__ import annotations

import logging
import math
import os
import re
import sys
import shlex
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from lightning.fabric.plugins.environments import LightningEnvironment, SLURMEnvironment
from lightning.pytorch.callbacks import ModelCheckpoint
from omegaconf import OmegaConf

from lightning_ulysses.integration.callbacks import TrainingProgressBar, planned_epochs
from lightning_ulysses.integration.faults import EXIT_PREEMPTED
from lightning_ulysses.models.gpt import GPTConfig
from lightning_ulysses.recipe.driver import (ResumeDecision, build_loggers, continue_command, end_preempted_run,
                                             resume_decision, resume_from)
from lightning_ulysses.training.optim import LRSchedule, parameter_groups, schedule_config
from tests.unit.test_checkpoint import save


def test_schedule_factors_by_hand():
    cosine = LRSchedule("cosine", warmup_steps=4, min_lr_ratio=0.1, total_steps=12)
    assert [cosine(s) for s in range(4)] == [0.25, 0.5, 0.75, 1.0]
    assert cosine(8) == pytest.approx(0.1 + 0.9 * 0.5)  # half-way through the decay: cos(pi/2) = 0
    assert cosine(12) == pytest.approx(0.1) and cosine(50) == pytest.approx(0.1)  # the floor after the end
    linear = LRSchedule("linear", warmup_steps=0, min_lr_ratio=0.0, total_steps=10)
    assert [linear(s) for s in (0, 5, 10)] == [1.0, 0.5, 0.0]
    assert LRSchedule("constant", warmup_steps=2)(1) == 1.0 and LRSchedule("constant")(10**6) == 1.0
    with pytest.raises(ValueError, match="model.schedule.total_steps"):
        LRSchedule("cosine").resolved(math.inf)
    with pytest.raises(ValueError, match="constant, cosine or linear"):
        LRSchedule("exponential")


def test_schedule_state_resumes_the_curve_it_started_on():
    """A scheduler rebuilt for a resume (here with another trainer length) takes the saved step and total."""
    def scheduler(max_steps):
        optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=2.0)
        config = schedule_config(optimizer, LRSchedule("cosine", warmup_steps=2),
                                 SimpleNamespace(estimated_stepping_batches=max_steps))
        assert config["lr_scheduler"]["interval"] == "step"
        return optimizer, config["lr_scheduler"]["scheduler"]

    optimizer, first = scheduler(10)
    seen = []
    for _ in range(10):
        seen.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        first.step()
        if len(seen) == 4:
            state = first.state_dict()
    assert seen == [2.0 * LRSchedule("cosine", 2, 0.0, 10)(s) for s in range(10)]
    optimizer, resumed = scheduler(1000)
    resumed.load_state_dict(state)
    resumed_lrs = []
    for _ in range(6):
        optimizer.step()
        resumed.step()
        resumed_lrs.append(optimizer.param_groups[0]["lr"])
    assert resumed_lrs == pytest.approx(seen[5:] + [2.0 * 0.0])


def _names(module, groups):
    names = {id(p): n for n, p in module.named_parameters()}
    return [(group["weight_decay"], sorted(names[id(p)] for p in group["params"])) for group in groups]


def test_no_weight_decay_on_norms_and_biases_frozen_left_out():
    model = GPTConfig(vocab_size=16, hidden_size=8, num_layers=1, num_heads=2).build()
    model.blocks[0].mlp.requires_grad_(False)
    names = dict(model.named_parameters())
    frozen = {n for n, p in names.items() if not p.requires_grad}
    assert frozen, "the test needs frozen parameters"
    (decay, decayed), (no_decay, exempt) = _names(model, parameter_groups(model, 0.1))
    assert (decay, no_decay) == (0.1, 0.0)
    assert set(exempt) == {n for n, p in names.items() if p.requires_grad and p.ndim < 2} and exempt
    assert set(decayed) == {n for n, p in names.items() if p.requires_grad and p.ndim >= 2} and decayed
    assert all("norm" in n or n.endswith("bias") for n in exempt)
    assert not frozen & set(decayed + exempt)


def test_groups_read_the_real_shape_of_zero3_partitions():
    """Under ZeRO-3 `configure_optimizers` sees `p.shape == [0]` (`deepspeed.zero.Init` partitioned it) and the real
    shape in `p.ds_shape`; by `p.shape` every parameter would look 1-D and lose its weight decay."""
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LayerNorm(4))
    for parameter in model.parameters():
        parameter.ds_shape = parameter.shape
        parameter.data = torch.empty(0)
    assert _names(model, parameter_groups(model, 0.1)) == [(0.1, ["0.weight"]),
                                                             (0.0, ["0.bias", "1.bias", "1.weight"])]


def test_tied_parameters_appear_once():
    embedding = torch.nn.Embedding(16, 8)
    head = torch.nn.Linear(8, 16, bias=False)
    head.weight = embedding.weight
    model = torch.nn.ModuleDict({"embedding": embedding, "head": head})
    groups = parameter_groups(model, 0.1)
    assert [len(group["params"]) for group in groups] == [1]


def test_module_steps_with_cpu_adam_where_the_strategy_offloads_the_optimizer():
    """DeepSpeed refuses torch's AdamW for its optimizer offload, which `memory="auto"` may switch on: the recipes'
    module then builds DeepSpeed's CPU Adam in AdamW mode with the same groups, and it makes the same update."""
    from deepspeed.ops.adam import DeepSpeedCPUAdam

    from lightning_ulysses.models import CausalLMModule

    spec = GPTConfig(vocab_size=16, hidden_size=8, num_layers=1, num_heads=2)
    torch.manual_seed(0)
    modules = []
    for device in (None, "cpu"):
        module = CausalLMModule(spec, learning_rate=0.1, weight_decay=0.1)
        module.configure_model()
        module.load_state_dict(modules[0].state_dict()) if modules else None
        strategy = SimpleNamespace(config={"zero_optimization": {"offload_optimizer": {"device": device}}})
        module.trainer = SimpleNamespace(strategy=strategy, lightning_module=module)
        modules.append(module)
    optimizers = [module.configure_optimizers() for module in modules]
    assert type(optimizers[0]) is torch.optim.AdamW and isinstance(optimizers[1], DeepSpeedCPUAdam)
    assert [g["weight_decay"] for g in optimizers[1].param_groups] == [0.1, 0.0]
    start = [p.detach().clone() for p in modules[0].parameters()]
    tokens = torch.arange(8).view(1, 8) % 16
    for module, optimizer in zip(modules, optimizers):
        for _ in range(2):
            optimizer.zero_grad()
            module.model(input_ids=tokens, labels=tokens).loss.backward()
            optimizer.step()
    for a, b, before in zip(modules[0].parameters(), modules[1].parameters(), start):
        # The same update, to 1e-3 of the tensor's largest step: where an element's gradient is near zero, Adam's step
        # (m / (sqrt(v) + eps)) turns the two implementations' rounding into up to 1e-3 of that element's own step
        # (measured 1.5e-4 and 7e-4 on random draws; an element-wise 1e-4 failed one run in three).
        update = a - before
        torch.testing.assert_close(b - before, update, rtol=0, atol=1e-3 * update.abs().max().item())
    assert any(not torch.equal(a, before) for a, before in zip(modules[0].parameters(), start))


def _fake_trainer(max_steps, batches, accumulate=1, max_epochs=-1, global_step=0, epoch_batches=0):
    progress = SimpleNamespace(current=SimpleNamespace(processed=epoch_batches), is_last_batch=False)
    return SimpleNamespace(max_steps=max_steps, max_epochs=max_epochs, num_training_batches=batches,
                           accumulate_grad_batches=accumulate, global_step=global_step, is_global_zero=True,
                           fit_loop=SimpleNamespace(epoch_loop=SimpleNamespace(batch_progress=progress)))


def test_progress_bar_totals_of_a_max_steps_run():
    assert planned_epochs(_fake_trainer(400, 2048)) == 1
    assert planned_epochs(_fake_trainer(400, 100)) == 4
    assert planned_epochs(_fake_trainer(400, 100, accumulate=3)) == 12  # 34 optimizer steps per epoch
    assert planned_epochs(_fake_trainer(-1, 100, max_epochs=5)) == 5
    assert planned_epochs(_fake_trainer(-1, math.inf)) is None
    bar = TrainingProgressBar()
    bar.setup(_fake_trainer(400, 2048, accumulate=2, global_step=100), None, "fit")
    assert bar._get_train_description(0).strip() == "Epoch 0/0"  # Lightning's own: "Epoch 0/-2"
    assert bar.total_train_batches == 600  # micro-batches of the 300 steps left
    bar.setup(_fake_trainer(400, 100), None, "fit")
    assert bar._get_train_description(2).strip() == "Epoch 2/3" and bar.total_train_batches == 100


def test_progress_bar_counts_the_epoch_from_its_start_after_a_resume_in_its_middle(monkeypatch):
    """Resumed after 399 steps of an epoch of 2048 batches, with 250 to go, the bar is first drawn at the end of the
    first batch: batch 400 of the epoch's 649 (Lightning's own: `400/249`, the steps left). At an epoch's start
    Lightning's batch counter still holds the previous epoch's count: the epoch starts at 0."""
    from lightning.pytorch.callbacks import RichProgressBar

    bar = TrainingProgressBar()
    bar.setup(_fake_trainer(649, 2048, global_step=400, epoch_batches=400), None, "fit")
    assert bar.total_train_batches == 649
    # with accumulation 4, in the middle of a window: 100 steps done (batches 0-399), batch 400 opens the next
    bar.setup(_fake_trainer(150, 2048, accumulate=4, global_step=100, epoch_batches=401), None, "fit")
    assert bar.total_train_batches == 600  # the window of batch 400 and 49 more: batches 400-599
    # the last epoch, 52 steps: as it starts, the counter still says 2048 (the epoch before)
    bar.setup(_fake_trainer(2100, 2048, global_step=2048, epoch_batches=2048), None, "fit")
    drawn = []
    monkeypatch.setattr(RichProgressBar, "on_train_epoch_start",
                        lambda self, trainer, module: drawn.append(self.total_train_batches))
    bar.on_train_epoch_start(bar.trainer, None)
    assert drawn == [52]


def test_the_strategy_corrects_lightnings_default_bar_and_leaves_others(tmp_path):
    import lightning as L
    from lightning.pytorch.callbacks import RichProgressBar, TQDMProgressBar
    from lightning.pytorch.callbacks.progress.rich_progress import RichProgressBarTheme

    from lightning_ulysses.integration.callbacks import correct_progress_bar

    trainer = L.Trainer(accelerator="cpu", logger=False, default_root_dir=tmp_path)
    correct_progress_bar(trainer)
    assert type(trainer.progress_bar_callback) is TrainingProgressBar
    themed = RichProgressBar(leave=True, theme=RichProgressBarTheme(description="green"))
    trainer = L.Trainer(accelerator="cpu", logger=False, default_root_dir=tmp_path, callbacks=[themed])
    correct_progress_bar(trainer)
    assert trainer.progress_bar_callback is themed and type(themed) is TrainingProgressBar
    assert themed.theme.description == "green" and themed._leave  # the settings it was made with

    class Mine(RichProgressBar):
        pass

    for bar in (Mine(), TQDMProgressBar()):
        trainer = L.Trainer(accelerator="cpu", logger=False, default_root_dir=tmp_path, callbacks=[bar])
        correct_progress_bar(trainer)
        assert trainer.progress_bar_callback is bar and type(bar) in (Mine, TQDMProgressBar)


def test_auto_resume_takes_the_newest_checkpoint_of_the_run_whatever_saved_it(tmp_path, monkeypatch):
    """`resume=auto` continues from the checkpoint with the highest global step in the run's checkpoint folders and
    the run folder: `last.ckpt`, numbered saves (every n steps, epoch ends), a scheduler signal's `hpc_ckpt_<n>.ckpt`,
    a save interrupted between its renames (its complete `.previous`), another strategy's single file; by step,
    not by file time; never a staging folder or an interrupted save (named in the line it prints). `resume=null` is
    refused where Lightning would resume anyway (SLURM, a signal's save in the run folder)."""
    run, checkpoints = tmp_path, tmp_path / "checkpoints"
    callbacks = [ModelCheckpoint(dirpath=checkpoints, save_last=True)]

    def newest():
        return resume_from("auto", callbacks, run)[0]

    assert resume_from("auto", callbacks, run) == (
        None, f"resume=auto: no complete checkpoint in {checkpoints}, {run}: starting afresh")
    save(checkpoints / "last.ckpt", 3, recorded=True)
    assert newest() == str(checkpoints / "last.ckpt")
    save(checkpoints / "epoch=0-step=6.ckpt", 6)  # every n steps (its step only in the shards: an older manifest)
    assert newest() == str(checkpoints / "epoch=0-step=6.ckpt")
    save(run / "hpc_ckpt_1.ckpt", 8, recorded=True)  # SIGTERM, in the run folder (the Trainer's default_root_dir)
    assert resume_from("auto", callbacks, run) == (
        str(run / "hpc_ckpt_1.ckpt"), f"resume=auto: continuing from {run / 'hpc_ckpt_1.ckpt'} at step 8")
    save(checkpoints / "epoch=1-step=10.ckpt", 10, recorded=True)  # an epoch end, then interrupted between renames
    (checkpoints / "epoch=1-step=10.ckpt").rename(checkpoints / "epoch=1-step=10.ckpt.previous")
    assert newest() == str(checkpoints / "epoch=1-step=10.ckpt")  # as fit takes it: the load resolves `.previous`
    # Newer files of less progress lose: a re-saved `last.ckpt` at step 4 (a rewound run), saved last.
    save(checkpoints / "last.ckpt", 4, recorded=True)
    assert newest() == str(checkpoints / "epoch=1-step=10.ckpt")
    # Never an unfinished save, however far it got: a folder without manifest beside its staging folder, a staging
    # folder alone, a truncated single file.
    save(checkpoints / "epoch=2-step=12.ckpt", 12, recorded=True)
    (checkpoints / "epoch=2-step=12.ckpt" / "ulysses.json").unlink()
    (checkpoints / "epoch=2-step=12.ckpt.partial").mkdir()
    (checkpoints / "epoch=2-step=14.ckpt.partial").mkdir()
    (run / "truncated.ckpt").write_bytes(b"PK\x03\x04")
    assert resume_from("auto", callbacks, run) == (
        str(checkpoints / "epoch=1-step=10.ckpt"),
        f"resume=auto: continuing from {checkpoints / 'epoch=1-step=10.ckpt'} at step 10 (passed over as incomplete:"
        f" {checkpoints / 'epoch=2-step=12.ckpt'}, {run / 'truncated.ckpt'})")
    torch.save({"global_step": 11, "state_dict": {}}, run / "other.ckpt")  # a single-file checkpoint
    assert newest() == str(run / "other.ckpt")
    save(checkpoints / "last.ckpt", 11, recorded=True)  # the same step: the later save
    os.utime(run / "other.ckpt", (1, 1))
    assert newest() == str(checkpoints / "last.ckpt")

    assert resume_from(None, callbacks, run) == (None, "resume=null: starting afresh")
    with monkeypatch.context() as slurm:  # where Lightning itself resumes from the run folder's hpc_ckpt_<n>.ckpt
        slurm.setattr(SLURMEnvironment, "detect", staticmethod(lambda: True))
        with pytest.raises(ValueError, match="under SLURM Lightning resumes from it whatever the recipe asks"):
            resume_from(None, callbacks, run)
        assert resume_from(None, callbacks, tmp_path / "new_run") == (None, "resume=null: starting afresh")
    assert resume_from(str(run / "hpc_ckpt_1.ckpt"), [], run) == (
        str(run / "hpc_ckpt_1.ckpt"), f"resume: continuing from {run / 'hpc_ckpt_1.ckpt'} at step 8")
    assert resume_from("/elsewhere/step-10.ckpt", [], run) == (
        "/elsewhere/step-10.ckpt", "resume: continuing from /elsewhere/step-10.ckpt")  # Lightning's load refuses it
    assert resume_from("auto", [], tmp_path / "elsewhere")[0] is None  # checkpointing off, no signal's save


def test_ranks_started_by_the_launching_process_take_its_resume_decision(tmp_path, monkeypatch):
    """Under `-m` Lightning's re-run of the script for rank 1 has a run folder of its own: it must not decide; only
    the launching process says where training starts."""
    monkeypatch.delenv("LIGHTNING_ULYSSES_RESUME_FROM", raising=False)
    save(tmp_path / "checkpoints" / "last.ckpt", 2, recorded=True)
    launching = [ModelCheckpoint(dirpath=tmp_path / "checkpoints")]
    said = []
    with resume_decision("auto", launching, tmp_path, announce=said.append) as decision:
        assert decision.path == str(tmp_path / "checkpoints" / "last.ckpt")
        assert not decision.started_by_launching_process
        with resume_decision("auto", [ModelCheckpoint(dirpath=tmp_path / "elsewhere")], tmp_path / "elsewhere",
                             announce=said.append) as started:  # rank 1
            assert started.path == decision.path and started.started_by_launching_process
    assert said == [f"resume=auto: continuing from {tmp_path / 'checkpoints' / 'last.ckpt'} at step 2"]
    assert "LIGHTNING_ULYSSES_RESUME_FROM" not in os.environ  # a later run in this process decides afresh
    with resume_decision(None, launching, tmp_path, announce=said.append) as decision:
        with resume_decision("auto", launching, tmp_path, announce=said.append) as started:
            assert decision.path is None and started.path is None
    assert said[1:] == ["resume=null: starting afresh"]


def test_the_continue_command_is_the_same_command_with_the_run_named_and_resume_auto():
    python, script = "/venv/bin/python", "recipes/train.py"
    command = continue_command([script, "trainer.max_steps=50", "resume=/old/step-3.ckpt", "+callbacks.x=1"],
                               "2026-12-03/13-15-44", executable=python)
    assert shlex.split(command) == [python, script, "trainer.max_steps=50", "+callbacks.x=1",
                                    "run_name=2026-12-03/13-15-44", "resume=auto"]
    # A run the user named keeps its name as typed; a name Hydra would misread is quoted for Hydra, then for the shell.
    assert shlex.split(continue_command([script, "run_name=my_run", "++resume=null"], "my_run", python)) == [
        python, script, "run_name=my_run", "resume=auto"]
    quoted = shlex.split(continue_command([script], "it's a run", python))[2]
    assert quoted == "run_name='it\\'s a run'"
    from hydra.core.override_parser.overrides_parser import OverridesParser

    assert OverridesParser.create().parse_override(quoted).value() == "it's a run"
    # A sweep: every job resumes its own folder under the same sweep folder.
    assert shlex.split(continue_command([script, "-m", "data.seq_len=64,128", "hydra.sweep.dir=multirun/x"], "r",
                                        python, sweep_dir="/abs/multirun/x")) == [
        python, script, "-m", "data.seq_len=64,128", "hydra.sweep.dir=/abs/multirun/x", "resume=auto"]


def test_a_preempted_run_exits_non_zero_except_ranks_the_launching_process_started(tmp_path, capsys):
    """Lightning's script launcher SIGKILLs every process, itself included, when a rank it started exits non-zero:
    those exit 0; every other process (the launching one, ranks torchrun or srun started) exits `EXIT_PREEMPTED`, the
    launching one once its ranks have ended, and global rank 0 prints the command that continues the run."""
    import subprocess
    import sys

    save(tmp_path / "hpc_ckpt_1.ckpt", 5, recorded=True)
    rank = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(0.2)"])
    strategy = SimpleNamespace(launcher=SimpleNamespace(procs=[rank]), cluster_environment=LightningEnvironment())
    trainer = SimpleNamespace(strategy=strategy, is_global_zero=True, global_step=5)
    started = ResumeDecision("x", started_by_launching_process=True)
    assert end_preempted_run(trainer, started, "python recipes/train.py run_name=r resume=auto", [], tmp_path) == 0
    assert rank.poll() is None and capsys.readouterr().out == ""  # a started rank neither waits nor prints
    launching = ResumeDecision(None, started_by_launching_process=False)
    assert end_preempted_run(trainer, launching, "python recipes/train.py run_name=r resume=auto", [],
                             tmp_path) == EXIT_PREEMPTED != 0
    assert rank.returncode == 0  # waited for
    printed = capsys.readouterr().out
    assert (f"Preempted at step 5 by a scheduler's signal: the newest checkpoint of the run is"
            f" {tmp_path / 'hpc_ckpt_1.ckpt'} (step 5); exit status {EXIT_PREEMPTED} (not finished)") in printed
    assert printed.endswith("\n  python recipes/train.py run_name=r resume=auto\n") and "SLURM" not in printed
    strategy.launcher, strategy.cluster_environment = None, SLURMEnvironment(auto_requeue=True)  # srun started it
    assert end_preempted_run(trainer, launching, "c", [], tmp_path) == EXIT_PREEMPTED
    printed = capsys.readouterr().out
    assert f"the requeued job runs the same command, whose run folder is this one ({tmp_path}" in printed


def test_an_unnamed_run_under_slurm_is_keyed_by_the_job_so_its_requeue_finds_the_checkpoint(tmp_path, monkeypatch):
    """The recipes' unnamed run folder was `outputs/<date>/<time>`: a requeued SLURM job (the same job script, the same
    job id, later) made a new one and started afresh. Under SLURM it is `slurm-<job>/<digest of the overrides>`:
    the requeued command finds the preempted run's folder and resumes from its checkpoint; another command of the
    same job, or another job, gets its own; outside SLURM the date and time stay."""
    from hydra import compose, initialize_config_dir

    from lightning_ulysses.recipe.config import default_run_name, register_resolvers

    command = ["recipes/train.py", "trainer.max_steps=6", "data.seq_len=64"]
    for name in ("SLURM_JOB_ID", "SLURM_ARRAY_JOB_ID", "SLURM_ARRAY_TASK_ID"):
        monkeypatch.delenv(name, raising=False)
    assert re.fullmatch(r"\d{4}-\d\d-\d\d/\d\d-\d\d-\d\d", default_run_name(command))
    monkeypatch.setenv("SLURM_JOB_ID", "4242")  # what SLURM sets in the job, and again in its requeued run
    first = default_run_name(command)
    assert re.fullmatch(r"slurm-4242/[0-9a-f]{8}", first)
    # The requeued job runs the job script's command as it was; resume and Hydra's own arguments change nothing.
    assert default_run_name([*command, "resume=auto", "hydra.run.dir=x"]) == first
    assert default_run_name([*command[:2], "data.seq_len=128"]) != first  # another command of the same job
    monkeypatch.setenv("SLURM_JOB_ID", "4243")
    assert default_run_name(command) != first
    monkeypatch.setenv("SLURM_ARRAY_JOB_ID", "4000")
    monkeypatch.setenv("SLURM_ARRAY_TASK_ID", "7")
    assert default_run_name(command).startswith("slurm-4000_7/")
    # Through the recipe's config, as Hydra resolves the run folder (outputs/${run_name}).
    monkeypatch.delenv("SLURM_ARRAY_JOB_ID")
    monkeypatch.setenv("SLURM_JOB_ID", "4242")
    monkeypatch.setattr(sys, "argv", command)
    register_resolvers()
    with initialize_config_dir(config_dir=str(Path(__file__).resolve().parents[2] / "conf"), version_base="1.3"):
        assert compose(config_name="train", overrides=command[1:]).run_name == first
    run_dir = tmp_path / "outputs" / first
    save(run_dir / "hpc_ckpt_1.ckpt", 5, recorded=True)  # where the preempted launch saved
    path, line = resume_from("auto", [], run_dir)
    assert path == str(run_dir / "hpc_ckpt_1.ckpt") and line.endswith("at step 5")


def test_loggers_csv_always_others_when_installed(tmp_path, caplog, monkeypatch):
    import importlib.util

    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)  # nothing optional installed
    with caplog.at_level(logging.INFO):
        auto = build_loggers(OmegaConf.create({"tensorboard": "auto", "wandb": False}), tmp_path, "run")
    assert [type(logger).__name__ for logger in auto] == ["CSVLogger"] and not caplog.records
    with caplog.at_level(logging.INFO):
        asked = build_loggers(OmegaConf.create({"tensorboard": True, "wandb": True}), tmp_path, "run")
    assert [type(logger).__name__ for logger in asked] == ["CSVLogger"]
    notes = [record.getMessage() for record in caplog.records]
    assert len(notes) == 2 and "loggers.tensorboard=true but tensorboard or tensorboardX is not installed" in notes[0]
    assert "loggers.wandb=true but wandb is not installed" in notes[1]
