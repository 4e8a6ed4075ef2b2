"""What a token mixer's recompute still costs when its products are kept (`keep_token_mixer_outputs`): the
step-time model's `kept_scan_share` (`planning/step_time.py`), measured on the recurrences alone.

For our chunked gated delta rule (Qwen3-Next-80B-A3B's widths, the inputs of `delta_rule.py`) and our blockwise
Mamba2 scan (Nemotron-H-8B's widths, the inputs of `ssd_scan.py`), bf16, batch 1, with gradients enabled as in a
checkpointed layer's recompute:
- `forward_s`: the forward run again (what a recompute without kept products does);
- `replayed_s`: the same forward under the memory engine's kept-outputs mode replaying the products it recorded in
  one forward (what a recompute with kept products does: the elementwise rest runs again);
- `share` = replayed_s / forward_s: the model's `kept_scan_share`;
- `forward_backward_s` and `scan_rate`: the model's FLOPs of the recurrence (3 × `LayerPart.scan_flops` per token)
  over the measured forward + backward: the model's `scan_flops` rate.
Median of `--iters` CUDA-event timings after a warm-up; one JSON line per (mixer, length).

    python benchmarks/kept_scan.py --lengths 32768 131072                # one GPU
    python benchmarks/kept_scan.py --tiny                                # CPU, tiny widths: the plumbing
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import delta_rule  # noqa: E402
import ssd_scan  # noqa: E402
from hybrid_auto import hf_config  # noqa: E402

from lightning_ulysses.memory.checkpointing import TOKEN_MIXERS, _KeptOutputs  # noqa: E402
from lightning_ulysses.mixers.delta_rule import chunk_gated_delta_rule  # noqa: E402
from lightning_ulysses.mixers.ssd import mamba2_chunk_scan  # noqa: E402
from lightning_ulysses.planning.planner import ModelShape  # noqa: E402


def _mixers(device: str, tiny: bool) -> dict:
    """name → (call on one length's inputs, inputs for a length, the planner's shape, its mixer part's kind)."""
    def delta(length):
        if tiny:
            make = lambda *s: torch.randn(*s, dtype=torch.bfloat16).requires_grad_()  # noqa: E731
            return (make(1, length, 4, 16), make(1, length, 4, 16), make(1, length, 4, 16),
                    (-torch.rand(1, length, 4)).requires_grad_(), torch.rand(1, length, 4).requires_grad_())
        return delta_rule.inputs(length)

    return {
        "gated_delta_rule": (lambda args: chunk_gated_delta_rule(*args, use_qk_l2norm_in_kernel=True)[0], delta,
                             "qwen3_next", "gated_deltanet"),
        "mamba2_ssd": (lambda args: mamba2_chunk_scan(**args, dt_softplus=True),
                       lambda length: ssd_scan.inputs(length, device, **(ssd_scan.TINY if tiny else ssd_scan.WIDTHS)),
                       "nemotron_h", "mamba2"),
    }


def _timed(run, iters: int, cuda: bool) -> float:
    run()  # warm-up
    times = []
    for _ in range(iters):
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            run()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end) / 1000)
        else:
            begin = time.perf_counter()
            run()
            times.append(time.perf_counter() - begin)
    return statistics.median(times)


def measure(name: str, length: int, device: str, tiny: bool, iters: int) -> dict:
    call, make, shape_name, kind = _mixers(device, tiny)[name]
    cuda = device == "cuda"
    torch.manual_seed(0)
    arguments = make(length)
    shape = ModelShape.from_hf_config(hf_config(shape_name, tiny))
    scan_per_token = next(part.scan_flops for layer in shape.layers for part in layer.parts if part.kind == kind)

    def forward():
        with torch.enable_grad():
            return call(arguments)

    def forward_backward():
        call(arguments).float().square().mean().backward()

    mode = _KeptOutputs(None, frozenset({TOKEN_MIXERS}))
    with mode:
        forward()  # records the region's products
    recorded = len(mode.recorded)

    def replayed():
        with mode.replaying():
            return forward()

    forward_s, replayed_s = _timed(forward, iters, cuda), _timed(replayed, iters, cuda)
    forward_backward_s = _timed(forward_backward, iters, cuda)
    kept_gib = mode.kept_bytes / 2**30
    mode.drop()
    return {"mixer": name, "tokens": length, "device": torch.cuda.get_device_name() if cuda else "cpu",
            "forward_s": forward_s, "replayed_s": replayed_s, "share": replayed_s / forward_s,
            "forward_backward_s": forward_backward_s, "kept_products": recorded, "kept_gib": kept_gib,
            "scan_flops_per_token": scan_per_token,
            "scan_rate": 3 * scan_per_token * length / forward_backward_s}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--lengths", type=int, nargs="+", default=[32768, 131072])
    parser.add_argument("--mixers", nargs="+", default=["gated_delta_rule", "mamba2_ssd"])
    parser.add_argument("--iters", type=int, default=3)
    parser.add_argument("--tiny", action="store_true", help="CPU, tiny widths, short rows")
    args = parser.parse_args()
    device = "cpu" if args.tiny else "cuda"
    for name in args.mixers:
        for length in ([256, 512] if args.tiny else args.lengths):
            try:
                record = measure(name, length, device, args.tiny, args.iters)
            except torch.OutOfMemoryError as error:
                record = {"mixer": name, "tokens": length, "error": f"out of memory: {str(error)[:160]}"}
            print(json.dumps(record), flush=True)
            if device == "cuda":
                torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
