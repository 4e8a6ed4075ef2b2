"""recipes/notebooks/quickstart.ipynb runs headless, top to bottom, without an error, and is committed without outputs.

The notebook asserts the SP 2 run's losses against the single-process run itself; a failing `assert` there is a
cell error here. It runs in a fresh kernel on this interpreter, in the notebook's own folder, as a user would, and
its outputs show no third-party noise (tests/console_noise.py).
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import nbclient  # the "dev" extra: nbclient, ipykernel
import nbformat
import pytest
from jupyter_client.kernelspec import KernelSpecManager
from jupyter_client.manager import AsyncKernelManager

from tests.console_noise import third_party_noise

NOTEBOOK = Path(__file__).resolve().parents[1] / "recipes" / "notebooks" / "quickstart.ipynb"
TIMEOUT_S = 180  # the budget for the whole notebook on 2 CPU cores; also each cell's limit (no hang)


def _kernel_manager(kernel_dir: Path) -> AsyncKernelManager:
    # This interpreter's ipykernel, whatever "python3" kernel spec the machine may have installed elsewhere.
    spec = kernel_dir / "python3"
    spec.mkdir(parents=True)
    argv = [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"]
    (spec / "kernel.json").write_text(json.dumps({"argv": argv, "display_name": "Python 3", "language": "python"}))
    return AsyncKernelManager(kernel_name="python3", kernel_spec_manager=KernelSpecManager(kernel_dirs=[str(kernel_dir)]))


def test_quickstart_is_committed_without_outputs():
    notebook = nbformat.read(NOTEBOOK, as_version=4)
    for cell in notebook.cells:
        if cell.cell_type == "code":
            assert cell.outputs == [] and cell.execution_count is None, cell.source[:80]


def test_quickstart_runs_headless(tmp_path):
    notebook = nbformat.read(NOTEBOOK, as_version=4)
    env = dict(os.environ)
    env.setdefault("TORCH_EXTENSIONS_DIR", str(NOTEBOOK.parents[2] / ".cache" / "torch_extensions"))
    # A notebook kernel starts with none of them; without pytest's variable, ipykernel forwards what is written to
    # the process's descriptors 1 and 2 (the ranks', the linker's) to the notebook, as it does under Jupyter.
    for key in ("MASTER_PORT", "RANK", "LOCAL_RANK", "WORLD_SIZE", "PYTEST_CURRENT_TEST"):
        env.pop(key, None)
    client = nbclient.NotebookClient(
        notebook,
        km=_kernel_manager(tmp_path / "kernels"),
        timeout=TIMEOUT_S,
        kernel_name="python3",
        resources={"metadata": {"path": str(NOTEBOOK.parent)}},
    )
    started = time.monotonic()
    try:
        client.execute(env=env)
    except nbclient.exceptions.CellExecutionError as error:  # names the cell and shows its traceback
        pytest.fail(f"quickstart.ipynb failed:\n{error}")
    finally:
        nbformat.write(notebook, tmp_path / "executed.ipynb")  # kept for a look after a failure
    outputs = "\n".join(
        output.get("text", "") for cell in notebook.cells if cell.cell_type == "code" for output in cell.outputs
    )
    assert "largest loss difference" in outputs
    assert third_party_noise(outputs) == [], outputs  # e.g. DeepSpeed's op probes' `cannot find -laio` in every rank
    assert time.monotonic() - started < TIMEOUT_S
