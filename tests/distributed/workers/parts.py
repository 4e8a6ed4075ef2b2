"""Worker: the jobs of several workers, one after the other in this one process (harness.launch_parts).

A rank's first process group, Trainer and ZeRO engine cost more than the jobs themselves, which are often short
(its imports are the server's, harness.py). Each part runs its script as `__main__` with the arguments a launch of
its own would give it (`<workdir>/<part>/spec.json <workdir>/<part>`), in that folder, and saves its results there.
The process group, once set up by the first part that needs one, is shared by the parts after it. A part that runs
past its timeout dumps every thread's stack and ends this rank: the launch fails instead of hanging. The heap is
settled (common.settle_heap: gc.freeze) after the imports and after every part.
"""

import faulthandler
import json
import os
import runpy
import sys
import threading
import time
from pathlib import Path


def expire(name: str, timeout: float) -> None:
    print(f"parts: {name} ran past its {timeout:.0f} s on this rank; stacks:", flush=True)
    faulthandler.dump_traceback(all_threads=True)
    os._exit(124)


def main() -> None:
    spec = json.loads(Path(sys.argv[1]).read_text())
    workdir = Path(sys.argv[2])
    # What every part imports anyway (torch, Lightning, DeepSpeed, transformers), before the heap is settled.
    import lightning_ulysses  # noqa: F401
    from tests.distributed.common import settle_heap

    settle_heap()
    # DeepSpeed wraps its ZeRO bookkeeping in NVTX ranges (a push and a pop around each of ~1000 calls per step); on
    # CPU they mark nothing. Profiling and markers only: no result depends on them.
    import deepspeed.utils.nvtx

    deepspeed.utils.nvtx.enable_nvtx = False
    for part in spec["parts"]:
        directory = workdir / part["name"]
        print(f"parts: === {part['name']} ({Path(part['script']).name}) ===", flush=True)
        timer = threading.Timer(part["timeout"], expire, (part["name"], part["timeout"]))
        timer.daemon = True
        timer.start()
        started, cpu = time.monotonic(), time.process_time()
        sys.argv = [part["script"], str(directory / "spec.json"), str(directory)]
        os.chdir(directory)
        runpy.run_path(part["script"], run_name="__main__")
        timer.cancel()
        print(f"parts: {part['name']} done in {time.monotonic() - started:.1f} s"
              f" ({time.process_time() - cpu:.1f} s of CPU)", flush=True)
        settle_heap()  # what the part left alive (caches, engines' globals) is not walked by later collections


if __name__ == "__main__":
    main()
