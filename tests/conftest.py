import os
from pathlib import Path

# DeepSpeed JIT-builds a shared-memory comm op on first use: keep its cache in the project's ignored folders.
os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(Path(__file__).resolve().parents[1] / ".cache" / "torch_extensions"))


def pytest_collection_finish(session):
    """Tell the shared launches (tests/distributed/pool.py) which test modules have selected tests: a launch runs
    the jobs of those only."""
    import sys

    pool = sys.modules.get("tests.distributed.pool")
    if pool is not None:
        pool.POOL.selected_modules = {item.module.__name__ for item in session.items if item.module is not None}
