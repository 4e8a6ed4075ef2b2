"""Worker: each case is a misconfiguration; every rank must raise (never hang). Saves type, message and time."""

import contextlib
import json
import os
import sys
import time
from pathlib import Path

import lightning as L
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader
from transformers import LlamaConfig, LlamaForCausalLM

from tests.distributed.families import tiny_model

import lightning_ulysses
from tests.distributed.common import CausalLM, UnevenlyMaskedTokens, collate, tiny_llama


class PlainModule(L.LightningModule):
    """Attention written by hand, not wrapped in UlyssesAttention."""

    def __init__(self):
        super().__init__()
        self.layer = torch.nn.Linear(8, 8)

    def training_step(self, batch, batch_idx):
        return self.layer(batch["input_ids"].float().unsqueeze(-1).expand(-1, -1, 8)).sum()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def llama_module(num_heads: int, num_key_value_heads: int, attn_implementation: str = "sdpa") -> CausalLM:
    module = CausalLM(num_key_value_heads=1)
    module.model = LlamaForCausalLM(LlamaConfig(
        vocab_size=64, hidden_size=8 * num_heads, intermediate_size=32, num_hidden_layers=1,
        num_attention_heads=num_heads, num_key_value_heads=num_key_value_heads, attn_implementation=attn_implementation,
    ))
    return module


def moe_module(kind: str) -> CausalLM:
    """Gemma 3 in bidirectional mode (an overlay in its mask function only); Qwen2-MoE asking for its load-balancing
    loss while that loss is code of its own (`own_router_loss`)."""
    import transformers

    shape = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=4, num_experts=4, num_experts_per_tok=2, attn_implementation="sdpa")
    module = CausalLM(num_key_value_heads=1)
    if kind == "mask_only_bidirectional":
        dense = {key: value for key, value in shape.items() if key not in ("num_experts", "num_experts_per_tok")}
        module.model = transformers.Gemma3ForCausalLM(transformers.Gemma3TextConfig(
            **dense, head_dim=8, use_bidirectional_attention=True))
    else:
        module.model = transformers.Qwen2MoeForCausalLM(transformers.Qwen2MoeConfig(
            **shape, moe_intermediate_size=16, shared_expert_intermediate_size=16, output_router_logits=True))
    return module


@contextlib.contextmanager
def own_router_loss():
    """Qwen2-MoE's modeling module with a load-balancing loss that is not transformers' shared code, for one case.

    The one decoder family whose loss is its own (Doge) is refused before that, for its attention's dynamic mask; a
    family like it is what the refusal is for. Restored afterwards: the worker runs its other cases in this process.
    """
    from transformers.models.qwen2_moe import modeling_qwen2_moe

    shared = modeling_qwen2_moe.load_balancing_loss_func

    def load_balancing_loss_func(*args, **kwargs):
        return shared(*args, **kwargs)

    modeling_qwen2_moe.load_balancing_loss_func = load_balancing_loss_func
    try:
        yield
    finally:
        modeling_qwen2_moe.load_balancing_loss_func = shared


class OpaqueAttentionModule(PlainModule):
    """UlyssesAttention around a callable it cannot know to be softmax attention (no `causal=` declared)."""

    def __init__(self):
        super().__init__()
        self.attention = lightning_ulysses.UlyssesAttention(lambda q, k, v: q)


class TupleBatches(torch.utils.data.Dataset):
    def __len__(self):
        return 8

    def __getitem__(self, index):
        return torch.arange(16), torch.arange(16)


class FlashKwargsRows(UnevenlyMaskedTokens):
    """Rows with the whole-row document description of flash-attention collators."""

    def __getitem__(self, index):
        sample = super().__getitem__(index)
        sample["cu_seq_lens_q"] = torch.tensor([0, 10, self.seq_len], dtype=torch.int32)
        return sample


class ForgetsPositions(CausalLM):
    """A step that passes the tokens and labels but not the batch's (global) position_ids."""

    def training_step(self, batch, batch_idx):
        return self.model(input_ids=batch["input_ids"], labels=batch["labels"]).loss


class OwnPositions(CausalLM):
    """A step that numbers the shard it holds itself (0..seq/P-1), as a plain Hugging Face habit would."""

    def training_step(self, batch, batch_idx):
        input_ids = batch["input_ids"]
        positions = torch.arange(input_ids.size(1)).expand_as(input_ids)
        return self.model(input_ids=input_ids, labels=batch["labels"], position_ids=positions).loss


class ShardedByGlobalRank(torch.utils.data.IterableDataset):
    """An iterable dataset that splits its samples by global rank, so the ranks of an SP group differ."""

    def __iter__(self):
        rows = UnevenlyMaskedTokens(64, 16)
        return iter([rows[i] for i in range(dist.get_rank(), 64, dist.get_world_size())])


class PeftAddsAdapter(CausalLM):
    """LoRA in configure_model (under ZeRO-3 partitioned at creation), a second adapter added by peft's own
    `add_adapter`, which leaves its `B` random there."""

    def configure_model(self):
        from lightning_ulysses.models.lora import LoraSettings, with_lora

        settings = LoraSettings(r=2, target_modules=("q_proj",))
        self.model = with_lora(tiny_llama(4), settings)
        self.model.add_adapter("second", settings.peft_config())


def build(case):
    data = DataLoader(UnevenlyMaskedTokens(8, 16), batch_size=2, collate_fn=collate)
    strategy_kwargs = {"sequence_parallel_size": case.get("sp", 2), "ring_size": case.get("ring_size")}
    kind = case["kind"]
    module = CausalLM(num_key_value_heads=4)
    if kind == "heads_not_divisible":
        module = llama_module(num_heads=3, num_key_value_heads=3)
    elif kind == "kv_heads_incompatible":
        module = llama_module(num_heads=6, num_key_value_heads=3)
    elif kind == "mixer_on_ring":
        module = CausalLM(num_key_value_heads=1)
        # 1 RG-LRU head does not split over the 2 SP ranks of a ring of 2: fewer heads than ranks (mixers that split,
        # evenly or not, run on a ring)
        module.model = tiny_model("recurrent_gemma", block_types=["recurrent", "attention"], num_attention_heads=1,
                                  num_key_value_heads=1, hidden_size=24, lru_width=24, head_dim=8)
    elif kind in ("mask_only_bidirectional", "unknown_router_loss"):
        module = moe_module(kind)
    elif kind == "no_attention_to_wrap":
        module = PlainModule()
    elif kind == "opaque_attention_on_ring":
        module = OpaqueAttentionModule()
    elif kind == "length_not_divisible":
        strategy_kwargs["sequence_padding"] = "error"
        data = DataLoader(UnevenlyMaskedTokens(8, 15), batch_size=2, collate_fn=collate)
    elif kind == "tuple_batch":
        data = DataLoader(TupleBatches(), batch_size=2)
    elif kind == "whole_row_documents":
        data = DataLoader(FlashKwargsRows(8, 16), batch_size=2, collate_fn=collate)
    elif kind == "positions_forgotten":
        module = ForgetsPositions(num_key_value_heads=4)
    elif kind == "positions_forgotten_native_gpt":
        module = ForgetsPositions(num_key_value_heads=4, kind="gpt")
    elif kind == "positions_not_global":
        module = OwnPositions(num_key_value_heads=4)
    elif kind == "ranks_fed_different_samples":
        data = DataLoader(ShardedByGlobalRank(), batch_size=2, collate_fn=collate)
    elif kind == "unavailable_backend":
        # A native model asking for a backend this machine lacks: rejected at setup, before any collective.
        module = CausalLM(num_key_value_heads=4, kind="gpt")
        for attention in module.model.modules():
            if isinstance(attention, lightning_ulysses.UlyssesAttention):
                attention.backend = "flash_attention_2"
    elif kind == "lora_adapter_added_by_peft":
        module = PeftAddsAdapter(num_key_value_heads=4, in_configure_model=True)
    elif kind == "zero3_without_reduce_scatter":
        strategy_kwargs["reduce_scatter"] = False
    elif kind == "parameters_outside_models":
        module.head = torch.nn.Linear(4, 4)  # beside the model: no FSDP2 unit of the strategy would own it
    if case.get("backend") == "fsdp2":  # the same refusal on FSDP2, with the same message
        return module, lightning_ulysses.UlyssesFSDPStrategy(**strategy_kwargs), data
    return module, lightning_ulysses.UlyssesDeepSpeedStrategy(stage=case.get("stage", 3), **strategy_kwargs), data


def main():
    spec = json.loads(Path(sys.argv[1]).read_text())
    results = {}
    for case in spec["cases"]:
        module, strategy, data = build(case)
        trainer = L.Trainer(accelerator="cpu", devices=spec["world_size"], strategy=strategy, max_steps=2,
                            logger=False, enable_checkpointing=False, enable_progress_bar=False,
                            enable_model_summary=False, precision=case.get("precision", "32-true"))
        start = time.monotonic()
        name = case.get("name", case["kind"])
        try:
            with own_router_loss() if case["kind"] == "unknown_router_loss" else contextlib.nullcontext():
                trainer.fit(module, data)
            results[name] = {"raised": None}
        except Exception as error:  # noqa: BLE001 - the test inspects what was raised
            results[name] = {"raised": type(error).__name__, "message": str(error),
                             "seconds": time.monotonic() - start}
    # The launcher's rank: a case refused before the process group exists (FSDP2's precision) leaves none to ask.
    torch.save(results, Path(sys.argv[2]) / f"result_{os.environ['RANK']}.pt")


if __name__ == "__main__":
    main()
