#!/usr/bin/env bash
# Scaling on the lent GPUs (1B Llama shape so that several configurations fit one lease):
#   bash benchmarks/run_scaling.sh OUT_DIR
set -uo pipefail
out="${1:?output folder}"; mkdir -p "$out"
export PYTHONUNBUFFERED=1
gpus=$(nvidia-smi -L | wc -l)
model="${MODEL:-llama3.2-1b}"
# Weak scaling: 32K tokens per GPU on 1 GPU, then on all GPUs (SP = GPUs).
torchrun --nproc_per_node 1 benchmarks/scaling.py --mode weak --model "$model" --tokens-per-gpu 32768 --steps 4 \
  > "$out/weak_1gpu.log" 2>&1
torchrun --nproc_per_node "$gpus" benchmarks/scaling.py --mode weak --model "$model" --tokens-per-gpu 32768 --steps 4 \
  > "$out/weak_${gpus}gpu.log" 2>&1
# Ulysses SP = GPUs + ZeRO-3 against pure ZeRO-3 (DP = GPUs) at one length.
torchrun --nproc_per_node "$gpus" benchmarks/scaling.py --mode compare --model "$model" --seq 131072 --steps 4 \
  > "$out/compare_${gpus}gpu.log" 2>&1
# The longest sequence memory="auto" trains at SP = GPUs (LONGEST=1; 8B at its limit: minutes per step).
if [ "${LONGEST:-0}" = 1 ]; then
  torchrun --nproc_per_node "$gpus" benchmarks/scaling.py --mode longest --model "$model" --steps 1 \
    > "$out/longest_${gpus}gpu.log" 2>&1
fi
grep -h '^{' "$out"/*.log > "$out/results.jsonl"
cat "$out/results.jsonl"; tail -n 5 "$out"/*.log
