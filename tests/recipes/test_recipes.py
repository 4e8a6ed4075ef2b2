"""The Hydra recipes: every config composes and instantiates; plans; overrides; the README's main job."""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from hydra import compose, initialize_config_dir
from hydra.utils import instantiate

from lightning_ulysses.recipe.config import register_resolvers
from lightning_ulysses.recipe.driver import plan
from lightning_ulysses.training.optim import LRSchedule
from tests.console_noise import third_party_noise
from tests.distributed.harness import run_script

ROOT = Path(__file__).resolve().parents[2]
CONF = ROOT / "conf"
EXPERIMENTS = sorted(p.stem for p in (CONF / "experiment").glob("*.yaml"))
GROUP_OPTIONS = [(group, p.stem) for group in ("model", "schedule", "data", "strategy", "trainer")
                 for p in sorted((CONF / group).glob("*.yaml"))]
REQUIRED = {"text": ["data.paths=[README.md]"], "tokens": ["data.path=/nonexistent.bin"]}


def _compose(overrides: list[str]):
    register_resolvers()
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return compose(config_name="train", overrides=overrides)


def _instantiate_everything(cfg) -> None:
    module = instantiate(cfg.model)
    assert module.spec.num_parameters() > 0  # big models are built on the meta device only
    instantiate(cfg.data)
    instantiate(cfg.strategy)
    # GPU and multi-node trainers are instantiated as CPU ones here: the point is that every key is valid.
    instantiate(cfg.trainer, accelerator="cpu", devices=1, num_nodes=1, logger=False)


# Experiments that start from a user's model folder and data files: given the tiny ones of `finetune_folder`.
FINETUNE_DATA = {"finetune_cpu": "text", "llama8b_extend_128k": "text", "sft_long_chat": "chat"}


@pytest.mark.parametrize("experiment", EXPERIMENTS)
def test_every_experiment_composes_and_instantiates(experiment, request):
    required = []
    if experiment in FINETUNE_DATA:
        folder = request.getfixturevalue("finetune_folder")
        required = [f"model.pretrained={folder.model}", f"data.files={getattr(folder, FINETUNE_DATA[experiment])}"]
    _instantiate_everything(_compose([f"experiment={experiment}", *required]))


@pytest.fixture(scope="session")
def tiny_pretrained(tmp_path_factory) -> Path:
    """A tiny Llama saved with `save_pretrained` (offline, a second), and the model itself."""
    from tests.distributed.common import PRETRAINED_SEED, tiny_llama

    folder = tmp_path_factory.mktemp("tiny_pretrained")
    model = tiny_llama(2, seed=PRETRAINED_SEED)
    model.save_pretrained(folder)
    return SimpleNamespace(folder=folder, model=model)


@pytest.mark.parametrize("group, option", GROUP_OPTIONS, ids=[f"{g}={o}" for g, o in GROUP_OPTIONS])
def test_every_group_option_composes_and_instantiates(group, option, request):
    required = REQUIRED.get(option, [])
    if option == "hf_pretrained":
        required = [f"model.pretrained={request.getfixturevalue('tiny_pretrained').folder}"]
    if option == "hf_dataset":
        folder = request.getfixturevalue("finetune_folder")  # tests/recipes/conftest.py
        required = [f"data.files={folder.text}", f"data.tokenizer={folder.model}"]
    _instantiate_everything(_compose([f"{group}={option}", *required]))


def test_hf_dataset_tokenizer_is_the_pretrained_folder_and_null_without_one():
    """`data.tokenizer` defaults to `model.pretrained`, and still composes (as null) for models without a folder."""
    assert _compose(["data=hf_dataset", "data.files=x.jsonl"]).data.tokenizer is None
    cfg = _compose(["model=hf_pretrained", "model.pretrained=/models/x", "data=hf_dataset", "data.files=x.jsonl"])
    assert cfg.data.tokenizer == "/models/x"


def test_hf_pretrained_starts_from_the_pretrained_weights(tiny_pretrained):
    """`model=hf_pretrained model.pretrained=<folder>`: configure_model loads the folder's weights (the same logits),
    in training mode; `rope_scaling` and `config` change the loaded config and keep the checkpoint's `rope_theta`.
    (Under the strategy's ZeRO-3, the same load into partitions: tests/distributed/test_parity.py `-pretrained`.)"""
    folder, saved = tiny_pretrained.folder, tiny_pretrained.model
    cfg = _compose(["model=hf_pretrained", f"model.pretrained={folder}"])
    assert "PretrainedCausalLM" in plan(cfg)  # plan=true reads the folder's config only
    module = instantiate(cfg.model)
    module.configure_model()
    assert module.model.training
    tokens = torch.arange(24).reshape(2, 12)
    with torch.no_grad():
        assert torch.equal(module.model(input_ids=tokens).logits, saved.eval()(input_ids=tokens).logits)

    extended = instantiate(_compose([
        "model=hf_pretrained", f"model.pretrained={folder}", "model.config={max_position_embeddings: 512}",
        "model.rope_scaling={rope_type: yarn, factor: 4.0, original_max_position_embeddings: 128}"]).model)
    config = extended.spec.config
    assert config.max_position_embeddings == 512
    assert config.rope_parameters == {"rope_theta": saved.config.rope_parameters["rope_theta"], "rope_type": "yarn",
                                      "factor": 4.0, "original_max_position_embeddings": 128}
    extended.configure_model()
    assert extended.model.model.rotary_emb.rope_type == "yarn"
    weights = dict(saved.state_dict())
    assert all(torch.equal(value, weights[name]) for name, value in extended.model.state_dict().items())


def _env() -> dict:
    # this checkout's package first; what PYTHONPATH held stays after it (e.g. a newer library installed to one side),
    # as for the launched ranks (tests/distributed/harness.py)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
               OMP_NUM_THREADS="1")
    env.setdefault("TORCH_EXTENSIONS_DIR", str(ROOT / ".cache" / "torch_extensions"))
    return env


def _recipe(*overrides: str, timeout: float = 60, fresh: bool = False) -> subprocess.CompletedProcess:
    """`python recipes/train.py <overrides>`, its output captured. Its first process is forked from the server that
    imported the libraries once (tests/distributed/harness.py run_script: ~15 s of CPU less per run); `fresh`: a new
    interpreter, for the tests that pin what a user's own command prints and does from its very start."""
    command = [str(ROOT / "recipes" / "train.py"), *overrides]
    if fresh:
        return subprocess.run([sys.executable, *command], env=_env(), cwd=ROOT, capture_output=True, text=True,
                              timeout=timeout)
    return run_script(Path(command[0]), command[1:], _env(), ROOT, timeout)


PLANS = [
    (["experiment=gpt3_176b_32k"], 175.0, "dp(4) × sp(8) = world_size(32)"),
    (["experiment=gpt3_176b_32k", "model=bloom_176b"], 176.0, "dp(4) × sp(8) = world_size(32)"),
    (["experiment=gpt3_176b_32k", "strategy.sequence_parallel_size=16", "trainer.num_nodes=8"], 175.0,
     "dp(4) × sp(16) = world_size(64)"),
]
ONE_GPU_PLAN = ["experiment=llama8b_360k_one_gpu", "plan=true"]
BAD_OVERRIDES = [
    (["strategy.sequence_parallel_size=3"], "sp(3) does not divide world_size(2)"),
    (["model.model.hidden_size=48", "model.model.num_heads=6", "model.model.num_key_value_heads=3"],
     "num_key_value_heads(3) and sequence_parallel_size(2) must divide one another"),
    (["strategy.sequence_padding=error", "data.seq_len=127"], "data.seq_len=127 is not divisible"),
    (["model=gpt_huge"], "Could not find 'model/gpt_huge'"),
    (["experiment=llama8b_360k_one_gpu", "schedule=cosine"], "schedule cosine (warmup 100) would not apply"),
    # A first fine-tune without its model and data, or with a mistyped folder (tests/recipes/test_finetune.py has
    # every message of check_before_run): the message, not Hugging Face's "Repo id must be in the form ...".
    (["experiment=finetune_cpu"], "error: experiment=finetune_cpu needs model.pretrained and data.files"),
    (["experiment=finetune_cpu", "model.pretrained=/nonexistent/model", "data.files=x.jsonl"],
     "error: model.pretrained=/nonexistent/model: the folder /nonexistent/model does not exist."),
]


@pytest.fixture(scope="module")
def in_one_process(tmp_path_factory):
    """The command lines that start no rank (plans, refused overrides), run one after the other in ONE process
    (run_recipes.py: each exactly as `python recipes/train.py <overrides>`, its own stdout, stderr and exit status),
    so that the interpreter and its imports start once (forked from the server that made them, harness.run_script).
    Keyed by the overrides, without hydra.run.dir."""
    outdir = tmp_path_factory.mktemp("recipes_in_one_process")
    runs = [[*overrides, "plan=true"] for overrides, _, _ in PLANS] + [ONE_GPU_PLAN]
    runs += [overrides for overrides, _ in BAD_OVERRIDES]
    run_dirs = [tmp_path_factory.mktemp("run") / "run" for _ in runs]  # not made yet: Hydra makes a run's folder
    (outdir / "runs.json").write_text(json.dumps(
        [[*overrides, f"hydra.run.dir={run_dir}"] for overrides, run_dir in zip(runs, run_dirs)]))
    driver = run_script(Path(__file__).parent / "run_recipes.py", [str(outdir / "runs.json"), str(outdir)], _env(), ROOT,
                        timeout=60 * len(runs))
    assert driver.returncode == 0, driver.stdout[-3000:] + driver.stderr[-3000:]
    codes = json.loads((outdir / "results.json").read_text())
    return {tuple(overrides): SimpleNamespace(returncode=code["returncode"], stdout=(outdir / f"{i}.out").read_text(),
                                              stderr=(outdir / f"{i}.err").read_text(), run_dir=run_dir)
            for i, (overrides, code, run_dir) in enumerate(zip(runs, codes, run_dirs))}


@pytest.mark.parametrize("experiment_overrides, billions, layout", PLANS)
def test_plan_without_hardware(in_one_process, experiment_overrides, billions, layout):
    result = in_one_process[(*experiment_overrides, "plan=true")]
    assert result.returncode == 0, result.stderr
    count = float(re.search(r"([\d.]+)B parameters", result.stdout).group(1))
    assert abs(count - billions) / billions < 0.01, result.stdout
    assert layout in result.stdout
    assert "optimizer" in result.stdout and "(100% offloaded to CPU)" in result.stdout


def test_one_gpu_360k_plan_fits_the_h200_machine(in_one_process):
    """The measured one-GPU configuration: 45% of the optimizer on the host through config_overrides (split by
    sub-group count), sparser checkpoints; the planner must find it within one H200 (139 GiB) and its host RAM."""
    result = in_one_process[tuple(ONE_GPU_PLAN)]
    assert result.returncode == 0, result.stderr
    assert "360448 tokens" in result.stdout and "(45% offloaded to CPU)" in result.stdout, result.stdout
    gpu = float(re.search(r"memory/GPU:\s+([\d.]+) GiB", result.stdout).group(1))
    host = float(re.search(r"CPU/node:\s+(\d+) GiB", result.stdout).group(1))
    assert 100 < gpu < 134 and 80 < host < 118, result.stdout  # 128.1 / 99.7 GiB in the benchmark's own plan
    assert "checkpoint_interval=4" in result.stdout


@pytest.mark.parametrize("overrides, message", BAD_OVERRIDES)
def test_bad_overrides_fail_before_training(in_one_process, overrides, message):
    """Refused with the message alone (no traceback) before Hydra made the run folder (recipe.CheckBeforeRunFolder):
    no empty run folder is left behind."""
    result = in_one_process[tuple(overrides)]
    assert result.returncode != 0
    assert message in result.stdout + result.stderr
    assert "Trainer.fit" not in result.stdout + result.stderr
    assert "Traceback" not in result.stdout + result.stderr
    assert not result.run_dir.exists()


def test_main_job_learns_across_shards(tmp_path):
    """The README's main job (experiment=tiny_cpu: 2 CPU ranks, SP 2, GPT-tiny, copy task), end to end.

    The random first half cannot be predicted by any model: its loss stays at ln 16 ≈ 2.77. The copied second
    half lives on the other SP rank from the tokens it copies, so its loss can fall below that only through
    the all-to-all; we require less than half of ln 16 (it reaches ~0.01 in this run).
    """
    result = _recipe(f"hydra.run.dir={tmp_path}", timeout=300, fresh=True)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    metrics = dict(re.findall(r"'(val/loss_\w+)': ([\d.]+)", result.stdout))
    random_half, copied_half = float(metrics["val/loss_first"]), float(metrics["val/loss_second"])
    chance = torch.log(torch.tensor(16.0)).item()
    assert random_half > 0.9 * chance
    assert copied_half < 0.5 * chance
    assert (tmp_path / "logs" / "version_0" / "metrics.csv").is_file()
    # The console (both ranks' stdout and stderr): the throughput fields by their short names and the run's real
    # epoch total, none of the third-party noise (lightning_ulysses.integration.console).
    console = result.stdout + result.stderr
    for field in ("tok/s:", "TFLOP/s:", "GiB:", "Epoch 0/0 "):
        assert field in console, field
    assert third_party_noise(console) == [], console


def test_multirun_keeps_every_rank_of_a_job_in_one_directory(tmp_path):
    """Under -m, Lightning's re-run of the script for rank 1 is a sweep of its own (with its own time-stamped
    sweep directory below); each job's DeepSpeed checkpoint shards must still land together in rank 0's job
    directory (Lightning broadcasts rank 0's checkpoint path)."""
    sweep = f"{tmp_path}/" + "${now:%H-%M-%S-%f}"
    # Forked, not fresh: what is pinned here is where the jobs' files land, not the console from its first line.
    result = _recipe("-m", "data.seq_len=64,128", "trainer.max_steps=3", "trainer.val_check_interval=3",
                     "trainer.limit_val_batches=1", f"hydra.sweep.dir={sweep}", timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    for job in ("0", "1"):
        # Rank 0's job directory is the one its logger wrote into.
        (metrics,) = tmp_path.glob(f"*/{job}/logs/version_0/metrics.csv")
        shards = sorted(p.name for p in metrics.parents[2].glob("checkpoints/*/checkpoint/*model_states.pt"))
        assert shards == ["zero_pp_rank_0_mp_rank_00_model_states.pt", "zero_pp_rank_1_mp_rank_00_model_states.pt"]


def test_hf_pretrained_recipe_trains_from_the_pretrained_weights(tiny_pretrained, tmp_path):
    """`python recipes/train.py model=hf_pretrained model.pretrained=<folder>` on 2 CPU ranks (SP 2, ZeRO-3, the
    weights loaded into the partitions in configure_model): the first logged loss is the single-process loss of the
    saved model on the first batch (Lightning's sampler: seed 0, one DP replica)."""
    from torch.utils.data import DistributedSampler

    from lightning_ulysses.data.copy_task import CopyTaskDataset

    result = _recipe("model=hf_pretrained", f"model.pretrained={tiny_pretrained.folder}", "model.report_loss_split=null",
                     "data.seq_len=32", "data.batch_size=2", "trainer.max_steps=1", "trainer.log_every_n_steps=1",
                     "trainer.limit_val_batches=0", "trainer.enable_checkpointing=false", f"hydra.run.dir={tmp_path}",
                     timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    first = _metrics(tmp_path / "logs" / "version_0" / "metrics.csv")[0]["train/loss"]
    dataset = CopyTaskDataset(4096, 32, 16, seed=0)
    indices = list(DistributedSampler(dataset, num_replicas=1, rank=0, shuffle=True, seed=0))[:2]
    input_ids = torch.stack([dataset[i]["input_ids"] for i in indices])
    with torch.no_grad():
        expected = tiny_pretrained.model(input_ids=input_ids, labels=input_ids).loss.item()
    assert abs(first - expected) < 1e-5, (first, expected)


def _metrics(csv: Path) -> dict[int, dict[str, float]]:
    """metrics.csv by optimizer step: every column that has a value at that step (rows of one step merged)."""
    import csv as csv_module

    steps: dict[int, dict[str, float]] = {}
    with open(csv) as handle:
        for row in csv_module.DictReader(handle):
            steps.setdefault(int(row["step"]), {}).update({k: float(v) for k, v in row.items() if v and k != "step"})
    return steps


def test_schedule_weight_decay_groups_auto_resume_and_preemption(tmp_path):
    """One recipe command (2 CPU ranks, SP 2, ZeRO-3, accumulation 2, warmup + cosine, a checkpoint every 3 steps)
    launched three times in one named run folder serves the training-setup claims and the preemption claims:

    - the first launch trains 6 optimizer steps: the learning rate of every optimizer step (LearningRateMonitor,
      both parameter groups) is the schedule's formula with the total from trainer.max_steps, so accumulation does
      not step it twice; the parameter groups `configure_optimizers` built on partitioned ZeRO-3 parameters
      (`p.shape` [0]) exempt exactly the norms and biases from weight decay, on both ranks;
    - then the run folder is left as a job killed after step 3 leaves it (its newest checkpoint is the numbered
      step-3 save, no `last.ckpt`), and the same command again (`resume=auto`, the default) says so and continues
      at step 3, not from warmup, with the first launch's learning rates and losses; a logger asked for but not
      installed is a one-line note, training goes on;
    - a real SIGTERM reaches that second launch's launching process at step 4 (`probes.PauseForSignal` holds rank 0
      there until the signal is in): every rank saves `hpc_ckpt_1.ckpt` at the next step boundary (step 5), the
      job exits with `EXIT_PREEMPTED` and prints the command that continues it; that command, run as printed,
      resumes from the SIGTERM save at step 5 (the newest checkpoint) and finishes with the first launch's losses.
    """
    from lightning_ulysses.integration.faults import EXIT_PREEMPTED
    from tests.distributed.harness import start_script

    base = 5e-3
    run = tmp_path / "run"
    run.mkdir()
    command = ["data.seq_len=32", "data.batch_size=2", "trainer.log_every_n_steps=1", "trainer.limit_val_batches=0",
               "trainer.accumulate_grad_batches=2", "trainer.max_steps=6", f"model.learning_rate={base}",
               "model.weight_decay=0.1", "schedule=cosine", "model.schedule.warmup_steps=2",
               "model.schedule.min_lr_ratio=0.1", "checkpoint.every_n_train_steps=3", "checkpoint.save_top_k=-1",
               "loggers.tensorboard=true", f"hydra.run.dir={run}",
               "+callbacks.groups._target_=tests.recipes.probes.ParameterGroupProbe", f"+callbacks.groups.folder={run}"]
    whole = _recipe(*command, timeout=300)
    assert whole.returncode == 0, whole.stdout[-3000:] + whole.stderr[-3000:]
    reference = _metrics(run / "logs" / "version_0" / "metrics.csv")
    assert sorted(reference) == list(range(6))
    schedule = LRSchedule("cosine", warmup_steps=2, min_lr_ratio=0.1, total_steps=6)
    for step in range(6):
        assert reference[step]["lr/pg1"] == reference[step]["lr/pg2"] == pytest.approx(base * schedule(step)), step
    assert "loggers.tensorboard=true but tensorboard or tensorboardX is not installed" in whole.stderr

    model = instantiate(_compose([]).model.model).build()
    exempt = {f"model.{n}" for n, p in model.named_parameters() if p.ndim < 2}
    decayed = {f"model.{n}" for n, p in model.named_parameters() if p.ndim >= 2}
    assert exempt and decayed and all("norm" in n or n.endswith("bias") for n in exempt)
    for rank in (0, 1):
        groups = json.loads((run / f"groups_rank{rank}.json").read_text())
        assert [(g["weight_decay"], set(g["parameters"])) for g in groups] == [(0.1, decayed), (0.0, exempt)]
        # Partitioned as configure_optimizers saw them: by p.shape every parameter would have looked 1-D.
        assert all(p["shape"] == [0] and p["ds_shape"] for g in groups for p in g["parameters"].values())

    checkpoints = run / "checkpoints"
    shutil.rmtree(checkpoints / "last.ckpt")
    shutil.rmtree(checkpoints / "epoch=0-step=6.ckpt")
    preempted_command = [*command, "+callbacks.pause._target_=tests.recipes.probes.PauseForSignal",
                         f"+callbacks.pause.folder={run}", "+callbacks.pause.step=4"]
    script = ROOT / "recipes" / "train.py"
    out, err = tmp_path / "preempted.out", tmp_path / "preempted.err"
    launch = start_script(script, preempted_command, _env(), ROOT, out, err)
    try:
        deadline = time.monotonic() + 300
        while not (run / "paused_at_step_4").exists():  # the second launch trained steps 3 and 4
            assert launch.poll() is None, out.read_text()[-3000:] + err.read_text()[-3000:]
            assert time.monotonic() < deadline, "the resumed launch did not reach step 4 within 300 s"
            time.sleep(0.2)
        os.kill(launch.pid, signal.SIGTERM)  # the launching process only, as a scheduler signals a job's main process
        launch.process.join(300)
    finally:
        if launch.poll() is None:
            launch.kill()
            launch.process.join()
    preempted = subprocess.CompletedProcess(preempted_command, launch.poll(), out.read_text(), err.read_text())
    assert preempted.returncode == EXIT_PREEMPTED, preempted.stdout[-3000:] + preempted.stderr[-3000:]
    assert f"resume=auto: continuing from {checkpoints / 'epoch=0-step=3.ckpt'} at step 3\n" in preempted.stdout
    assert (f"Restoring states from the checkpoint path at {checkpoints / 'epoch=0-step=3.ckpt'}"
            in preempted.stdout + preempted.stderr)
    assert (run / "hpc_ckpt_1.ckpt" / "ulysses.json").is_file()
    assert f"the newest checkpoint of the run is {run / 'hpc_ckpt_1.ckpt'} (step 5)" in preempted.stdout
    assert "ckpt_path" not in preempted.stdout + preempted.stderr  # no advice for the Python API
    (continuing,) = re.findall(r"^  (\S+ \S+ .*resume=auto)$", preempted.stdout, re.MULTILINE)
    argv = shlex.split(continuing)
    assert argv[:2] == [sys.executable, str(script)]
    assert argv[2:-2] == preempted_command and re.fullmatch(r"run_name=\S+", argv[-2]) and argv[-1] == "resume=auto"
    assert sorted(_metrics(run / "logs" / "version_1" / "metrics.csv")) == [3, 4]

    finished = run_script(Path(argv[1]), argv[2:], _env(), ROOT, timeout=300)
    assert finished.returncode == 0, finished.stdout[-3000:] + finished.stderr[-3000:]
    assert f"resume=auto: continuing from {run / 'hpc_ckpt_1.ckpt'} at step 5\n" in finished.stdout
    resumed = {**_metrics(run / "logs" / "version_1" / "metrics.csv"),
               **_metrics(run / "logs" / "version_2" / "metrics.csv")}
    assert sorted(_metrics(run / "logs" / "version_2" / "metrics.csv")) == [5]
    for step, row in resumed.items():
        assert row["lr/pg1"] == pytest.approx(reference[step]["lr/pg1"], rel=1e-12), step
        assert abs(row["train/loss"] - reference[step]["train/loss"]) < 1e-5, (step, row, reference[step])


def test_plan_of_the_fsdp2_strategy():
    """`strategy=ulysses_fsdp plan=true`: the FSDP2 run described as `UlyssesFSDPStrategy` reads its arguments
    (sharded over all ranks, nothing offloaded) and planned with FSDP2's memory (fp32 shards, the root unit gathered);
    `memory=auto` chooses from it; what FSDP2 refuses is refused by the plan already."""
    report = plan(_compose(["strategy=ulysses_fsdp", "plan=true"]))
    assert "dp(1) × sp(2) = world_size(2)" in report and "(on GPU)" in report and "features: none" in report
    assert "parameters (fp32 shards, FSDP2)" in report and "; FSDP2;" in report and "weights (16-bit)" not in report
    assert "features: tiled_mlp" in plan(_compose(["strategy=ulysses_fsdp", "plan=true", "strategy.memory.tiled_mlp=true"]))
    assert "low_memory_norms" in plan(_compose(["strategy=ulysses_fsdp", "plan=true",
                                                "+strategy.memory.low_memory_norms=true"]))
    auto = plan(_compose(["strategy=ulysses_fsdp", "plan=true", "~strategy.memory",
                          "+strategy.memory={auto: true, free_memory: [1e10, 1e10]}"]))
    assert 'memory="auto" (decided once' in auto and "FSDP2, 32-bit compute" in auto
    assert "FSDP2: the optimizer stays on the device" in auto
    with pytest.raises(ValueError, match="moves a share of the optimizer to the host"):
        plan(_compose(["strategy=ulysses_fsdp", "plan=true", "~strategy.memory",
                       "+strategy.memory={auto: true, offload_optimizer: 0.5}"]))
