"""Every invalid configuration fails on every rank, fast, with a message that says how to fix it (no hang).

All cases run in one 2-rank launch; the harness kills the launch (and fails the test) if any rank hangs.
"""

import pytest

from tests.distributed.harness import ROOT
from tests.distributed.pool import shared

WORKER = ROOT / "tests" / "distributed" / "workers" / "expect_error.py"

CASES = {
    "sp_does_not_divide_world": ({"sp": 4}, "ValueError", ["sp(4) does not divide world_size(2)", "Valid sequence_parallel_size values here: [1, 2]"]),
    # Pure Ulysses forced (ring_size=1): automatic ring_size would run these on a ring instead.
    "heads_not_divisible": ({"ring_size": 1}, "ValueError", ["num_attention_heads(3) is not divisible by sequence_parallel_size(2)", "Use a sequence_parallel_size in [1, 3]", "Use a ring_size in [2]"]),
    "kv_heads_incompatible": ({"ring_size": 1}, "ValueError", ["num_key_value_heads(3) and sequence_parallel_size(2) must divide one another", "Use a ring_size in [2]"]),
    "opaque_attention_on_ring": ({"ring_size": 2}, "ValueError", ["UlyssesAttention(..., causal=True)", "ring_size=1"]),
    "mixer_on_ring": ({"ring_size": 2}, "NotImplementedError", ["RecurrentGemmaForCausalLM has token mixers that are not attention", "cannot split by their heads", "ring_size=1"]),
    "no_attention_to_wrap": ({}, "ValueError", ["no Hugging Face PreTrainedModel and no lightning_ulysses.UlyssesAttention", "UlyssesAttention(F.scaled_dot_product_attention)"]),
    "length_not_divisible": ({"stage": 2}, "ValueError", ["sequence length 15 is not divisible by sequence_parallel_size(2)", "pad_to_multiple_of=2", "sequence_padding='pad'"]),
    "tuple_batch": ({"stage": 1}, "TypeError", ["must be a dict with at least 'input_ids'", "got list"]),
    "whole_row_documents": ({"stage": 0}, "ValueError", ["batch['cu_seq_lens_q'] describes packed documents of the whole row", "position_ids restarting at 0"]),
    "positions_forgotten": ({"stage": 2}, "ValueError", ["LlamaForCausalLM was called under sequence parallelism with no position_ids", "position_ids=batch['position_ids']"]),
    "positions_forgotten_native_gpt": ({"stage": 3}, "ValueError", ["GPT was called under sequence parallelism with no position_ids"]),
    "positions_not_global": ({"stage": 3}, "ValueError", ["with position_ids that are not the batch's", "model(**batch)"]),
    "ranks_fed_different_samples": ({"stage": 2}, "ValueError", ["ranks [0, 1] of one sequence-parallel group were given different batches", "strategy.data_parallel_rank"]),
    # In the model's forward (its mask function), before the first all-to-all, under ZeRO-3's parameter hooks.
    "mask_only_bidirectional": ({}, "NotImplementedError", ["Gemma3ForCausalLM builds its attention mask with an overlay that lets tokens attend beyond the causal mask", "use_bidirectional_attention=False"]),
    "unknown_router_loss": ({}, "NotImplementedError", ["Qwen2MoeForCausalLM computes its MoE load-balancing loss", "Set output_router_logits=False"]),
    "unavailable_backend": ({"stage": 0}, "ImportError", ["'flash_attention_2' needs the flash-attn package", "use 'sdpa'"]),
    # Its small buckets divide by DP, its oversized ones by DP × SP: refused before any group is created.
    # In configure_model under ZeRO-3: peft's init of an adapter it adds is a no-op on the partitions; refused at setup.
    "lora_adapter_added_by_peft": ({"stage": 3}, "ValueError", [
        "The LoRA adapters ['second'] were created partitioned by ZeRO-3",
        "lightning_ulysses.models.lora.add_adapter(peft_model, name, LoraSettings(...))"]),
    "zero3_without_reduce_scatter": ({"stage": 3}, "ValueError", ["reduce_scatter=False cannot train exactly at sequence_parallel_size=2", "Leave reduce_scatter on"]),
}
# The FSDP2 strategy (`UlyssesFSDPStrategy`): the layout, the model and the batches are refused in the same places with
# the same messages (shared runtime); what only FSDP2 refuses, before any collective: a precision it does not run
# (before the process group exists) and parameters outside the models it shards.
FSDP2_CASES = {
    f"fsdp2_{kind}": (dict(CASES[kind][0], kind=kind, backend="fsdp2"), *CASES[kind][1:])
    for kind in ("sp_does_not_divide_world", "heads_not_divisible", "no_attention_to_wrap", "positions_forgotten",
                 "ranks_fed_different_samples")
}
FSDP2_CASES.update({
    "fsdp2_bf16_true": ({"kind": "plain", "backend": "fsdp2", "precision": "bf16-true"}, "ValueError", [
        "precision='bf16-true' is not supported by the FSDP2 strategy", "('32-true', 'bf16-mixed')"]),
    "fsdp2_parameters_outside_models": ({"kind": "parameters_outside_models", "backend": "fsdp2"}, "ValueError", [
        "trainable parameters outside them would not be reduced: ['head.weight', 'head.bias']",
        "apply torch.distributed.fsdp.fully_shard to the module holding them"]),
})
CASES.update(FSDP2_CASES)
# In the shared 2-rank launch (pool.py).
JOB = shared(2, "errors", WORKER, {"cases": [{"kind": kind, **options, "name": kind}
                                             for kind, (options, _, _) in CASES.items()]}, timeout=480)


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return JOB.ranks(tmp_path_factory)


@pytest.mark.parametrize("kind", list(CASES))
def test_fails_fast_with_fix(results, kind):
    _, error_type, fragments = CASES[kind]
    for rank in results:
        outcome = rank[kind]
        assert outcome["raised"] == error_type, outcome
        for fragment in fragments:
            assert fragment in outcome["message"], outcome["message"]
        assert outcome["seconds"] < 60
