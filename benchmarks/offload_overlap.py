"""Offloaded activations on a GPU: every tensor the recomputes read back is the one the forward stashed, bit for bit,
with the copies overlapped; losses bit-identical, gradients as repeatable as the reference's own. One JSON line.

    python benchmarks/offload_overlap.py

CUDA streams cannot run on the CPU machines the tests run on, so this is the GPU half of the check in
`tests/unit/test_memory.py`: a small HF Llama (4 layers) trains one step with layer checkpointing and its inputs and
kept attention outputs offloaded, copies on the side stream (`HostActivationStore.overlap_transfers`, the default)
and on the compute stream, in fp32 and bf16, with every input kept and with every second one. Each kept tensor is
also cloned on the device when stashed, and each copy back is compared with its clone once the compute stream has
waited for it (`torch.equal`): the copies move bytes, nothing else. The loss must equal that of the same
checkpointing without offload bit for bit; the fused attention kernels' backward accumulates with atomics (two runs
of the reference itself differ), so gradients are compared with the reference's own run-to-run difference. The
layers' compute is padded with a long sequence so that the copies really do run beside it.
"""

from __future__ import annotations

import copy
import json
import os

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from lightning_ulysses.memory import HostActivationStore, MemoryOptions, apply_memory_options
from lightning_ulysses.memory import checkpointing


class _Compared(checkpointing._Kept):
    """A kept tensor with a device clone; every `get` compares what came back with it."""

    mismatches = 0
    reads = 0

    def __init__(self, tensor, store, what):
        super().__init__(tensor, store, what)
        self.clone = tensor.detach().clone()

    def get(self):
        tensor = super().get()
        _Compared.reads += 1
        _Compared.mismatches += not torch.equal(tensor, self.clone)
        return tensor


def _step(model: torch.nn.Module, input_ids: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    loss = model(input_ids=input_ids, labels=input_ids).loss
    loss.backward()
    torch.cuda.synchronize()
    return loss.detach(), {name: p.grad.clone() for name, p in model.named_parameters()}


def _largest_difference(a: dict, b: dict) -> float:
    return max((a[name].float() - b[name].float()).abs().max().item() for name in b)


def main() -> None:
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    checkpointing._Kept = _Compared
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
            noise = _largest_difference(_step(reference, input_ids)[1], expected[1])
            for overlap in (True, False):
                HostActivationStore.overlap_transfers = overlap
                model = copy.deepcopy(base).to(dtype)
                apply_memory_options(model, MemoryOptions(offload_activations=True, **kept), HostActivationStore())
                _Compared.reads = _Compared.mismatches = 0
                for step in range(2):  # the second step reuses the host buffers
                    loss, grads = _step(model, input_ids)
                    results.append({"dtype": str(dtype), "interval": interval, "overlapped": overlap, "step": step,
                                    "copies_read": _Compared.reads, "copies_differing": _Compared.mismatches,
                                    "loss_bit_identical": bool(torch.equal(loss, expected[0])),
                                    "largest_gradient_difference": _largest_difference(grads, expected[1]),
                                    "reference_run_to_run": noise})
    HostActivationStore.overlap_transfers = True
    print("RESULT " + json.dumps({"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                                  "every_copy_exact": all(r["copies_differing"] == 0 and r["copies_read"] > 0
                                                          for r in results),
                                  "cases": results}), flush=True)

if __name__ == "__main__":
    main()
