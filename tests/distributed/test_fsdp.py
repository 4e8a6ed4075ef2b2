"""Parity of `UlyssesFSDPStrategy` (FSDP2) against the single-process full-sequence fp32 reference, with SGD.

The same module, data and checks as `test_parity.py` (its worker `train_parity.py`, its claims), with
`strategy=UlyssesFSDPStrategy(...)` instead: SP 1/2/4 with DP in a world of 4 (SP 1 × DP 4, SP 2 × DP 2, SP 4) and
SP 2 in a world of 2, for a Llama, a Qwen3-MoE and a Qwen3-Next hybrid (Gated DeltaNet split by heads), with
gradient accumulation, gradient clipping, `labels=input_ids`, a ring (Ulysses 2 × ring 2), pretrained weights loaded
in configure_model, the native GPT with validate/test/predict after fit, evaluation on whole rows, packed rows (each
document alone in the reference), bf16-mixed through FSDP2's MixedPrecisionPolicy, and `ExportPretrained`. Every loss
within 1e-5 of the reference, the weights after the SGD steps within 1e-4 of the update. The cases ride in the shared
launches of 4 and 2 ranks (pool.py).
"""

from __future__ import annotations

import pytest
import torch

from tests.distributed.pool import shared
from tests.distributed.reference import assert_training_matches, reference_training
from tests.distributed.test_packing import _documents_alone_loss
from tests.distributed.test_parity import ATTENTION, STEPS, WORKER, check_parity

SEQ_LEN, BATCH_SIZE = 16, 2


def _case(world_size: int, sp: int, attention: str, suffix: str = "", **extra) -> dict:
    name = f"fsdp2-sp{sp}-dp{world_size // sp}-{attention}{suffix}"
    return {"name": name, "backend": "fsdp2", "world_size": world_size, "sp": sp, "stage": 3,
            "kv_heads": ATTENTION[attention], "steps": STEPS, "batch_size": BATCH_SIZE, "seq_len": SEQ_LEN, **extra}


ACCUMULATE_CLIP = {"batch_size": 1, "trainer_kwargs": {"accumulate_grad_batches": 2, "gradient_clip_val": 0.8}}
CASES = [
    # The other ranks' models differ from rank 0's before training: FSDP2 shards each rank's own copy, so the strategy
    # broadcasts rank 0's first (as DDP and DeepSpeed do).
    _case(4, 1, "mha", "-other-ranks-perturbed", perturb_other_ranks=True),
    # Accumulation and clipping (the threshold between the true norm and norm / k, as in test_parity.py).
    _case(4, 2, "mqa", "-accumulate2-clip", **ACCUMULATE_CLIP),
    # `ExportPretrained` at the end of fit: the save_pretrained folder gathered from FSDP2's shards.
    _case(4, 4, "gqa", "-labels_are_input_ids-export", step="labels_are_input_ids", model="llama", export=True),
    _case(4, 2, "gqa", "-qwen3_moe", model="family:qwen3_moe"),
    _case(4, 2, "gqa", "-qwen3_next-accumulate2-clip", model="family:qwen3_next", split_mixers=True,
          **ACCUMULATE_CLIP),
    _case(4, 2, "mqa", "-bf16-mixed", precision="bf16-mixed"),
    # Hybrid Ulysses × ring (zig-zag shards): 2 KV heads at SP 4 = Ulysses 2 × ring 2.
    _case(4, 4, "gqa", "-ring2", strategy_kwargs={"ring_size": 2}),
    # Pretrained weights loaded in configure_model (each rank loads the folder, then the strategy shards it).
    _case(4, 2, "mha", "-pretrained", model="pretrained", in_configure_model=True),
    # The native GPT (UlyssesAttention, tied embeddings, swapped loss), then validate, test and predict; and a Llama
    # evaluated on whole rows (sequence_parallel_in_evaluation=False: the model's own attention, unsharded).
    _case(2, 2, "mqa", "-gpt-then-validate", model="gpt", validate=True),
    _case(2, 2, "mha", "-unsharded-evaluation", validate=True, strategy_kwargs={"sequence_parallel_in_evaluation": False}),
]
# The memory features FSDP2 runs (`run_spec.FSDP2_MEMORY_FEATURES`), as test_memory_parity.py trains them: layer
# checkpointing with host offload, tiled MLP and tiled logits + loss together (HF Llama and the native GPT; DP ranks
# on rows of 16 and 12 tokens, so they run different numbers of MLP tiles), and checkpointing with kept attention
# outputs and the fused elementwise kernels (aot_eager). Plain reference, losses 1e-5, weights 1e-4 of the update.
MEMORY = {"tiled_mlp": True, "mlp_tile_tokens": 3, "tiled_logits_loss": True, "logits_tile_tokens": 4,
          "activation_checkpointing": True, "offload_activations": True}
KEPT_FUSED = {"activation_checkpointing": True, "keep_attention_outputs": True, "fused_elementwise": True,
              "fused_backend": "aot_eager"}
MEMORY_CASES = [dict(_case(4, 2, "gqa", f"-{model}-{suffix}"), model=model, batch_size=1,
                     dataset_kwargs={"odd_rows_shorter_by": 4}, strategy_kwargs={"memory": memory}, wrapped=sorted(wrapped))
                for model, suffix, memory, wrapped in [
                    ("llama", "memory", MEMORY, {"FSDPLlamaDecoderLayer", "FSDPLlamaForCausalLM", "LlamaMLP"}),
                    ("gpt", "memory", MEMORY, {"FSDPBlock", "MLP"}),
                    ("llama", "kept-attention-fused", KEPT_FUSED, {"FSDPLlamaDecoderLayer", "LlamaRMSNorm"})]]
# Packed rows (the recipes' PackedTokenRows): each document alone in the reference (test_packing.py's check).
PACKED = [dict(_case(4, 2, "mqa", "-packed"), model="llama", data="packed", lr=0.5)]

JOBS = {world: shared(world, "fsdp2_parity", WORKER,
                      {"cases": [case for case in CASES + PACKED + MEMORY_CASES if case["world_size"] == world]},
                      timeout=900)
        for world in (2, 4)}


def _ranks(case: dict, tmp_path_factory) -> list[dict]:
    return [result[case["name"]] for result in JOBS[case["world_size"]].ranks(tmp_path_factory)]


def _claims(case: dict) -> list[str]:
    claims = ["shards", "losses", "weights", "replicas", "groups"]
    return claims + [claim for claim, key in (("evaluation", "validate"), ("split_mixers", "split_mixers"),
                                              ("export", "export"), ("tying", "in_configure_model")) if case.get(key)]


@pytest.mark.parametrize(("case", "claim"), [(case, claim) for case in CASES for claim in _claims(case)],
                         ids=[f"{case['name']}-{claim}" for case in CASES for claim in _claims(case)])
def test_fsdp2_matches_single_process_reference(case, claim, tmp_path_factory):
    ranks = _ranks(case, tmp_path_factory)
    if claim == "groups":
        _check_groups_released(case, ranks)
    else:
        check_parity(case, ranks, claims=(claim,))


def _check_groups_released(case: dict, ranks: list[dict]) -> None:
    """Every run (fit, and validate/test/predict where it evaluates) released the device mesh's SP and DP groups at
    its end: none is still registered with torch.distributed, except a dimension that spans the whole world, which
    the mesh takes from the default group itself (never destroyed)."""
    whole_world = {kind for kind, size in (("sequence_parallel", case["sp"]),
                                           ("data_parallel", case["world_size"] // case["sp"]))
                   if size == case["world_size"]}
    for rank in ranks:
        groups = rank["groups"]
        assert ("fit", "sequence_parallel") in groups["recorded"], groups
        assert {kind for _, kind in groups["registered"]} <= whole_world, groups


@pytest.mark.parametrize("case", PACKED, ids=[case["name"] for case in PACKED])
def test_fsdp2_trains_packed_rows_like_documents_alone(case, tmp_path_factory):
    from tests.distributed.packed import PackedDocuments

    ranks = _ranks(case, tmp_path_factory)
    steps = []
    for step in range(STEPS):
        by_dp = {rank["data_parallel_rank"]: rank["records"][step]["sample_index"] for rank in ranks}
        steps.append([by_dp[dp] for dp in sorted(by_dp)])
    dataset = PackedDocuments(10_000 // SEQ_LEN, SEQ_LEN)
    reference = reference_training(case["kv_heads"], SEQ_LEN, steps, lr=case["lr"], kind=case["model"],
                                   dataset=dataset, replica_loss=_documents_alone_loss)
    assert_training_matches(ranks, reference)


@pytest.mark.parametrize("case", MEMORY_CASES, ids=[case["name"] for case in MEMORY_CASES])
def test_fsdp2_memory_features_match_plain_reference(case, tmp_path_factory):
    ranks = _ranks(case, tmp_path_factory)
    # the features were applied (their forwards wrapped) and every checkpointed layer ran again in backward
    assert all(set(case["wrapped"]) <= set(rank["wrapped_modules"]) for rank in ranks), ranks[0]["wrapped_modules"]
    assert all(rank["attention_runs"] == [2 * STEPS] * 2 for rank in ranks), ranks[0]["attention_runs"]
    if case["strategy_kwargs"]["memory"].get("fused_elementwise"):
        assert all(rank["compiled_graphs"] > 0 for rank in ranks)
    steps = []
    for step in range(STEPS):
        by_dp = {rank["data_parallel_rank"]: rank["records"][step]["sample_index"] for rank in ranks}
        steps.append([by_dp[dp] for dp in sorted(by_dp)])
    reference = reference_training(case["kv_heads"], SEQ_LEN, steps, kind=case["model"],
                                   dataset_kwargs=case["dataset_kwargs"])
    assert_training_matches(ranks, reference)


# Checkpoints (torch Distributed Checkpoint through the same protocol as the DeepSpeed strategy's), with
# test_checkpoints.py's worker: SP 2 × DP 2 saving every 2 steps (mid-epoch: 12 samples, a global batch of 4), resumed
# at the same split (exact: samples, losses, random draws and weights bit for bit) and at SP 4 × DP 1 (the same
# samples, losses and weights within float rounding); its last checkpoint exported by `checkpoint export`; a SIGTERM's
# save at the step boundary, resumed exactly.
CHECKPOINT_STEPS, SAVE_AT = 4, 2
CHECKPOINT_CASES = [
    {"name": "fsdp2_sp2", "backend": "fsdp2", "sp": 2, "batch_size": 2, "steps": CHECKPOINT_STEPS,
     "save_every": SAVE_AT},
    {"name": "fsdp2_sp2_to_sp2", "backend": "fsdp2", "sp": 2, "batch_size": 2, "steps": CHECKPOINT_STEPS,
     "resume": f"fsdp2_sp2/step={SAVE_AT}.ckpt"},
    {"name": "fsdp2_sp2_to_sp4", "backend": "fsdp2", "sp": 4, "batch_size": 4, "steps": CHECKPOINT_STEPS,
     "resume": f"fsdp2_sp2/step={SAVE_AT}.ckpt"},
    # A SIGTERM inside a step: every rank saves hpc_ckpt_1.ckpt at the step boundary and exits; resumed with "hpc".
    {"name": "fsdp2_sp2_sigterm", "backend": "fsdp2", "sp": 2, "batch_size": 2, "steps": CHECKPOINT_STEPS,
     "sigterm_in_batch": SAVE_AT - 1},
    {"name": "fsdp2_sp2_from_sigterm", "backend": "fsdp2", "sp": 2, "batch_size": 2, "steps": CHECKPOINT_STEPS,
     "resume": "hpc", "root": "fsdp2_sp2_sigterm"},
]
CHECKPOINT_JOB = shared(4, "fsdp2_checkpoints", WORKER.parent / "resume.py", {"cases": CHECKPOINT_CASES}, timeout=600)


@pytest.fixture(scope="module")
def checkpoint_runs(tmp_path_factory):
    return CHECKPOINT_JOB.ranks(tmp_path_factory), CHECKPOINT_JOB.workdir(tmp_path_factory)


def test_fsdp2_checkpoint_resumes_exactly_at_the_same_split(checkpoint_runs):
    from tests.distributed.test_checkpoints import steps

    results, workdir = checkpoint_runs
    assert (workdir / f"fsdp2_sp2/step={SAVE_AT}.ckpt" / "ulysses.json").exists()  # the protocol's manifest
    full, resumed = steps(results, "fsdp2_sp2"), steps(results, "fsdp2_sp2_to_sp2")
    assert sorted(resumed) == list(range(SAVE_AT, CHECKPOINT_STEPS))
    for step in resumed:  # same samples (mid-epoch position, then the next epoch), losses and RNG draws, bit for bit
        assert resumed[step] == full[step], step
    for name, value in results[0]["fsdp2_sp2"]["weights"].items():
        assert torch.equal(results[0]["fsdp2_sp2_to_sp2"]["weights"][name], value), name


def test_fsdp2_sigterm_saves_at_the_step_boundary_and_resumes_exactly(checkpoint_runs):
    from tests.distributed.test_checkpoints import steps

    results, workdir = checkpoint_runs
    assert all(rank["fsdp2_sp2_sigterm"]["exit_status"] == 79 for rank in results)  # faults.EXIT_PREEMPTED
    assert {rank["fsdp2_sp2_sigterm"]["global_step"] for rank in results} == {SAVE_AT}
    assert (workdir / "fsdp2_sp2_sigterm" / "hpc_ckpt_1.ckpt" / "ulysses.json").exists()
    full, resumed = steps(results, "fsdp2_sp2"), steps(results, "fsdp2_sp2_from_sigterm")
    assert sorted(resumed) == list(range(SAVE_AT, CHECKPOINT_STEPS))
    for step in resumed:
        assert resumed[step] == full[step], step
    for name, value in results[0]["fsdp2_sp2"]["weights"].items():
        assert torch.equal(results[0]["fsdp2_sp2_from_sigterm"]["weights"][name], value), name


def test_fsdp2_checkpoint_resumes_at_another_split(checkpoint_runs):
    from tests.distributed.test_checkpoints import max_relative_weight_error, steps

    results, _ = checkpoint_runs
    full, after = steps(results, "fsdp2_sp2"), steps(results, "fsdp2_sp2_to_sp4")
    assert sorted(after) == list(range(SAVE_AT, CHECKPOINT_STEPS))
    for step in after:
        assert after[step]["samples"] == full[step]["samples"]
        full_mean = sum(full[step]["losses"]) / len(full[step]["losses"])
        after_mean = sum(after[step]["losses"]) / len(after[step]["losses"])
        assert abs(full_mean - after_mean) < 1e-5
    assert max_relative_weight_error(results, "fsdp2_sp2_to_sp4", "fsdp2_sp2") < 1e-4


def test_fsdp2_checkpoint_exports_a_pretrained_model(checkpoint_runs, tmp_path):
    from transformers import LlamaForCausalLM

    from lightning_ulysses.integration.checkpoint.command_line import main
    from tests.distributed.common import tiny_llama

    results, workdir = checkpoint_runs
    assert main(["export", str(workdir / f"fsdp2_sp2/step={CHECKPOINT_STEPS}.ckpt"), str(tmp_path)]) == 0
    trained = results[0]["fsdp2_sp2"]["weights"]  # gathered from the live shards at the end of the same run
    state = torch.load(tmp_path / "model.pt")
    assert all(torch.equal(state[f"model.{name}"], value) for name, value in trained.items())
    exported = LlamaForCausalLM.from_pretrained(tmp_path).eval()
    expected = tiny_llama(2).eval()
    expected.load_state_dict(trained)
    tokens = torch.randint(0, 64, (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert torch.equal(exported(tokens).logits, expected(tokens).logits)
