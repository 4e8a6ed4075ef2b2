"""Two "nodes" of two CPU processes each on loopback, started by torchrun with a static rendezvous, or with the
variables SLURM's srun sets, as on a cluster.

The core parity check must pass unchanged; SP groups stay inside a node unless the SP size asks for more
processes than a node has, and then the strategy warns.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import torch

from tests.distributed.harness import ROOT, _free_port, run_ranks
from tests.distributed.test_parity import _case, check_parity

WORKER = ROOT / "tests" / "distributed" / "workers" / "train_parity.py"
NODES, PER_NODE = 2, 2
CASES = [
    _case(4, 2, 3, "mha", suffix="-two-nodes", devices=PER_NODE, num_nodes=NODES),
    _case(4, 4, 3, "mqa", suffix="-two-nodes-sp-spans-nodes", devices=PER_NODE, num_nodes=NODES),
]


def test_two_nodes_via_torchrun(tmp_path):
    (tmp_path / "spec.json").write_text(json.dumps({"world_size": NODES * PER_NODE, "cases": CASES}))
    port = _free_port()
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    env.setdefault("TORCH_EXTENSIONS_DIR", str(ROOT / ".cache" / "torch_extensions"))
    nodes = [
        subprocess.Popen(
            [sys.executable, "-m", "torch.distributed.run", f"--nnodes={NODES}", f"--nproc-per-node={PER_NODE}",
             f"--node-rank={node}", "--master-addr=127.0.0.1", f"--master-port={port}", str(WORKER),
             str(tmp_path / "spec.json"), str(tmp_path)],
            env=env, cwd=tmp_path, stdout=open(tmp_path / f"node_{node}.log", "w"), stderr=subprocess.STDOUT,
        )
        for node in range(NODES)
    ]
    try:
        codes = [node.wait(timeout=400) for node in nodes]
    finally:
        for node in nodes:
            node.kill()
    logs = [(tmp_path / f"node_{node}.log").read_text() for node in range(NODES)]
    assert codes == [0, 0], "\n".join(log[-4000:] for log in logs)
    results = [torch.load(tmp_path / f"result_{rank}.pt") for rank in range(NODES * PER_NODE)]

    for case in CASES:
        ranks = [result[case["name"]] for result in results]
        assert {rank["cluster_environment"] for rank in ranks} == {"TorchElasticEnvironment"}
        check_parity(case, ranks)
        nodes_of_group = {}
        for rank in ranks:
            nodes_of_group.setdefault(rank["data_parallel_rank"], set()).add(rank["node_rank"])
        spans = case["sp"] > PER_NODE
        assert all(len(group_nodes) == (NODES if spans else 1) for group_nodes in nodes_of_group.values())
    warning = "sequence_parallel_size=4 with 2 devices per node: SP groups span nodes"
    assert logs[0].count(warning) == 1  # once, on global rank 0, for the case that asked for it


def slurm_variables(rank: int, world_size: int) -> dict[str, str]:
    """What `srun --nodes 2 --ntasks-per-node 2` gives each task (Lightning's SLURMEnvironment reads these)."""
    return dict(SLURM_NTASKS=str(world_size), SLURM_PROCID=str(rank), SLURM_LOCALID=str(rank % PER_NODE),
                SLURM_NODEID=str(rank // PER_NODE), SLURM_NNODES=str(NODES), SLURM_NTASKS_PER_NODE=str(PER_NODE),
                SLURM_JOB_ID="4242", SLURM_JOB_NAME="ulysses-test", SLURM_NODELIST="127.0.0.1")


def test_two_nodes_via_slurm_variables(tmp_path):
    case = CASES[0]
    outcome = run_ranks(WORKER, NODES * PER_NODE, {"world_size": NODES * PER_NODE, "cases": [case]}, tmp_path,
                        launcher_variables=slurm_variables)
    assert outcome.failure is None, "\n".join(log[-3000:] for log in outcome.logs)
    ranks = [torch.load(tmp_path / f"result_{rank}.pt")[case["name"]] for rank in range(NODES * PER_NODE)]
    check_parity(case, ranks)
    assert {rank["cluster_environment"] for rank in ranks} == {"SLURMEnvironment"}
    assert [rank["node_rank"] for rank in ranks] == [0, 0, 1, 1]  # Lightning took the nodes from SLURM
