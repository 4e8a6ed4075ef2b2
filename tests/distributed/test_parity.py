"""Parity: UlyssesDeepSpeedStrategy against a single-process full-sequence fp32 reference, with SGD.

ZeRO {0,2,3} × (SP, DP) in {(1,1), (1,2), (2,1), (2,2), (4,1)} (ZeRO-1: SP 2 × DP 2 and a ring) × {MHA, MQA with fewer KV heads than SP},
labels masked unevenly. Every returned loss must match the reference within 1e-5 and the weights after 3 SGD
steps within 1e-4 of the size of the update. One launch per world size runs all of its cases; each case has
its own Trainer and its own SP/DP groups.
"""

from __future__ import annotations

import contextlib
import functools
import json
from pathlib import Path

import pytest
import torch

from lightning_ulysses.parallel.layout import ShardOrder
from tests.distributed.common import (NUM_HEADS, SECOND_ADAPTER, UnevenlyMaskedTokens, build_model, built_labels,
                                      collate)
from tests.distributed.harness import ROOT
from tests.distributed.pool import shared
from tests.distributed.reference import assert_weights_match, reference_training

WORKER = ROOT / "tests" / "distributed" / "workers" / "train_parity.py"
STEPS, BATCH_SIZE, SEQ_LEN = 3, 2, 16
ATTENTION = {"mha": NUM_HEADS, "mqa": 1, "gqa": 2}  # 1 KV head < SP 2 and 4: KV replication
SMALL_BUCKET = 500  # elements: below every weight matrix of the tiny models (the norms fit)


def _case(world_size, sp, stage, attention, seq_len=SEQ_LEN, suffix="", **extra):
    name = f"zero{stage}-sp{sp}-dp{world_size // sp}-{attention}{suffix}"
    return {"name": name, "world_size": world_size, "sp": sp, "stage": stage, "kv_heads": ATTENTION[attention],
            "steps": STEPS, "batch_size": BATCH_SIZE, "seq_len": seq_len, **extra}


# The hybrid feature matrix (tests/README.md has it as a table): Qwen3-Next (Gated DeltaNet), Nemotron-H (Mamba2,
# with attention, MLP and MoE layers) and LFM2 (short convolutions) with their mixers split by heads, each family once
# at SP 2 × DP 2 and once at SP 4, the four (layout, ZeRO stage) pairs all met, and the features users combine dealt
# over the six so that each family meets each feature and each feature meets both layouts and both stages:
# accumulation 2 with clipping, LoRA on the mixer's linears (`MIXER_LORA_TARGETS`), bf16-mixed against the one-process
# bf16 reference (`check_bf16_against_bf16`); the save_pretrained folders ExportPretrained writes (full; LoRA adapter
# and merged, gathered from ZeRO-3) and `checkpoint export` of a checkpoint saved after fit (`export`,
# `checkpoint_export`). The save paths that resume (ModelCheckpoint, SIGTERM, FSDP2's DCP): test_checkpoints.py,
# test_fsdp.py. Each clipping threshold lies between its case's true gradient norm and that norm / 2 at every step
# (the reference asserts it clips; a norm 2x too small would not be): the norms of the 3 steps measured 0.086, 0.104,
# 0.089 (Qwen3-Next with LoRA), 5.04, 3.51, 2.98 (Nemotron-H, at a learning rate of 0.1: at 0.5 its clipped steps
# bring the norm down to 2.5, below half the first's), 0.122, 0.163, 0.207 (LFM2 with LoRA).
HYBRID_CLIP = {"qwen3_next": 0.07, "nemotron_h": 2.8, "lfm2": 0.11}


def _hybrid(world, sp, stage, family, features, **extra):
    # (the samples the measured norms below are of, whatever job of the shared launch seeded last)
    suffix, model, case = "", f"family:{family}", {"split_mixers": True, "sampler_seed": 0, **extra}
    if "accumulate2-clip" in features:
        suffix += "-accumulate2-clip"
        case.update(batch_size=1, trainer_kwargs={"accumulate_grad_batches": 2,
                                                  "gradient_clip_val": HYBRID_CLIP[family]})
    if "lora" in features:
        suffix, model = suffix + "-lora", model + "+lora"
    if "bf16" in features:
        suffix += "-bf16-mixed"
        case.update(precision="bf16-mixed", bf16_reference=True)
    return _case(world, sp, stage, "gqa", suffix=f"-{family}-features{suffix}", model=model, **case)


HYBRID_FEATURE_MATRIX = [
    _hybrid(4, 2, 2, "qwen3_next", ("accumulate2-clip", "lora")),
    _hybrid(4, 4, 3, "qwen3_next", ("bf16",)),
    _hybrid(4, 2, 3, "nemotron_h", ("lora", "bf16")),
    _hybrid(4, 4, 2, "nemotron_h", ("accumulate2-clip",), lr=0.1, export=True, checkpoint_export=True),
    _hybrid(4, 2, 2, "lfm2", ("bf16",)),
    _hybrid(4, 4, 3, "lfm2", ("accumulate2-clip", "lora"), export=True, checkpoint_export=True),
]


def _matrix():
    layouts = {1: [1], 2: [1, 2], 4: [2, 4]}
    cases = [
        _case(world, sp, stage, attention)
        for world, sps in layouts.items() for sp in sps for stage in (0, 2, 3) for attention in ("mha", "mqa")
    ]
    cases += [
        # ZeRO-1 reduces gradients with ZeRO-2's code (stage_1_and_2.py): one SP × DP case here, one on a ring below.
        _case(4, 2, 1, "mha"),
        # A length that SP 2 does not divide: padded at the end with ignored labels.
        _case(2, 2, 3, "mqa", seq_len=15, suffix="-len15"),
        # ZeRO-3 without reduce-scatter divides small buckets by DP and oversized ones by DP × SP (refused at SP > 1,
        # see RunSpec.loss_gradient_scale); at SP 1 both are DP. Tiny buckets: every matrix is larger than one.
        _case(4, 1, 3, "mha", suffix="-no-reduce-scatter-small-buckets",
              strategy_kwargs={"reduce_scatter": False, "reduce_bucket_size": SMALL_BUCKET}),
        # Parameters larger than reduce_bucket_size (and gradients not contiguous): ZeRO-2 divides every bucket the
        # same way, ZeRO-3's reduce-scatter too (ZeRO-1 shares ZeRO-2's reduction code).
        _case(4, 2, 2, "mqa", suffix="-small-buckets-not-contiguous",
              strategy_kwargs={"reduce_bucket_size": SMALL_BUCKET, "contiguous_gradients": False}),
        _case(4, 2, 3, "mha", suffix="-small-buckets", strategy_kwargs={"reduce_bucket_size": SMALL_BUCKET}),
        # Gradient accumulation (micro-batches of 1) against one step over the same samples, clipped or not. The
        # clipping threshold lies between the true gradient norm (0.96-1.53 here) and that norm / k: a norm k times
        # too small would not be clipped (a threshold below both would hide the scale: clipping normalises it).
        *[_case(4, sp, stage, attention, suffix=f"-accumulate{k}{'-clip' if clip else ''}", batch_size=1,
                steps=STEPS if k == 2 else 2,
                trainer_kwargs={"accumulate_grad_batches": k, **({"gradient_clip_val": 0.8} if clip else {})})
          for sp, stage, attention, k, clip in [
              (2, 2, "mha", 2, False), (2, 3, "mha", 2, True), (2, 2, "mqa", 4, True), (1, 3, "mha", 2, True)]],
        # Accumulation windows that the epoch's batches do not fill (4 micro-batches per epoch, 3 per window: a
        # window of 3 and one of 1 each epoch, over 2 epochs): Lightning's windows, which restart every epoch and
        # step on the partial one, at SP 1, SP 2, SP 2 × DP 2, ZeRO-2 and -3, clipped and in bf16; and the other ways
        # a window ends early: `limit_train_batches`, `max_steps` after a partial window, validation inside a window
        # (whose checkpoint a resume refuses: its gradients are not saved).
        *[_case(world, sp, stage, attention, suffix=f"-epochs-accumulate3{suffix}", batch_size=1, epochs=2,
                batches_per_epoch=4, trainer_kwargs={"accumulate_grad_batches": 3, **trainer_kwargs}, **extra)
          for world, sp, stage, attention, suffix, trainer_kwargs, extra in [
              (1, 1, 2, "mha", "", {}, {}), (2, 2, 3, "mqa", "", {}, {}), (4, 2, 2, "mha", "", {}, {}),
              (4, 2, 3, "gqa", "-clip", {"gradient_clip_val": 0.05}, {}),
              (4, 2, 3, "mqa", "-bf16-mixed", {}, {"precision": "bf16-mixed"}),
              (2, 2, 3, "mha", "-max-steps3", {}, {"max_steps": 3}),
              # beyond Llama: the native GPT (its own swapped loss), a Gated-DeltaNet hybrid (mixers on whole rows)
              (2, 2, 2, "mqa", "-gpt", {}, {"model": "gpt"}),
              (4, 2, 3, "gqa", "-qwen3_next", {}, {"model": "family:qwen3_next"})]],
        _case(2, 2, 2, "mha", suffix="-limit-batches5-accumulate3", batch_size=1, epochs=1, batches_per_epoch=6,
              trainer_kwargs={"accumulate_grad_batches": 3, "limit_train_batches": 5}),
        _case(4, 2, 3, "mqa", suffix="-validation-inside-window-accumulate3", batch_size=1, epochs=1,
              batches_per_epoch=5, resume_inside_window=True,
              trainer_kwargs={"accumulate_grad_batches": 3, "val_check_interval": 2}),
        # Gradient clipping must count gradients replicated over the SP group once.
        _case(4, 2, 0, "mha", suffix="-clip", trainer_kwargs={"gradient_clip_val": 0.05}),
        _case(4, 2, 2, "mqa", suffix="-clip", trainer_kwargs={"gradient_clip_val": 0.05}),
        _case(4, 2, 3, "mha", suffix="-clip", trainer_kwargs={"gradient_clip_val": 0.05}),
        # fit, then validate, test and predict in the same process with the same Trainer.
        _case(2, 2, 3, "mqa", suffix="-then-validate", validate=True, validate_from_checkpoint=True),
        _case(4, 2, 2, "mha", suffix="-then-validate", validate=True),
        # Evaluation without sequence parallelism (opt-in): whole sequences, the model's own attention.
        _case(2, 2, 3, "mha", suffix="-unsharded-evaluation", validate=True,
              strategy_kwargs={"sequence_parallel_in_evaluation": False}),
        _case(2, 2, 2, "mqa", suffix="-gpt-unsharded-evaluation", model="gpt", validate=True,
              strategy_kwargs={"sequence_parallel_in_evaluation": False}),
        # The native GPT (UlyssesAttention, RoPE from global positions, tied embeddings, swapped loss).
        _case(2, 2, 3, "mqa", suffix="-gpt", model="gpt"),
        _case(4, 4, 3, "mha", suffix="-gpt", model="gpt"),
        _case(4, 2, 2, "mqa", suffix="-gpt", model="gpt"),
        # Built in configure_model, i.e. partitioned at construction by deepspeed.zero.Init.
        _case(2, 2, 3, "mha", suffix="-gpt-zero-init", model="gpt", in_configure_model=True),
        # Hybrid Ulysses × ring (zig-zag shards): 2 KV heads at SP 4 = Ulysses 2 × ring 2, and a pure ring of 2
        # inside world 4 (DP 2), for Hugging Face Llama and the native GPT.
        _case(4, 4, 3, "gqa", suffix="-ring2", strategy_kwargs={"ring_size": 2}),
        _case(4, 4, 2, "gqa", suffix="-gpt-ring2", model="gpt", validate=True, strategy_kwargs={"ring_size": 2}),
        _case(4, 2, 1, "mqa", suffix="-ring2", seq_len=15, strategy_kwargs={"ring_size": 2}),
        # A hybrid on a ring: its attention's K/V blocks pass around the ring, its Gated-DeltaNet mixers split by
        # heads over all four SP ranks (mixers/ranks.py)
        _case(4, 4, 3, "gqa", suffix="-qwen3_next-ring2", model="family:qwen3_next", strategy_kwargs={"ring_size": 2}),
        # ... its value heads split unevenly over the four (3, 2, 2, 2 of 9): two-stage exchanges of per-rank sizes
        _case(4, 4, 2, "gqa", suffix="-qwen3_next-uneven-ring2", model="family:qwen3_next@uneven",
              strategy_kwargs={"ring_size": 2}, split_mixers=True),
        # Label idioms: labels=input_ids and labels built in the step are read as Hugging Face reads them
        # (unshifted), at SP 1 (DP 2), SP 2 and SP 2 x DP 2; the batch's own labels with the strategy's loss.
        *[_case(world, sp, stage, "mqa", suffix=f"-{step}", step=step)
          for step, layouts in (("labels_are_input_ids", ((2, 1, 3), (4, 2, 3))), ("built_labels", ((2, 1, 2), (2, 2, 2))))
          for world, sp, stage in layouts],
        _case(4, 2, 3, "mqa", suffix="-labels_are_input_ids-len15", seq_len=15, step="labels_are_input_ids"),
        _case(4, 2, 2, "gqa", suffix="-own_loss", step="own_loss"),
        # The loss written by hand on batch["labels"] (which arrive as the user gave them, unshifted): exact at SP 1
        # (ZeRO-3, DP 2; ZeRO-2 accumulating), refused at SP 2 and SP 4 before any optimizer step (`-refused`).
        _case(2, 1, 3, "mqa", suffix="-hand_written", step="hand_written"),
        _case(4, 1, 2, "mha", suffix="-hand_written-accumulate2", step="hand_written", batch_size=1,
              trainer_kwargs={"accumulate_grad_batches": 2}),
        _case(2, 2, 2, "mqa", suffix="-hand_written-refused", step="hand_written", refused=True),
        _case(2, 1, 2, "mqa", suffix="-gpt-hand_written", step="hand_written", model="gpt"),
        _case(2, 2, 2, "mqa", suffix="-gpt-hand_written-refused", step="hand_written", model="gpt", refused=True),
        _case(4, 4, 2, "mha", suffix="-hand_written-refused", step="hand_written", refused=True),
        # ... with a Qwen3-MoE model's load-balancing term added (whole: it reaches the SP reduction, the cross-entropy
        # does not): exact at SP 1 (DP 2), refused at SP 2, SP 2 x DP 2 (accumulating) and SP 4.
        _case(2, 1, 2, "gqa", suffix="-qwen3_moe-hand_written_aux", step="hand_written_aux",
              model="family:qwen3_moe@router"),
        *[_case(world, sp, 2, "gqa", suffix=f"-qwen3_moe-hand_written_aux{suffix}-refused", step="hand_written_aux",
                model="family:qwen3_moe@router", refused=True, **extra)
          for world, sp, suffix, extra in [
              (2, 2, "", {}), (4, 4, "", {}),
              (4, 2, "-accumulate2", {"batch_size": 1, "trainer_kwargs": {"accumulate_grad_batches": 2}})]],
        _case(4, 4, 3, "gqa", suffix="-ring2-labels_are_input_ids", step="labels_are_input_ids",
              strategy_kwargs={"ring_size": 2}),
        # bf16-mixed against the fp32 reference, within bf16's precision (check_bf16_against_fp32).
        _case(4, 2, 3, "mqa", suffix="-bf16-mixed", precision="bf16-mixed"),
        # A PEFT LoRA model (frozen base, adapters train) against the same LoRA model in one process.
        _case(4, 2, 3, "mqa", suffix="-lora", model="lora"),
        # Families beyond Llama (tests/distributed/families.py, their own head counts) with the features users combine:
        # a Gated-DeltaNet hybrid (mixers on whole rows) accumulating gradients, sinks and sliding windows (GPT-OSS's
        # own eager attention on whole rows) with labels=input_ids, a sliding-window family in bf16-mixed.
        _case(4, 2, 3, "gqa", suffix="-qwen3_next-accumulate2", model="family:qwen3_next", batch_size=1,
              trainer_kwargs={"accumulate_grad_batches": 2}),
        # selective recompute on a hybrid: its first layer checkpointed with the delta rule's and the linear layers'
        # products kept (the recompute runs only their elementwise rest), the others keeping their activations
        _case(4, 2, 3, "gqa", suffix="-qwen3_next-selective-recompute", model="family:qwen3_next",
              strategy_kwargs={"memory": {"activation_checkpointing": True, "checkpoint_layers": 1,
                                          "keep_matmul_outputs": True, "keep_token_mixer_outputs": True,
                                          "keep_attention_outputs": True}}),
        _case(4, 2, 2, "gqa", suffix="-gpt_oss-labels_are_input_ids", model="family:gpt_oss",
              step="labels_are_input_ids"),
        _case(4, 2, 3, "gqa", suffix="-mistral-bf16-mixed", model="family:mistral", precision="bf16-mixed"),
        # Hybrid families whose token mixers are split by heads (lightning_ulysses/mixers/), with `model(**batch)` and
        # nothing more (their default cache made in training): every mixer kind under ZeRO-2 and under ZeRO-3 (Gated
        # DeltaNet, KDA, Mamba2, Mamba1, short convolution, lightning attention), at SP 4 where the heads allow, at
        # SP 2 × DP 2, accumulating and clipped (Mamba2), in bf16-mixed (short convolution), and LoRA on every linear
        # of a Mamba2, a Mamba and a KDA mixer (`MIXER_LORA_TARGETS`: called through the split's stand-ins, or sliced
        # in their parts). Mixers whose units do not divide by SP (`@uneven`, families.py `UNEVEN`: ⌈U/SP⌉ or ⌊U/SP⌋
        # units per rank): Gated DeltaNet's 9 value heads over 3 key heads at SP 4 on ZeRO-3 and on a ring (below),
        # Mamba2's 9 heads in 3 groups at SP 2 × DP 2 on ZeRO-2, a short convolution's 31 channels at SP 4 on ZeRO-2,
        # KDA's 5 heads with LoRA on every linear at SP 2.
        # Packed rows: test_packing.py; a save and an exact resume: test_checkpoints.py.
        *[_case(world, sp, stage, "gqa", suffix=f"-{family}{suffix}", model=f"family:{family}{model}",
                split_mixers=True, **extra)
          for world, sp, stage, family, suffix, model, extra in [
              (2, 2, 3, "qwen3_5_text", "", "", {}),
              (4, 4, 2, "olmo_hybrid", "", "", {}),
              (4, 4, 3, "kimi_linear", "", "", {}),
              (4, 2, 2, "bamba", "-accumulate2-clip", "", {
                  "batch_size": 1, "trainer_kwargs": {"accumulate_grad_batches": 2, "gradient_clip_val": 1.2}}),
              (4, 2, 3, "bamba", "-lora", "+lora", {}),
              (2, 2, 3, "jamba", "-lora", "+lora", {}),
              (2, 2, 2, "kimi_linear", "-uneven-lora", "@uneven+lora", {}),  # 5 heads: 3 and 2, LoRA sliced so
              (4, 4, 2, "mamba", "", "", {}),
              (4, 2, 3, "mamba", "", "", {}),
              (4, 4, 2, "lfm2", "", "", {}),
              (4, 2, 3, "lfm2", "", "", {}),
              (2, 2, 3, "lfm2", "-bf16-mixed", "", {"precision": "bf16-mixed"}),
              (2, 2, 3, "minimax", "", "", {}),
              (4, 4, 2, "minimax", "", "", {}),
              (4, 4, 3, "qwen3_next", "-uneven", "@uneven", {}),
              (4, 2, 2, "mamba2", "-uneven", "@uneven", {}),
              (4, 4, 2, "lfm2", "-uneven", "@uneven", {})]],
        *HYBRID_FEATURE_MATRIX,
        # Pretrained weights (`save_pretrained`, then `from_pretrained`): loaded in configure_model under ZeRO-3
        # straight into the partitions (pretrained.py), untied, tied, partly frozen, and through the recipes'
        # PretrainedCausalLM with YaRN scaling; under ZeRO-2 and ZeRO-0 in configure_model (no zero.Init); and in
        # __init__. The reference starts from the saved model.
        # `export`: the save_pretrained folder ExportPretrained writes at the end of training (gathered from ZeRO-3).
        _case(4, 2, 3, "mha", suffix="-pretrained", model="pretrained", in_configure_model=True, export=True),
        _case(4, 4, 3, "gqa", suffix="-pretrained-tied", model="pretrained-tied", in_configure_model=True, export=True),
        # LoRA on the loaded model in configure_model (adapters partitioned by zero.Init as peft creates them),
        # against peft's own LoRA model in one process; exported as adapters and merged, at the end of fit and by
        # `checkpoint export` from a checkpoint saved after fit (`checkpoint_export`).
        _case(4, 2, 3, "mha", suffix="-pretrained-lora", model="pretrained-lora", in_configure_model=True, export=True,
              checkpoint_export=True),
        # The same with a second adapter (`add_adapter`, inactive: only the first trains), exported beside the first.
        _case(4, 2, 3, "mha", suffix="-pretrained-lora2", model="pretrained-lora2", in_configure_model=True,
              export=True, checkpoint_export=True),
        _case(4, 2, 3, "mqa", suffix="-pretrained-frozen", model="pretrained-frozen", in_configure_model=True),
        _case(4, 2, 3, "gqa", suffix="-pretrained-yarn", model="pretrained-yarn", in_configure_model=True),
        _case(4, 2, 2, "mha", suffix="-pretrained-tied", model="pretrained-tied", in_configure_model=True),
        _case(4, 4, 0, "mqa", suffix="-pretrained", model="pretrained", in_configure_model=True),
        _case(4, 2, 3, "mha", suffix="-pretrained-in-init", model="pretrained"),
        # Pipelined head groups (NUM_HEADS 4 at SP 2: two groups of 2 heads, one per rank each).
        _case(2, 2, 3, "mha", suffix="-overlap2", strategy_kwargs={"overlap_head_groups": 2}),
        _case(4, 2, 2, "mha", suffix="-gpt-overlap2", model="gpt", strategy_kwargs={"overlap_head_groups": 2}),
    ]
    return cases


# The plain Hugging Face loss each step form of tests/distributed/common.py STEP_FORMS stands for.
REFERENCE_LOSSES = {
    "batch": lambda model, batch: model(input_ids=batch["input_ids"], labels=batch["labels"]).loss,
    "own_loss": lambda model, batch: model(input_ids=batch["input_ids"], labels=batch["labels"]).loss,
    "hand_written": lambda model, batch: model(input_ids=batch["input_ids"], labels=batch["labels"]).loss,
    # the model's own loss adds router_aux_loss_coef * aux_loss with output_router_logits=True
    "hand_written_aux": lambda model, batch: model(input_ids=batch["input_ids"], labels=batch["labels"]).loss,
    "labels_are_input_ids": lambda model, batch: model(input_ids=batch["input_ids"], labels=batch["input_ids"]).loss,
    "built_labels": lambda model, batch: model(input_ids=batch["input_ids"],
                                               labels=built_labels(batch["input_ids"])).loss,
}

CASES = _matrix()
# One job per world size, each in the shared launch of that world size (pool.py).
JOBS = {world: shared(world, "parity", WORKER, {"cases": [case for case in CASES if case["world_size"] == world]},
                     timeout=1200)  # some 50 trainings at 4 ranks: several minutes on 2 cores
        for world in sorted({case["world_size"] for case in CASES})}


def _results_for(world_size: int, tmp_path_factory) -> list[dict]:
    return JOBS[world_size].ranks(tmp_path_factory)


CLAIMS = ("routing", "shards", "losses", "weights", "evaluation", "replicas", "tying", "export", "checkpoint_export",
          "groups", "engines", "resume_refused", "refused", "split_mixers")
_APPLIES = {"refused": lambda case: case.get("refused"), "split_mixers": lambda case: case.get("split_mixers"),"evaluation": lambda case: case.get("validate"), "export": lambda case: case.get("export"),
            "resume_refused": lambda case: case.get("resume_inside_window"),
            "checkpoint_export": lambda case: case.get("checkpoint_export"),
            "tying": lambda case: case.get("model", "").startswith("pretrained")}


def _claims_of(case: dict) -> tuple[str, ...]:
    if case.get("refused"):  # a run refused at its first step: nothing trained to compare
        return ("refused",)
    return tuple(claim for claim in CLAIMS if _APPLIES.get(claim, lambda case: True)(case))


@pytest.mark.parametrize(("case", "claim"), [(case, claim) for case in CASES for claim in _claims_of(case)],
                         ids=[f"{case['name']}-{claim}" for case in CASES for claim in _claims_of(case)])
def test_parity_with_single_process_reference(case, claim, tmp_path_factory):
    """One claim of one training case against the single-process reference: the test's id names what broke."""
    check_parity(case, [result[case["name"]] for result in _results_for(case["world_size"], tmp_path_factory)],
                 claims=(claim,))


def check_parity(case: dict, ranks: list[dict], claims: tuple[str, ...] | None = None) -> None:
    """The `claims` of one training case (default: all that apply): its records and final weights against the
    reference."""
    steps = None if case.get("refused") else _routed_samples(case, ranks)  # what every later claim reads
    for claim in claims or _claims_of(case):
        if claim != "routing":
            _CHECKS[claim](case, ranks, steps)


def _accumulation(case: dict) -> int:
    return case.get("trainer_kwargs", {}).get("accumulate_grad_batches", 1)


def _windows(case: dict) -> list[int]:
    """The micro-batches of each optimizer step, by Lightning's rules: windows of `accumulate_grad_batches` that
    restart at every epoch, the epoch's last (partial) window stepping too; `max_steps` ends the run at a step."""
    k = _accumulation(case)
    if "epochs" not in case:
        return [k] * case["steps"]
    per_epoch = case.get("trainer_kwargs", {}).get("limit_train_batches") or case["batches_per_epoch"]
    epoch = [k] * (per_epoch // k) + ([per_epoch % k] if per_epoch % k else [])
    return (epoch * case["epochs"])[:case.get("max_steps")]


def _routed_samples(case: dict, ranks: list[dict]) -> list[list[list[int]]]:
    """Routing: the same samples on every rank of an SP group, different samples on different DP groups.
    Returns them per micro-batch (= per record), per DP rank."""
    sp, steps = case["sp"], []
    assert all(len(rank["records"]) == sum(_windows(case)) for rank in ranks), "routing: micro-batches trained"
    for step in range(sum(_windows(case))):
        by_dp = {}
        for rank in ranks:
            by_dp.setdefault(rank["data_parallel_rank"], []).append(rank["records"][step]["sample_index"])
        for indices in by_dp.values():
            assert len(indices) == sp and all(i == indices[0] for i in indices), f"routing: SP ranks differ {by_dp}"
        flat = [i for dp in sorted(by_dp) for i in by_dp[dp][0]]
        assert len(set(flat)) == len(flat), f"routing: DP groups saw overlapping samples at step {step}: {by_dp}"
        steps.append([by_dp[dp][0] for dp in sorted(by_dp)])
    return steps


def _order(case: dict) -> tuple[ShardOrder, int]:
    """The shard order of the case (zig-zag with a ring) and the length its rows are padded to."""
    order = ShardOrder(case["sp"], case.get("strategy_kwargs", {}).get("ring_size") or 1)
    return order, -(-case["seq_len"] // order.length_multiple) * order.length_multiple


def _check_shards(case: dict, ranks: list[dict], steps) -> None:
    """Shard contents: this rank's slice of the labels (as the user gave them, unshifted), tokens and global positions
    (padded when needed)."""
    dataset, batch_size = UnevenlyMaskedTokens(10_000, case["seq_len"]), case["batch_size"]
    order, padded = _order(case)
    for rank in ranks:
        for step, record in enumerate(rank["records"]):
            full = collate([dataset[i] for i in record["sample_index"]])
            extra = padded - case["seq_len"]
            input_ids = torch.cat([full["input_ids"], torch.zeros(batch_size, extra, dtype=torch.long)], 1)
            labels = torch.cat([full["labels"], torch.full((batch_size, extra), -100)], 1)
            sp_rank = rank["sequence_parallel_rank"]
            assert torch.equal(record["input_ids"], order.shard(input_ids, sp_rank, dim=1)), ("input_ids", step)
            assert torch.equal(record["labels"], order.shard(labels, sp_rank, dim=1)), ("labels", step)
            # Global positions at every SP size (SP 1 included: one rule for all).
            positions = order.positions(padded, sp_rank).expand(batch_size, -1)
            assert torch.equal(record["position_ids"], positions), ("position_ids", step)


@functools.lru_cache(maxsize=None)
def _reference(case_json: str, windows: tuple) -> dict:
    """The single-process reference of one case, computed once for all its claims."""
    case = json.loads(case_json)
    return reference_training(case["kv_heads"], case["seq_len"], [list(map(list, w)) for w in windows],
                              lr=case.get("lr", 0.5),
                              gradient_clip_val=case.get("trainer_kwargs", {}).get("gradient_clip_val"),
                              kind=case.get("model", "llama"), micro_batches=_accumulation(case),
                              micro_batch_size=case["batch_size"],
                              replica_loss=REFERENCE_LOSSES[case.get("step", "batch")],
                              precision=case["precision"] if case.get("bf16_reference") else "32-true")


def _reference_of(case: dict, steps) -> dict:
    # One reference step per optimizer step, over all the samples of its accumulation window.
    windows, start = [], 0
    for size in _windows(case):
        windows.append(tuple(tuple(sum((steps[start + j][dp] for j in range(size)), [])) for dp in range(len(steps[0]))))
        start += size
    return _reference(json.dumps(case, sort_keys=True), tuple(windows))


def _check_losses(case: dict, ranks: list[dict], steps) -> None:
    """Every returned loss: the whole-sequence loss of this rank's DP replica, the same on every SP rank (bf16-mixed:
    within 2e-2 relative of the fp32 reference, bf16's precision, see `check_bf16_against_fp32`; within
    `BF16_LOSS_TOLERANCE` of the bf16 reference where the case has one, `bf16_reference`)."""
    reference = _reference_of(case, steps)
    bf16 = case.get("precision") == "bf16-mixed"
    for rank in ranks:
        for step, record in enumerate(rank["records"]):
            expected = reference["losses"][step][rank["data_parallel_rank"]]
            tolerance = (BF16_LOSS_TOLERANCE if case.get("bf16_reference") else 2e-2) * abs(expected) if bf16 else 1e-5
            assert abs(record["loss"] - expected) <= tolerance, (step, rank["sequence_parallel_rank"], record["loss"],
                                                                 expected)


def _check_weights(case: dict, ranks: list[dict], steps) -> None:
    """Weights after the SGD steps, relative to the size of the update (bf16: `check_bf16_against_fp32`)."""
    reference = _reference_of(case, steps)
    if case.get("bf16_reference"):
        check_bf16_against_bf16(ranks, reference)
        return
    if case.get("precision") == "bf16-mixed":
        check_bf16_against_fp32(ranks, reference)
        return
    assert_weights_match(next(rank["weights"] for rank in ranks if rank["weights"] is not None), reference)


def _check_evaluation(case: dict, ranks: list[dict], steps) -> None:
    """validate, test and predict after fit (same process, same Trainer): each batch's loss equals the trained
    reference model's loss on it."""
    reference = _reference_of(case, steps)
    dataset = UnevenlyMaskedTokens(10_000, case["seq_len"])
    _, padded = _order(case)
    model = build_model(case.get("model", "llama"), case["kv_heads"], reference=True)
    result = model.load_state_dict(reference["final"], strict=False)
    assert not result.unexpected_keys and set(result.missing_keys) <= {"lm_head.weight"}  # tied to the embedding
    for rank in ranks:
        stages = [record["stage"] for record in rank["validation_records"]]
        expected_stages = ["validate"] * 2 + ["test"] * 2 + ["predict"] * 2
        if case.get("validate_from_checkpoint"):
            expected_stages += ["validate_from_checkpoint"] * 2
        assert stages == expected_stages
        unsharded = not case.get("strategy_kwargs", {}).get("sequence_parallel_in_evaluation", True)
        for record in rank["validation_records"]:
            assert record["local_length"] == (padded if unsharded else padded // case["sp"])
            batch = collate([dataset[i] for i in record["sample_index"]])
            with torch.no_grad():
                expected = model(input_ids=batch["input_ids"], labels=batch["labels"]).loss.item()
            assert abs(record["loss"] - expected) < 1e-5, (record["stage"], record["loss"], expected)


def _check_replicas(case: dict, ranks: list[dict], steps) -> None:
    """No replica drifted: every rank ends with the same weights."""
    checksums = [rank["weights_checksum"] for rank in ranks]
    assert max(checksums) - min(checksums) <= 1e-9 * max(checksums), checksums


def _check_tying(case: dict, ranks: list[dict], steps) -> None:
    """A pretrained model with tied embeddings still has one tensor for both after loading and training (an untied
    copy would train the two apart: the weights claim compares the one tensor only)."""
    tied = case["model"].endswith("-tied")
    assert [rank["tied_embeddings"] for rank in ranks] == [tied] * len(ranks)


def _check_export(case: dict, ranks: list[dict], steps) -> None:
    """The folders `ExportPretrained` wrote at the end of training (see `_check_exported`)."""
    rank = next(rank for rank in ranks if rank["weights"] is not None)
    _check_exported(case, rank, Path(rank["export"]))


def _check_checkpoint_export(case: dict, ranks: list[dict], steps) -> None:
    """`python -m lightning_ulysses checkpoint export <checkpoint saved after fit> <folder> --merged` writes the
    folders the callback writes, for the PEFT model at `model`, with the same logits (`_check_exported`, same
    tolerances). The checkpoint holds DeepSpeed's fp32 master weights and the callback exports the module's weights:
    in fp32 (`32-true`) these are the same values (ZeRO-3 copies the updated fp32 master partition into the module's
    fp32 partition, no rounding; the frozen base is saved from the module's own partitions), so the logits are
    identical, not merely close."""
    from lightning_ulysses.integration.checkpoint.command_line import main

    rank = next(rank for rank in ranks if rank["weights"] is not None)
    output = Path(rank["checkpoint"]).with_suffix(".exported")
    # With a second, inactive adapter, `merged/` leaves it out and says so (`export` module docstring).
    warns = (pytest.warns(UserWarning, match=rf"not the inactive \['{SECOND_ADAPTER}'\]")
             if case["model"].endswith("-lora2") else contextlib.nullcontext())
    with warns:
        assert main(["export", rank["checkpoint"], str(output), "--merged"]) == 0
    # One model: its folders in the output itself, as the callback's are (beside the consolidated state dict).
    written = sorted(p.name for p in output.iterdir())
    if _is_lora(case):
        assert written == ["adapter", "merged", "model.pt"], written
    else:  # a full model: its save_pretrained folder is the output
        assert {"config.json", "model.safetensors", "model.pt"} <= set(written), written
    _check_exported(case, rank, output)


def _is_lora(case: dict) -> bool:
    return case["model"].endswith(("-lora", "-lora2", "+lora"))


def _check_exported(case: dict, rank: dict, export: Path) -> None:
    """Exported folders load, without the training code, with the trained model's logits (eager attention on both
    sides): a full model through `AutoModelForCausalLM` identically; LoRA's adapter folder on the saved base through
    `PeftModel` identically, and the merged folder identically to peft's merge of the trained model (within 1e-5 of
    the unmerged one: merging changes the order of the sums). With a second adapter (`-lora2`): that one too, from
    its subfolder (peft's layout), with the reference's own weights exactly (inactive and frozen, it keeps peft's
    initial values: `A` random, `B` zero, so weights rather than logits tell a dropped or swapped adapter), and the
    merged folder merges the active (trained) adapter only, as the comparisons above then demand (merging an
    inactive adapter is caught by tests/unit/test_lora.py, whose inactive adapters are not zero). A family's model
    (`family:`) is compared in the attention it trained with, its LoRA adapters loaded on the family's own tiny
    model (the frozen base the case started from)."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    trained = build_model(case["model"], case["kv_heads"], reference=True)
    result = trained.load_state_dict(rank["weights"], strict=False)
    buffers = {name for name, _ in trained.named_buffers()}  # (the weights are parameters; the buffers built alike)
    assert not result.unexpected_keys and all(key in buffers or "rotary" in key or key.endswith("lm_head.weight")
                                              for key in result.missing_keys), result
    tokens = torch.arange(2 * case["seq_len"]).reshape(2, -1) % trained.config.vocab_size
    logits = _logits(trained, tokens)
    attention = trained.config._attn_implementation
    if not _is_lora(case):
        assert torch.equal(_logits(AutoModelForCausalLM.from_pretrained(export, attn_implementation=attention),
                                   tokens), logits)
        return
    if rank["pretrained"]:
        base = AutoModelForCausalLM.from_pretrained(rank["pretrained"], attn_implementation=attention)
    else:
        base = build_model(case["model"].partition("+")[0], case["kv_heads"], reference=True)
    loaded = PeftModel.from_pretrained(base, export / "adapter")
    if case["model"].endswith("-lora2"):
        second = export / "adapter" / SECOND_ADAPTER
        assert sorted(p.name for p in second.glob("*")) == ["adapter_config.json", "adapter_model.safetensors"]
        loaded.load_adapter(second, adapter_name=SECOND_ADAPTER)  # loaded inactive: `default` stays the one applied
    assert torch.equal(_logits(loaded, tokens), logits)
    if case["model"].endswith("-lora2"):
        reference = build_model(case["model"], case["kv_heads"], reference=True)  # untrained: as its second adapter
        expected = {key: value for key, value in reference.state_dict().items() if f".{SECOND_ADAPTER}." in key}
        exported = {key: value for key, value in loaded.state_dict().items() if f".{SECOND_ADAPTER}." in key}
        assert list(exported) == list(expected) and all(torch.equal(exported[k], expected[k]) for k in expected)
    merged = _logits(AutoModelForCausalLM.from_pretrained(export / "merged", attn_implementation=attention), tokens)
    assert torch.equal(merged, _logits(trained.merge_and_unload(), tokens))
    assert (merged - logits).abs().max() < 1e-5


def _logits(model, tokens):
    with torch.no_grad():
        return model.eval()(input_ids=tokens).logits


def _check_groups(case: dict, ranks: list[dict], steps) -> None:
    """Every run of the case (fit, then validate, test and predict where it evaluates, each building its groups
    again) released the process groups it trained or evaluated on when it ended, on every rank: none stays registered
    with torch.distributed, DeepSpeed's global mpu is cleared, and the only one still alive is the SP group, which the
    DeepSpeed engine still held by the case's Trainer keeps: the DP group and the Ulysses/ring sub-groups are gone
    (with them, their gloo threads). Without the release each run left all of them registered for good."""
    for rank in ranks:
        groups = rank["groups"]
        assert ("fit", "sequence_parallel") in groups["recorded"], groups
        assert groups["registered"] == [], groups
        assert groups["deepspeed_mpu"] is None, groups
        assert {kind for _, kind in groups["alive"]} <= {"sequence_parallel"}, groups


def _check_engines(case: dict, ranks: list[dict], steps) -> None:
    """Every DeepSpeed engine of the case (fit's, and validate's, test's and predict's where it evaluates) is freed
    once the case's Trainers and module are dropped, on every rank: the strategy destroys it at teardown and drops
    what DeepSpeed's globals hold (ZeRO-3's module stack and release cache, the engine's hooks on the user's module).
    Without that every engine of a process stayed alive, with its optimizer state."""
    for rank in ranks:
        engines = rank["engines"]
        assert "fit" in engines["recorded"], engines
        assert engines["alive"] == [], engines


def _check_resume_refused(case: dict, ranks: list[dict], steps) -> None:
    """A checkpoint saved by a validation inside an accumulation window (after 2 of its 3 micro-batches): resuming
    training from it is refused on every rank before any step, naming the cause and the fix."""
    for rank in ranks:
        refusal = rank["resume_refusal"] or ""
        assert "inside a gradient-accumulation window, after 2 micro-batch(es)" in refusal, refusal
        assert "every_n_train_steps" in refusal, refusal


def _check_split_mixers(case: dict, ranks: list[dict], steps) -> None:
    """Every token mixer of the hybrid that is not attention trained split by heads on every rank (none fell back to
    whole rows, whose work does not shrink with SP: exact too, so the other claims would not tell)."""
    for rank in ranks:
        assert rank["token_mixers"] and set(rank["token_mixers"].values()) == {"split"}, rank["token_mixers"]


def _check_refused(case: dict, ranks: list[dict], steps) -> None:
    """A loss computed from this rank's shard alone differs between the SP ranks: refused after the first step,
    before its backward, on every rank, naming the fix; no optimizer step ran (one forward, the weights as built)."""
    for rank in ranks:
        assert "The loss training_step returned differs between the ranks" in (rank["refusal"] or ""), rank["refusal"]
        assert "computed from this rank's shard alone" in rank["refusal"], rank["refusal"]
        assert "self.trainer.strategy.loss_function(logits, batch['labels'])" in rank["refusal"]
        assert rank["steps_before_refusal"] == 1 and rank["weights_unchanged"], rank


_CHECKS = {"refused": _check_refused, "resume_refused": _check_resume_refused, "shards": _check_shards, "losses": _check_losses, "weights": _check_weights,
           "evaluation": _check_evaluation, "replicas": _check_replicas, "tying": _check_tying,
           "export": _check_export, "checkpoint_export": _check_checkpoint_export, "groups": _check_groups,
           "engines": _check_engines, "split_mixers": _check_split_mixers}


def check_bf16_against_fp32(ranks: list[dict], reference: dict) -> None:
    """`bf16-mixed` weights against the fp32 reference. bf16 keeps 8 significant bits (relative rounding 2^-9 ≈
    2e-3 per operation): each weight tensor is held to 10% of its fp32 update plus one bf16 rounding step of the
    weight itself (DeepSpeed's bf16 module weights are rounded copies of the fp32 master); losses to 2e-2 relative
    (`_check_losses`). A scaling bug of the kind these tests exist for (a gradient 2× or 0.5× too large) moves
    weights by the whole update."""
    weights = next(rank["weights"] for rank in ranks if rank["weights"] is not None)
    for name, final in reference["final"].items():
        update = (final - reference["initial"][name]).norm()
        error = (weights[name].float() - final).norm()
        assert error <= 0.1 * update + 2 ** -8 * final.norm(), f"{name}: error {error:.3e} vs update {update:.3e}"


# Against the bf16 reference (`check_bf16_against_bf16`), measured on the hybrid feature matrix: losses at most 1.1e-4
# relative (LFM2; Qwen3-Next 2.2e-5, Nemotron-H 9e-6), weights at most 0.010 of the update beyond one bf16 step; a
# learning rate 10% off moves them 0.1-0.16 of it (tests/README.md).
BF16_LOSS_TOLERANCE = 1e-3
BF16_WEIGHT_TOLERANCE = 5e-2


def check_bf16_against_bf16(ranks: list[dict], reference: dict) -> None:
    """`bf16-mixed` weights against the one-process bf16 reference (`reference_training(precision="bf16-mixed")`: bf16
    weights computing, the SGD step on an fp32 master, the weights its rounding, as DeepSpeed's bf16 does). Both sides
    round the same master values to bf16, so an element may differ by one bf16 step of the weight (2^-8 relative:
    its master a hair across a rounding boundary) without meaning anything; what differs beyond that, over each
    tensor, is held to `BF16_WEIGHT_TOLERANCE` of the tensor's fp32 update. Gradients computed in bf16 in another
    order (split mixers, the SP and DP sums) differ by bf16 roundings: measured below that (see tests/README.md); a
    gradient 2x or 0.5x off moves the weights by the whole update or half of it."""
    weights = next(rank["weights"] for rank in ranks if rank["weights"] is not None)
    updates = {name: (final - reference["initial"][name]).norm() for name, final in reference["final"].items()}
    floor = 1e-6 * max(updates.values())  # as `assert_weights_match`: updates too small to measure against
    for name, final in reference["final_bf16"].items():
        mine = weights[name]
        assert mine.dtype == torch.bfloat16, (name, mine.dtype)  # DeepSpeed's bf16 module weights
        if name not in reference["trainable"]:  # frozen (LoRA's base): the initial weights, rounded once
            assert torch.equal(mine, final), f"{name} is frozen but changed"
            continue
        update = max(updates[name], floor)
        difference = (mine.float() - final.float()).abs()
        error = (difference - torch.maximum(bf16_spacing(mine), bf16_spacing(final))).clamp(min=0).norm()
        assert error <= BF16_WEIGHT_TOLERANCE * update, f"{name}: error {error:.3e} vs update {update:.3e}"


def bf16_spacing(weights: torch.Tensor) -> torch.Tensor:
    """The gap between each bf16 value and the next one away from zero (8 significant bits: 2^(e-8) for a value in
    [2^(e-1), 2^e))."""
    _, exponent = torch.frexp(weights.float())
    return torch.ldexp(torch.ones_like(weights, dtype=torch.float32), exponent - 8)
