"""Offloaded activations on a GPU: the overlapped copies give bit-identical losses and gradients; one JSON line.

    python benchmarks/offload_overlap.py

CUDA streams cannot run on the CPU machines the tests run on, so this is the GPU half of the check in
`tests/unit/test_memory.py`: a small HF Llama (4 layers) trains one step with layer checkpointing and its inputs and
kept attention outputs offloaded, copies on the side stream (`HostActivationStore.overlap_transfers`, the default)
and on the compute stream, in fp32 and bf16, with every input kept and with every second one; the loss and every
gradient must equal those of the same checkpointing without offload bit for bit (the copies move bytes, nothing
else). The layers' compute is padded with a long sequence so that the copies really do run beside it. Deterministic
algorithms are on, attention runs on the memory-efficient kernel (flash's bf16 backward accumulates with atomics:
two runs of the reference itself differ), and the reference runs twice: its own repeatability is part of the line.
"""

from __future__ import annotations

import copy
import json
import os

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from transformers import LlamaConfig, LlamaForCausalLM

from lightning_ulysses.memory import HostActivationStore, MemoryOptions, apply_memory_options


def _step(model: torch.nn.Module, input_ids: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    with sdpa_kernel([SDPBackend.EFFICIENT_ATTENTION]):  # forward and backward (recomputes) alike
        loss = model(input_ids=input_ids, labels=input_ids).loss
        loss.backward()
    torch.cuda.synchronize()
    return loss.detach(), {name: p.grad.clone() for name, p in model.named_parameters()}


def _equal(a: tuple, b: tuple) -> bool:
    return bool(torch.equal(a[0], b[0])) and all(torch.equal(a[1][name], b[1][name]) for name in b[1])


def main() -> None:
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=512, hidden_size=512, intermediate_size=1536, num_hidden_layers=4,
                         num_attention_heads=8, num_key_value_heads=8, max_position_embeddings=16384,
                         attn_implementation="sdpa")
    base = LlamaForCausalLM(config).cuda().train()
    input_ids = torch.randint(0, config.vocab_size, (1, 16384), device="cuda")
    results = []
    for dtype in (torch.float32, torch.bfloat16):
        for interval in (1, 2):
            kept = dict(activation_checkpointing=True, checkpoint_interval=interval, keep_attention_outputs=True)
            reference = copy.deepcopy(base).to(dtype)
            apply_memory_options(reference, MemoryOptions(**kept))
            expected = _step(reference, input_ids)
            repeatable = _equal(_step(reference, input_ids), expected)
            for overlap in (True, False):
                HostActivationStore.overlap_transfers = overlap
                model = copy.deepcopy(base).to(dtype)
                apply_memory_options(model, MemoryOptions(offload_activations=True, **kept), HostActivationStore())
                # the second step reuses the host buffers
                same = [_equal(_step(model, input_ids), expected) for _ in range(2)]
                results.append({"dtype": str(dtype), "interval": interval, "overlapped": overlap,
                                "reference_repeatable": repeatable, "bit_identical": all(same)})
    HostActivationStore.overlap_transfers = True
    print("RESULT " + json.dumps({"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                                  "all_bit_identical": all(r["bit_identical"] for r in results),
                                  "cases": results}), flush=True)


if __name__ == "__main__":
    main()
