"""Worker: train several cases with UlyssesDeepSpeedStrategy on this rank; save what each step saw and the weights.

Each case builds its own Trainer and its own SP/DP groups on the shared world process group.
"""

import collections
import contextlib
import dataclasses
import json
import os
import sys
import weakref
from pathlib import Path

import lightning as L
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader

import lightning_ulysses
from tests.distributed.common import CausalLM, UnevenlyMaskedTokens, collate, save_pretrained_once, settle_heap
from tests.distributed.packed import PackedDocuments

DATASETS = {"uneven": UnevenlyMaskedTokens, "packed": PackedDocuments}  # case["data"], "uneven" by default


class CaptureWeights(L.Callback):
    def on_train_end(self, trainer, pl_module):
        import deepspeed

        params = dict(pl_module.model.named_parameters())
        if isinstance(trainer.strategy, lightning_ulysses.UlyssesFSDPStrategy):  # DTensor shards, gathered
            from lightning_ulysses.integration.fsdp import full_weights

            pl_module.final_weights = full_weights(pl_module.model)
            # What this rank holds of the model states (the planner's FSDP2 terms): local shards' bytes and dtypes.
            local = [(p.to_local(), p.grad.to_local() if p.grad is not None else None) for p in params.values()]
            pl_module.shard_bytes = {"parameters": sum(w.numel() * w.element_size() for w, _ in local),
                                     "gradients": sum(g.numel() * g.element_size() for _, g in local if g is not None),
                                     "dtypes": sorted({str(t.dtype) for pair in local for t in pair if t is not None})}
        else:
            with deepspeed.zero.GatheredParameters(list(params.values()), enabled=trainer.strategy.zero_stage_3):
                pl_module.final_weights = {name: p.detach().clone() for name, p in params.items()}
        # Which modules trained with a wrapped forward (the memory features), seen before teardown undoes them.
        pl_module.wrapped_modules = sorted({type(m).__name__ for m in pl_module.model.modules() if "forward" in m.__dict__})
        # How each token mixer that is not attention trained: split by heads (its forward routed through the split,
        # mixers/head_split.py) or not (on whole rows, by hooks)
        from lightning_ulysses.hf import token_mixer_modules

        pl_module.token_mixers = {path: "split" if "forward" in mixer.__dict__ else "whole rows"
                                  for path, mixer in token_mixer_modules(pl_module.model)}
        # Decoder layers DeepSpeed gathers whole (ZeRO-3 leaves: it points their parameters at them)
        from lightning_ulysses.memory import _decoder_layers

        pl_module.leaf_layers = [all(getattr(p, "ds_z3_leaf_module", None) is layer for p in layer.parameters())
                                 for layer in _decoder_layers(pl_module.model)]
        # The tiled MLPs a checkpointed layer's recompute leaves out (None: not checked; False: kept in)
        pl_module.mlps_deferrable = [getattr(m.__dict__.get("forward"), "deferrable", None)
                                     for m in pl_module.model.modules() if "forward" in m.__dict__
                                     and hasattr(m.__dict__["forward"], "deferrable")]
        # Whether the output head still shares the input embedding's tensor (HF models; None for the native GPT).
        model = pl_module.model
        if hasattr(model, "get_input_embeddings"):
            embeddings, head = model.get_input_embeddings(), model.get_output_embeddings()
            pl_module.tied_embeddings = head is not None and head.weight is embeddings.weight
        else:
            pl_module.tied_embeddings = None


class CountedReads:
    """`safetensors.safe_open` (and transformers' own reference to it) counting the bytes of every tensor read
    through it, per checkpoint key: whole (`get_tensor`) or sliced (`get_slice(key)[...]`, what torch's
    HuggingFaceStorageReader and transformers' loader call); headers (`keys`, `get_shape`) read no tensor."""

    def __init__(self):
        self.bytes_by_key: dict[str, int] = {}
        self._restore = []

    def _count(self, key, tensor):
        self.bytes_by_key[key] = self.bytes_by_key.get(key, 0) + tensor.numel() * tensor.element_size()
        return tensor

    def _open(self, original):
        counter = self

        class Slice:
            def __init__(self, key, inner):
                self.key, self.inner = key, inner

            def __getitem__(self, index):
                return counter._count(self.key, self.inner[index])

            def __getattr__(self, name):
                return getattr(self.inner, name)

        class Handle:
            def __init__(self, *args, **kwargs):
                self.inner = original(*args, **kwargs)

            def __enter__(self):
                self.inner.__enter__()
                return self

            def __exit__(self, *exc):
                return self.inner.__exit__(*exc)

            def get_slice(self, key):
                return Slice(key, self.inner.get_slice(key))

            def get_tensor(self, key):
                return counter._count(key, self.inner.get_tensor(key))

            def __getattr__(self, name):
                return getattr(self.inner, name)

        return Handle

    def __enter__(self):
        import safetensors
        import transformers.modeling_utils as modeling_utils

        for module in (safetensors, modeling_utils):
            self._restore.append((module, module.safe_open))
            module.safe_open = self._open(module.safe_open)
        return self

    def __exit__(self, *exc):
        for module, original in reversed(self._restore):
            module.safe_open = original
        self._restore = []


class CaptureLoaded(L.Callback):
    """What `from_pretrained` in configure_model put into the model before training (gathered from the shards), and
    the checkpoint bytes this rank read from `setup` (before configure_model) to the start of fit."""

    def __init__(self):
        self.reads = CountedReads()

    def setup(self, trainer, pl_module, stage):
        self.reads.__enter__()

    def on_fit_start(self, trainer, pl_module):
        self.reads.__exit__(None, None, None)
        from torch.distributed.tensor import DTensor

        model = pl_module.model
        pl_module.loaded = {
            "parameters": {name: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
                           for name, p in model.named_parameters()},
            "buffers": {name: b.detach().clone() for name, b in model.named_buffers()},
            "bytes_by_key": dict(self.reads.bytes_by_key),
        }


class CountAttentionRuns(L.Callback):
    """How often each decoder layer's attention module ran in training: forward, plus each recompute of the layer
    under activation checkpointing (the layer's own module hooks fire only in forward); and the SDPA kernel orders
    in force at those runs (a recompute runs inside the strategy's `backward`)."""

    def on_train_start(self, trainer, pl_module):
        pl_module.attention_runs, pl_module.sdpa_orders, self.handles = [], set(), []

        def ran(index):
            pl_module.attention_runs[index] += 1
            pl_module.sdpa_orders.add(tuple(torch._C._get_sdp_priority_order()))

        for name, module in pl_module.model.named_modules():
            # Llama's `self_attn`, the GPT's `attention` (not the Ulysses core inside it, `attention.attention`)
            if name.endswith((".self_attn", ".attention")) and not name.endswith(".attention.attention"):
                index = len(pl_module.attention_runs)
                pl_module.attention_runs.append(0)
                self.handles.append(module.register_forward_hook(lambda *_, index=index: ran(index)))

    def on_train_end(self, trainer, pl_module):
        for handle in self.handles:
            handle.remove()


class CountReplayedOutputs(L.Callback):
    """Which kept outputs the checkpointed layers' recomputes replayed in training, by operator (`_KeptOutputs` of
    memory/checkpointing.py): what keep_attention_outputs / keep_matmul_outputs / keep_token_mixer_outputs kept. A
    product written into in the forward (ZeRO-3's in-place bias add) runs again in the recompute: not counted."""

    def on_train_start(self, trainer, pl_module):
        from lightning_ulysses.memory import checkpointing

        pl_module.replayed_outputs = counts = collections.Counter()
        original = self.original = checkpointing._KeptOutputs.replaying

        @contextlib.contextmanager
        def replaying(mode):
            with original(mode):
                yield
            counts.update(str(func) for func, _, outputs, *_ in mode.recorded if outputs is not None)

        checkpointing._KeptOutputs.replaying = replaying

    def on_train_end(self, trainer, pl_module):
        from lightning_ulysses.memory import checkpointing

        checkpointing._KeptOutputs.replaying = self.original


class RecordGroups(L.Callback):
    """Weak references to the process groups each run of a case trains or evaluates on (SP, DP, and the Ulysses and
    ring sub-groups where the SP group is split): what `released_groups` looks for once the case is over; and to the
    DeepSpeed engine of each run, for `freed_engines` once the case's Trainers are dropped."""

    def __init__(self):
        self.groups: list[tuple[str, str, weakref.ref]] = []  # (run, kind, group)
        self.engines: list[tuple[str, weakref.ref]] = []  # (run, engine)

    def _record(self, trainer, run: str) -> None:
        groups, seen = trainer.strategy.parallel_groups, []
        for kind in ("sequence_parallel", "data_parallel", "ulysses", "ring"):
            group = getattr(groups, f"{kind}_group")
            if group is not None and all(group is not other for other in seen):  # a sub-group may be the SP group
                seen.append(group)
                self.groups.append((run, kind, weakref.ref(group)))
        self.engines.append((run, weakref.ref(trainer.strategy.model)))  # the engine `strategy.setup` built

    def on_train_start(self, trainer, pl_module):
        self._record(trainer, "fit")

    def on_validation_start(self, trainer, pl_module):
        if not trainer.sanity_checking and trainer.state.fn == "validate":
            self._record(trainer, "validate")

    def on_test_start(self, trainer, pl_module):
        self._record(trainer, "test")

    def on_predict_start(self, trainer, pl_module):
        self._record(trainer, "predict")


def released_groups(recorder: RecordGroups) -> dict:
    """Which of the recorded groups torch.distributed still has registered, and which are still alive at all (a
    DeepSpeed engine keeps the SP group it ran on), after the case's last run; and DeepSpeed's global mpu. `alive`
    is read after a full collection that does not freeze (the case's Trainer is still held here: frozen, its cycles
    would never be collected; `freed_engines` settles the heap once it is dropped)."""
    import gc

    from deepspeed.utils import groups as deepspeed_groups

    gc.collect()
    alive = [(run, kind, ref()) for run, kind, ref in recorder.groups if ref() is not None]
    registered = dist.distributed_c10d._world.pg_map
    return {"recorded": [(run, kind) for run, kind, _ in recorder.groups],
            "registered": [(run, kind) for run, kind, group in alive if group in registered],
            "alive": [(run, kind) for run, kind, _ in alive],
            "deepspeed_mpu": type(deepspeed_groups.mpu).__name__ if deepspeed_groups.mpu is not None else None}


def freed_engines(recorder: RecordGroups) -> dict:
    """Which runs' DeepSpeed engines are still alive after a full collection, once the case's modules, Trainers and
    strategies are dropped (`main`, after `run_case` returned): DeepSpeed's globals and hooks kept every one for the
    life of the process, with its optimizer state, until the strategy released them at teardown. The collection
    also freezes what is left (`settle_heap`): it is not walked again by the next cases' collections (every ZeRO-3
    engine's set-up runs one). Lightning gives every callback the module's `log` and `log_dict` (bound methods:
    the module, its Trainer, the strategy, the engine); the recorder outlives the case, so they are dropped first."""
    for name in ("log", "log_dict"):
        vars(recorder).pop(name, None)
    settle_heap()
    return {"recorded": [run for run, _ in recorder.engines],
            "alive": [run for run, ref in recorder.engines if ref() is not None]}


class SaveInsideWindow(L.Callback):
    """Saves a checkpoint at the first mid-epoch validation, inside an accumulation window; `resume` then tries to
    continue training from it and records what the strategy said (`resume_refusal`)."""

    def __init__(self, case: dict):
        self.path = str(Path(case["workdir"]) / f"{case['name']}.inside-window.ckpt")
        self.case, self.saved, self.refusal = case, False, None

    def on_validation_end(self, trainer, pl_module):
        if not trainer.sanity_checking and not self.saved:
            self.saved = True
            trainer.save_checkpoint(self.path)

    def resume(self, module, world_size: int) -> None:
        case = self.case
        trainer = L.Trainer(accelerator="cpu", devices=world_size, max_epochs=case["epochs"] + 1, logger=False,
                            enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                            strategy=lightning_ulysses.UlyssesDeepSpeedStrategy(sequence_parallel_size=case["sp"],
                                                                                stage=case["stage"]),
                            **case["trainer_kwargs"])
        dataset = UnevenlyMaskedTokens(case["batch_size"] * case["batches_per_epoch"] * (world_size // case["sp"]),
                                       case["seq_len"])
        records = len(module.records)
        try:
            trainer.fit(module, DataLoader(dataset, batch_size=case["batch_size"], collate_fn=collate),
                        ckpt_path=self.path)
        except ValueError as error:
            self.refusal = str(error)
        assert len(module.records) == records, "refused before any step"


def _export(case: dict) -> list[L.Callback]:
    """The trained model's save_pretrained folder(s) (LoRA: the adapters and the merged model), for the export claim."""
    if not case.get("export"):
        return []
    from lightning_ulysses.integration.export import ExportPretrained

    return [ExportPretrained(str(Path(case["workdir"]) / f"{case['name']}.export"), merged=True)]


def refused_run(module, trainer, loader) -> dict:
    """`fit` that the strategy must refuse: what it said, after how many steps, and whether any weight moved."""
    before = {name: p.detach().clone() for name, p in module.model.named_parameters()}
    refusal = None
    try:
        trainer.fit(module, loader)
    except RuntimeError as error:
        refusal = str(error)
    # (refused cases run ZeRO-0/1/2, whose module parameters stay whole)
    unchanged = all(torch.equal(p.detach(), before[name]) for name, p in module.model.named_parameters())
    return {"refusal": refusal, "steps_before_refusal": len(module.records), "weights_unchanged": unchanged}


@contextlib.contextmanager
def sampler_seed(seed: int | None):
    """Lightning's DistributedSampler draws each epoch's order from `PL_GLOBAL_SEED`, which whatever job of the shared
    launch last called `seed_everything` set (the dropout job 7, the resume worker 0): a case whose settings depend on
    its samples (a clipping threshold between measured gradient norms) pins it for its run; None leaves it alone."""
    if seed is None:
        yield
        return
    previous = os.environ.get("PL_GLOBAL_SEED")
    os.environ["PL_GLOBAL_SEED"] = str(seed)
    try:
        yield
    finally:
        if previous is None:
            del os.environ["PL_GLOBAL_SEED"]
        else:
            os.environ["PL_GLOBAL_SEED"] = previous


def run_case(case: dict, world_size: int, recorder: RecordGroups | None = None,
             callbacks: tuple[L.Callback, ...] = ()) -> dict:
    kind, pretrained = case.get("model", "llama"), None
    if kind.startswith("pretrained"):  # the model the reference starts from, saved; the module loads it
        pretrained = str(Path(case["workdir"]) / f"{case['name']}.pretrained")
        save_pretrained_once(kind, case["kv_heads"], pretrained, int(os.environ["RANK"]))
    module = CausalLM(num_key_value_heads=case["kv_heads"], lr=case.get("lr", 0.5), kind=kind,
                      in_configure_model=case.get("in_configure_model", False), step=case.get("step", "batch"),
                      pretrained=pretrained)
    if case.get("perturb_other_ranks") and int(os.environ["RANK"]) != 0:  # the strategy must train rank 0's model
        with torch.no_grad():
            for parameter in module.model.parameters():
                parameter.add_(0.01 * int(os.environ["RANK"]))
    strategy_kwargs = dict(case.get("strategy_kwargs", {}))
    memory = strategy_kwargs.get("memory")
    if isinstance(memory, dict) and memory.get("fused_elementwise"):
        # A case claims the fused kernels compiled: an earlier case of this process (the FSDP2 one with the same
        # model) would otherwise have left them compiled, and this one's count at zero.
        torch._dynamo.reset()
    graphs_before = torch._dynamo.utils.counters["stats"]["unique_graphs"]  # this case's, in a process of many
    recorder = recorder or RecordGroups()
    # memory="auto" with this rank's own free memory (the ranks agree on the least); before the process group exists
    if "free_memory_by_rank" in case:
        free_memory = case["free_memory_by_rank"][int(os.environ["RANK"])]
        strategy_kwargs["memory"] = dict(strategy_kwargs["memory"], free_memory=free_memory)
    if case.get("backend") == "fsdp2":  # the same module on FSDP2 (tests/distributed/test_fsdp.py)
        strategy = lightning_ulysses.UlyssesFSDPStrategy(sequence_parallel_size=case["sp"], **strategy_kwargs)
    else:
        strategy = lightning_ulysses.UlyssesDeepSpeedStrategy(
            sequence_parallel_size=case["sp"], stage=case["stage"], **strategy_kwargs
        )
    # "epochs": that many epochs of "batches_per_epoch" micro-batches per DP rank (accumulation windows that do not
    # divide them), up to "max_steps" if given; otherwise "steps" optimizer steps of full windows.
    length = ({"max_epochs": case["epochs"], "max_steps": case.get("max_steps", -1)} if "epochs" in case
              else {"max_steps": case["steps"]})
    saves = [SaveInsideWindow(case)] if case.get("resume_inside_window") else []
    trainer = L.Trainer(
        accelerator="cpu", devices=case.get("devices", world_size), num_nodes=case.get("num_nodes", 1), strategy=strategy, precision=case.get("precision", "32-true"),
        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        callbacks=[CaptureWeights(), CountAttentionRuns(), CountReplayedOutputs(), recorder, *_export(case), *saves,
                   *([CaptureLoaded()] if case.get("check_loading") else []), *callbacks], **length,
        **case.get("trainer_kwargs", {}),
    )
    batch_size = case["batch_size"]
    dataset_type = DATASETS[case.get("data", "uneven")]
    accumulate = case.get("trainer_kwargs", {}).get("accumulate_grad_batches", 1)
    batches = case.get("batches_per_epoch", case["steps"] * accumulate)
    dataset = dataset_type(batch_size * batches * (world_size // case["sp"]), case["seq_len"],
                           **case.get("dataset_kwargs", {}))
    loader = DataLoader(dataset, batch_size=batch_size, collate_fn=collate)
    # Validation inside the training epoch ("val_check_interval" in trainer_kwargs): on the training samples.
    evaluate = case.get("trainer_kwargs", {}).get("val_check_interval") is not None
    if case.get("refused"):  # expected to stop at its first backward
        return refused_run(module, trainer, loader)
    with sampler_seed(case.get("sampler_seed")):
        trainer.fit(module, loader, loader if evaluate else None)
    weights = module.final_weights
    path = str(Path(case["workdir"]) / f"{case['name']}.ckpt")
    if case.get("validate_from_checkpoint") or case.get("checkpoint_export"):
        trainer.save_checkpoint(path)  # while the training engine exists (predict replaces it)
    if case.get("validate"):
        # Same process, same Trainer: the groups and the attention must be set up again cleanly.
        validation = UnevenlyMaskedTokens(4 * (world_size // case["sp"]), case["seq_len"])
        loader = DataLoader(validation, batch_size=batch_size, collate_fn=collate)
        trainer.validate(module, loader, verbose=False)
        trainer.test(module, loader, verbose=False)
        trainer.predict(module, loader, return_predictions=False)
        if case.get("validate_from_checkpoint"):
            # A fresh module, Trainer and strategy in the same process, restored from a DeepSpeed checkpoint.
            restored = CausalLM(num_key_value_heads=case["kv_heads"], kind=case.get("model", "llama"))
            restored.model.apply(lambda m: [p.data.zero_() for p in m.parameters(recurse=False)])
            fresh = L.Trainer(accelerator="cpu", devices=world_size, precision="32-true", logger=False,
                              enable_progress_bar=False, enable_model_summary=False, callbacks=[recorder],
                              strategy=lightning_ulysses.UlyssesDeepSpeedStrategy(
                                  sequence_parallel_size=case["sp"], stage=case["stage"]))
            fresh.validate(restored, loader, ckpt_path=path, verbose=False)
            module.validation_records += [dict(r, stage="validate_from_checkpoint") for r in restored.validation_records]
    groups = released_groups(recorder)  # while the Trainer is still held, as a user's script holds it
    if saves:  # after the groups are read: the refused run keeps its own (as every run that raised)
        saves[0].resume(module, world_size)
    return {
        "groups": groups,
        "records": module.records,
        "validation_records": module.validation_records,
        "sequence_parallel_rank": strategy.sequence_parallel_rank,
        "data_parallel_rank": strategy.data_parallel_rank,
        "node_rank": strategy.node_rank,
        "cluster_environment": type(strategy.cluster_environment).__name__,
        "weights": weights if dist.get_rank() == 0 else None,
        "weights_checksum": sum(w.double().abs().sum().item() for w in weights.values()),
        "wrapped_modules": module.wrapped_modules,
        "token_mixers": module.token_mixers,
        "mlps_deferrable": module.mlps_deferrable,
        "leaf_layers": module.leaf_layers,
        "tied_embeddings": module.tied_embeddings,
        "attention_runs": module.attention_runs,
        "replayed_outputs": dict(module.replayed_outputs),
        "sdpa_orders": sorted(module.sdpa_orders),
        "pretrained": pretrained,
        "export": str(Path(case["workdir"]) / f"{case['name']}.export") if case.get("export") else None,
        "checkpoint": path if case.get("checkpoint_export") else None,
        "memory_choice": strategy.memory_choice and strategy.memory_choice.as_dict(),
        "memory_confirmation": strategy.memory_confirmation and strategy.memory_confirmation.as_dict(),
        "memory": dataclasses.asdict(strategy.memory),
        "shard_bytes": getattr(module, "shard_bytes", None),
        "compiled_graphs": torch._dynamo.utils.counters["stats"]["unique_graphs"] - graphs_before,
        "resume_refusal": saves[0].refusal if saves else None,
        "loaded": getattr(module, "loaded", None),
    }


def main() -> None:
    spec = json.loads(Path(sys.argv[1]).read_text())
    workdir = Path(sys.argv[2])
    world_size = int(spec["world_size"])
    results = {}
    for case in spec["cases"]:
        recorder = RecordGroups()
        results[case["name"]] = run_case(dict(case, workdir=str(workdir)), world_size, recorder)
        results[case["name"]]["engines"] = freed_engines(recorder)  # the case's Trainers are gone now
    torch.save(results, workdir / f"result_{dist.get_rank()}.pt")


if __name__ == "__main__":
    main()
