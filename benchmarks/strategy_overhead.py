"""Step time of (a) a plain DeepSpeed ZeRO-3 + Hugging Face loop against (b) UlyssesDeepSpeedStrategy through
Lightning (and (c) Lightning's stock DeepSpeedStrategy), same model, same DeepSpeed config, same data; one JSON
line per run.

    python benchmarks/strategy_overhead.py --variant raw --shape 1b --seq 8192
    python benchmarks/strategy_overhead.py --variant lightning --shape 1b --seq 8192 --sequence-parallel-size 1

With N GPUs (torchrun --nproc_per_node N) variant (b) runs sequence parallelism over them (--sequence-parallel-size
N) and (a) is plain data parallelism on the same total batch: the comparison users make when they switch.
Each variant runs in its own process so that peak memory is its own. Timing: CUDA-synchronised wall time of
whole optimizer steps (data, forward, backward, step), median over the measured steps after warm-up.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch

SHAPES = {
    # Llama 3.2 1B and Llama 3 8B shapes, random init.
    "1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
               num_key_value_heads=8, vocab_size=128256, tie_word_embeddings=True),
    "8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
               num_key_value_heads=8, vocab_size=128256, tie_word_embeddings=False),
}
PEAK_BF16_FLOPS = 772e12  # bf16 matmul peak measured on the lent H200 (8192³ GEMM, 2026-11-29)


def llama_config(shape: str, seq: int):
    from transformers import LlamaConfig

    return LlamaConfig(**SHAPES[shape], max_position_embeddings=max(seq, 8192), rope_theta=500000.0)


def deepspeed_config() -> dict:
    return {
        "zero_optimization": {"stage": 3, "overlap_comm": True, "contiguous_gradients": True,
                              "reduce_bucket_size": 200_000_000, "allgather_bucket_size": 200_000_000},
        "zero_allow_untested_optimizer": True,
    }


class RandomTokens(torch.utils.data.Dataset):
    def __init__(self, seq: int, vocab: int, count: int):
        self.seq, self.vocab, self.count = seq, vocab, count

    def __len__(self):
        return self.count

    def __getitem__(self, index):
        ids = torch.randint(0, self.vocab, (self.seq,), generator=torch.Generator().manual_seed(index))
        return {"input_ids": ids, "labels": ids.clone()}


def model_flops_per_step(config, tokens: int, seq: int, params: int) -> float:
    # 6·N·T for the dense parts plus 6·layers·seq²·hidden per sequence for causal attention (the project's MFU formula).
    return 6 * params * tokens + 6 * config.num_hidden_layers * seq * seq * config.hidden_size * (tokens // seq)


def run_raw(args, config) -> list[float]:
    import deepspeed
    from transformers import AutoModelForCausalLM

    deepspeed.init_distributed("nccl")
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    torch.cuda.set_device(local_rank)
    ds_config = {**deepspeed_config(), "bf16": {"enabled": True}, "train_micro_batch_size_per_gpu": 1,
                 "gradient_accumulation_steps": 1, "gradient_clipping": 0.0}
    with deepspeed.zero.Init(config_dict_or_path=ds_config):
        model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa", dtype=torch.bfloat16)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=ds_config)
    world = torch.distributed.get_world_size()
    dataset = RandomTokens(args.seq, config.vocab_size, (args.warmup + args.steps) * world)
    data = torch.utils.data.DataLoader(
        dataset, sampler=torch.utils.data.DistributedSampler(dataset, shuffle=False), batch_size=1
    )
    times = []
    profiler = StepProfiler(args)
    torch.cuda.synchronize()
    last = time.perf_counter()
    for batch in data:
        profiler.step(len(times))
        batch = {k: v.cuda(non_blocking=True) for k, v in batch.items()}
        loss = engine(**batch).loss
        engine.backward(loss)
        engine.step()
        torch.cuda.synchronize()
        now = time.perf_counter()
        times.append(now - last)
        last = now
    profiler.finish()
    return times[args.warmup:]


class StepProfiler:
    """With --profile: torch.profiler over two steps after warm-up; prints the top kernels and CPU ops."""

    def __init__(self, args):
        self.enabled, self.start, self.profiler = args.profile, args.warmup, None

    def step(self, index: int) -> None:
        if not self.enabled:
            return
        if index == self.start:
            self.profiler = torch.profiler.profile(
                activities=[torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA])
            self.profiler.__enter__()
        elif index == self.start + 2:
            self.finish()

    def finish(self) -> None:
        if self.profiler is not None:
            torch.cuda.synchronize()
            self.profiler.__exit__(None, None, None)
            averages = self.profiler.key_averages()
            print("PROFILE cuda\n" + averages.table(sort_by="cuda_time_total", row_limit=25), flush=True)
            print("PROFILE cpu\n" + averages.table(sort_by="self_cpu_time_total", row_limit=25), flush=True)
            self.profiler = None


def step_timer(profiler: "StepProfiler", split: bool = False):
    """A Lightning callback timing whole steps (CUDA-synchronised): `.times`, one per step. With `split`, also the
    optimizer step alone, from the end of backward (`on_before_optimizer_step`, synchronised: one more wait per step)
    to the step's end: `.optimizer_times`."""
    import lightning as L

    class StepTimer(L.Callback):
        def __init__(self):
            self.times, self.last, self.profiler = [], None, profiler
            self.optimizer_times, self.backward_done = [], None

        def on_train_batch_start(self, trainer, module, batch, batch_idx):
            self.profiler.step(batch_idx)
            if self.last is None:
                torch.cuda.synchronize()
                self.last = time.perf_counter()

        def on_before_optimizer_step(self, trainer, module, optimizer):
            if split:
                torch.cuda.synchronize()
                self.backward_done = time.perf_counter()

        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
            torch.cuda.synchronize()
            now = time.perf_counter()
            self.times.append(now - self.last)
            if self.backward_done is not None:
                self.optimizer_times.append(now - self.backward_done)
                self.backward_done = None
            self.last = now

    return StepTimer()


def run_lightning(args, config) -> list[float]:
    import lightning as L

    from lightning_ulysses import UlyssesDeepSpeedStrategy
    from lightning_ulysses.models import CausalLMModule, HuggingFaceCausalLM

    class Module(CausalLMModule):
        def configure_model(self):
            super().configure_model()
            self.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})

        def training_step(self, batch, batch_idx):
            return self.model(**batch).loss  # no logging: the raw loop logs nothing either

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-5)

    world = int(os.environ.get("WORLD_SIZE", 1))
    dp = world // args.sequence_parallel_size
    options = {key: value for key, value in config.to_dict().items() if key in SHAPES[args.shape]
               or key in ("max_position_embeddings", "rope_theta")}
    module = Module(HuggingFaceCausalLM("llama", attn_implementation="sdpa", **options))
    timer = step_timer(StepProfiler(args))
    if args.variant == "lightning-stock":  # Lightning's own DeepSpeedStrategy: isolates Lightning's share of the cost
        from lightning.pytorch.strategies import DeepSpeedStrategy

        strategy = DeepSpeedStrategy(config=deepspeed_config())
    else:
        strategy = UlyssesDeepSpeedStrategy(sequence_parallel_size=args.sequence_parallel_size, config=deepspeed_config())
    trainer = L.Trainer(accelerator="cuda", devices=world, strategy=strategy, precision="bf16-mixed",
                        max_steps=args.warmup + args.steps, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, callbacks=[timer])
    data = torch.utils.data.DataLoader(RandomTokens(args.seq, config.vocab_size, (args.warmup + args.steps) * dp),
                                       batch_size=1)
    trainer.fit(module, data)
    timer.profiler.finish()
    return timer.times[args.warmup:]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--variant", choices=["raw", "lightning", "lightning-stock"], required=True)
    parser.add_argument("--shape", choices=list(SHAPES), required=True)
    parser.add_argument("--seq", type=int, required=True)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--sequence-parallel-size", type=int, default=1)
    parser.add_argument("--profile", action="store_true", help="print torch.profiler tables of two steps")
    args = parser.parse_args()
    config = llama_config(args.shape, args.seq)
    torch.cuda.reset_peak_memory_stats()
    try:
        times = (run_raw if args.variant == "raw" else run_lightning)(args, config)
        error = None
    except torch.OutOfMemoryError as oom:
        times, error = [], f"OOM: {str(oom).splitlines()[0]}"
    if int(os.environ.get("RANK", 0)) != 0:
        return
    params = _count_params(config)
    world = int(os.environ.get("WORLD_SIZE", 1))
    result = {"variant": args.variant, "shape": args.shape, "seq": args.seq, "gpus": world,
              "sequence_parallel_size": args.sequence_parallel_size if args.variant == "lightning" else 1,
              "params": params, "steps": len(times), "error": error,
              "peak_memory_gib": torch.cuda.max_memory_allocated() / 2**30,
              "device": torch.cuda.get_device_name(), "torch": torch.__version__}
    if times:
        step = statistics.median(times)
        tokens = args.seq * (world // result["sequence_parallel_size"])  # tokens per optimizer step, all GPUs
        flops = model_flops_per_step(config, tokens, args.seq, params)
        result.update(step_time_median_s=step, step_times_s=times, tokens_per_s=tokens / step,
                      model_tflops_per_gpu=flops / step / world / 1e12, mfu=flops / step / world / PEAK_BF16_FLOPS)
    print("RESULT " + json.dumps(result), flush=True)


def _count_params(config) -> int:
    with torch.device("meta"):
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_config(config)
    return sum(p.numel() for p in model.parameters())


if __name__ == "__main__":
    main()
