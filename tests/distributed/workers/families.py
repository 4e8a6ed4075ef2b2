"""Worker: the model-family matrix. Every family is prepared as the strategy prepares it and run on shards.

For each SP size and family: a tiny random model switched by `prepare_hf_model` (the strategy's
`SequenceParallelCausalLMLoss`), a batch cut by `SequenceSharder` with unevenly masked labels, one forward and
backward; compared with the same model unprepared on the full sequence in this process (fp32): the loss, and the
gradients summed over the SP group. A family refused by the checks is recorded with the refusal's message; one
that cannot be built small here is recorded as untested with the reason. Then a few families train through the
Trainer (train_parity's cases) on ZeRO-2 and ZeRO-3.
"""

import copy
import json
import logging
import sys
import time
import warnings
from pathlib import Path

import torch
import torch.distributed as dist

from lightning_ulysses import SequenceSharder, prepare_hf_model
from lightning_ulysses.attention.hf import validate_hf_model
from lightning_ulysses.layout import ParallelLayout, SequenceParallelGroups
from lightning_ulysses.attention.rows import BatchRowsSlot
from lightning_ulysses.loss import SequenceParallelCausalLMLoss
from tests.distributed.families import SEQ_LEN, VOCAB, tiny_model


def family_batch() -> dict:
    generator = torch.Generator().manual_seed(5)
    input_ids = torch.randint(3, VOCAB, (2, SEQ_LEN), generator=generator)
    labels = input_ids.clone()
    labels[0, : SEQ_LEN // 2] = -100  # row 0: no target at all in its first half (a whole shard at SP 2 and 4)
    labels[1, torch.rand(SEQ_LEN, generator=generator) < 0.3] = -100
    return {"input_ids": input_ids, "labels": labels}


def relative_gradient_error(model, reference, group) -> float:
    """Largest gap between the gradients summed over the SP group and the reference's, relative to each tensor's
    largest reference gradient, floored at 1e-6 of the model's largest: a gradient that is zero analytically
    (a key projection's bias under softmax, which shifts every score of a query alike) comes out as ~1e-11 of
    rounding noise, and noise measured against noise says nothing (it read as "OPT is 50% off")."""
    named = dict(reference.named_parameters())
    floor = 1e-6 * max(p.grad.abs().max().item() for p in reference.parameters() if p.grad is not None)
    worst = 0.0
    for name, mine in model.named_parameters():
        full = named[name].grad if named[name].grad is not None else torch.zeros_like(mine)
        grad = torch.zeros_like(mine) if mine.grad is None else mine.grad.clone()
        dist.all_reduce(grad, group=group)
        worst = max(worst, (grad - full).abs().max().item() / max(full.abs().max().item(), floor))
    return worst


def build(family: dict):
    """(model, attention implementation) or the reason it cannot be built small here."""
    name, overrides = family["family"], family.get("overrides", {})
    try:
        return tiny_model(name, "sdpa", **overrides), "sdpa"
    except ValueError as error:
        if "scaled_dot_product_attention" not in str(error):
            raise
    # a family transformers allows in eager (or flash/flex) only: the checks must refuse it
    return tiny_model(name, "eager", **overrides), "eager"


def run_family(family: dict, sp_groups: dict) -> dict:
    """{sp: outcome} for one family; the model is built once and copied for every SP size."""
    batch = family_batch()
    try:
        reference, _ = build(family)
        if family.get("eval"):
            reference.eval()  # a router that samples in training (PhiMoE's Gumbel draws) has no exact reference
        pristine = copy.deepcopy(reference)
        reference_loss = reference(**batch).loss
        reference_loss.backward()
    except Exception as error:  # the same on every rank: no collective has run for this family
        why = f"{type(error).__name__}: {str(error).strip().splitlines()[0][:160]}"
        return {sp: {"status": "untested", "why": why} for sp in sp_groups}
    outcomes = {}
    for sp, groups in sp_groups.items():
        group, model = groups.sequence_parallel_group, copy.deepcopy(pristine)
        try:
            validate_hf_model(model, sp)  # what the strategy checks first, for every model, before any collective
            slot = BatchRowsSlot()  # as the strategy: the sharder publishes each batch's rows to the attention and loss
            prepare_hf_model(model, group, SequenceParallelCausalLMLoss(group, 1.0, batch_rows=slot), batch_rows=slot)
        except (ValueError, NotImplementedError) as error:
            outcomes[sp] = {"status": "refused", "why": str(error)}
            continue
        loss = model(**SequenceSharder(sp, groups.sequence_parallel_rank, batch_rows=slot)(batch)).loss
        loss.backward()
        outcomes[sp] = {"status": "ran", "loss_error": abs(loss.item() - reference_loss.item()),
                        "grad_error": relative_gradient_error(model, reference, group)}
    return outcomes


def main():
    spec = json.loads(Path(sys.argv[1]).read_text())
    workdir = Path(sys.argv[2])
    warnings.filterwarnings("ignore")
    logging.getLogger("transformers").setLevel(logging.ERROR)
    dist.init_process_group("gloo")
    import transformers

    output = {"families": {}, "seconds": {}, "transformers_version": transformers.__version__}
    sp_groups = {sp: SequenceParallelGroups.build(ParallelLayout(dist.get_world_size(), sp))
                 for sp in spec["sequence_parallel_sizes"]}
    for family in spec["families"]:
        start = time.monotonic()
        output["families"][family["family"]] = run_family(family, sp_groups)
        output["seconds"][family["family"]] = time.monotonic() - start
    if spec.get("training_cases"):
        from tests.distributed.workers.train_parity import run_case

        start = time.monotonic()
        output["training"] = {case["name"]: run_case(dict(case, workdir=str(workdir)), dist.get_world_size())
                              for case in spec["training_cases"]}
        output["seconds"]["training"] = time.monotonic() - start
    torch.save(output, workdir / f"result_{dist.get_rank()}.pt")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
