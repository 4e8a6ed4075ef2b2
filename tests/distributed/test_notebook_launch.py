"""The notebook launch (strategy="ulysses_notebook": ranks forked from the current process).

One plain Python process (workers/fork_launch.py, forked from the harness's server, so that pytest itself is never
forked) runs four fits one after the other, as a notebook kernel would: SP 2 by the registered name, SP 2 with every
ZeRO-3 parameter partitioned, devices=1, and SP 2 in bf16. The fp32 fits must match the single-process fp32
reference (losses within 1e-5, the weights that come back to the parent within 1e-4 of the update); the bf16 fit
must bring back its 16-bit weights with a warning saying so; the parent must end every fit outside
torch.distributed with its environment unchanged. The checks that refuse to fork run in-process: they
raise before any process starts.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal

import lightning as L
import pytest
import torch
import torch.multiprocessing as mp
from lightning.fabric.utilities import imports as fabric_imports
from lightning.pytorch.strategies import StrategyRegistry
from lightning.pytorch.strategies.launchers import _SubprocessScriptLauncher
from torch.utils.data import DataLoader

from lightning_ulysses import UlyssesDeepSpeedStrategy
from lightning_ulysses.integration.notebook import UlyssesForkLauncher, check_parent_can_fork
from tests.distributed.common import CausalLM, UnevenlyMaskedTokens, collate
from tests.distributed.harness import ROOT, start_script
from tests.distributed.reference import reference_training

WORKER = ROOT / "tests" / "distributed" / "workers" / "fork_launch.py"
STEPS, BATCH_SIZE, SEQ_LEN = 3, 2, 16
CASES = [
    {"name": "registered-sp2-mha", "strategy": "registered", "devices": 2, "sp": 2, "kv_heads": 4},
    {"name": "partitioned-sp2-mqa", "strategy": "partitioned", "devices": 2, "sp": 2, "kv_heads": 1},
    {"name": "registered-devices1", "strategy": "registered", "devices": 1, "sp": 1, "kv_heads": 4},
]
BF16_CASE = {"name": "registered-sp2-bf16", "strategy": "registered", "devices": 2, "sp": 2, "kv_heads": 4,
             "precision": "bf16-mixed"}
for _case in [*CASES, BF16_CASE]:
    _case.update(steps=STEPS, batch_size=BATCH_SIZE, seq_len=SEQ_LEN)


@pytest.fixture(scope="module")
def launched(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("fork_launch")
    spec = workdir / "spec.json"
    spec.write_text(json.dumps({"cases": [*CASES, BF16_CASE]}))
    env = {key: value for key, value in os.environ.items() if key not in ("MASTER_PORT", "RANK", "LOCAL_RANK", "WORLD_SIZE")}
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]))
    env.setdefault("TORCH_EXTENSIONS_DIR", str(ROOT / ".cache" / "torch_extensions"))
    log_path = workdir / "worker.log"
    # Forked from the harness's server (its imports made once), not a fresh interpreter; its own session (the
    # worker's setsid): on a timeout the worker and the ranks it forked go down together.
    process = start_script(WORKER, [str(spec), str(workdir)], env, workdir, log_path, None)  # stderr with stdout
    process.process.join(240)
    if process.poll() is None:
        with contextlib.suppress(ProcessLookupError):  # (not yet in its own session)
            os.killpg(process.pid, signal.SIGKILL)
        process.kill()
        process.wait()
    if process.returncode != 0:
        pytest.fail(f"fork-launch worker exited with {process.returncode}:\n{log_path.read_text()[-6000:]}")
    parent = torch.load(workdir / "parent.pt")
    ranks = {
        case["name"]: [torch.load(workdir / f"{case['name']}_rank{rank}.pt") for rank in range(case["devices"])]
        for case in [*CASES, BF16_CASE]
    }
    return parent, ranks, log_path.read_text()


@pytest.mark.parametrize("case", CASES, ids=[case["name"] for case in CASES])
def test_fork_launch_matches_single_process_reference(launched, case):
    parent_results, rank_results, _ = launched
    parent, ranks = parent_results[case["name"]], rank_results[case["name"]]
    assert parent["launcher"] == "UlyssesForkLauncher"
    assert parent["status"] == "TrainerStatus.FINISHED"
    assert parent["parent_records"] == 0, "the steps must run in the forked ranks, not in the parent"
    assert all(rank["pid"] != parent["parent_pid"] for rank in ranks)
    assert len({rank["master_port"] for rank in ranks}) == 1

    # Every rank of the SP group saw the same samples (one DP group here), as with the script launch.
    steps = []
    for step in range(STEPS):
        indices = [rank["records"][step]["sample_index"] for rank in ranks]
        assert all(i == indices[0] for i in indices)
        steps.append([indices[0]])
    assert sorted(rank["sequence_parallel_rank"] for rank in ranks) == list(range(case["sp"]))

    reference = reference_training(case["kv_heads"], case["seq_len"], steps)
    for rank in ranks:
        for step, record in enumerate(rank["records"]):
            expected = reference["losses"][step][0]
            assert abs(record["loss"] - expected) < 1e-5, (step, rank["sequence_parallel_rank"], record["loss"], expected)

    # The trained weights came back to the parent's LightningModule (under ZeRO-3 gathered from the partitions).
    for name, final in reference["final"].items():
        assert torch.equal(parent["initial"][name], reference["initial"][name]), name
        update = (final - reference["initial"][name]).norm()
        error = (parent["final"][name] - final).norm()
        assert error <= 1e-4 * update, f"{name}: error {error:.3e} vs update {update:.3e}"

    # The parent stays out of torch.distributed and keeps no MASTER_PORT, so the next fit starts clean.
    assert parent["parent_dist_initialized"] is False
    assert parent["parent_master_port"] is None


def test_bf16_fit_brings_back_its_16_bit_weights_and_says_so(launched):
    parent_results, rank_results, log = launched
    parent = parent_results[BF16_CASE["name"]]
    assert parent["status"] == "TrainerStatus.FINISHED" and parent["parent_dist_initialized"] is False
    assert all(len(rank["records"]) == STEPS for rank in rank_results[BF16_CASE["name"]])
    changed = [name for name, final in parent["final"].items() if not torch.equal(final, parent["initial"][name])]
    assert changed, "no trained weight came back"
    for name in changed:  # the parent's fp32 parameters now hold bf16 values
        final = parent["final"][name]
        assert final.dtype == torch.float32 and torch.equal(final, final.bfloat16().float()), name
    assert log.count("not DeepSpeed's fp32 master weights") == 1  # rank 0 only


# -- configuration and refusals, in this process: nothing is launched ---------------------------------------------
def _trainer(strategy, devices=2):
    return L.Trainer(
        accelerator="cpu", devices=devices, strategy=strategy, max_steps=1, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )


def test_registered_name_and_launchers():
    assert StrategyRegistry["ulysses_notebook"]["strategy"] is UlyssesDeepSpeedStrategy
    assert StrategyRegistry["ulysses_notebook"]["init_params"] == {"start_method": "fork"}
    notebook = _trainer("ulysses_notebook").strategy
    assert isinstance(notebook.launcher, UlyssesForkLauncher) and notebook.launcher.is_interactive_compatible
    assert notebook.config["zero_optimization"]["stage"] == 3
    assert isinstance(_trainer("ulysses").strategy.launcher, _SubprocessScriptLauncher)  # unchanged default


def test_bad_start_method():
    with pytest.raises(ValueError, match="start_method must be None .* or 'fork'"):
        UlyssesDeepSpeedStrategy(start_method="spawn")


def test_no_fork_on_this_platform(monkeypatch):
    monkeypatch.setattr(mp, "get_all_start_methods", lambda: ["spawn"])
    with pytest.raises(RuntimeError, match="this platform cannot fork .* run the training as a script"):
        _trainer("ulysses_notebook")


def test_script_launch_in_a_notebook_points_to_the_notebook_strategy(monkeypatch):
    monkeypatch.setattr(fabric_imports, "_IS_INTERACTIVE", True)
    with pytest.raises(RuntimeError, match="strategy='ulysses_notebook'"):
        _trainer("ulysses")


def test_cuda_initialised_in_parent_refuses_before_forking(monkeypatch):
    def no_fork(*args, **kwargs):
        raise AssertionError("a process was started")

    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(mp, "start_processes", no_fork)
    trainer = _trainer("ulysses_notebook")
    data = DataLoader(UnevenlyMaskedTokens(2, SEQ_LEN), batch_size=2, collate_fn=collate)
    with pytest.raises(RuntimeError, match="CUDA is already initialised here.* Restart the kernel"):
        trainer.fit(CausalLM(num_key_value_heads=4), data)


def test_process_group_in_parent_refuses(monkeypatch):
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)
    with pytest.raises(RuntimeError, match="torch.distributed is already initialised here.*destroy_process_group"):
        check_parent_can_fork()
