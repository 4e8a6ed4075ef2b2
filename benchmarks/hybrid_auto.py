"""Hybrid models on ONE GPU: plain Hugging Face against the recipe with `memory=auto`, in one call.

For each shape (`conf/model/qwen3_next_like.yaml`, `conf/model/nemotron_h_like.yaml`):
- **plain HF**: transformers as the user has it (its own PyTorch fallbacks of the delta rule and the SSD scan, no
  flash-linear-attention or mamba kernels on the image; not our linear-time delta rule and blockwise SSD scan, which are
  the recipe's), the
  model from `AutoModelForCausalLM.from_config`, fp32 weights under bf16 autocast and torch's fused AdamW (what
  Lightning's bf16-mixed does, and the bytes per parameter of the recipe's ZeRO-3), `model(input_ids=...,
  labels=...).loss.backward()` and an optimizer step; at 32K, then doubling until it runs out of memory — or, where
  32K does not fit, halving down to 8K, and the recipe also runs at the longest length plain HF fits (the ratio);
- **recipe**: `recipes/train.py experiment=<shape>_auto data.seq_len=L` (SP 1, `strategy.memory=auto`) at 32K,
  64K, 128K and 256K: tokens/s and peak from its `metrics.csv` (ThroughputCallback, the steps after the first) and
  auto's choice from its log.

Each point runs in its own process with a time cap (`--point-cap` seconds; the whole call under `--budget`), so an
out-of-memory or a slow point costs only itself; points left when the budget is spent print "not run" (run them with
`--shapes nemotron_h` in a second call). DeepSpeed's CPU Adam (which an offloading choice needs; 1-2 minutes to build
on a fresh machine) builds in the background from the start, into `$OUT/torch_extensions`. One JSON line per point: shape, variant, tokens, status, tokens/s,
step seconds, peak GiB, the model's FLOPs per step (`planning.step_time.model_flops_per_step`) and, for the recipe,
auto's choice and predicted step.

    # the GPU run (one H200, ~9 minutes at most; carry .whl: deepspeed, hydra-core, omegaconf)
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
        .whl/*.whl && export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1 && python3 benchmarks/hybrid_auto.py
    python benchmarks/hybrid_auto.py --tiny                  # CPU, tiny widths, short rows: checks the plumbing
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SHAPES = ("qwen3_next", "nemotron_h")
# --tiny: widths that keep every layer kind, small enough for a CPU step in seconds (Hydra overrides of the model)
TINY = {"qwen3_next": {"hidden_size": 64, "num_attention_heads": 4, "head_dim": 16, "linear_num_key_heads": 2,
                       "linear_num_value_heads": 4, "linear_key_head_dim": 16, "linear_value_head_dim": 16,
                       "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                       "shared_expert_intermediate_size": 32, "intermediate_size": 96, "vocab_size": 1024},
        "nemotron_h": {"hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
                       "mamba_num_heads": 8, "mamba_head_dim": 16, "ssm_state_size": 16, "n_groups": 2,
                       "chunk_size": 32, "intermediate_size": 96, "n_routed_experts": 4, "moe_intermediate_size": 32,
                       "moe_shared_expert_intermediate_size": 32, "vocab_size": 1024}}

# --tiny: features pinned on (a tiny row needs none), so that the memory engine runs on every layer kind here as the
# GPU run's choices will: layer checkpointing, the tiled MLP (Qwen3-Next's experts; Nemotron-H's blocks refuse it)
TINY_PINNED = {"qwen3_next": "activation_checkpointing: true, tiled_mlp: true, tiled_logits_loss: true",
               "nemotron_h": "activation_checkpointing: true, keep_attention_outputs: true, tiled_logits_loss: true"}


def model_settings(shape: str, tiny: bool) -> dict:
    """The Hugging Face config keywords of `conf/model/<shape>_like.yaml` (with the tiny widths)."""
    import yaml

    settings = yaml.safe_load((ROOT / f"conf/model/{shape}_like.yaml").read_text())["model"]
    settings = {k: v for k, v in settings.items() if k not in ("_target_", "_convert_", "attn_implementation")}
    return {**settings, **(TINY[shape] if tiny else {})}


def hf_config(shape: str, tiny: bool):
    from transformers import AutoConfig

    settings = model_settings(shape, tiny)
    return AutoConfig.for_model(settings.pop("model_type"), **settings)


def flops_per_step(shape: str, tiny: bool, length: int) -> float:
    from lightning_ulysses.planning.planner import ModelShape
    from lightning_ulysses.planning.step_time import model_flops_per_step

    return model_flops_per_step(ModelShape.from_hf_config(hf_config(shape, tiny)), length)


def plain_point(shape: str, length: int, tiny: bool, steps: int) -> dict:
    """Plain Hugging Face, in this process: the median of `steps` timed training steps after one warm-up step."""
    import torch
    from transformers import AutoModelForCausalLM

    device = "cpu" if tiny else "cuda"
    torch.manual_seed(0)
    with torch.device(device):  # initialised where it trains (a CPU init of 1.5B parameters takes longer than a step)
        model = AutoModelForCausalLM.from_config(hf_config(shape, tiny), attn_implementation="sdpa").train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=device == "cuda")
    tokens = torch.randint(0, model.config.vocab_size, (1, length), device=device)
    times = []
    for step in range(steps + 1):
        if device == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        with torch.autocast(device, dtype=torch.bfloat16):
            loss = model(input_ids=tokens, labels=tokens, use_cache=False).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if device == "cuda":
            torch.cuda.synchronize()
        if step:
            times.append(time.perf_counter() - start)
        elif device == "cuda":
            torch.cuda.reset_peak_memory_stats()
    step_s = statistics.median(times)
    peak = torch.cuda.max_memory_allocated() / 2**30 if device == "cuda" else None
    return {"status": "ok", "tokens_per_s": length / step_s, "step_s": step_s, "peak_gib": peak, "times": times}


def recipe_point(shape: str, length: int, tiny: bool, steps: int, cap: float, out: Path,
                 split: bool = False) -> dict:
    """`recipes/train.py experiment=<shape>_auto` at `length`, in a child process; its metrics.csv read back (and
    with `split`, each step's seconds by Lightning hook: `step_split.SplitProfiler`)."""
    run = out / f"{shape}_{length}"
    overrides = [f"experiment={shape}_auto", f"data.seq_len={length}", f"trainer.max_steps={steps + 1}",
                 f"data.num_train={steps + 1}", f"hydra.run.dir={run}", "loggers.tensorboard=false"]
    if split:
        overrides.append("+trainer.profiler={_target_: benchmarks.step_split.SplitProfiler}")
    if tiny:
        overrides += ["trainer=cpu", "trainer.devices=1", "trainer.max_steps=%d" % (steps + 1), "trainer.limit_val_batches=0",
                      "trainer.enable_checkpointing=false", "trainer.log_every_n_steps=1", "data.vocab_size=64",
                      "~strategy.memory", "+strategy.memory={auto: true, free_memory: [8.0e9, 8.0e9], %s}"
                      % TINY_PINNED[shape]]
        overrides += [f"model.model.{key}={value}" for key, value in TINY[shape].items()]
    command = [sys.executable, str(ROOT / "recipes/train.py"), *overrides]
    try:
        done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=cap)
    except subprocess.TimeoutExpired as expired:
        log = (expired.stdout or b"").decode() if isinstance(expired.stdout, bytes) else (expired.stdout or "")
        return {"status": f"over the {cap:.0f} s cap", "log_tail": log[-600:]}
    (out / f"{shape}_{length}.log").write_text(done.stdout + done.stderr)
    record: dict = {"choice": _auto_choice(done.stdout + done.stderr)}
    hooks = [line for line in done.stdout.splitlines() if line.startswith("STEP_SPLIT ")]
    if hooks:
        record["seconds_by_hook"] = json.loads(hooks[-1].split(" ", 1)[1])
    if done.returncode:
        text = done.stdout + done.stderr
        record["status"] = "out of memory" if "out of memory" in text.lower() else f"exit {done.returncode}"
        record["error"] = next((line for line in reversed(text.splitlines()) if "Error" in line or "error" in line),
                               text[-300:])[:400]
        return record
    rows = [row for path in run.rglob("metrics.csv") for row in csv.DictReader(path.open())
            if row.get("throughput/tokens_per_s")]
    timed = [row for row in rows if int(row["step"]) >= 1] or rows  # the steps after the first
    rate = statistics.median(float(row["throughput/tokens_per_s"]) for row in timed)
    return {**record, "status": "ok", "tokens_per_s": rate, "step_s": length / rate,
            "peak_gib": max(float(row["memory/peak_gib"]) for row in timed)}


def _auto_choice(log: str) -> dict:
    """memory="auto"'s report lines from a run's log: the features on, the predicted peak and step."""
    features = re.findall(r"^\s{2}(\w+)\s+True\s", log, flags=re.M)
    predicted = re.search(r"predicted: device peak ([\d.]+) GiB.*?step ([\d.]+) s", log)
    confirmed = re.search(r"confirmed over \d+ steps: step ([\d.]+) s", log)
    # which layers are checkpointed ("all", or "N of L (layers [...])" with the reason) and what the recompute keeps
    layers = re.search(r"^\s{2}checkpoint_layers\s+(\S+)\s+(.*)$", log, flags=re.M)
    return {"features": features, "checkpoint_layers": layers and f"{layers.group(1)}: {layers.group(2)}",
            "kept_in_recompute": [name for name in features if name.startswith("keep_")],
            "predicted_peak_gib": predicted and float(predicted.group(1)),
            "predicted_step_s": predicted and float(predicted.group(2)),
            "confirmed_step_s": confirmed and float(confirmed.group(1))}


def planned_longest(shape: str) -> int:
    """memory="auto"'s longest row for `shape` on this machine (`auto.longest_fit` from the free memory auto reads,
    in a child process: no CUDA context here), rounded down to a multiple of 1024 tokens."""
    code = ("import sys; sys.path.insert(0, 'benchmarks'); import torch; from hybrid_auto import hf_config;"
            " from lightning_ulysses.planning.planner import ModelShape;"
            " from lightning_ulysses.planning.auto import AutoMemory, longest_fit, measure_free_memory;"
            " from lightning_ulysses.parallel.run_spec import RunSpec;"
            " free = measure_free_memory(torch.device('cuda'));"
            f" print(longest_fit(ModelShape.from_hf_config(hf_config({shape!r}, False)), AutoMemory(),"
            " RunSpec(precision='bf16-mixed', device='cuda'), free)[0], free)")
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    print(json.dumps({"shape": shape, "planned_longest": done.stdout.strip(), "error": done.stderr[-300:] or None}),
          flush=True)
    return int(done.stdout.split()[0]) // 1024 * 1024


def _linear_time_kernels() -> dict:
    """Per hybrid mixer class: which of transformers' fallbacks our linear-time kernels replace there, and whether
    flash-linear-attention imports (its kernels are never replaced)."""
    import importlib
    import importlib.util

    from lightning_ulysses.mixers.kernels import LinearTimeKernels

    bound = {}
    for module, name in (("qwen3_next.modeling_qwen3_next", "Qwen3NextGatedDeltaNet"),
                         ("nemotron_h.modeling_nemotron_h", "NemotronHMamba2Mixer")):
        mixer = getattr(importlib.import_module(f"transformers.models.{module}"), name)
        bound[name] = sorted(LinearTimeKernels(mixer).replacements)
    return {"ours_in_place_of": bound, "fla_installed": importlib.util.find_spec("fla") is not None}


def environment() -> dict:
    """The first JSON line: versions and device, read without initialising CUDA here (a context in this process
    would take memory from the points' processes)."""
    import torch
    import transformers

    try:
        gpu = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=30).stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        gpu = None
    return {"torch": torch.__version__, "transformers": transformers.__version__, "gpu": gpu or None,
            **_linear_time_kernels()}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--shapes", nargs="+", choices=SHAPES, default=list(SHAPES))
    parser.add_argument("--lengths", type=int, nargs="+", default=[32768, 65536, 131072, 262144])
    parser.add_argument("--steps", type=int, default=2, help="timed steps per point (after one warm-up step)")
    parser.add_argument("--point-cap", type=float, default=130.0, help="seconds one point may take")
    parser.add_argument("--budget", type=float, default=530.0, help="seconds the whole call may take")
    parser.add_argument("--tiny", action="store_true", help="CPU, tiny widths, 64- and 128-token rows")
    parser.add_argument("--longest", action="store_true", help="the recipe also at auto's planned longest row")
    parser.add_argument("--split", action="store_true", help="the recipe's seconds per step by Lightning hook")
    parser.add_argument("--out", default=os.environ.get("OUT", "outputs/hybrid_auto"))
    parser.add_argument("--point", nargs=2, metavar=("SHAPE", "LENGTH"), help=argparse.SUPPRESS)  # one plain point
    args = parser.parse_args()
    if args.point:
        print(json.dumps(plain_point(args.point[0], int(args.point[1]), args.tiny, args.steps)), flush=True)
        return
    lengths = [64, 128] if args.tiny else args.lengths
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    start = time.monotonic()

    def emit(shape: str, variant: str, length: int, record: dict) -> None:
        print(json.dumps({"shape": shape, "variant": variant, "tokens": length,
                          "model_tflops_per_step": flops_per_step(shape, args.tiny, length) / 1e12, **record}),
              flush=True)

    def cap() -> float:
        return min(args.point_cap, args.budget - (time.monotonic() - start))

    def plain(shape: str, length: int) -> str:
        command = [sys.executable, __file__, "--point", shape, str(length), "--steps", str(args.steps)]
        command += ["--tiny"] if args.tiny else []
        try:
            done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=cap(),
                                  env={**os.environ, "PYTHONPATH": f"{ROOT}:{os.environ.get('PYTHONPATH', '')}"})
            lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
            record = (json.loads(lines[-1]) if lines else
                      {"status": "out of memory" if "OutOfMemoryError" in done.stderr else f"exit {done.returncode}",
                       "error": done.stderr.strip().splitlines()[-1][:300] if done.stderr.strip() else ""})
        except subprocess.TimeoutExpired:
            record = {"status": "over the time cap"}
        emit(shape, "plain_hf", length, record)
        return record["status"]

    if not args.tiny:  # DeepSpeed's CPU Adam (an offloading choice needs it) builds beside the first points
        os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(out / "torch_extensions"))
        subprocess.Popen([sys.executable, "-c", "import torch; from deepspeed.ops.adam import DeepSpeedCPUAdam;"
                          " DeepSpeedCPUAdam([torch.nn.Parameter(torch.zeros(8))])"], cwd=ROOT,
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    print(json.dumps(environment()), flush=True)
    for shape in args.shapes:
        # plain HF: the first length, then doubling until it runs out of memory (or the time is spent); where the
        # first does not fit, halving down to 8K, and the recipe runs at the longest that fits too (the ratio)
        compared, length = [], lengths[0]
        while cap() > 10:
            status = plain(shape, length)
            if status == "ok":
                compared.append(length)
                if compared[0] < lengths[0] or (args.tiny and length >= lengths[-1]):
                    break
                length *= 2
            elif compared or length <= min(8192, lengths[0]):
                break
            else:
                length //= 2
        extra = [length for length in compared if length < lengths[0]]
        longest = [planned_longest(shape)] if args.longest and not args.tiny else []
        for length in sorted(set(extra + lengths + longest)):
            if cap() <= 10:
                emit(shape, "recipe_auto", length, {"status": "not run: the call's time budget is spent"})
                continue
            steps = min(args.steps, 1) if longest and length == longest[0] else args.steps  # the longest row: 1
            emit(shape, "recipe_auto", length, recipe_point(shape, length, args.tiny, steps, cap(), out, args.split))


if __name__ == "__main__":
    main()
