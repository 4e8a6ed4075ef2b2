import os
from pathlib import Path

# DeepSpeed JIT-builds a shared-memory comm op on first use: keep its cache in the project's ignored folders.
os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(Path(__file__).resolve().parents[1] / ".cache" / "torch_extensions"))
