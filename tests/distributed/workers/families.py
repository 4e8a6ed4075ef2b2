"""Worker: the model-family matrix. Every family is prepared as the strategy prepares it and run on shards.

For each SP size and family: a tiny random model switched by `prepare_hf_model` (the strategy's
`SequenceParallelCausalLMLoss`), batches cut by `SequenceSharder` (unevenly masked labels, padded rows, packed
rows: `family_batches`), one forward and backward each; compared with the same model unprepared on the full sequence in this process (fp32): the loss, and the
gradients summed over the SP group. A family refused by the checks is recorded with the refusal's message; one
that cannot be built small here is recorded as untested with the reason. Then a few families train through the
Trainer (train_parity's cases) on ZeRO-2 and ZeRO-3.
"""

import copy
import inspect
import os
import json
import logging
import math
import sys
import time
import warnings
from pathlib import Path

import torch
import torch.distributed as dist

from lightning_ulysses import SequenceSharder, prepare_hf_model
from lightning_ulysses.adapters import position_rule_of
from lightning_ulysses.attention.rows import BatchRowsSlot
from lightning_ulysses.hf import token_mixer_modules, validate_hf_model
from lightning_ulysses.mixers import install_mixers, left_on_whole_rows, split_of
from lightning_ulysses.mixers.channels import unit_range
from lightning_ulysses.mixers.kernels import LinearTimeKernels
from lightning_ulysses.parallel.layout import ParallelLayout, SequenceParallelGroups, ShardOrder
from lightning_ulysses.training.loss import SequenceParallelCausalLMLoss
from tests.distributed.common import relative_gradient_error
from tests.distributed.families import SEQ_LEN, VOCAB, tiny_model


def family_batches() -> dict[str, dict]:
    """The rows every family runs: plain (labels masked unevenly), padded (rows of 21 and 15 real tokens, padded on the right; `left_padded`: on the left, for the families that
    ask for it) and packed
    (documents restarting their position_ids inside the rows, crossing shard boundaries)."""
    generator = torch.Generator().manual_seed(5)
    input_ids = torch.randint(3, VOCAB, (2, SEQ_LEN), generator=generator)
    labels = input_ids.clone()
    labels[0, : SEQ_LEN // 2] = -100  # row 0: no target at all in its first half (a whole shard at SP 2 and 4)
    labels[1, torch.rand(SEQ_LEN, generator=generator) < 0.3] = -100
    mask = torch.ones(2, SEQ_LEN, dtype=torch.long)
    mask[0, -3:], mask[1, -9:] = 0, 0  # right padding
    left = torch.ones_like(mask)
    left[0, :3], left[1, :9] = 0, 0  # left padding (OPT numbers positions from the mask: the sharder fills its rule in)
    position_ids = torch.cat([torch.cat([torch.arange(10), torch.arange(SEQ_LEN - 10)])[None],
                              torch.cat([torch.arange(7), torch.arange(SEQ_LEN - 7)])[None]])
    return {
        "plain": {"input_ids": input_ids, "labels": labels},
        "padded": {"input_ids": input_ids, "attention_mask": mask, "labels": input_ids.masked_fill(mask == 0, -100)},
        "packed": {"input_ids": input_ids, "position_ids": position_ids, "labels": input_ids},
        "left_padded": {"input_ids": input_ids, "attention_mask": left,
                        "labels": input_ids.masked_fill(left == 0, -100)},
    }


def build(family: dict):
    """(model, attention implementation) or the reason it cannot be built small here (`<family>@<variant>`: the
    family's model with the variant's overrides, which the spec carries)."""
    name, overrides = family["family"].partition("@")[0], family.get("overrides", {})
    if family.get("float64"):
        return tiny_model(name, "sdpa", **overrides).double(), "sdpa"
    try:
        return tiny_model(name, "sdpa", **overrides), "sdpa"
    except ValueError as error:
        if "scaled_dot_product_attention" not in str(error):
            raise
    # a family transformers allows in eager (or flash/flex) only: the checks must refuse it
    return tiny_model(name, "eager", **overrides), "eager"


def without_cache(model) -> dict:
    """The reference runs without a cache: transformers' sdpa keeps packed documents apart only then. (The prepared
    models run as users call them, with the cache transformers makes by default.)"""
    return {"use_cache": False} if "use_cache" in inspect.signature(model.forward).parameters else {}


def keeps_documents_apart(model, batch: dict) -> bool:
    """Whether the unprepared model keeps the packed documents of `batch` apart: the logits of row 0's second
    document do not move when its first document's tokens change."""
    if "position_ids" not in inspect.signature(model.forward).parameters:
        return False
    model = copy.deepcopy(model).eval()
    changed = dict(batch, input_ids=batch["input_ids"].clone())
    changed["input_ids"][0, :10] = (changed["input_ids"][0, :10] + 1) % VOCAB
    with torch.no_grad():
        before, after = (model(input_ids=b["input_ids"], position_ids=b["position_ids"], **without_cache(model)).logits
                         for b in (batch, changed))
    return torch.allclose(before[0, 10:], after[0, 10:], atol=1e-6)


def document_by_document_loss(model, batch: dict) -> torch.Tensor:
    """The causal-LM loss of packed rows with every document run through `model` on its own (documents restart
    their position_ids): what keeping the documents apart means, whatever the model's kernels can do."""
    logits = []
    for row in range(batch["input_ids"].size(0)):
        positions = batch["position_ids"][row]
        cuts = [0] + [t for t in range(1, positions.numel()) if positions[t] != positions[t - 1] + 1] + [positions.numel()]
        logits.append(torch.cat([model(input_ids=batch["input_ids"][row:row + 1, start:end],
                                       position_ids=positions[None, start:end]).logits
                                 for start, end in zip(cuts[:-1], cuts[1:])], dim=1))
    logits = torch.cat(logits).float()
    return torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), batch["labels"][:, 1:].flatten(),
                                             ignore_index=-100)


def run_family(family: dict, sp_groups: dict) -> dict:
    """{sp: outcome} for one family: the worst errors over the batches it takes; the model is built once, then copied
    once for the reference and once per SP size."""
    try:
        pristine, _ = build(family)
    except Exception as error:  # the same on every rank: no collective has run for this family
        why = f"{type(error).__name__}: {str(error).strip().splitlines()[0][:160]}"
        return {sp: {"status": "untested", "why": why} for sp in sp_groups}
    batches = family_batches()
    if not family.get("left_padded"):
        del batches["left_padded"]
    if os.environ.get("FAMILY_BATCHES"):  # (debugging: a subset of the batch kinds)
        batches = {kind: batches[kind] for kind in os.environ["FAMILY_BATCHES"].split(",")}
    by_document = False
    if "packed" in batches and not keeps_documents_apart(pristine, batches["packed"]):
        # Recurrent mixers, and models whose mask ignores the positions, let packed documents see each other in
        # transformers (the strategy's attention keeps them apart). Where every mixer runs split by heads, which
        # restarts them at every document, the reference runs each document on its own; the others (Mamba, RWKV;
        # Mamba2, whose mixers split but whose model takes no position_ids: no positions to pack by) have none.
        mixers = token_mixer_modules(pristine)
        by_document = ("position_ids" in inspect.signature(pristine.forward).parameters and bool(mixers)
                       and not left_on_whole_rows(mixers, 1))
        if not by_document:
            del batches["packed"]
    outcomes = {sp: {"status": "ran", "loss_error": 0.0, "grad_error": 0.0, "batches": []} for sp in sp_groups}
    reference = copy.deepcopy(pristine)
    if family.get("eval"):
        reference.eval()  # a router that samples in training (PhiMoE's Gumbel draws) has no exact reference
    # One copy per SP size, prepared once and run on every batch, as the strategy prepares a model once for all its
    # batches; gradients cleared before each batch (on the reference too).
    prepared = {}
    for kind, batch in batches.items():
        reference.zero_grad(set_to_none=True)
        reference_loss = (document_by_document_loss(reference, batch) if kind == "packed" and by_document
                          else reference(**batch, **without_cache(reference)).loss)
        reference_loss.backward()
        for sp, groups in sp_groups.items():
            if outcomes[sp]["status"] != "ran":
                continue
            group = groups.sequence_parallel_group
            if sp not in prepared:
                model = copy.deepcopy(pristine)
                if family.get("eval"):
                    model.eval()
                try:
                    validate_hf_model(model, sp)  # what the strategy checks first, for every model, before any collective
                    slot = BatchRowsSlot()  # as the strategy: the sharder publishes each batch's rows to attention and loss
                    prepare_hf_model(model, group, SequenceParallelCausalLMLoss(group, 1.0, batch_rows=slot),
                                     batch_rows=slot)
                except (ValueError, NotImplementedError) as error:
                    outcomes[sp] = {"status": "refused", "why": str(error)}
                    continue
                prepared[sp] = model, slot
            model, slot = prepared[sp]
            model.zero_grad(set_to_none=True)
            try:
                sharder = SequenceSharder(sp, groups.sequence_parallel_rank, batch_rows=slot,
                                          position_rule=position_rule_of([model]))  # as the strategy's
                loss = model(**sharder(batch)).loss
                loss.backward()
            except Exception as error:  # a failure in training is no refusal: the test reports it
                outcomes[sp] = {"status": "failed", "why": f"{kind} rows: {type(error).__name__}: {error}"[:300]}
                continue
            outcome = outcomes[sp]
            outcome["batches"].append(kind)
            outcome["loss_error"] = max(outcome["loss_error"], abs(loss.item() - reference_loss.item()))
            outcome["grad_error"] = max(outcome["grad_error"], relative_gradient_error(model, reference, group))
    return outcomes


def _outermost_mixer_kinds(pristine) -> dict:
    """{class name: (path, module)}: the first token mixer of each kind, less those inside another listed mixer
    (RecurrentGemma's RG-LRU inside its recurrent block, which runs it as part of itself)."""
    mixers, kinds = token_mixer_modules(pristine), {}
    for path, module in mixers:
        if not any(path.startswith(f"{outer}.") for outer, _ in mixers):
            kinds.setdefault(type(module).__name__, (path, module))
    return kinds


def _on_whole_rows(module, pristine, seed: int):
    """A mixer's reference: hidden states and output weights drawn from `seed`, a copy of the layer run on the whole
    rows in one process as transformers runs it: (hidden, weights, output, input gradient, work). The work is counted
    in a second run of the same copy with our kernels where a split runs them (mixers/kernels.py: Mamba2's blockwise
    scan recomputes its forward in backward), so that what a split's ranks do is compared with the same computation
    on whole rows. Both runs go without a cache, as the models' references do (`without_cache`): a layer that keeps
    its cache on itself would otherwise start its second run from the first's final state (docs/internals.md,
    "RecurrentGemma's recurrent block")."""
    generator = torch.Generator().manual_seed(seed)
    hidden = torch.randn(2, SEQ_LEN, pristine.config.get_text_config().hidden_size, generator=generator)
    weights = torch.randn(2, SEQ_LEN, 1, generator=generator)
    whole = hidden.clone().requires_grad_(True)
    reference = copy.deepcopy(module)
    expected = _first(reference(whole, **_call_kwargs(reference, whole), **without_cache(reference)))
    (expected * weights).sum().backward()
    again = hidden.clone().requires_grad_(True)
    with LinearTimeKernels(type(reference)).in_place(), _Work(reference) as work:
        output = _first(reference(again, **_call_kwargs(reference, again), **without_cache(reference)))
        (output * weights).sum().backward()
    return hidden, weights, expected, whole.grad, work


def mixer_errors(pristine, sp_groups: dict) -> dict:
    """{sp: {path: {...}}} for the first token mixer of each kind: one layer run on its shard as the strategy runs it
    (`install_mixers`: split by heads, or on whole rows) against the same layer on the whole rows in one process:
    output and input-gradient errors, how it ran, and the work of each (forward + backward FLOPs, bytes of
    activations saved for backward, the rows each of its linear layers saw), and which of its linear layers are the
    input and output projections of its split (none when it runs on whole rows)."""
    kinds, results = _outermost_mixer_kinds(pristine), {}
    for sp, groups in sp_groups.items():
        group, rank = groups.sequence_parallel_group, groups.sequence_parallel_rank
        results[sp] = {}
        for path, module in kinds.values():
            hidden, weights, expected, whole_grad, whole_work = _on_whole_rows(module, pristine, seed=11)
            mine = copy.deepcopy(module)
            handles, whole_rows = install_mixers([(path, mine)], group)
            split = split_of(mine, sp, rank)
            cut = slice(rank * SEQ_LEN // sp, (rank + 1) * SEQ_LEN // sp)
            shard = hidden[:, cut].clone().requires_grad_(True)
            with _Work(mine) as work:
                output = _first(mine(shard, **_call_kwargs(mine, shard, cut)))
                (output * weights[:, cut, :1]).sum().backward()
            for handle in handles:
                handle.remove()
            packed = _packed_refusal(module, path, group, cut, hidden[:, cut]) if whole_rows else ""
            results[sp][path] = {
                "packed_refusal": packed,
                "output_error": (output - expected[:, cut]).abs().max().item(),
                "gradient_error": (shard.grad - whole_grad[:, cut]).abs().max().item(),
                "ran": "whole rows" if whole_rows else "split", "work": work.totals(), "whole_work": whole_work.totals(),
                "projections": [] if whole_rows else [*split.inputs, split.output[0]],
                "units": split.units if split else None,
                "local_units": len(unit_range(split.units, sp, rank)) if split else None,
            }
    return results


def mixer_ring_errors(pristine, groups) -> dict:
    """{path: {...}} for the first token mixer of each kind under hybrid Ulysses × ring (`groups`: SP 4 as Ulysses 2
    × ring 2, zig-zag shards): one layer split over all four SP ranks against the same layer on the whole rows in
    one process: output and input-gradient errors, and how it ran."""
    kinds, results = _outermost_mixer_kinds(pristine), {}
    order, rank = ShardOrder.of_groups(groups.ulysses_group, groups.ring_group)
    for path, module in kinds.values():
        hidden, weights, expected, whole_grad, _ = _on_whole_rows(module, pristine, seed=13)
        mine = copy.deepcopy(module)
        handles, whole_rows = install_mixers([(path, mine)], groups.ulysses_group, groups.ring_group)
        reference = (hidden, weights, expected, whole_grad)
        results[path] = {**_installed_errors(mine, handles, reference, order.positions(SEQ_LEN, rank)),
                         "ran": "whole rows" if whole_rows else "split"}
    return results


def _installed_errors(mine, handles, reference: tuple, tokens) -> dict:
    """Output and input-gradient errors of `mine` (its mixers installed: `handles`, removed after) run on the
    `tokens` of the rows (a slice, or positions), against `reference` = `_on_whole_rows`' (hidden, weights, output,
    input gradient)."""
    hidden, weights, expected, whole_grad = reference
    shard = hidden[:, tokens].clone().requires_grad_(True)
    try:
        output = _first(mine(shard, **_call_kwargs(mine, shard, tokens)))
        (output * weights[:, tokens]).sum().backward()
    finally:
        for handle in handles:
            handle.remove()
    return {"output_error": (output - expected[:, tokens]).abs().max().item(),
            "gradient_error": (shard.grad - whole_grad[:, tokens]).abs().max().item()}


def mixer_transport_errors(pristine, groups) -> dict:
    """{path: {...}} for the first token mixer of each kind split over `groups` with the copy-engine exchange
    (emulated on gloo: `EmulatedCopyTransport`) against the same layer on the whole rows: output and input-gradient
    errors, and how many exchanges the transport moved (equal pieces only; unequal ones take the collective)."""
    from lightning_ulysses.attention.copy_engine import EmulatedCopyTransport

    class Counted(EmulatedCopyTransport):
        launches = 0

        def launch(self, *args, **kwargs):
            Counted.launches += 1
            return super().launch(*args, **kwargs)

    kinds, results = _outermost_mixer_kinds(pristine), {}
    sp, rank = groups.sequence_parallel_world_size, groups.sequence_parallel_rank
    cut = slice(rank * SEQ_LEN // sp, (rank + 1) * SEQ_LEN // sp)
    for path, module in kinds.values():
        hidden, weights, expected, whole_grad, _ = _on_whole_rows(module, pristine, seed=17)
        mine, Counted.launches = copy.deepcopy(module), 0
        handles, _ = install_mixers([(path, mine)], groups.sequence_parallel_group, transport=Counted())
        results[path] = {**_installed_errors(mine, handles, (hidden, weights, expected, whole_grad), cut),
                          "transport_launches": Counted.launches}
    return results


def _packed_refusal(module, path: str, group, cut: slice, shard: torch.Tensor) -> str:
    """What a mixer left on whole rows says when the model's positions hold packed documents ("" if nothing)."""
    mine = copy.deepcopy(module)
    positions = torch.cat([torch.arange(10), torch.arange(SEQ_LEN - 10)])[None, cut].expand(shard.size(0), -1)
    handles, _ = install_mixers([(path, mine)], group, positions=lambda: positions)
    try:
        mine(shard, **_call_kwargs(mine, shard, cut))
    except NotImplementedError as error:
        return str(error)
    finally:
        for handle in handles:
            handle.remove()
    return ""


def _convolution_flops(x_shape, w_shape, *args, out_shape=None, **kwargs) -> int:
    # torch's own formula counts a grouped (depthwise) convolution as a dense one: C_in x C_out per output position,
    # so narrowing its channels would look quadratically cheaper. Each output reads C_in/groups x kernel inputs.
    return 2 * math.prod(out_shape) * math.prod(w_shape[1:])


def _convolution_backward_flops(grad_out_shape, x_shape, w_shape, *args, output_mask=(True, True, False),
                                out_shape=None, **kwargs) -> int:
    per_output = 2 * math.prod(grad_out_shape) * math.prod(w_shape[1:])
    return per_output * (int(output_mask[0]) + int(output_mask[1]))  # input gradient, weight gradient


class _Work:
    """What one run of a module costs this rank: FLOPs (torch's counter: matmuls and convolutions, forward and
    backward), bytes of the activations the forward saves for backward (parameters and their slices excluded), and the
    most rows (tokens) each of its linear layers (by path) was handed when called as a module."""

    def __init__(self, module: torch.nn.Module):
        from torch.utils.flop_counter import FlopCounterMode

        aten = torch.ops.aten
        self.module = module
        self.counter = FlopCounterMode(display=False, custom_mapping={
            aten.convolution: _convolution_flops, aten.convolution_backward: _convolution_backward_flops})
        self.parameters = {p.untyped_storage().data_ptr() for p in module.parameters()}
        self.saved: dict[int, int] = {}
        self.rows: dict[str, int] = {}

    def _pack(self, tensor):
        # The forward's saved activations only: a recompute inside backward (Mamba2's blockwise scan) packs transients
        # that are freed block by block, whose reused addresses made the count depend on the allocator's history.
        if torch._C._current_graph_task_id() != -1:
            return tensor
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in self.parameters:
            self.saved[storage.data_ptr()] = storage.nbytes()
        return tensor

    def _linear_input(self, path: str, args) -> None:
        self.rows[path] = max(self.rows.get(path, 0), args[0].shape[-2] if args[0].dim() >= 2 else 1)

    def __enter__(self):
        self.hooks = [m.register_forward_pre_hook(lambda _module, args, path=path: self._linear_input(path, args))
                      for path, m in self.module.named_modules() if isinstance(m, torch.nn.Linear)]
        self.saving = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda tensor: tensor)
        self.saving.__enter__()
        self.counter.__enter__()
        return self

    def __exit__(self, *exc):
        self.counter.__exit__(*exc)
        self.saving.__exit__(*exc)
        for hook in self.hooks:
            hook.remove()

    def totals(self) -> dict:
        return {"flops": self.counter.get_total_flops(), "saved_bytes": sum(self.saved.values()), "rows": self.rows}


def _call_kwargs(module, hidden, cut=slice(None)) -> dict:
    # the class's forward: a mixer split by heads is called through a forward of `*args, **kwargs` (head_split.py)
    parameters = inspect.signature(type(module).forward).parameters
    kwargs = {}
    if "position_ids" in parameters:
        kwargs["position_ids"] = torch.arange(SEQ_LEN)[None, cut].expand(hidden.size(0), -1)
    for name in ("attention_mask", "position_embeddings"):
        if name in parameters and parameters[name].default is inspect.Parameter.empty:
            kwargs[name] = None
    return kwargs


def _first(output):
    return output[0] if isinstance(output, tuple) else output


def main():
    # A part of the shared launch (workers/parts.py): the parts after it keep their warnings and transformers' logs.
    transformers_logger = logging.getLogger("transformers")
    level = transformers_logger.level
    transformers_logger.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            run(json.loads(Path(sys.argv[1]).read_text()), Path(sys.argv[2]))
    finally:
        transformers_logger.setLevel(level)


def run(spec: dict, workdir: Path) -> None:
    if not dist.is_initialized():  # a part of a shared launch (workers/parts.py) may find it set up
        dist.init_process_group("gloo")
    import transformers

    output = {"families": {}, "seconds": {}, "transformers_version": transformers.__version__}
    sp_groups = {sp: SequenceParallelGroups.build(ParallelLayout(dist.get_world_size(), sp))
                 for sp in spec["sequence_parallel_sizes"]}
    # SP 4 as Ulysses 2 × ring 2 (its sub-groups made once, on every rank alike), for split mixers on a ring
    ring_groups = sp_groups[4].with_ring_size(2) if 4 in sp_groups else None
    for family in spec["families"]:
        start = time.monotonic()
        if not family.get("layers_only"):  # (a variant whose mixers alone are checked: `mixer_errors` below)
            output["families"][family["family"]] = run_family(family, sp_groups)
        if family.get("mixers"):
            output.setdefault("mixers", {})[family["family"]] = mixer_errors(build(family)[0], sp_groups)
            if ring_groups is not None:
                output.setdefault("mixer_rings", {})[family["family"]] = mixer_ring_errors(build(family)[0],
                                                                                           ring_groups)
            if family["family"] in spec.get("transport_mixers", ()):
                output.setdefault("mixer_transports", {})[family["family"]] = mixer_transport_errors(
                    build(family)[0], sp_groups[max(sp_groups)])
        output["seconds"][family["family"]] = time.monotonic() - start
        if dist.get_rank() == 0:  # progress in the launch's log
            print(f"{family['family']}: {output['families'].get(family['family'], 'layers')}"
                  f" ({output['seconds'][family['family']]:.1f} s)",
                  file=sys.stderr, flush=True)
    for groups in sp_groups.values():
        groups.release()
    if spec.get("training_cases"):
        from tests.distributed.workers.train_parity import run_case

        start = time.monotonic()
        output["training"] = {case["name"]: run_case(dict(case, workdir=str(workdir)), dist.get_world_size())
                              for case in spec["training_cases"]}
        output["seconds"]["training"] = time.monotonic() - start
    torch.save(output, workdir / f"result_{dist.get_rank()}.pt")


if __name__ == "__main__":
    main()
