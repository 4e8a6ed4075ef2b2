"""Checkpoints: exact resume, resume at another SP × DP split, SIGTERM save, atomic saves, export (world 4)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from lightning_ulysses.integration.faults import EXIT_PREEMPTED
from tests.distributed.pool import shared

WORKERS = Path(__file__).parent / "workers"
WORLD_SIZE = 4
STEPS, SAVE_AT = 4, 2  # 12 samples: at a global batch of 4, step 2 is mid-epoch and step 4 is in the next epoch
LONG = 7  # the SP 2 × DP 2 reference: epochs 0 and 1 whole (steps 1-3, 4-6), and one step of epoch 2

# Every way a checkpoint gets written, each resumed at SP 2 × DP 2 and compared with the uninterrupted "sp2".
SAVE_PATHS = {
    "after_fit_mid_epoch": "stop_mid_epoch/after_fit.ckpt",  # fit(max_steps=2); trainer.save_checkpoint
    "epoch_end_hook_mid_epoch": f"stop_mid_epoch/epoch_end/step={SAVE_AT}.ckpt",  # ModelCheckpoint, same stop
    "after_fit_at_epoch_end": "stop_at_epoch_end/after_fit.ckpt",  # fit(max_steps=3): the epoch's last step
    "epoch_end": "sp2/epoch_end/step=3.ckpt",  # ModelCheckpoint(every_n_epochs=1) at a real epoch end
    "last_batch": "sp2/step=3.ckpt",  # ModelCheckpoint(every_n_train_steps=3): after the epoch's last batch
    "callback_mid_epoch": "sp2/callback.ckpt",  # trainer.save_checkpoint from on_train_batch_end after step 5
}

# The hybrid feature matrix's resumes (tests/README.md): hybrids whose mixers are split by heads, saved and resumed at
# the same split, bit for bit. Qwen3-Next at SP 2 × DP 2 on ZeRO-2, saved by ModelCheckpoint mid-epoch; Nemotron-H
# at SP 4 on ZeRO-3, killed by a SIGTERM inside a step (saved at the step boundary, exit 79) and resumed from that
# save. LFM2 on FSDP2 (Distributed Checkpoint): test_fsdp.py.
HYBRID_RESUMES = [
    {"name": "qwen3_next", "model": "family:qwen3_next", "sp": 2, "stage": 2, "batch_size": 2, "steps": STEPS,
     "save_every": SAVE_AT},
    {"name": "qwen3_next_resumed", "model": "family:qwen3_next", "sp": 2, "stage": 2, "batch_size": 2,
     "steps": STEPS, "resume": f"qwen3_next/step={SAVE_AT}.ckpt"},
    {"name": "nemotron_h", "model": "family:nemotron_h", "sp": 4, "stage": 3, "batch_size": 4, "steps": STEPS},
    {"name": "nemotron_h_killed", "model": "family:nemotron_h", "sp": 4, "stage": 3, "batch_size": 4,
     "steps": STEPS, "sigterm_in_batch": SAVE_AT - 1},
    {"name": "nemotron_h_resumed", "model": "family:nemotron_h", "sp": 4, "stage": 3, "batch_size": 4,
     "steps": STEPS, "resume": "hpc", "root": "nemotron_h_killed"},
]

CASES = [
    {"name": "sp4", "sp": 4, "batch_size": 4, "steps": STEPS, "save_every": SAVE_AT},
    {"name": "sp4_to_sp4", "sp": 4, "batch_size": 4, "steps": STEPS, "resume": f"sp4/step={SAVE_AT}.ckpt"},
    {"name": "sp4_to_sp2", "sp": 2, "batch_size": 2, "steps": STEPS, "resume": f"sp4/step={SAVE_AT}.ckpt"},
    {"name": "sp4_to_sp1", "sp": 1, "batch_size": 1, "steps": STEPS, "resume": f"sp4/step={SAVE_AT}.ckpt"},
    # Half the global batch: Lightning's restored batch counter could not continue the epoch's data.
    {"name": "sp4_to_sp2_half_batch", "sp": 2, "batch_size": 1, "steps": STEPS, "resume": f"sp4/step={SAVE_AT}.ckpt",
     "expect_error": True},
    {"name": "sp1", "sp": 1, "batch_size": 1, "steps": STEPS, "save_every": SAVE_AT},
    {"name": "sp1_to_sp4", "sp": 4, "batch_size": 4, "steps": STEPS, "resume": f"sp1/step={SAVE_AT}.ckpt"},
    # Uninterrupted, saving along the way: ModelCheckpoint every 3 steps (the epoch's last batch, is_last_batch),
    # ModelCheckpoint at every epoch end, and `trainer.save_checkpoint` from a callback after step 5 (mid-epoch).
    {"name": "sp2", "sp": 2, "batch_size": 2, "steps": LONG, "save_every": 3, "save_epoch_end": True,
     "save_at_step": 5},
    {"name": "sp2_sigterm", "sp": 2, "batch_size": 2, "steps": STEPS, "sigterm_in_batch": SAVE_AT - 1},
    {"name": "sp2_from_sigterm", "sp": 2, "batch_size": 2, "steps": LONG, "resume": "hpc", "root": "sp2_sigterm"},
    # max_steps ends fit inside epoch 0 (Lightning then counts the epoch as done and runs its epoch-end hooks, so
    # the epoch-end ModelCheckpoint saves too), and exactly at its end; each saved after fit returned.
    {"name": "stop_mid_epoch", "sp": 2, "batch_size": 2, "steps": SAVE_AT, "save_after_fit": True,
     "save_epoch_end": True},
    {"name": "stop_at_epoch_end", "sp": 2, "batch_size": 2, "steps": 3, "save_after_fit": True},
    *[{"name": f"from_{name}", "sp": 2, "batch_size": 2, "steps": LONG, "resume": path}
      for name, path in SAVE_PATHS.items()],
    # The checkpoint saved after fit at SP 2 × DP 2, resumed at SP 4 × DP 1 and SP 1 × DP 4 (same global batch).
    {"name": "after_fit_to_sp4", "sp": 4, "batch_size": 4, "steps": LONG, "resume": SAVE_PATHS["after_fit_mid_epoch"]},
    {"name": "after_fit_to_sp1", "sp": 1, "batch_size": 1, "steps": LONG, "resume": SAVE_PATHS["after_fit_mid_epoch"]},
    *HYBRID_RESUMES,
]


# In the shared 4-rank launch (pool.py). 20 runs: slow on a busy machine.
JOB = shared(WORLD_SIZE, "checkpoints", WORKERS / "resume.py", {"cases": CASES}, timeout=900)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return JOB.ranks(tmp_path_factory), JOB.workdir(tmp_path_factory)


def steps(results, name):
    """Per step: samples over all ranks, losses of all ranks, RNG probes of all ranks, Lightning's epoch."""
    by_step = {}
    for rank_result in results:
        for record in rank_result[name]["records"]:
            entry = by_step.setdefault(record["global_step"],
                                       {"samples": set(), "losses": [], "probes": [], "epochs": set()})
            entry["samples"].update(record["sample_index"])
            entry["epochs"].add(record["epoch"])
            entry["losses"].append(record["loss"])
            entry["probes"].append(record["rng_probe"])
    return by_step


def max_relative_weight_error(results, name, reference):
    weights, expected = results[0][name]["weights"], results[0][reference]["weights"]
    initial = results[0][reference]["initial"]
    update = max((expected[k] - initial[k]).abs().max().item() for k in expected)
    return max((weights[k] - expected[k]).abs().max().item() for k in expected) / update


def test_resume_at_the_same_split_is_exact(runs):
    results, _ = runs
    full, resumed = steps(results, "sp4"), steps(results, "sp4_to_sp4")
    assert sorted(resumed) == list(range(SAVE_AT, STEPS))  # steps after the checkpoint only
    for step in resumed:  # same samples (mid-epoch position and next epoch), losses and RNG draws, bit for bit
        assert resumed[step] == full[step]
    for name, value in results[0]["sp4"]["weights"].items():
        assert torch.equal(results[0]["sp4_to_sp4"]["weights"][name], value)


@pytest.mark.parametrize(("reference", "resumed"), [("sp4", "sp4_to_sp2"), ("sp4", "sp4_to_sp1"), ("sp1", "sp1_to_sp4")])
def test_resume_at_another_split_continues_the_same_training(runs, reference, resumed):
    results, _ = runs
    full, after = steps(results, reference), steps(results, resumed)
    assert sorted(after) == list(range(SAVE_AT, STEPS))
    for step in after:
        assert after[step]["samples"] == full[step]["samples"]
        # The mean over the global batch of per-rank token-mean losses (every sample has the same token count).
        mean = lambda losses, n: sum(losses) / n  # noqa: E731
        full_mean = mean(full[step]["losses"], len(full[step]["losses"]))
        after_mean = mean(after[step]["losses"], len(after[step]["losses"]))
        assert abs(full_mean - after_mean) < 1e-5
    assert max_relative_weight_error(results, resumed, reference) < 1e-4


def test_a_mid_epoch_resume_with_another_global_batch_is_refused_on_every_rank(runs):
    results, _ = runs
    for rank in results:
        assert "global batch of 4 samples" in rank["sp4_to_sp2_half_batch"]["error"]
        assert rank["sp4_to_sp2_half_batch"]["records"] == []  # refused before the first step


def test_sigterm_saves_exits_79_and_resumes_exactly(runs):
    results, workdir = runs
    # Lightning's SIGTERMException is a SystemExit without status: a script letting it through exited 0, a finished
    # job to its scheduler. Every rank (none was started by Lightning's script launcher here) now carries 79.
    assert all(rank["sp2_sigterm"]["exit_status"] == EXIT_PREEMPTED for rank in results)
    assert all(rank["sp2_sigterm"]["warnings"] == [] for rank in results)  # not under SLURM: no folder note
    assert all(rank["sp2_sigterm"]["global_step"] == SAVE_AT for rank in results)
    assert (workdir / "sp2_sigterm" / "hpc_ckpt_1.ckpt" / "ulysses.json").exists()
    full, resumed = steps(results, "sp2"), steps(results, "sp2_from_sigterm")
    assert sorted(resumed) == list(range(SAVE_AT, LONG))
    for step in resumed:
        assert resumed[step] == full[step]
    for name, value in results[0]["sp2"]["weights"].items():
        assert torch.equal(results[0]["sp2_from_sigterm"]["weights"][name], value)


def resumed_from(results, name):
    """The global step a resumed run started at (its first recorded step)."""
    return min(steps(results, name))


def test_a_save_after_fit_stopped_mid_epoch_continues_that_epochs_permutation(runs):
    # The reported failure: fit(max_steps=2), save, fit(ckpt_path, max_steps=7) trained steps 3.. on epoch 1's
    # permutation (Lightning counts a max_steps stop as a finished epoch), with epoch 0's skip applied to it.
    results, _ = runs
    full, resumed = steps(results, "sp2"), steps(results, "from_after_fit_mid_epoch")
    assert sorted(resumed) == list(range(SAVE_AT, LONG))
    assert [resumed[step]["samples"] for step in resumed] == [full[step]["samples"] for step in resumed]
    assert [resumed[step]["epochs"] for step in resumed] == [{0}, {1}, {1}, {1}, {2}]


@pytest.mark.parametrize("save_path", list(SAVE_PATHS))
def test_every_save_path_resumes_exactly(runs, save_path):
    results, _ = runs
    full, resumed = steps(results, "sp2"), steps(results, f"from_{save_path}")
    start = resumed_from(results, f"from_{save_path}")
    assert start == {"after_fit_mid_epoch": 2, "epoch_end_hook_mid_epoch": 2, "callback_mid_epoch": 5}.get(save_path, 3)
    assert sorted(resumed) == list(range(start, LONG))
    for step in resumed:  # same samples, losses, RNG draws and Lightning epoch, bit for bit
        assert resumed[step] == full[step], step
    for name, value in results[0]["sp2"]["weights"].items():
        assert torch.equal(results[0][f"from_{save_path}"]["weights"][name], value)
    assert {rank[f"from_{save_path}"]["current_epoch"] for rank in results} == {results[0]["sp2"]["current_epoch"]}


@pytest.mark.parametrize("resumed", ["after_fit_to_sp4", "after_fit_to_sp1"])
def test_a_save_after_fit_resumes_at_another_split(runs, resumed):
    results, _ = runs
    full, after = steps(results, "sp2"), steps(results, resumed)
    assert sorted(after) == list(range(SAVE_AT, LONG))
    for step in after:
        assert after[step]["samples"] == full[step]["samples"]
        assert after[step]["epochs"] == full[step]["epochs"]
        full_mean = sum(full[step]["losses"]) / len(full[step]["losses"])
        after_mean = sum(after[step]["losses"]) / len(after[step]["losses"])
        assert abs(full_mean - after_mean) < 1e-6  # another reduction order: float rounding only
    assert max_relative_weight_error(results, resumed, "sp2") < 1e-4


def test_export_writes_a_state_dict_and_a_pretrained_model_with_identical_outputs(runs, tmp_path):
    from transformers import LlamaForCausalLM

    from tests.distributed.common import tiny_llama

    results, workdir = runs
    command = [sys.executable, "-m", "lightning_ulysses", "checkpoint", "export", str(workdir / f"sp4/step={STEPS}.ckpt"),
               str(tmp_path)]
    printed = subprocess.run(command, check=True, capture_output=True, text=True).stdout.splitlines()
    # One model: the output folder itself is its save_pretrained folder, model.pt beside (the recipes' export layout)
    assert printed[-2:] == [f"wrote {tmp_path / 'model.pt'}", f"wrote {tmp_path}"]  # after DeepSpeed's logs
    trained = results[0]["sp4"]["weights"]  # gathered from the live engine at the end of the same run
    state = torch.load(tmp_path / "model.pt")
    assert all(torch.equal(state[f"model.{name}"], value) for name, value in trained.items())
    exported = LlamaForCausalLM.from_pretrained(tmp_path).eval()
    assert exported.config._attn_implementation != "ulysses"  # the user's own attention, not ours
    expected = tiny_llama(2).eval()
    expected.load_state_dict(trained)
    tokens = torch.randint(0, 64, (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert torch.equal(exported(tokens).logits, expected(tokens).logits)


HYBRID = "family:jamba"
# A SIGTERM inside a gradient-accumulation window (world 2, SP 2, 6 batches of 2 per epoch, 2 batches per step).
# Under SLURM (auto-requeue), its requeue signal SIGUSR1 reaching one rank inside a window. A SIGTERM that reaches
# only one rank (rank 0, then rank 1) while it is inside a batch.
DATED_ROOT = "accumulate_sigusr1/2026-12-04_13-27-54"
ACCUMULATION_CASES = [
    {"name": "accumulate", "sp": 2, "batch_size": 2, "steps": 3, "accumulate": 2},
    {"name": "accumulate_sigterm", "sp": 2, "batch_size": 2, "steps": 3, "accumulate": 2, "sigterm_in_batch": 2},
    {"name": "accumulate_resumed", "sp": 2, "batch_size": 2, "steps": 3, "accumulate": 2, "resume": "hpc",
     "root": "accumulate_sigterm"},
    # (its default_root_dir named for the launch, as a plain script's datetime folder: a requeue would not look there)
    {"name": "accumulate_sigusr1", "sp": 2, "batch_size": 2, "steps": 3, "accumulate": 2, "sigterm_in_batch": 2,
     "signal": "SIGUSR1", "sigterm_ranks": [1], "slurm": True, "root": DATED_ROOT},
    {"name": "accumulate_sigusr1_resumed", "sp": 2, "batch_size": 2, "steps": 3, "accumulate": 2, "resume": "hpc",
     "root": DATED_ROOT, "slurm": True},
    *[{"name": f"one_rank_{rank}", "sp": 2, "batch_size": 2, "steps": 4, "sigterm_in_batch": 1, "sigterm_ranks": [rank]}
      for rank in (0, 1)],
    # The DataLoader's own RandomSampler (use_distributed_sampler=False, shuffle=True): 3 batches of 4 an epoch, saved
    # after step 4, in the middle of epoch 1, whose order a new process (seeded alike) would draw otherwise.
    {"name": "random_sampler", "sp": 2, "batch_size": 4, "steps": 6, "save_every": 4, "distributed_sampler": False},
    {"name": "random_sampler_resumed", "sp": 2, "batch_size": 4, "steps": 6, "resume": "random_sampler/step=4.ckpt",
     "distributed_sampler": False},
    # A hybrid whose Mamba mixers are split by channels (mixers/mamba.py) and whose MoE layers hold experts: saved by
    # ModelCheckpoint mid-epoch, resumed at SP 2 and at SP 1 × DP 2 (the same global batch).
    {"name": "jamba", "model": HYBRID, "sp": 2, "batch_size": 2, "steps": STEPS, "save_every": SAVE_AT},
    {"name": "jamba_resumed", "model": HYBRID, "sp": 2, "batch_size": 2, "steps": STEPS,
     "resume": f"jamba/step={SAVE_AT}.ckpt"},
    {"name": "jamba_to_sp1", "model": HYBRID, "sp": 1, "batch_size": 1, "steps": STEPS,
     "resume": f"jamba/step={SAVE_AT}.ckpt"},
]
# In the shared 2-rank launch (pool.py).
SIGNAL_JOB = shared(2, "signals", WORKERS / "resume.py", {"cases": ACCUMULATION_CASES})


@pytest.fixture(scope="module")
def accumulation_runs(tmp_path_factory):
    return SIGNAL_JOB.ranks(tmp_path_factory)


def test_sigterm_inside_an_accumulation_window_resumes_exactly(accumulation_runs):
    results = accumulation_runs
    full, resumed = steps(results, "accumulate"), steps(results, "accumulate_resumed")
    assert all(rank["accumulate_sigterm"]["exit_status"] == EXIT_PREEMPTED for rank in results)
    # The save waits for the window's optimizer step: no accumulated gradient is lost with the process.
    assert {rank["accumulate_sigterm"]["global_step"] for rank in results} == {2}
    assert sorted(resumed) == [2]
    for step in resumed:
        assert resumed[step] == full[step]
    for name, value in results[0]["accumulate"]["weights"].items():
        assert torch.equal(results[0]["accumulate_resumed"]["weights"][name], value)


def test_slurm_requeue_signal_to_one_rank_saves_on_every_rank_at_the_step_boundary(accumulation_runs):
    # Lightning's own SIGUSR1 handler would save inside the signal handler, on the signalled rank only, in the middle
    # of the window: its collectives would pair with whatever the other rank was doing.
    results = accumulation_runs
    assert {rank["accumulate_sigusr1"]["cluster_environment"] for rank in results} == {"SLURMEnvironment"}
    assert all(rank["accumulate_sigusr1"]["exit_status"] == EXIT_PREEMPTED for rank in results)
    assert {rank["accumulate_sigusr1"]["global_step"] for rank in results} == {2}
    # Saved into a folder named for the launch: rank 0 says, once, that a requeued job would not find it.
    note, = [line for line in results[0]["accumulate_sigusr1"]["warnings"] if "named for this launch" in line]
    assert f"{DATED_ROOT}/hpc_ckpt_1.ckpt is in a folder named for this launch ('2026-12-04_13-27-54')" in note
    assert "SLURM requeues job 4244" in note and "default_root_dir=f\"runs/{os.environ['SLURM_JOB_ID']}\"" in note
    assert not any("named for this launch" in line for line in results[1]["accumulate_sigusr1"]["warnings"])
    # Every rank trained exactly the batches up to the window's end (batch 3 of 0..5), none after it.
    assert {len(rank["accumulate_sigusr1"]["records"]) for rank in results} == {4}
    full, resumed = steps(results, "accumulate"), steps(results, "accumulate_sigusr1_resumed")
    assert sorted(resumed) == [2]
    assert resumed[2] == full[2]
    for name, value in results[0]["accumulate"]["weights"].items():
        assert torch.equal(results[0]["accumulate_sigusr1_resumed"]["weights"][name], value)


def test_a_hybrid_with_split_mixers_resumes_exactly(accumulation_runs):
    # Its mixers' forward is routed through the split and they are ZeRO-3 leaves (mixers/head_split.py): neither may
    # change what is saved or restored.
    results = accumulation_runs
    full, resumed = steps(results, "jamba"), steps(results, "jamba_resumed")
    assert sorted(resumed) == list(range(SAVE_AT, STEPS))
    for step in resumed:  # same samples, losses, RNG draws and epoch, bit for bit
        assert resumed[step] == full[step], step
    for name, value in results[0]["jamba"]["weights"].items():
        assert torch.equal(results[0]["jamba_resumed"]["weights"][name], value), name
    # at another split: the same samples, the same losses within float rounding and the weights within 1e-4
    after = steps(results, "jamba_to_sp1")
    assert sorted(after) == list(range(SAVE_AT, STEPS))
    for step in after:
        assert after[step]["samples"] == full[step]["samples"]
        assert abs(sum(after[step]["losses"]) / 2 - sum(full[step]["losses"]) / 2) < 1e-5
    assert max_relative_weight_error(results, "jamba_to_sp1", "jamba") < 1e-4


def test_a_random_sampler_resumed_in_the_middle_of_an_epoch_continues_its_order(accumulation_runs):
    # The strategy skips the samples the epoch already trained on: exact only in the epoch's own order, which a
    # RandomSampler draws from the generators when its iteration starts (another order in the resumed process).
    results = accumulation_runs
    full, resumed = steps(results, "random_sampler"), steps(results, "random_sampler_resumed")
    assert sorted(resumed) == [4, 5]
    for step in resumed:  # the same samples, losses, RNG draws and epoch, bit for bit
        assert resumed[step] == full[step], step
    assert set().union(*(full[step]["samples"] for step in (3, 4, 5))) == set(range(12))  # epoch 1, each sample once
    for name, value in results[0]["random_sampler"]["weights"].items():
        assert torch.equal(results[0]["random_sampler_resumed"]["weights"][name], value), name


@pytest.mark.parametrize("signalled_rank", [0, 1])
def test_sigterm_reaching_one_rank_inside_a_batch_saves_on_every_rank(accumulation_runs, tmp_path_factory,
                                                                      signalled_rank):
    name = f"one_rank_{signalled_rank}"
    assert all(rank[name]["exit_status"] == EXIT_PREEMPTED for rank in accumulation_runs)
    assert {rank[name]["global_step"] for rank in accumulation_runs} == {2}
    assert (SIGNAL_JOB.workdir(tmp_path_factory) / name / "hpc_ckpt_1.ckpt" / "ulysses.json").exists()


def assert_resumed_exactly(results, full: str, resumed: str, start: int = SAVE_AT, steps_run: int = STEPS) -> None:
    """`resumed` trained the steps after `start` exactly as the uninterrupted `full` did (samples, losses, RNG
    draws and epochs bit for bit) and ended with its weights bit for bit; both trained every token mixer of the
    hybrid split by heads."""
    uninterrupted, after = steps(results, full), steps(results, resumed)
    assert sorted(after) == list(range(start, steps_run))
    for step in after:
        assert after[step] == uninterrupted[step], step
    for name, value in results[0][full]["weights"].items():
        assert torch.equal(results[0][resumed]["weights"][name], value), name
    for rank in results:
        for run in (full, resumed):
            assert set(rank[run]["token_mixers"].values()) == {"split"}, (run, rank[run]["token_mixers"])


def test_a_hybrid_saved_by_model_checkpoint_on_zero2_resumes_exactly(runs):
    results, workdir = runs
    assert (workdir / "qwen3_next" / f"step={SAVE_AT}.ckpt").is_dir()
    assert_resumed_exactly(results, "qwen3_next", "qwen3_next_resumed")


def test_a_hybrid_killed_by_sigterm_on_zero3_resumes_exactly(runs):
    results, workdir = runs
    assert all(rank["nemotron_h_killed"]["exit_status"] == EXIT_PREEMPTED for rank in results)
    assert {rank["nemotron_h_killed"]["global_step"] for rank in results} == {SAVE_AT}
    assert (workdir / "nemotron_h_killed" / "hpc_ckpt_1.ckpt" / "ulysses.json").exists()
    assert_resumed_exactly(results, "nemotron_h", "nemotron_h_resumed")
