#!/usr/bin/env bash
# Runs on the GPU machine (device tool). Usage: bash benchmarks/run_strategy_overhead.sh "1b:8192 1b:32768" [steps]
# Alternates which variant goes first per point, so warm-up effects of the machine do not favour one side.
set -uo pipefail
points="${1:-1b:8192 1b:32768 8b:8192}"
steps="${2:-8}"
out="${OUT:-.}"
export MASTER_ADDR=127.0.0.1 MASTER_PORT=29511 RANK=0 WORLD_SIZE=1 LOCAL_RANK=0 PYTHONUNBUFFERED=1
export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
export TORCH_EXTENSIONS_DIR=/tmp/torch_extensions
order="${VARIANTS:-raw lightning}"
for point in $points; do
  shape="${point%%:*}"; seq="${point##*:}"
  for variant in $order; do
    python3 benchmarks/strategy_overhead.py --variant "$variant" --shape "$shape" --seq "$seq" --steps "$steps" \
      2>&1 | tee -a "$out/strategy_overhead.log" | grep -E "^RESULT|Error|error" | tail -5
  done
  order="$(echo $order | awk '{for (i = NF; i > 0; i--) printf "%s%s", $i, (i > 1 ? " " : "")}')"  # reverse
done
grep '^RESULT ' "$out/strategy_overhead.log" | sed 's/^RESULT //' > "$out/strategy_overhead.jsonl"
