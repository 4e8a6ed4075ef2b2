"""Run `python recipes/train.py <overrides>` several times in this ONE process (test_recipes.py: the plans and the
refused overrides, which never start a rank).

`python run_recipes.py <runs.json> <outdir>`: runs.json is a list of override lists. Each run executes
recipes/train.py as `__main__` with those arguments in `sys.argv`, exactly as the command line would (Hydra parses
them, reports an error and exits 1 the same way), with file descriptors 1 and 2 redirected to `<outdir>/<i>.out`
and `<i>.err` (so that output written by any logging handler lands there too). `<outdir>/results.json` holds the
exit status of each run. What differs from one process per run is only the start-up: the interpreter and its
imports of torch, Lightning and DeepSpeed (~10 s of CPU) are paid once.
"""

import json
import os
import runpy
import sys
import time
import traceback
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "recipes" / "train.py"


def run(overrides: list[str], stdout: Path, stderr: Path) -> int:
    sys.stdout.flush()
    sys.stderr.flush()
    saved = os.dup(1), os.dup(2)
    with open(stdout, "w") as out, open(stderr, "w") as err:
        os.dup2(out.fileno(), 1)
        os.dup2(err.fileno(), 2)
        try:
            sys.argv = [str(SCRIPT), *overrides]
            runpy.run_path(str(SCRIPT), run_name="__main__")
            return 0
        except SystemExit as stop:
            return stop.code if isinstance(stop.code, int) else (0 if stop.code is None else 1)
        except BaseException:  # what the interpreter would print before exiting 1
            traceback.print_exc()
            return 1
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os.dup2(saved[0], 1)
            os.dup2(saved[1], 2)
            os.close(saved[0])
            os.close(saved[1])


def main() -> None:
    runs = json.loads(Path(sys.argv[1]).read_text())
    outdir = Path(sys.argv[2])
    results = []
    for index, overrides in enumerate(runs):
        started = time.monotonic()
        code = run(overrides, outdir / f"{index}.out", outdir / f"{index}.err")
        results.append({"returncode": code, "seconds": time.monotonic() - started})
        print(f"run {index} {overrides}: exit {code} in {results[-1]['seconds']:.1f} s", flush=True)
    (outdir / "results.json").write_text(json.dumps(results))


if __name__ == "__main__":
    main()
