#!/usr/bin/env bash
# Attention-layer benchmark on the lent GPU machine (see ../shared/gpu/README.md for the .whl setup).
# Usage (from the project root, on a machine with N GPUs): bash benchmarks/run_attention_layer.sh OUT_DIR
set -uo pipefail
out="${1:?output folder}"
mkdir -p "$out"
export PYTHONUNBUFFERED=1
gpus=$(nvidia-smi -L | wc -l)
nvidia-smi topo -m > "$out/topology.txt" 2>&1
python -m lightning_ulysses preflight --parameters 8e9 --offload-optimizer > "$out/preflight.txt" 2>&1
if [ "$gpus" -ge 2 ]; then
  torchrun --nproc_per_node 2 benchmarks/attention_layer.py --modes sdpa ulysses ring \
    --seq 32768 65536 131072 --warmup 3 --iters 20 --output "$out/sp2.jsonl" > "$out/sp2.log" 2>&1
fi
python benchmarks/attention_layer.py --modes sdpa ulysses ring --seq 32768 131072 --warmup 3 --iters 20 \
  --output "$out/sp1.jsonl" > "$out/sp1.log" 2>&1
tail -n 30 "$out"/*.log
