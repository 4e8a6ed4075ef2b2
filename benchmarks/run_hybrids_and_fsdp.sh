#!/usr/bin/env bash
# Runs on the GPU machine (device tool), after the wheels are installed: the hybrid and FSDP2 runs, one stage a call
# (each ~8 minutes on one H100):
#   bash benchmarks/run_hybrids_and_fsdp.sh qwen       # kept_scan.py, ssd_scan.py, hybrid_auto.py for the Qwen3-Next-like shape
#   bash benchmarks/run_hybrids_and_fsdp.sh nemotron   # hybrid_auto.py for the Nemotron-H-like shape, to auto's longest and 256K
#   bash benchmarks/run_hybrids_and_fsdp.sh fsdp       # fsdp_vs_deepspeed.py with the memory features: 1B 8K-128K, 8B on FSDP2
# JSON lines in $OUT/*.jsonl; the points' logs (and metrics.csv) packed into $OUT/logs.tgz.
set -uo pipefail
out="${OUT:-.}"
export MASTER_ADDR=127.0.0.1 RANK=0 WORLD_SIZE=1 LOCAL_RANK=0 PYTHONUNBUFFERED=1 TORCH_EXTENSIONS_DIR=/tmp/torch_extensions
work=/tmp/issue45
mkdir -p "$work"
stage() { echo "== $(date +%T) $*" | tee -a "$out/stages.log"; }
stage "environment: $1"
nvidia-smi --query-gpu=name,memory.total,driver_version,power.limit --format=csv,noheader | tee -a "$out/stages.log"
features='{"activation_checkpointing": true, "tiled_logits_loss": true}'
case "$1" in
  qwen)
    stage "kept_scan"
    timeout 90 python3 benchmarks/kept_scan.py --lengths 32768 131072 2>>"$work/kept_scan.err" | tee "$out/kept_scan.jsonl"
    stage "ssd_scan"
    timeout 110 python3 benchmarks/ssd_scan.py --lengths 8192 32768 65536 131072 2>>"$work/ssd_scan.err" \
      | tee "$out/ssd_scan.jsonl"
    stage "hybrid_auto qwen3_next"
    python3 benchmarks/hybrid_auto.py --shapes qwen3_next --lengths 32768 131072 --split --point-cap 150 \
      --budget "${BUDGET:-300}" --out "$work" 2>>"$work/hybrid_auto.err" | tee "$out/hybrid_auto.jsonl" | cut -c1-400
    ;;
  nemotron)
    stage "hybrid_auto nemotron_h"
    python3 benchmarks/hybrid_auto.py --shapes nemotron_h --lengths 32768 131072 262144 --longest --split \
      --point-cap 170 --budget "${BUDGET:-450}" --out "$work" 2>>"$work/hybrid_auto.err" \
      | tee "$out/hybrid_auto.jsonl" | cut -c1-400
    ;;
  fsdp)
    stage "FSDP2 against DeepSpeed, 1B 8K and 32K, $features"
    timeout 200 python3 benchmarks/fsdp_vs_deepspeed.py --points 1b:8192 1b:32768 --steps 6 --warmup 2 \
      --memory "$features" 2>>"$work/fsdp.err" | grep '^RESULT ' | sed 's/^RESULT //' | tee -a "$out/fsdp_vs_deepspeed.jsonl" | cut -c1-300
    stage "FSDP2 against DeepSpeed, 1B 128K"
    timeout 200 python3 benchmarks/fsdp_vs_deepspeed.py --points 1b:131072 --steps 3 --warmup 1 \
      --memory "$features" 2>>"$work/fsdp.err" | grep '^RESULT ' | sed 's/^RESULT //' | tee -a "$out/fsdp_vs_deepspeed.jsonl" | cut -c1-300
    stage "FSDP2, 8B 8K (DeepSpeed ZeRO-3 without offload: out of memory in 2026-12-07-h100-memory-auto)"
    timeout 100 python3 benchmarks/fsdp_vs_deepspeed.py --points 8b:8192 --backends fsdp2 --steps 1 --warmup 0 \
      --memory "$features" 2>>"$work/fsdp.err" | grep '^RESULT ' | sed 's/^RESULT //' | tee -a "$out/fsdp_vs_deepspeed.jsonl" | cut -c1-600
    if [ "${LIGER:-0}" = 1 ]; then
      stage "fused_elementwise --liger, 8B widths, 32K"
      timeout 90 python3 benchmarks/fused_elementwise.py --shape 8b --tokens 32768 --liger 2>>"$work/liger.err" \
        | tee "$out/fused_elementwise_liger.jsonl" | cut -c1-300
    fi
    ;;
esac
stage "done"
tar czf "$out/logs.tgz" -C "$work" --exclude=torch_extensions . 2>/dev/null
ls -la "$out"
