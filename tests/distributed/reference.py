"""Single-process, full-sequence fp32 references: plain Hugging Face, plain torch SGD, no DeepSpeed."""

from __future__ import annotations

import torch

from typing import Callable, Optional

from torch.utils.data import Dataset

from tests.distributed.common import UnevenlyMaskedTokens, build_model, collate


def _model_loss(model, batch: dict) -> torch.Tensor:
    return model(input_ids=batch["input_ids"], labels=batch["labels"]).loss


def reference_training(
    num_key_value_heads: int,
    seq_len: int,
    steps: list[list[list[int]]],
    lr: float = 0.5,
    gradient_clip_val: float | None = None,
    kind: str = "llama",
    dataset: Optional[Dataset] = None,
    replica_loss: Callable[..., torch.Tensor] = _model_loss,
    dataset_kwargs: dict | None = None,
    micro_batches: int = 1,
    micro_batch_size: int | None = None,
    precision: str = "32-true",
) -> dict:
    """Train on `steps[t][dp_rank]` = sample indices, averaging the DP replicas' losses as DDP/ZeRO do.

    `micro_batches` > 1: one SGD step per `t` still, each replica's samples cut into that many equal micro-batches
    whose losses are averaged (what gradient accumulation means); `losses` then holds one entry per micro-batch.
    `micro_batch_size`: cut into micro-batches of that many samples instead, as Lightning's accumulation windows do:
    a window may hold fewer than `micro_batches` of them (the epoch's last, partial one), and its summed loss is still
    divided by `micro_batches` (Lightning divides every micro-batch's loss by `accumulate_grad_batches`).

    Uses eager attention and Hugging Face's own shifted loss (for the native GPT: its own unsharded forward and
    shifted loss), independent of everything under test; `replica_loss(model, batch)` replaces that loss (packed
    rows: every document alone), `dataset` the `UnevenlyMaskedTokens` samples (or `dataset_kwargs` its options).

    `precision="bf16-mixed"`: what DeepSpeed's bf16 does, in one process: the model's weights in bf16 (forward and
    backward in bf16), the SGD step on an fp32 master copy of the bf16 weights (gradients cast to fp32, clipped there),
    the bf16 weights then the master rounded; `initial` and `final` are the fp32 masters, `final_bf16` the bf16
    weights.
    """
    dataset = dataset if dataset is not None else UnevenlyMaskedTokens(10_000, seq_len, **(dataset_kwargs or {}))
    model = build_model(kind, num_key_value_heads, reference=True)
    initial = {name: p.detach().clone() for name, p in model.named_parameters()}
    if precision == "bf16-mixed":
        return _bf16_reference_training(model, initial, dataset, steps, lr, gradient_clip_val, replica_loss,
                                        micro_batches, micro_batch_size)
    assert precision == "32-true", precision
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    losses = []
    for replicas in steps:
        optimizer.zero_grad()
        micro_losses = []  # [dp_rank][micro-batch]
        for indices in replicas:
            size = micro_batch_size or len(indices) // micro_batches
            micro_losses.append([replica_loss(model, collate([dataset[i] for i in indices[j:j + size]]))
                                 for j in range(0, len(indices), size)])
        torch.stack([torch.stack(micro).sum() / micro_batches for micro in micro_losses]).mean().backward()
        if gradient_clip_val:
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), gradient_clip_val)
            assert norm > gradient_clip_val, "the clipping case must actually clip"
        optimizer.step()
        losses += [[micro[j].item() for micro in micro_losses] for j in range(len(micro_losses[0]))]
    final = {name: p.detach().clone() for name, p in model.named_parameters()}
    trainable = {name for name, p in model.named_parameters() if p.requires_grad}
    return {"losses": losses, "initial": initial, "final": final, "trainable": trainable}


def _bf16_reference_training(model, initial, dataset, steps, lr, gradient_clip_val, replica_loss, micro_batches,
                             micro_batch_size) -> dict:
    """`reference_training` under bf16-mixed (see there): bf16 weights computing, an fp32 master copy stepping."""
    model = model.to(torch.bfloat16)
    trainable = [(name, p) for name, p in model.named_parameters() if p.requires_grad]
    # DeepSpeed's master copy starts from the bf16 weights (the fp32 initialisation rounded), not from the fp32 ones
    master = {name: p.detach().float() for name, p in trainable}
    initial = {name: p.detach().float() for name, p in model.named_parameters()}
    losses = []
    for replicas in steps:
        model.zero_grad(set_to_none=True)
        micro_losses = []  # [dp_rank][micro-batch]
        for indices in replicas:
            size = micro_batch_size or len(indices) // micro_batches
            micro_losses.append([replica_loss(model, collate([dataset[i] for i in indices[j:j + size]]))
                                 for j in range(0, len(indices), size)])
        torch.stack([torch.stack(micro).sum() / micro_batches for micro in micro_losses]).float().mean().backward()
        gradients = {name: p.grad.float() for name, p in trainable}
        if gradient_clip_val:
            norm = torch.nn.utils.get_total_norm(list(gradients.values()))
            assert norm > gradient_clip_val, "the clipping case must actually clip"
            gradients = {name: g * (gradient_clip_val / (norm + 1e-6)) for name, g in gradients.items()}
        with torch.no_grad():
            for name, p in trainable:
                master[name] -= lr * gradients[name]
                p.copy_(master[name])
        losses += [[micro[j].item() for micro in micro_losses] for j in range(len(micro_losses[0]))]
    final = {name: master.get(name, p.detach().float()) for name, p in model.named_parameters()}
    return {"losses": losses, "initial": initial, "final": final, "trainable": set(master),
            "final_bf16": {name: p.detach().clone() for name, p in model.named_parameters()}}


def assert_weights_match(weights: dict, reference: dict) -> None:
    """Weights after the SGD steps equal the reference's within 1e-4 of the size of its update.

    An update is measured against at least 1e-6 of the largest one: some gradients are zero analytically (a key
    projection's bias under softmax, which shifts all scores of a query alike: OPT, BioGPT, ...), and their
    "update" is rounding noise (~1e-11) that no two summation orders reproduce. Some are too small to move an fp32
    weight at all (a tiny Mamba2 mixer's `dt_bias` and `A_log`: gradients of ~1e-9 on weights of ~1): their update
    is exactly zero, and they are held to that floor too (they must not move either).

    Below that, fp32 itself: `w - lr * g` rounds to the weight's own resolution, so a gradient that differs in its
    last bits (another summation order: a ring's two-stage exchange) can move a weight one unit in the last place
    the other way. So each element's difference is counted beyond one such rounding (`eps * |w|`: one or two units
    in the last place of that element), not below it, which no two summation orders can promise: a Gated DeltaNet
    mixer's `A_log` updated by 2.4e-4 differed by 3.0e-8 (one ulp) in one element on a ring, 1.25e-4 of its update.
    """
    updates = {name: (final - reference["initial"][name]).norm() for name, final in reference["final"].items()}
    floor = 1e-6 * max(updates.values())
    assert floor > 0, "the reference trained nothing"
    for name, final in reference["final"].items():
        if name not in reference.get("trainable", reference["final"]):  # frozen (LoRA's base): never moves
            assert torch.equal(weights[name], final), f"{name} is frozen but changed"
            continue
        difference = (weights[name] - final).abs()
        error = (difference - torch.finfo(final.dtype).eps * final.abs()).clamp(min=0).norm()
        assert error <= 1e-4 * max(updates[name], floor), \
            f"{name}: error {error:.3e} beyond fp32 rounding (whole: {difference.norm():.3e}) vs update {updates[name]:.3e}"


def assert_training_matches(ranks: list[dict], reference: dict) -> None:
    """Every rank's per-step loss equals its DP replica's reference loss (1e-5) and the final weights match."""
    for rank in ranks:
        for step, record in enumerate(rank["records"]):
            expected = reference["losses"][step][rank["data_parallel_rank"]]
            assert abs(record["loss"] - expected) < 1e-5, (step, record["loss"], expected)
    assert_weights_match(next(rank["weights"] for rank in ranks if rank["weights"] is not None), reference)
