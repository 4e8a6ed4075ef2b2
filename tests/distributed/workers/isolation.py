"""Worker: cases that leave process state behind (`leave`), look for it (`find`) or fail (`fail`); test_isolation.py.

`leave` sets up a process group and keeps it, seeds the global RNG, replaces `torch.nn.functional.linear` (as
DeepSpeed's `zero.Init` does), sets a module attribute and an environment variable, and writes a file in its folder.
`find` records which of those it finds in its own process before doing anything, and whether that file is there.
"""

import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

import tests.distributed.common as common

SEED = 1234


def leave(workdir: Path) -> dict:
    dist.init_process_group("gloo")
    torch.manual_seed(SEED)
    torchs = torch.nn.functional.linear
    torch.nn.functional.linear = lambda *args, **kwargs: torchs(*args, **kwargs)
    common.LEFT_BY_A_CASE = "leave"
    os.environ["LEFT_BY_A_CASE"] = "leave"
    (workdir / "leave").mkdir(exist_ok=True)
    (workdir / "leave" / f"written_by_rank_{os.environ['RANK']}").touch()
    return {"pid": os.getpid()}


def find(workdir: Path) -> dict:
    return {"pid": os.getpid(), "process_group": dist.is_initialized(), "initial_seed": torch.initial_seed(),
            "linear": type(torch.nn.functional.linear).__name__,  # torch's own is a builtin
            "module_attribute": getattr(common, "LEFT_BY_A_CASE", None),
            "environment": os.environ.get("LEFT_BY_A_CASE"),
            "file": (workdir / "leave" / f"written_by_rank_{os.environ['RANK']}").exists()}


def fail(workdir: Path) -> dict:
    raise RuntimeError("this case fails on purpose")


def main() -> None:
    spec = json.loads(Path(sys.argv[1]).read_text())
    workdir = Path(sys.argv[2])
    results = {case["name"]: {"leave": leave, "find": find, "fail": fail}[case["kind"]](workdir)
               for case in spec["cases"]}
    torch.save(results, workdir / f"result_{os.environ['RANK']}.pt")


if __name__ == "__main__":
    main()
