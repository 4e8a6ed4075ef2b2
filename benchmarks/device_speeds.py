"""The device's own rates that the step-time model's `DeviceSpeeds` stands on, one JSON line each (one GPU):

    python benchmarks/device_speeds.py                 # matmul, copies, host link, GPU Adam
    python benchmarks/device_speeds.py --cpu-adam      # + DeepSpeed's CPU Adam (JIT-built on first use)

- `matmul`: an 8192³ bf16 product on random data (FLOP/s), the MFU denominator measured;
- `copy`: a device-to-device copy (bytes read + written per second), the ceiling of the elementwise kernels;
- `host_link`: pinned host → device, device → host and both at once on two streams (bytes/s of each direction,
  and their sum), what offloaded activations and the optimizer's host share cross;
- `gpu_adam`: torch's AdamW (its default foreach path, as the strategy's `training.optim.adamw` on the device) over
  fp32 tensors: elements per second of one step;
- `cpu_adam`: DeepSpeed's CPU Adam in AdamW mode (what an offloaded optimizer share steps with) over fp32 host
  tensors: elements per second of one step, and the seconds its first build took.

Timing: CUDA events (device work) or a synchronised host clock, median over repeats after warm-up.
`benchmarks/results/2026-12-07-h100-calibration/` holds the H100's lines; `planning/step_time.py` the constants.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

GIB = 2**30


def _events(fn, warmup: int, repeats: int) -> float:
    """Median seconds of `fn` on the current stream (CUDA events), after `warmup` calls."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times)


def _wall(fn, warmup: int, repeats: int, cuda: bool = True) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        if cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        if cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def device_line() -> dict:
    props = torch.cuda.get_device_properties(0)
    free, total = torch.cuda.mem_get_info()
    available = None
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            available = int(line.split()[1]) * 1024
    return {"what": "device", "device": torch.cuda.get_device_name(), "capability": f"{props.major}.{props.minor}",
            "multiprocessors": props.multi_processor_count, "total_gib": props.total_memory / GIB,
            "free_gib": free / GIB, "host_available_gib": (available or 0) / GIB, "cpus": os.cpu_count(),
            "torch": torch.__version__}


def matmul(n: int = 8192) -> dict:
    a, b = (torch.randn(n, n, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    seconds = _events(lambda: a @ b, 5, 20)
    return {"what": "matmul", "n": n, "seconds": seconds, "flops": 2 * n**3 / seconds}


def copy(gib: float = 4.0) -> dict:
    count = int(gib * GIB) // 2
    source = torch.randn(count, device="cuda", dtype=torch.bfloat16)
    target = torch.empty_like(source)
    seconds = _events(lambda: target.copy_(source), 3, 10)
    return {"what": "copy", "gib": gib, "seconds": seconds, "bytes_per_s": 2 * count * 2 / seconds}


def host_link(gib: float = 2.0) -> dict:
    count = int(gib * GIB) // 2
    host_a = torch.randn(count, dtype=torch.bfloat16).pin_memory()
    host_b = torch.empty_like(host_a).pin_memory()
    device_a = torch.randn(count, device="cuda", dtype=torch.bfloat16)
    device_b = torch.empty_like(device_a)
    nbytes = count * 2
    to_device = _wall(lambda: device_b.copy_(host_a, non_blocking=True), 2, 5)
    to_host = _wall(lambda: host_b.copy_(device_a, non_blocking=True), 2, 5)
    streams = torch.cuda.Stream(), torch.cuda.Stream()

    def both():
        with torch.cuda.stream(streams[0]):
            device_b.copy_(host_a, non_blocking=True)
        with torch.cuda.stream(streams[1]):
            host_b.copy_(device_a, non_blocking=True)

    together = _wall(both, 2, 5)
    return {"what": "host_link", "gib": gib, "to_device_bytes_per_s": nbytes / to_device,
            "to_host_bytes_per_s": nbytes / to_host, "both_directions_bytes_per_s": 2 * nbytes / together,
            "both_seconds": together}


def gpu_adam(elements: int = 500_000_000, pieces: int = 8) -> dict:
    size = elements // pieces
    params = [torch.randn(size, device="cuda", requires_grad=True) for _ in range(pieces)]
    for p in params:
        p.grad = torch.randn_like(p)
    optimizer = torch.optim.AdamW(params, lr=1e-5)
    seconds = _events(optimizer.step, 2, 5)
    result = {"what": "gpu_adam", "elements": size * pieces, "seconds": seconds,
              "elements_per_s": size * pieces / seconds}
    del optimizer, params
    torch.cuda.empty_cache()
    return result


def cpu_adam(elements: int = 1_000_000_000, pieces: int = 8) -> dict:
    started = time.perf_counter()
    from deepspeed.ops.adam import DeepSpeedCPUAdam
    from deepspeed.ops.op_builder import CPUAdamBuilder

    CPUAdamBuilder().load()  # the JIT build (or the cached one), timed apart from the steps
    built = time.perf_counter() - started
    size = elements // pieces
    params = [torch.nn.Parameter(torch.randn(size)) for _ in range(pieces)]
    for p in params:
        p.grad = torch.randn_like(p)
    optimizer = DeepSpeedCPUAdam(params, lr=1e-5, adamw_mode=True)
    seconds = _wall(optimizer.step, 1, 3, cuda=False)
    return {"what": "cpu_adam", "elements": size * pieces, "seconds": seconds,
            "elements_per_s": size * pieces / seconds, "build_s": built, "threads": torch.get_num_threads()}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--cpu-adam", action="store_true", help="also DeepSpeed's CPU Adam (JIT-built on first use)")
    parser.add_argument("--small", action="store_true", help="tiny sizes (a dry run of the script)")
    args = parser.parse_args()
    small = args.small
    runs = [device_line, lambda: matmul(1024 if small else 8192), lambda: copy(0.01 if small else 4.0),
            lambda: host_link(0.01 if small else 2.0), lambda: gpu_adam(10**6 if small else 500_000_000)]
    if args.cpu_adam:
        runs.append(lambda: cpu_adam(10**6 if small else 1_000_000_000))
    for run in runs:
        try:
            record = run()
        except Exception as error:  # one failing must not lose the others' lines
            record = {"what": getattr(run, "__name__", "?"), "error": f"{type(error).__name__}: {error}"[:300]}
        print(json.dumps(record), flush=True)
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
