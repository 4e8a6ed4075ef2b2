"""A user's own script (tests/user_script.py) under `Trainer(strategy="ulysses", devices=2)`, run as the user runs
it: a fresh interpreter, whose second rank Lightning starts by running the script again, neither under pytest's
warning filters. Its console shows no third-party noise, the progress bar's true totals also after a resume in the
middle of an epoch, and everything of the package's own: its start-up notes, its warning, its refusal."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from lightning_ulysses.integration.faults import EXIT_PREEMPTED
from tests.console_noise import third_party_noise

ROOT = Path(__file__).resolve().parents[1]


def _start(script: Path, args: list[str], cwd: Path, output: Path) -> subprocess.Popen:
    """`python <script> <args>` as the user runs it: a fresh interpreter, not under pytest's warning filters; its
    stdout and stderr written to `output`/stdout and `output`/stderr (files: a full pipe would stall it)."""
    # (what PYTHONPATH held stays after this checkout, e.g. a newer library installed to one side)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
               OMP_NUM_THREADS="1")
    env.pop("PYTHONWARNINGS", None)
    with open(output / "stdout", "w") as stdout, open(output / "stderr", "w") as stderr:
        return subprocess.Popen([sys.executable, str(script), *args], env=env, cwd=cwd, stdout=stdout, stderr=stderr)


@pytest.fixture(scope="module")
def consoles(tmp_path_factory) -> dict[str, subprocess.CompletedProcess]:
    """Both scripts at once: each spends its first seconds importing in one process (and again when Lightning starts
    its second rank), which side by side keeps both cores busy."""
    runs = {name: (tmp_path_factory.mktemp(name), tmp_path_factory.mktemp(f"{name}_console"))
            for name in ("user_script", "example")}
    scripts = {"user_script": (ROOT / "tests" / "user_script.py", [str(runs["user_script"][0])]),
               "example": (ROOT / "examples" / "your_module.py", [])}
    started = {name: _start(*scripts[name], *runs[name]) for name in runs}
    try:
        for process in started.values():
            process.wait(timeout=300)
    finally:
        for process in started.values():
            if process.poll() is None:
                process.kill()
                process.wait()
    return {name: subprocess.CompletedProcess(process.args, process.returncode,
                                              (runs[name][1] / "stdout").read_text(),
                                              (runs[name][1] / "stderr").read_text())
            for name, process in started.items()}


def test_a_users_own_script_is_quiet_and_says_what_is_ours(consoles):
    result = consoles["user_script"]
    console = result.stdout + result.stderr
    # The third fit is refused on every rank, before any collective, with its fix named; the two before it ran.
    assert "ValueError: sp(3) does not divide world_size(2)" in console, console[-3000:]
    assert console.count("`Trainer.fit` stopped") == 2 and "Restored all states from the checkpoint" in console
    # Ours: the layout, the preflight report, the warning about eager attention (from both ranks).
    assert "lightning_ulysses: dp(1) × sp(2) = world_size(2)" in console and "lightning_ulysses preflight" in console
    assert console.count("attends with eager attention") >= 2
    # The bar: the epoch total of a max_steps run (Lightning: `Epoch 0/-2`) and, resumed at batch 4 of 8 with 2 steps
    # left, the epoch's 6 batches (Lightning: `6/2`).
    assert "Epoch 0/0 " in console and "3/3" in console and "6/6" in console and "6/2" not in console
    assert third_party_noise(console) == [], console


def test_a_users_own_script_stopped_by_sigterm_exits_79_and_says_how_to_continue(consoles, tmp_path_factory):
    # The last fit: SIGTERM to both ranks in batch 2. Lightning's SIGTERMException is a SystemExit without status:
    # the script exited 0, a finished job to its scheduler, never requeued or resumed. Now every rank saved, the rank
    # Lightning's launcher started exited 0 (a non-zero one makes the launcher SIGKILL every process, the script's
    # own too: -9 here), and the script exits 79 with one line saying how to continue.
    result = consoles["user_script"]
    console = result.stdout + result.stderr
    assert result.returncode == EXIT_PREEMPTED, console[-3000:]
    folder = Path(result.args[2])
    assert (folder / "hpc_ckpt_1.ckpt" / "ulysses.json").exists()
    note, = [line for line in result.stdout.splitlines() if line.startswith("lightning_ulysses: preempted")]
    assert note.startswith(f"lightning_ulysses: preempted at step 3, exit status {EXIT_PREEMPTED} (not finished);")
    assert f"run `{sys.executable} {ROOT / 'tests' / 'user_script.py'} {folder}` again with" in note
    assert f'trainer.fit(..., ckpt_path="{folder / "hpc_ckpt_1.ckpt"}")' in note


def test_the_readme_contract_example_is_this_file_and_trains_quietly(consoles):
    """The README's contract example is `examples/your_module.py` verbatim, and runs as it is: two ranks, ZeRO-3,
    SP 2, a few steps, no third-party noise."""
    example = ROOT / "examples" / "your_module.py"
    readme = (ROOT / "README.md").read_text()
    block = readme.split("## Your module's contract\n\n```python\n", 1)[1].split("```\n", 1)[0]
    assert block == example.read_text(), "README's contract example differs from examples/your_module.py"
    result = consoles["example"]
    console = result.stdout + result.stderr
    assert result.returncode == 0, console[-3000:]
    assert "`Trainer.fit` stopped: `max_steps=8` reached" in console, console[-3000:]
    assert third_party_noise(console) == [], console
