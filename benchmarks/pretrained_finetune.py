"""Fine-tuning a `save_pretrained` folder against random init, through the Trainer and the strategy.

`--init save` writes a random Llama folder of the chosen shape (bf16 safetensors) and exits; `--init pretrained`
trains `CausalLMModule.from_pretrained(folder)` (weights loaded in `configure_model`, under ZeRO-3 straight into the
partitions); `--init random` trains the same shape from `HuggingFaceCausalLM` (what the random-init recipes build).
Both: UlyssesDeepSpeedStrategy ZeRO-3, SP 1 on one GPU, bf16-mixed, torch AdamW on the GPU, the long-sequence memory
features of conf/experiment/llama8b_long.yaml, random tokens. One JSON line: load time and host-memory peak of
`configure_model` (RSS sampled every 10 ms), median step time after the first step, tokens/s.

    python benchmarks/pretrained_finetune.py --init save --shape llama3-8b --folder /tmp/llama8b
    python benchmarks/pretrained_finetune.py --init pretrained --shape llama3-8b --folder /tmp/llama8b --seq-len 32768
    python benchmarks/pretrained_finetune.py --init random --shape llama3-8b --seq-len 32768
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")

import lightning as L  # noqa: E402
import torch  # noqa: E402
from torch.utils.data import DataLoader, Dataset  # noqa: E402

from benchmarks.memory_engine import host_rss  # noqa: E402
from lightning_ulysses import UlyssesDeepSpeedStrategy  # noqa: E402
from lightning_ulysses.models import CausalLMModule, HuggingFaceCausalLM  # noqa: E402

GIB = 2**30
# conf/model/llama_8b.yaml's shape; the 1B row is Llama-3.2-1B's
SHAPES = {
    "llama3-8b": dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                      num_attention_heads=32, num_key_value_heads=8, rope_theta=500000.0, tie_word_embeddings=False),
    "llama3.2-1b": dict(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                        num_attention_heads=32, num_key_value_heads=8, rope_theta=500000.0, tie_word_embeddings=True),
    "tiny": dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, tie_word_embeddings=False),
}
MEMORY = dict(tiled_mlp=True, tiled_logits_loss=True, activation_checkpointing=True, offload_activations=True,
              keep_attention_outputs=True, low_memory_norms=True, expandable_segments=True)


class RandomTokens(Dataset):
    def __init__(self, vocab: int, seq_len: int, rows: int):
        self.vocab, self.seq_len, self.rows = vocab, seq_len, rows

    def __len__(self) -> int:
        return self.rows

    def __getitem__(self, index: int) -> dict:
        row = torch.randint(self.vocab, (self.seq_len,), generator=torch.Generator().manual_seed(index))
        return {"input_ids": row, "labels": row.clone()}


class Measured(CausalLMModule):
    """The recipes' module, timing `configure_model` and sampling host memory while it runs."""

    def configure_model(self) -> None:
        if self.model is not None:
            return
        peak, stop = [host_rss()], threading.Event()

        def sample() -> None:
            while not stop.wait(0.01):
                peak[0] = max(peak[0], host_rss())

        before, started = peak[0], time.perf_counter()
        thread = threading.Thread(target=sample, daemon=True)
        thread.start()
        try:
            super().configure_model()
        finally:
            stop.set()
            thread.join()
        self.load = {"load_s": time.perf_counter() - started, "load_host_peak_gib": (peak[0] - before) / GIB,
                     "host_before_gib": before / GIB}


def synchronize() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


class StepTimes(L.Callback):
    def __init__(self) -> None:
        self.times: list[float] = []

    def on_train_batch_start(self, trainer, module, batch, batch_idx) -> None:
        synchronize()
        self.started = time.perf_counter()

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx) -> None:
        synchronize()
        self.times.append(time.perf_counter() - self.started)


def save(shape: str, folder: Path) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    started = time.perf_counter()
    config = LlamaConfig(**SHAPES[shape], max_position_embeddings=1 << 20, torch_dtype="bfloat16")
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
        model = LlamaForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(folder, max_shard_size="5GB")
    print(json.dumps({"saved": str(folder), "shape": shape, "save_s": time.perf_counter() - started,
                      "bytes": sum(f.stat().st_size for f in folder.glob("*.safetensors"))}), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--init", choices=["save", "pretrained", "random"], required=True)
    parser.add_argument("--shape", choices=sorted(SHAPES), default="llama3-8b")
    parser.add_argument("--folder", type=Path, default=Path("/tmp/pretrained"))
    parser.add_argument("--seq-len", type=int, default=32768)
    parser.add_argument("--steps", type=int, default=4)
    args = parser.parse_args()
    if args.init == "save":
        return save(args.shape, args.folder)
    if args.init == "pretrained":
        module = Measured.from_pretrained(str(args.folder), learning_rate=1e-5)
    else:
        module = Measured(HuggingFaceCausalLM("llama", max_position_embeddings=1 << 20, **SHAPES[args.shape]),
                          learning_rate=1e-5)
    timer = StepTimes()
    gpu = torch.cuda.is_available()  # CPU: a smoke run of the script itself (tiny shape, fp32, no memory features)
    strategy = UlyssesDeepSpeedStrategy(stage=3, sequence_parallel_size=1, memory=MEMORY if gpu else None,
                                        sdpa_kernel_priority=["cudnn"] if gpu else None)
    trainer = L.Trainer(accelerator="gpu" if gpu else "cpu", devices=1, precision="bf16-mixed" if gpu else "32-true", strategy=strategy,
                        max_steps=args.steps, callbacks=[timer], logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0)
    data = DataLoader(RandomTokens(SHAPES[args.shape]["vocab_size"], args.seq_len, args.steps), batch_size=1)
    trainer.fit(module, train_dataloaders=data)
    median = statistics.median(timer.times[1:] or timer.times)
    print(json.dumps({"init": args.init, "shape": args.shape, "seq_len": args.seq_len, **module.load,
                      "step_s": median, "tokens_per_s": args.seq_len / median, "times": timer.times,
                      "gpu_peak_gib": torch.cuda.max_memory_allocated() / GIB if gpu else None,
                      "loss": float(trainer.callback_metrics.get("train/loss", float("nan")))}), flush=True)


if __name__ == "__main__":
    main()
