#!/usr/bin/env bash
# The documentation that is built, not written:
#   bash scripts/docs.sh [OUTPUT_DIR]   API reference (HTML, pdoc, from the docstrings) into docs/api/ (ignored by git),
#                                       and the README's pictures (docs/figures/*.svg, committed) redrawn from the code.
# Uses .venv when scripts/run.sh has set it up (pdoc comes with `pip install -e ".[dev]"`), else $PYTHON / python3.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
if [ -x .venv/bin/python ]; then python="${PYTHON:-.venv/bin/python}"; else python="${PYTHON:-python3}"; fi
if ! "$python" -c "import pdoc" >/dev/null 2>&1; then
  echo "pdoc is missing: pip install -e \".[dev]\" (or: bash scripts/run.sh test, which sets up .venv)" >&2
  exit 1
fi
export PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}"
export TORCH_EXTENSIONS_DIR="${TORCH_EXTENSIONS_DIR:-$root/.cache/torch_extensions}"
"$python" docs/figures.py docs/figures
exec "$python" scripts/api_docs.py "${1:-docs/api}"
