#!/usr/bin/env bash
# Runs on the GPU machine (device tool). Usage:
#   bash benchmarks/run_memory_auto.sh "1b:32768 8b:131072" [steps] [variants]
# Per point: memory="auto", the best configuration picked by hand (HAND_<shape>_<seq>, else the recipes' choice for
# that length) and plain HF + DeepSpeed ZeRO-3 (strategy_overhead.py --variant raw), each in its own process, in the
# same run. One JSON line per run in $OUT/memory_auto.jsonl. Keep a call under 10 minutes: 8B at 128K is ~3 minutes
# per variant (engine start ~90 s with CPU Adam's first build, 1 warm-up + 3 steps of ~51 s).
set -uo pipefail
points="${1:-1b:32768 8b:8192}"
steps="${2:-3}"
variants="${3:-auto hand raw}"  # a subset saves device time (e.g. raw measured already in the same session)
out="${OUT:-.}"
export MASTER_ADDR=127.0.0.1 MASTER_PORT=29512 RANK=0 WORLD_SIZE=1 LOCAL_RANK=0 PYTHONUNBUFFERED=1
export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
export TORCH_EXTENSIONS_DIR=/tmp/torch_extensions
# The hand-picked configurations measured best so far (benchmarks/results/, DESIGN-NOTES), per length.
hand() {
  case "$1:$2" in
    1b:*) echo "--features none" ;;
    8b:8192) echo "--features ac,attn" ;;
    8b:32768) echo "--features ac,attn,offload,logits,norms" ;;
    *) echo "--features ac,offload,mlp,logits,norms,attn --offload-optimizer 0.15 --sub-group-size 268435456" ;;
  esac
}
for point in $points; do
  shape="${point%%:*}"; seq="${point##*:}"
  var="HAND_${shape}_${seq}"
  [[ " $variants " == *" auto "* ]] && python3 benchmarks/memory_auto.py --variant auto --shape "$shape" --seq "$seq" --steps "$steps" 2>&1 \
    | tee -a "$out/memory_auto.log" | grep -E "^RESULT|memory=\"auto\"|Error" | tail -3
  # shellcheck disable=SC2046
  [[ " $variants " == *" hand "* ]] && python3 benchmarks/memory_auto.py --variant hand --shape "$shape" --seq "$seq" --steps "$steps" ${!var:-$(hand "$shape" "$seq")} \
    2>&1 | tee -a "$out/memory_auto.log" | grep -E "^RESULT|Error" | tail -3
  [[ " $variants " == *" raw "* ]] && python3 benchmarks/strategy_overhead.py --variant raw --shape "$shape" --seq "$seq" --steps "$steps" --warmup 1 2>&1 \
    | tee -a "$out/memory_auto.log" | grep -E "^RESULT|Error" | tail -3
done
grep '^RESULT ' "$out/memory_auto.log" | sed 's/^RESULT //' > "$out/memory_auto.jsonl"
