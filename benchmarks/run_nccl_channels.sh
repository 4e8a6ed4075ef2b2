#!/usr/bin/env bash
# Ulysses exchange time under NCCL channel settings (2 GPUs). Usage: bash benchmarks/run_nccl_channels.sh OUT_DIR
set -uo pipefail
out="${1:?output folder}"
mkdir -p "$out"
export PYTHONUNBUFFERED=1
settings=("" "NCCL_MIN_P2P_NCHANNELS=32" "NCCL_MIN_P2P_NCHANNELS=32 NCCL_P2P_NVL_CHUNKSIZE=2097152"
          "NCCL_MIN_NCHANNELS=32 NCCL_MIN_P2P_NCHANNELS=64 NCCL_MAX_P2P_NCHANNELS=64")
for setting in "${settings[@]}"; do
  modes="exchange ulysses"
  [ -z "$setting" ] && modes="sdpa exchange ulysses"
  env $setting NCCL_DEBUG=WARN torchrun --nproc_per_node 2 benchmarks/attention_layer.py --modes $modes \
    --seq 32768 131072 --head-groups 1 2 --warmup 3 --iters 20 --output "$out/nccl.jsonl" --label "$setting" \
    >> "$out/nccl.log" 2>&1
done
