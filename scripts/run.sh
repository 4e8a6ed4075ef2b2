#!/usr/bin/env bash
# One entry point for a fresh machine that has only Python:
#   bash scripts/run.sh train [hydra overrides...]   set up .venv, run the main job (tiny CPU default)
#   bash scripts/run.sh test  [pytest args...]       set up .venv, run the test suite
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
python="${PYTHON:-python3}"

# --system-site-packages: a torch the user already has (CUDA or CPU) stays visible and is never replaced.
if [ ! -x .venv/bin/python ]; then
  "$python" -m venv --system-site-packages .venv
fi
venv_python=.venv/bin/python
if ! "$venv_python" -c "import torch" >/dev/null 2>&1; then
  # No torch anywhere: take the release this project is tested with (a plain `torch` would pull CUDA wheels).
  "$venv_python" -m pip install -q "torch==2.13.0"
fi
"$venv_python" -m pip install -q -e ".[dev]"

# DeepSpeed JIT-builds ops on first use; keep that cache inside the project's ignored folders so that
# other environments sharing the home cache neither rebuild nor break ours.
export TORCH_EXTENSIONS_DIR="${TORCH_EXTENSIONS_DIR:-$root/.cache/torch_extensions}"

command="${1:-test}"
shift || true
case "$command" in
  train) exec "$venv_python" recipes/train.py "$@" ;;
  test)  exec "$venv_python" -m pytest tests "$@" ;;
  *) echo "usage: bash scripts/run.sh {train|test} [args...]" >&2; exit 2 ;;
esac
