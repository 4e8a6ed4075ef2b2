#!/usr/bin/env bash
# SP 1 on one GPU: the prepared hybrid / sliding-window models with the memory engine's features against
# plain HF, at 32K (cost of the features) and on to the lengths where plain HF runs out of memory.
# Usage (device tool, from the project root, after the .whl install of ../shared/gpu/README.md):
#   bash benchmarks/run_token_mixers_memory.sh qwen3_next    # ~5 min of device time (estimate)
#   bash benchmarks/run_token_mixers_memory.sh mistral       # ~5 min (estimate; includes flex compiles)
# One process per group of lengths, each under its own timeout, so that a hang or a crash leaves the other points;
# JSON lines go to $OUT/<family>.jsonl, everything else to $OUT/<family>.log.
set -uo pipefail
family="${1:?qwen3_next or mistral}"
out="${OUT:-.}"
export PYTHONUNBUFFERED=1 PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
point() {  # timeout_s, then the benchmark's arguments
  local limit="$1"; shift
  timeout "$limit" python3 benchmarks/token_mixers_sp1.py --family "$family" --variants hf strategy_sp1_memory \
    --memory ac+mlp+logits "$@" 2>>"$out/$family.log" | tee -a "$out/$family.jsonl"
}
nvidia-smi --query-gpu=name,memory.total,clocks.sm --format=csv >"$out/$family.log" 2>&1
if [ "$family" = qwen3_next ]; then
  point 180 --layers 4 --lengths 32768 --steps 2 --warmup 1
  point 240 --layers 4 --lengths 131072 262144 --steps 2 --warmup 1
else
  # transformers' own sdpa path: the window is a dense [1, 1, seq, seq] boolean mask (see README)
  point 200 --layers 2 --lengths 32768 131072 --steps 3 --warmup 1
  # the same model with attn_implementation="flex_attention": transformers' compiled block mask, no dense mask
  point 300 --layers 2 --attn flex_attention --lengths 32768 131072 262144 524288 --steps 3 --warmup 1
fi
tail -n 5 "$out/$family.log"
