"""Parity of `UlyssesFSDPStrategy` (FSDP2) against the single-process full-sequence fp32 reference, with SGD.

The same module, data and checks as `test_parity.py` (its worker `train_parity.py`, its claims), with
`strategy=UlyssesFSDPStrategy(...)` instead: SP 1/2/4 with DP in a world of 4 (SP 1 × DP 4, SP 2 × DP 2, SP 4) and
SP 2 in a world of 2, for a Llama, a Qwen3-MoE and a Qwen3-Next hybrid (Gated DeltaNet split by heads), with
gradient accumulation, gradient clipping, `labels=input_ids`, a ring (Ulysses 2 × ring 2), pretrained weights loaded
in configure_model, the native GPT with validate/test/predict after fit, evaluation on whole rows, packed rows (each
document alone in the reference), bf16-mixed through FSDP2's MixedPrecisionPolicy, `ExportPretrained`, every memory
feature and `memory="auto"` (planning FSDP2's memory, whose shard terms every rank's shards are held to). Every loss
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
    # Selective recompute on a hybrid under FSDP2: every layer checkpointed, the delta rule's and the linear layers'
    # (experts' too) products kept and replayed in the recompute (which runs only their elementwise rest), the mixers
    # split by heads; and in bf16-mixed, where the recompute runs under the forward's autocast again (Lightning's
    # autocast covers the forward only: memory/autocast_state.py).
    *[_case(4, 2, "gqa", f"-qwen3_next-kept-products{suffix}", model="family:qwen3_next", split_mixers=True,
            strategy_kwargs={"memory": {"activation_checkpointing": True, "keep_matmul_outputs": True,
                                        "keep_token_mixer_outputs": True}},
            replayed=["aten._grouped_mm.default", "aten.bmm.default", "aten.linalg_solve_triangular.default",
                      "aten.mm.default"], **extra)
      for suffix, extra in (("", {}), ("-bf16-mixed", {"precision": "bf16-mixed"}))],
    _case(4, 2, "mqa", "-bf16-mixed", precision="bf16-mixed"),
    # Hybrid Ulysses × ring (zig-zag shards): 2 KV heads at SP 4 = Ulysses 2 × ring 2.
    _case(4, 4, "gqa", "-ring2", strategy_kwargs={"ring_size": 2}),
    # Pretrained weights loaded in configure_model: built on the meta device, each rank reads its own shards of the
    # folder's safetensors after fully_shard (`pretrained.ShardedPretrainedLoads`). In a world of 2 (SP 2 with tied
    # embeddings; SP 1 × DP 2 through the recipes' PretrainedCausalLM with YaRN, whose inv_freq the file lacks) the
    # loaded model is also held to the one-process load bit for bit, and each rank's reads to its shards (`loaded`).
    _case(4, 2, "mha", "-pretrained", model="pretrained", in_configure_model=True),
    _case(2, 2, "gqa", "-pretrained-tied", model="pretrained-tied", in_configure_model=True, check_loading=True),
    _case(2, 1, "mha", "-pretrained-yarn", model="pretrained-yarn", in_configure_model=True, check_loading=True),
    # LoRA added after that load (`models.lora.with_lora`: peft's initial values on the host, kept by the shard read)
    # against peft's own LoRA model in one process; the frozen base unchanged (the weights claim).
    _case(2, 2, "mha", "-pretrained-lora", model="pretrained-lora", in_configure_model=True),
    # That load under the memory features: the model is still on the meta device when the memory engine wraps it.
    _case(2, 2, "gqa", "-pretrained-memory", model="pretrained", in_configure_model=True, batch_size=1,
          strategy_kwargs={"memory": {"tiled_mlp": True, "mlp_tile_tokens": 3, "tiled_logits_loss": True,
                                      "logits_tile_tokens": 4, "activation_checkpointing": True,
                                      "offload_activations": True}}),
    # The native GPT (UlyssesAttention, tied embeddings, swapped loss), then validate, test and predict; and a Llama
    # evaluated on whole rows (sequence_parallel_in_evaluation=False: the model's own attention, unsharded).
    _case(2, 2, "mqa", "-gpt-then-validate", model="gpt", validate=True),
    _case(2, 2, "mha", "-unsharded-evaluation", validate=True, strategy_kwargs={"sequence_parallel_in_evaluation": False}),
]
# The memory features on FSDP2 (every one of the DeepSpeed strategy's), as test_memory_parity.py trains them: layer
# checkpointing with host offload, tiled MLP and tiled logits + loss together (HF Llama and the native GPT; DP ranks
# on rows of 16 and 12 tokens, so they run different numbers of MLP tiles), checkpointing with kept attention outputs
# and the fused elementwise kernels (aot_eager), and all of them with low-memory norms and sparser checkpoints (both
# layers in one stretch: the second's input is recomputed in its backward, FSDP2 gathering the first layer again,
# `memory/checkpointing.py`). Plain reference, losses 1e-5, weights 1e-4 of the update.
MEMORY = {"tiled_mlp": True, "mlp_tile_tokens": 3, "tiled_logits_loss": True, "logits_tile_tokens": 4,
          "activation_checkpointing": True, "offload_activations": True}
KEPT_FUSED = {"activation_checkpointing": True, "keep_attention_outputs": True, "fused_elementwise": True,
              "fused_backend": "aot_eager"}
STRETCH_NORMS = {**MEMORY, "checkpoint_interval": 2, "keep_attention_outputs": True, "low_memory_norms": True}
# Partial checkpointing with kept products: the first layer checkpointed (its input offloaded, its products and
# attention replayed in the recompute), the second keeping its activations; and the native GPT's biased linear
# layers keeping their products (`addmm`: FSDP2 adds no bias in place, ZeRO-3's linear does and keeps none).
PARTIAL_KEPT = {"activation_checkpointing": True, "checkpoint_layers": 1, "offload_activations": True,
                "keep_matmul_outputs": True, "keep_attention_outputs": True}
KEPT_PRODUCTS = {"activation_checkpointing": True, "keep_matmul_outputs": True}
# memory="auto" planning FSDP2's memory for 4096-token rows (the rows trained are shorter) with the least of the
# ranks' free memory (planner, the tiny Llama: at SP 2 x DP 2, 4.5 MB gives low-memory norms, a tiled MLP, tiled
# logits and the first layer checkpointed, 4.23 MB planned; at SP 1 x DP 4, 11 MB the same with the first layer's
# attention outputs and products kept for its recompute, 10.37 MB planned: partial checkpointing and kept products
# chosen on FSDP2 as on DeepSpeed). The first step confirms the choice (`memory_confirmation`).
AUTO = {"auto": True, "seq_len": 4096, "device_margin": 0, "host_margin": 0, "mlp_tile_tokens": 3,
        "logits_tile_tokens": 4, "confirm_steps": 1}
AUTO_CHOICES = {2: ([[9e6] * 2, [4.5e6] * 2, [8e6] * 2, [7e6] * 2],
                    {"low_memory_norms", "tiled_mlp", "tiled_logits_loss", "activation_checkpointing"}),
                1: ([[1.2e7] * 2, [1.1e7] * 2, [1.3e7] * 2, [2e7] * 2],
                    {"low_memory_norms", "tiled_mlp", "tiled_logits_loss", "activation_checkpointing",
                     "keep_attention_outputs", "keep_matmul_outputs"})}
MEMORY_CASES = [dict(_case(4, 2, "gqa", f"-{model}-{suffix}"), model=model, batch_size=1,
                     dataset_kwargs={"odd_rows_shorter_by": 4}, strategy_kwargs={"memory": memory}, wrapped=sorted(wrapped))
                for model, suffix, memory, wrapped in [
                    ("llama", "memory", MEMORY, {"FSDPLlamaDecoderLayer", "FSDPLlamaForCausalLM", "LlamaMLP"}),
                    ("gpt", "memory", MEMORY, {"FSDPBlock", "MLP"}),
                    ("llama", "kept-attention-fused", KEPT_FUSED, {"FSDPLlamaDecoderLayer", "LlamaRMSNorm"}),
                    ("llama", "stretch-norms", STRETCH_NORMS, {"FSDPLlamaDecoderLayer", "LlamaMLP", "LlamaRMSNorm"}),
                    ("llama", "partial-kept-products", PARTIAL_KEPT, {"FSDPLlamaDecoderLayer"}),
                    ("gpt", "kept-products", KEPT_PRODUCTS, {"FSDPBlock"})]]
AUTO_CASES = [dict(_case(4, sp, "gqa", "-llama-auto"), model="llama", batch_size=1,
                   dataset_kwargs={"odd_rows_shorter_by": 4}, strategy_kwargs={"memory": AUTO},
                   free_memory_by_rank=free, chosen=sorted(chosen), wrapped=["FSDPLlamaDecoderLayer", "LlamaMLP"])
              for sp, (free, chosen) in AUTO_CHOICES.items()]
MEMORY_CASES += AUTO_CASES
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
                                              ("export", "export"), ("tying", "in_configure_model"),
                                              ("loaded", "check_loading"), ("replayed", "replayed")) if case.get(key)]


@pytest.mark.parametrize(("case", "claim"), [(case, claim) for case in CASES for claim in _claims(case)],
                         ids=[f"{case['name']}-{claim}" for case in CASES for claim in _claims(case)])
def test_fsdp2_matches_single_process_reference(case, claim, tmp_path_factory):
    ranks = _ranks(case, tmp_path_factory)
    if claim == "groups":
        _check_groups_released(case, ranks)
    elif claim == "loaded":
        _check_sharded_load(case, ranks)
    elif claim == "replayed":
        _check_replayed(ranks, case["replayed"])
    else:
        check_parity(case, ranks, claims=(claim,))


def _check_replayed(ranks: list[dict], operators) -> None:
    """The checkpointed layers' recomputes replayed the kept outputs of exactly these operators on every rank (the
    worker's `CountReplayedOutputs`): under FSDP2 the linear layers run plain `mm` / `addmm` on the gathered
    parameters, biased ones too (no in-place bias add, unlike DeepSpeed ZeRO-3's linear)."""
    assert all(sorted(rank["replayed_outputs"]) == sorted(operators) for rank in ranks), ranks[0]["replayed_outputs"]


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


def _check_sharded_load(case: dict, ranks: list[dict]) -> None:
    """`from_pretrained` in configure_model: the sharded model (gathered before training) equals the one-process load
    bit for bit — every parameter, tied embeddings, and the buffers the file lacks (RoPE's inv_freq, YaRN's here) —
    and each rank read only its own rows of each checkpoint tensor: at most ⌈rows / world⌉ of them, every byte of the
    file read by exactly one rank (a rank that loaded the whole model, as before, reads each tensor whole)."""
    from safetensors import safe_open

    from tests.distributed.common import pretrained_model

    folder = ranks[0]["pretrained"]
    expected = pretrained_model(case["model"], case["kv_heads"], "sdpa", folder)
    loaded = ranks[0]["loaded"]
    assert set(loaded["parameters"]) == {name for name, _ in expected.named_parameters()}
    for name, value in expected.named_parameters():
        assert torch.equal(loaded["parameters"][name], value), name
    for name, value in expected.named_buffers():
        assert torch.equal(loaded["buffers"][name], value), name
    world = case["world_size"]
    with safe_open(f"{folder}/model.safetensors", framework="pt") as handle:
        sizes = {key: handle.get_tensor(key) for key in handle.keys()}
    for key, tensor in sizes.items():
        whole, rows = tensor.numel() * tensor.element_size(), tensor.shape[0]
        read = [rank["loaded"]["bytes_by_key"].get(key, 0) for rank in ranks]
        assert sum(read) == whole, (key, read, whole)
        assert max(read) <= -(-rows // world) * (whole // rows), (key, read, whole)


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
    # a stretch of both layers runs the first once more per step, to recompute the second's input; a layer that
    # checkpoint_layers leaves out runs once
    memory = ranks[0]["memory"]
    checkpointed = memory["checkpoint_layers"] if memory["checkpoint_layers"] is not None else 2
    runs = [1 + (layer < checkpointed) for layer in range(2)]
    runs[0] += memory["checkpoint_interval"] == 2
    assert all(rank["attention_runs"] == [STEPS * count for count in runs] for rank in ranks), ranks[0]["attention_runs"]
    # the kept outputs the recomputes replayed: the attention kernel's, the linear layers' products (biased: addmm)
    kept = {"aten._scaled_dot_product_flash_attention_for_cpu.default": memory["keep_attention_outputs"],
            "aten.addmm.default" if case["model"] == "gpt" else "aten.mm.default": memory["keep_matmul_outputs"]}
    _check_replayed(ranks, [operator for operator, on in kept.items() if on])
    if case["strategy_kwargs"]["memory"].get("fused_elementwise"):
        assert all(rank["compiled_graphs"] > 0 for rank in ranks)
    steps = []
    for step in range(STEPS):
        by_dp = {rank["data_parallel_rank"]: rank["records"][step]["sample_index"] for rank in ranks}
        steps.append([by_dp[dp] for dp in sorted(by_dp)])
    reference = reference_training(case["kv_heads"], SEQ_LEN, steps, kind=case["model"],
                                   dataset_kwargs=case["dataset_kwargs"])
    assert_training_matches(ranks, reference)


@pytest.mark.parametrize("case", AUTO_CASES, ids=[case["name"] for case in AUTO_CASES])
def test_fsdp2_memory_auto_chooses_from_fsdp2s_memory_on_every_rank_and_confirms(case, tmp_path_factory):
    ranks = _ranks(case, tmp_path_factory)
    choices = [rank["memory_choice"] for rank in ranks]
    assert all(choice == choices[0] for choice in choices)  # from the least free memory, on every rank
    assert choices[0]["offload_optimizer"] == 0  # FSDP2 keeps the optimizer on the device
    assert choices[0]["predicted_device_bytes"] <= min(free for free, _ in case["free_memory_by_rank"])
    features = ("tiled_logits_loss", "low_memory_norms", "tiled_mlp", "activation_checkpointing",
                "keep_attention_outputs", "offload_activations", "keep_matmul_outputs", "keep_token_mixer_outputs")
    assert sorted(name for name in features if ranks[0]["memory"][name]) == case["chosen"]
    assert ranks[0]["memory"]["checkpoint_layers"] == 1  # the first of the two layers (the last runs backward first)
    # the first step confirmed once, from the slowest rank's time (the same on every rank); no device peak on CPU
    confirmations = [rank["memory_confirmation"] for rank in ranks]
    assert confirmations[0]["steps"] == 1 and confirmations[0]["step_s"] > 0
    assert confirmations[0]["device_peak_bytes"] is None
    assert all(confirmation == confirmations[0] for confirmation in confirmations)


# the tiny Llama under bf16-mixed (the test below plans the tiny Llama's shape)
BF16_MIXED = next(case for case in CASES if case["name"] == "fsdp2-sp2-dp2-mqa-bf16-mixed")


@pytest.mark.parametrize("case", [AUTO_CASES[0], BF16_MIXED], ids=[AUTO_CASES[0]["name"], BF16_MIXED["name"]])
def test_fsdp2_shards_hold_what_the_planner_counts(case, tmp_path_factory):
    """The planner's FSDP2 model states (`planner._fsdp2_terms`) against what every rank holds after training: fp32
    parameter shards (no other master copy, under bf16-mixed too) and fp32 gradient shards, 4 bytes per parameter
    each over all ranks (the tiny Llama's dimensions divide by 4: no padding)."""
    from lightning_ulysses.planning.auto import shape_of
    from lightning_ulysses.planning.planner import TrainingSetup, plan_memory
    from tests.distributed.common import tiny_llama

    ranks = _ranks(case, tmp_path_factory)
    setup = TrainingSetup(seq_len=SEQ_LEN, sequence_parallel_size=case["sp"], data_parallel_size=4 // case["sp"],
                          compute_bytes=2 if case.get("precision") == "bf16-mixed" else 4, backend="fsdp2")
    planned = plan_memory(shape_of([tiny_llama(case["kv_heads"])]), setup).gpu
    for rank in ranks:
        assert rank["shard_bytes"]["dtypes"] == ["torch.float32"]
        assert rank["shard_bytes"]["parameters"] == planned["parameters (fp32 shards, FSDP2)"]
        assert rank["shard_bytes"]["gradients"] == planned["gradients (fp32 shards)"]


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
    # The hybrid feature matrix's FSDP2 resume (tests/README.md): LFM2, its short convolutions split by channels, at
    # SP 2 × DP 2, saved mid-epoch by ModelCheckpoint (Distributed Checkpoint) and resumed at the same split.
    {"name": "fsdp2_lfm2", "backend": "fsdp2", "model": "family:lfm2", "sp": 2, "batch_size": 2,
     "steps": CHECKPOINT_STEPS, "save_every": SAVE_AT},
    {"name": "fsdp2_lfm2_resumed", "backend": "fsdp2", "model": "family:lfm2", "sp": 2, "batch_size": 2,
     "steps": CHECKPOINT_STEPS, "resume": f"fsdp2_lfm2/step={SAVE_AT}.ckpt"},
]
CHECKPOINT_JOB = shared(4, "fsdp2_checkpoints", WORKER.parent / "resume.py", {"cases": CHECKPOINT_CASES}, timeout=600)


@pytest.fixture(scope="module")
def checkpoint_runs(tmp_path_factory):
    return CHECKPOINT_JOB.ranks(tmp_path_factory), CHECKPOINT_JOB.workdir(tmp_path_factory)


@pytest.fixture(scope="module")
def other_world_resume(checkpoint_runs, tmp_path_factory):
    """The world of 4's mid-epoch checkpoint (SP 2 × DP 2, batches of 2: 4 samples a step) resumed by a world of 2 at
    SP 2 × DP 1 with batches of 2 accumulated over 2: the same 4 samples a step. Registered once the world of 4 has
    written it (its own launch of 2 ranks when the shared one has already run)."""
    results, workdir = checkpoint_runs
    case = {"name": "fsdp2_world4_to_world2_accumulate2", "backend": "fsdp2", "sp": 2, "batch_size": 2,
            "accumulate": 2, "steps": CHECKPOINT_STEPS, "resume": str(workdir / f"fsdp2_sp2/step={SAVE_AT}.ckpt")}
    job = shared(2, "fsdp2_other_world_resume", WORKER.parent / "resume.py", {"cases": [case]}, timeout=300)
    return results, job.ranks(tmp_path_factory)


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


def test_fsdp2_checkpoint_resumes_at_another_world_size(other_world_resume):
    """Distributed Checkpoint reshards the model and optimizer (momentum, the scheduler) to 2 ranks; Lightning's count
    of the epoch's batches is translated to the new batch size, so the epoch continues at the same sample, each step
    on the uninterrupted run's samples with its loss (the fully labelled rows: the mean of the micro-batches' means is
    the DP ranks' one) and its weights (float rounding apart, as at another split)."""
    from tests.distributed.test_checkpoints import max_relative_weight_error, steps

    results, resumed = other_world_resume
    name = "fsdp2_world4_to_world2_accumulate2"
    full, after = steps(results, "fsdp2_sp2"), steps(resumed, name)
    assert sorted(after) == list(range(SAVE_AT, CHECKPOINT_STEPS))
    for step in after:
        assert after[step]["samples"] == full[step]["samples"], step
        assert after[step]["epochs"] == full[step]["epochs"], step
        full_mean = sum(full[step]["losses"]) / len(full[step]["losses"])
        after_mean = sum(after[step]["losses"]) / len(after[step]["losses"])
        assert abs(full_mean - after_mean) < 1e-5, step
    merged = [{**rank, name: resumed_rank[name]} for rank, resumed_rank in zip(results, resumed)]
    assert max_relative_weight_error(merged, name, "fsdp2_sp2") < 1e-4


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


def test_fsdp2_checkpoint_of_a_hybrid_resumes_exactly(checkpoint_runs):
    from tests.distributed.test_checkpoints import assert_resumed_exactly

    results, workdir = checkpoint_runs
    assert (workdir / f"fsdp2_lfm2/step={SAVE_AT}.ckpt" / "ulysses.json").exists()
    assert_resumed_exactly(results, "fsdp2_lfm2", "fsdp2_lfm2_resumed", SAVE_AT, CHECKPOINT_STEPS)
