"""FSDP2 (`UlyssesFSDPStrategy`) against DeepSpeed ZeRO-3 (`UlyssesDeepSpeedStrategy`) on one GPU, in the same call:
the Llama 3.2 1B and Llama 3 8B shapes (`strategy_overhead.SHAPES`) at 8K, 32K and 128K tokens; one JSON line per
(point, backend), prefixed `RESULT `.

    python benchmarks/fsdp_vs_deepspeed.py                                  # 1b and 8b at 8K, 32K, 128K
    python benchmarks/fsdp_vs_deepspeed.py --points 1b:8192 8b:32768 --steps 8 --warmup 3
    python benchmarks/fsdp_vs_deepspeed.py --smoke                          # a tiny shape on the CPU, 2 ranks' worth

Both backends train the same module (the recipes' `CausalLMModule` around an HF Llama, random init, sdpa, bf16-mixed,
torch AdamW; by default the model's own activation checkpointing, or with `--memory '{...}'` the same
`MemoryOptions` on both sides instead, e.g. layer checkpointing + tiled logits and loss) at SP 1, each run in a
process of its own (its own peak memory), the order of the two alternating from point to point. FSDP2's bf16-mixed
is its MixedPrecisionPolicy (bf16 compute, fp32 parameters and reduction); DeepSpeed's is its bf16 mode (bf16 parameters, fp32 master copy). Timing as `strategy_overhead.py`: CUDA-synchronised whole steps,
median after warm-up; MFU against the measured 772 TFLOP/s bf16 peak and the 989 TFLOP/s datasheet peak. An out of
memory is a line with `error`.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from memory_auto import timed_fields  # noqa: E402
from strategy_overhead import SHAPES, RandomTokens, StepProfiler, llama_config, step_timer  # noqa: E402

BACKENDS = ("fsdp2", "deepspeed")
DEFAULT_POINTS = [f"{shape}:{seq}" for shape in ("1b", "8b") for seq in (8192, 32768, 131072)]
# --smoke: a tiny Llama on the CPU (no timing claims; checks that both paths run in this script)
TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            vocab_size=256, tie_word_embeddings=False)


def _config(shape: str, seq: int):
    if shape != "tiny":
        return llama_config(shape, seq)
    from transformers import LlamaConfig

    return LlamaConfig(**TINY, max_position_embeddings=max(seq, 128))


def train(backend: str, shape: str, seq: int, steps: int, warmup: int, on_cuda: bool,
          memory: dict | None = None, applied: dict | None = None) -> list[float]:
    """One run: `warmup + steps` optimizer steps of one sequence of `seq` tokens; the measured steps' times. Into
    `applied`: the memory features the strategy ran with (its resolved `MemoryOptions`, the fields set)."""
    import lightning as L

    from lightning_ulysses import UlyssesDeepSpeedStrategy, UlyssesFSDPStrategy
    from lightning_ulysses.models import CausalLMModule, HuggingFaceCausalLM

    class Module(CausalLMModule):
        def configure_model(self):
            super().configure_model()
            if memory is None:  # otherwise the memory engine checkpoints the layers (when asked to)
                self.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})

        def training_step(self, batch, batch_idx):
            return self.model(**batch).loss

        def configure_optimizers(self):
            # fused: foreach AdamW's fp32 temporary of the whole local optimizer state would tip FSDP2 (fp32
            # parameters and gradients) out of memory first; the same optimizer on both sides
            return torch.optim.AdamW(self.parameters(), lr=1e-5, fused=torch.cuda.is_available())

    config = _config(shape, seq)
    options = {key: value for key, value in config.to_dict().items()
               if key in (TINY if shape == "tiny" else SHAPES[shape]) or key in ("max_position_embeddings", "rope_theta")}
    module = Module(HuggingFaceCausalLM("llama", attn_implementation="sdpa", **options))
    strategy = (UlyssesFSDPStrategy(sequence_parallel_size=1, memory=memory) if backend == "fsdp2"
                else UlyssesDeepSpeedStrategy(sequence_parallel_size=1, stage=3, memory=memory))
    timer = step_timer(StepProfiler(argparse.Namespace(profile=False, warmup=0))) if on_cuda else _CpuTimer()
    trainer = L.Trainer(accelerator="cuda" if on_cuda else "cpu", devices=1, strategy=strategy,
                        precision="bf16-mixed" if on_cuda else "32-true", max_steps=warmup + steps, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        callbacks=[timer])
    trainer.fit(module, torch.utils.data.DataLoader(RandomTokens(seq, config.vocab_size, warmup + steps), batch_size=1))
    if applied is not None:
        applied.update(_features_set(strategy.memory))
    return timer.times[warmup:]


def _features_set(options) -> dict:
    """The fields of a `MemoryOptions` that differ from its defaults (what the run really applied)."""
    import dataclasses

    defaults = type(options)()
    return {field.name: getattr(options, field.name) for field in dataclasses.fields(options)
            if getattr(options, field.name) != getattr(defaults, field.name)}


def _CpuTimer():
    """`step_timer` without CUDA (the --smoke run)."""
    import time

    import lightning as L

    class CpuTimer(L.Callback):
        def __init__(self):
            self.times, self.last = [], None

        def on_train_batch_start(self, trainer, module, batch, batch_idx):
            self.last = self.last or time.perf_counter()

        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
            now = time.perf_counter()
            self.times.append(now - self.last)
            self.last = now

    return CpuTimer()


def worker(args) -> None:
    """One (backend, point) in this process: prints its RESULT line."""
    on_cuda = torch.cuda.is_available() and not args.smoke
    if on_cuda:
        torch.cuda.reset_peak_memory_stats()
    times, error, applied = [], None, {}
    try:
        times = train(args.backend, args.shape, args.seq, args.steps, args.warmup, on_cuda,
                      json.loads(args.memory) if args.memory else None, applied)
    except torch.OutOfMemoryError as oom:
        error = f"OOM: {str(oom).splitlines()[0]}"
    config = _config(args.shape, args.seq)
    result = {"backend": args.backend, "shape": args.shape, "seq": args.seq, "sequence_parallel_size": 1,
              "steps": len(times), "error": error, "memory": args.memory,
              "memory_applied": applied if times else None, "torch": torch.__version__,
              "device": torch.cuda.get_device_name() if on_cuda else "cpu",
              "peak_memory_gib": torch.cuda.max_memory_allocated() / 2**30 if on_cuda else None}
    result.update(timed_fields(config, args.seq, times))
    print("RESULT " + json.dumps(result), flush=True)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--points", nargs="+", default=DEFAULT_POINTS,
                        help="shape:tokens, shapes " + ", ".join(SHAPES) + f" (default: {' '.join(DEFAULT_POINTS)})")
    parser.add_argument("--backends", nargs="+", choices=BACKENDS, default=list(BACKENDS))
    parser.add_argument("--steps", type=int, default=6, help="measured steps per run")
    parser.add_argument("--warmup", type=int, default=2, help="steps before measuring")
    parser.add_argument("--memory", help="MemoryOptions fields as JSON, the same on both backends (default: none; the "
                        "model's own activation checkpointing instead)")
    parser.add_argument("--smoke", action="store_true", help="a tiny Llama on the CPU (fp32), 2 steps per backend")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--backend", choices=BACKENDS, help=argparse.SUPPRESS)
    parser.add_argument("--shape", help=argparse.SUPPRESS)
    parser.add_argument("--seq", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        worker(args)
        return
    points = ["tiny:128"] if args.smoke else args.points
    steps, warmup = (2, 1) if args.smoke else (args.steps, args.warmup)
    order = list(args.backends)
    environment = {"MASTER_ADDR": "127.0.0.1", "RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0",
                   "PYTHONUNBUFFERED": "1", **os.environ}
    for index, point in enumerate(points):
        shape, _, seq = point.partition(":")
        for backend in order:
            command = [sys.executable, __file__, "--worker", "--backend", backend, "--shape", shape, "--seq", seq,
                       "--steps", str(steps), "--warmup", str(warmup), *(["--smoke"] if args.smoke else []),
                       *(["--memory", args.memory] if args.memory else [])]
            run = subprocess.run(command, capture_output=True, text=True,
                                 env={**environment, "MASTER_PORT": str(29700 + index * len(order) + order.index(backend))})
            lines = [line for line in run.stdout.splitlines() if line.startswith("RESULT ")]
            if lines:
                print(lines[-1], flush=True)
            else:
                print("RESULT " + json.dumps({"backend": backend, "shape": shape, "seq": int(seq),
                                              "error": f"exit {run.returncode}: {run.stderr.strip()[-600:]}"}),
                      flush=True)
        order.reverse()  # the other backend first at the next point: machine warm-up favours neither


if __name__ == "__main__":
    main()
