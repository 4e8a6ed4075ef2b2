#!/usr/bin/env bash
# Runs on the GPU machine (device tool): each argument is one benchmark run, "<script> <its arguments>", e.g.
#   bash benchmarks/run_points.sh "memory_auto.py --variant auto --shape 8b --seq 4096 --steps 10 --warmup 3" \
#                                 "strategy_overhead.py --variant raw --shape 8b --seq 4096 --steps 10 --warmup 3"
# each in its own process (and port), one after the other; the RESULT line of each goes to $OUT/points.jsonl (a
# timed-out call still keeps the finished runs), its whole output to $OUT/run<N>.log.
set -uo pipefail
out="${OUT:-.}"
export MASTER_ADDR=127.0.0.1 RANK=0 WORLD_SIZE=1 LOCAL_RANK=0 PYTHONUNBUFFERED=1
export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True TORCH_EXTENSIONS_DIR=/tmp/torch_extensions
n=0
for run in "$@"; do
  n=$((n + 1))
  export MASTER_PORT=$((29600 + n))
  # shellcheck disable=SC2086
  python3 benchmarks/$run > "$out/run$n.log" 2>&1
  grep -h "^RESULT " "$out/run$n.log" | sed 's/^RESULT //' >> "$out/points.jsonl" \
    || { echo "run $n failed: $run"; tail -5 "$out/run$n.log"; }
  tail -1 "$out/points.jsonl" | cut -c1-400
done
