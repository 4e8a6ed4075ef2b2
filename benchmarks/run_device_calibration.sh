#!/usr/bin/env bash
# Runs on the GPU machine (device tool), after the wheels are installed: the step-time model's calibration runs for
# the card it runs on, in one call (~7 minutes on an H100):
#   bash benchmarks/run_device_calibration.sh [fsdp points, e.g. "1b:8192 1b:32768"]
# 1. the device's rates (`device_speeds.py --cpu-adam`: matmul, copies, host link, GPU and CPU Adam);
# 2. the attention kernels' rates at 32K and 128K (`attention_kernels.py`, the rows `H200`'s rates came from);
# 3. the 1B shape's whole steps with the features of `calibration.CALIBRATION`'s 1B rows (`memory_engine.py`);
# 4. FSDP2 against DeepSpeed ZeRO-3 at the given points (`fsdp_vs_deepspeed.py`), if any.
# One JSON line per point in $OUT/*.jsonl, everything else in $OUT/calibration.log; DeepSpeed's CPU Adam build
# (TORCH_EXTENSIONS_DIR=.gpu_ext, ignored by git) is packed into $OUT/gpu_ext.tgz (13 MB; not carried so far: its
# -march=native objects are only safe on the same host CPU).
set -uo pipefail
out="${OUT:-.}"
log="$out/calibration.log"
export MASTER_ADDR=127.0.0.1 RANK=0 WORLD_SIZE=1 LOCAL_RANK=0 PYTHONUNBUFFERED=1
export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True TORCH_EXTENSIONS_DIR="$PWD/.gpu_ext"
fsdp_points="${1:-}"
stage() { echo "== $(date +%T) $*" | tee -a "$log"; }
stage "environment"
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm,power.limit --format=csv >> "$log" 2>&1
python3 -c "import torch, lightning, transformers, deepspeed, hydra, lightning_ulysses; print('imports ok', torch.__version__, lightning.__version__, transformers.__version__, deepspeed.__version__, torch.cuda.get_device_name())" 2>&1 | tail -2 | tee -a "$log"
stage "device speeds"
timeout 300 python3 benchmarks/device_speeds.py --cpu-adam 2>>"$log" | tee "$out/device_speeds.jsonl"
[ -d .gpu_ext ] && tar czf "$out/gpu_ext.tgz" .gpu_ext && ls -la "$out/gpu_ext.tgz" | tee -a "$log"
stage "attention kernels"
timeout 120 python3 benchmarks/attention_kernels.py --seq 32768 131072 --kernels cudnn flash efficient --iters 5 \
  2>>"$log" | tee "$out/attention_kernels.jsonl" | cut -c1-300
stage "1B whole steps"
MASTER_PORT=29511 timeout 200 python3 benchmarks/memory_engine.py --model llama3.2-1b --warmup 1 --steps 3 \
  --points 32768:ac+logits+mlp:cudnn,32768:ac+logits:cudnn,32768:ac:cudnn,8192:ac+logits:cudnn@2/6,8192:none:cudnn@2/6 \
  2>>"$log" | tee "$out/llama1b-features.jsonl" | cut -c1-300
if [ -n "$fsdp_points" ]; then
  stage "FSDP2 against DeepSpeed: $fsdp_points"
  # shellcheck disable=SC2086
  timeout 300 python3 benchmarks/fsdp_vs_deepspeed.py --points $fsdp_points --steps 6 --warmup 2 2>>"$log" \
    | tee -a "$log" | grep '^RESULT ' | sed 's/^RESULT //' | tee "$out/fsdp_vs_deepspeed.jsonl" | cut -c1-300
fi
stage "done"
