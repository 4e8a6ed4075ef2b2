"""What the distributed workers and the single-process references share: model, data, module."""

from __future__ import annotations

import contextlib

import lightning as L
import torch
import torch.distributed as dist
from torch.utils.data import Dataset
from transformers import LlamaConfig, LlamaForCausalLM

VOCAB = 64
NUM_HEADS = 4


def settle_heap() -> None:
    """Collect garbage, then move every object alive now to the permanent generation (`gc.freeze`), in a worker
    that runs many trainings in one process. DeepSpeed runs a full `gc.collect()` in the set-up of every ZeRO-3
    engine (`deepspeed/runtime/zero/utils.py: defragment`); once the ~550k objects of the imported libraries are
    frozen, that collection no longer walks them (0.5-1.7 s of CPU per engine and rank on 2 busy cores, ~5 us
    after). What is alive now is never collected later (it is module state that lives as long as the process);
    everything created afterwards is collected as usual."""
    import gc

    gc.collect()
    gc.freeze()


def _summed_over(group, gradients: list[torch.Tensor]) -> list[torch.Tensor]:
    """`gradients` summed over `group` in ONE all-reduce of their concatenation: a small model has dozens of
    tensors, and each all-reduce of its own is a round trip through every rank of a launch that shares two cores
    (the family matrix made about 10k of them: 80 families × 2 SP sizes × 3-4 batches × ~20 tensors)."""
    flat = torch.cat([g.reshape(-1) for g in gradients])
    dist.all_reduce(flat, group=group)
    return [part.view_as(g) for part, g in zip(flat.split([g.numel() for g in gradients]), gradients)]


def summed_gradient_error(model, reference, group) -> float:
    """Largest gap, relative to the largest reference gradient, between the reference's gradients and `model`'s
    summed over the SP group (what DeepSpeed's reduction over the SP ranks adds up), over all parameters."""
    summed = _summed_over(group, [mine.grad for mine in model.parameters()])
    return max((grad - full.grad).abs().max().item() / full.grad.abs().max().item()
               for grad, full in zip(summed, reference.parameters()))


def tiny_llama(num_key_value_heads: int, seed: int = 0, attn_implementation: str = "sdpa",
               num_heads: int = NUM_HEADS, num_layers: int = 2, tie_word_embeddings: bool = False) -> LlamaForCausalLM:
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_key_value_heads,
        max_position_embeddings=128,
        tie_word_embeddings=tie_word_embeddings,
        attn_implementation=attn_implementation,
    )
    torch.manual_seed(seed)
    return LlamaForCausalLM(config).float()


def tiny_gpt(num_key_value_heads: int, seed: int = 0, num_layers: int = 2, **config):
    """The package's native GPT (UlyssesAttention, RoPE from global positions, tied embeddings)."""
    from lightning_ulysses.models import GPTConfig

    torch.manual_seed(seed)
    return GPTConfig(vocab_size=VOCAB, hidden_size=32, num_layers=num_layers, num_heads=NUM_HEADS,
                     num_key_value_heads=num_key_value_heads, **config).build().float()


def relative_gradient_error(model, reference, group) -> float:
    """Largest gap between the gradients summed over the SP group and the reference's, relative to each tensor's
    largest reference gradient, floored at 1e-6 of the model's largest: a gradient that is zero analytically
    (a key projection's bias under softmax, which shifts every score of a query alike) comes out as ~1e-11 of
    rounding noise, and noise measured against noise says nothing (it read as "OPT is 50% off")."""
    named = dict(reference.named_parameters())
    floor = 1e-6 * max(p.grad.abs().max().item() for p in reference.parameters() if p.grad is not None)
    mine = dict(model.named_parameters())
    summed = _summed_over(group, [torch.zeros_like(p) if p.grad is None else p.grad for p in mine.values()])
    worst = 0.0
    for name, grad in zip(mine, summed):
        full = named[name].grad if named[name].grad is not None else torch.zeros_like(grad)
        worst = max(worst, (grad - full).abs().max().item() / max(full.abs().max().item(), floor))
    return worst


def build_model(kind: str, num_key_value_heads: int, reference: bool = False, pretrained: str | None = None):
    """`pretrained`: the folder a `pretrained*` kind loads with `from_pretrained` (without it: the model saved there)."""
    if kind.startswith("pretrained"):
        return pretrained_model(kind, num_key_value_heads, "eager" if reference else "sdpa", pretrained)
    if kind.startswith("family:"):  # a tiny model of a transformers family (tests/distributed/families.py)
        from tests.distributed.families import family_model

        name, _, adapters = kind.removeprefix("family:").partition("+")
        model = family_model(name)  # its own head counts (GQA 4:2 where it has GQA)
        return tiny_lora(model, MIXER_LORA_TARGETS[name.partition("@")[0]]) if adapters == "lora" else model
    if kind == "gpt":
        return tiny_gpt(num_key_value_heads)
    model = tiny_llama(num_key_value_heads, attn_implementation="eager" if reference else "sdpa")
    if kind == "lora":
        return tiny_lora(model)
    return model


# `pretrained*` kinds: a Llama saved with `save_pretrained` and loaded with `from_pretrained`; `-tied`: tied input and
# output embeddings; `-frozen`: the embeddings and the first layer's MLP frozen after the load; `-yarn`: loaded through
# the recipes' `PretrainedCausalLM` with YaRN RoPE scaling added (past 8 positions: the rows are 16 long); `-lora`:
# LoRA adapters added after the load by `lightning_ulysses.models.lora` (the reference: peft's own, seeded alike);
# `-lora2`: the same, plus a second adapter (`add_second_adapter`).
PRETRAINED_SEED = 3  # no other model here starts from it: weights a fresh initialisation would not give
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 8}
LORA = {"r": 4, "alpha": 8, "target_modules": ["q_proj", "v_proj", "down_proj"], "seed": 5}


def saved_model(kind: str, num_key_value_heads: int, attn_implementation: str = "sdpa") -> LlamaForCausalLM:
    """What a `pretrained*` case saves with `save_pretrained`."""
    model = tiny_llama(num_key_value_heads, seed=PRETRAINED_SEED, attn_implementation=attn_implementation,
                       tie_word_embeddings=kind.endswith("-tied"))
    if kind.endswith("-yarn"):  # sharp attention, so that positions (the RoPE scaling) matter to the loss
        with torch.no_grad():
            for layer in model.model.layers:
                layer.self_attn.q_proj.weight.mul_(8)
                layer.self_attn.k_proj.weight.mul_(8)
    return model


def pretrained_model(kind: str, num_key_value_heads: int, attn_implementation: str, folder: str | None = None):
    """The model of a `pretrained*` kind: loaded from `folder`, or (None) the reference's: the saved model, in memory."""
    from transformers import AutoModelForCausalLM

    from lightning_ulysses.models import PretrainedCausalLM

    if folder is None:
        model = saved_model(kind, num_key_value_heads, attn_implementation)
        if kind.endswith("-yarn"):  # the same weights under the scaled config
            config = model.config
            config.rope_parameters = {"rope_theta": config.rope_parameters["rope_theta"], **YARN}
            weights, model = model.state_dict(), LlamaForCausalLM(config).float()
            model.load_state_dict(weights)
    elif kind.endswith("-yarn"):
        model = PretrainedCausalLM(folder, attn_implementation, rope_scaling=YARN).build()
    else:
        model = AutoModelForCausalLM.from_pretrained(folder, attn_implementation=attn_implementation)
    if kind.endswith("-frozen"):
        model.model.embed_tokens.requires_grad_(False)
        model.model.layers[0].mlp.requires_grad_(False)
    if kind.endswith("-lora"):
        return lora_model(model, plain=folder is None)
    if kind.endswith("-lora2"):
        return add_second_adapter(lora_model(model, plain=folder is None), plain=folder is None)
    return model


def lora_model(model, plain: bool):
    """`model` with the `-lora` kinds' adapters: through `with_lora` (what a module calls in configure_model), or
    (`plain`, the reference) peft's `get_peft_model` in one process seeded with the same seed."""
    from peft import LoraConfig, get_peft_model

    from lightning_ulysses.models.lora import LoraSettings, with_lora

    if not plain:
        return with_lora(model, LoraSettings(**LORA))
    torch.manual_seed(LORA["seed"])
    return get_peft_model(model, LoraConfig(r=LORA["r"], lora_alpha=LORA["alpha"], target_modules=LORA["target_modules"],
                                            task_type="CAUSAL_LM"))


# The `-lora2` kinds' second adapter: another rank, and a layer the first does not adapt (`o_proj`), so that its
# folder cannot pass for the first's; its own seed.
SECOND_ADAPTER = "second"
SECOND_LORA = {"r": 2, "alpha": 6, "target_modules": ["q_proj", "o_proj"], "seed": 7}


def add_second_adapter(peft_model, plain: bool):
    """`peft_model` with the adapter `SECOND_ADAPTER`: through `lightning_ulysses.models.lora.add_adapter` (in
    configure_model: under ZeRO-3's `zero.Init`, partitioned at creation), or (`plain`, the reference) peft's own
    `add_adapter` in one process seeded with the same seed. peft leaves it inactive and frozen, so training moves the
    first adapter only and this one keeps its initial values: the `weights` claim holds them `torch.equal` to the
    reference's (peft's `A`, `B` zero; peft's own `add_adapter` under ZeRO-3 would leave `B` random), and the export
    claims compare its exported weights with them."""
    from lightning_ulysses.models.lora import LoraSettings, add_adapter

    settings = LoraSettings(**SECOND_LORA)
    if plain:
        torch.manual_seed(settings.seed)
        peft_model.add_adapter(SECOND_ADAPTER, settings.peft_config())
    else:
        add_adapter(peft_model, SECOND_ADAPTER, settings)
    return peft_model


def save_pretrained_once(kind: str, num_key_value_heads: int, folder: str, rank: int) -> None:
    """Rank 0 saves the `pretrained*` model to `folder` (written aside, then renamed); the other ranks wait for it."""
    import os
    import time

    if rank == 0:
        partial = f"{folder}.partial"
        saved_model(kind, num_key_value_heads).save_pretrained(partial)
        os.rename(partial, folder)
    deadline = time.monotonic() + 120
    while not os.path.isdir(folder):
        assert time.monotonic() < deadline, f"rank 0 did not save {folder}"
        time.sleep(0.1)


# `family:<name>+lora` kinds: LoRA on every linear of the family's token mixers that are not attention. A mixer split
# by heads (lightning_ulysses/mixers/) calls the peft layers of its exchanged projections through stand-ins, and
# slices those whose weights it slices in their parts (mixers/lora.py): Mamba's dt_proj by its output channels and
# x_proj by its input channels (a sum of partial products), Kimi's g_b_proj and f_b_proj by their output channels.
MIXER_LORA_TARGETS = {"bamba": ["in_proj", "out_proj"], "jamba": ["in_proj", "x_proj", "dt_proj", "out_proj"],
                      "kimi_linear": ["q_proj", "k_proj", "v_proj", "b_proj", "g_a_proj", "g_b_proj", "f_a_proj",
                                      "f_b_proj", "o_proj"],
                      # (peft refuses out_proj on a Mamba-based model such as Nemotron-H: its fused kernel reads the
                      # weight without calling the layer; LFM2's attention has an out_proj too, adapted as well)
                      "qwen3_next": ["in_proj_qkvz", "in_proj_ba", "out_proj"], "nemotron_h": ["in_proj"],
                      "lfm2": ["in_proj", "out_proj"]}


def tiny_lora(model, target_modules=("q_proj", "v_proj", "down_proj")):
    """A PEFT LoRA model: frozen base weights, adapters on `target_modules` (by default attention and MLP
    projections; seeded, so every build of it starts from the same adapter weights)."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(1)
    config = LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=list(target_modules))
    return get_peft_model(model, config)


class UnevenlyMaskedTokens(Dataset):
    """Random tokens whose labels are masked unevenly, so the shards of one row hold different numbers of targets.

    Every fourth row has its whole first half masked (a shard with no target at all at SP 2 and 4); the others
    have a varying masked prefix plus scattered masked positions.
    """

    def __init__(self, num_samples: int, seq_len: int, odd_rows_shorter_by: int = 0):
        # odd_rows_shorter_by: odd-numbered samples are this much shorter (batch size 1), so DP ranks see
        # different lengths in one step.
        self.num_samples, self.seq_len, self.odd_rows_shorter_by = num_samples, seq_len, odd_rows_shorter_by

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, index: int) -> dict:
        generator = torch.Generator().manual_seed(1000 + index)
        seq_len = self.seq_len - self.odd_rows_shorter_by * (index % 2)
        input_ids = torch.randint(0, VOCAB, (seq_len,), generator=generator)
        labels = input_ids.clone()
        if index % 4 == 0:
            labels[: seq_len // 2] = -100
        else:
            labels[: (index * 3) % (seq_len // 2)] = -100
            labels[torch.rand(seq_len, generator=generator) < 0.2] = -100
        return {"input_ids": input_ids, "labels": labels, "sample_index": torch.tensor(index)}


def collate(samples: list[dict]) -> dict:
    return {key: torch.stack([sample[key] for sample in samples]) for key in samples[0]}


class CausalLM(L.LightningModule):
    """A LightningModule written exactly as without sequence parallelism (plus bookkeeping for the tests)."""

    def __init__(self, num_key_value_heads: int, lr: float = 0.5, kind: str = "llama", in_configure_model=False,
                 step: str = "batch", pretrained: str | None = None):
        super().__init__()
        self.pretrained = pretrained  # the folder a `pretrained*` kind loads from (from_pretrained)
        self.step = step  # how the step calls the model: see STEP_FORMS
        # in_configure_model: build under Lightning's model_sharded_context (deepspeed.zero.Init on ZeRO-3), where
        # every tensor is partitioned at construction: checks that initialisation survives partitioning.
        self.kind, self.num_key_value_heads = kind, num_key_value_heads
        self.model = None if in_configure_model else build_model(kind, num_key_value_heads, pretrained=pretrained)
        self.lr = lr
        self.records: list[dict] = []
        self.validation_records: list[dict] = []

    def configure_model(self):
        if self.model is None:
            self.model = build_model(self.kind, self.num_key_value_heads, pretrained=self.pretrained)

    def training_step(self, batch, batch_idx):
        loss = STEP_FORMS[self.step](self, batch)
        self.records.append(
            {
                "loss": loss.detach().item(),
                "sample_index": batch["sample_index"].tolist(),
                "input_ids": batch["input_ids"].clone(),
                "labels": batch["labels"].clone(),
                "position_ids": batch.get("position_ids"),
            }
        )
        return loss

    def validation_step(self, batch, batch_idx):
        self.validation_records.append(self._evaluate(batch, "validate"))

    def test_step(self, batch, batch_idx):
        self.validation_records.append(self._evaluate(batch, "test"))

    def predict_step(self, batch, batch_idx):
        self.validation_records.append(self._evaluate(batch, "predict"))

    def _evaluate(self, batch, stage):
        inputs = {key: value for key, value in batch.items() if key != "sample_index"}
        loss = self.model(**inputs).loss
        return {"stage": stage, "loss": loss.item(), "sample_index": batch["sample_index"].tolist(),
                "local_length": batch["input_ids"].size(1)}

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.lr)


def built_labels(input_ids: torch.Tensor) -> torch.Tensor:
    """Labels a step builds itself from the tokens, as with plain Hugging Face: unshifted, some tokens ignored."""
    return input_ids.masked_fill(input_ids < VOCAB // 4, -100)


def _batch_step(module, batch):
    return module.model(**{key: value for key, value in batch.items() if key != "sample_index"}).loss


def _labels_are_input_ids_step(module, batch):
    # The most common Hugging Face idiom: the model shifts the labels itself.
    return module.model(input_ids=batch["input_ids"], position_ids=batch["position_ids"],
                        labels=batch["input_ids"]).loss


def _built_labels_step(module, batch):
    return module.model(input_ids=batch["input_ids"], position_ids=batch["position_ids"],
                        labels=built_labels(batch["input_ids"])).loss


def _own_loss_step(module, batch):
    # A step that computes its loss from the logits with the strategy's loss function and the batch's labels.
    logits = module.model(input_ids=batch["input_ids"], position_ids=batch["position_ids"]).logits
    return module.trainer.strategy.loss_function(logits, batch["labels"])


def _hand_written_step(module, batch):
    # The loss a user writes by hand, as without the strategy: logits of t against label t+1, token mean.
    logits = module.model(input_ids=batch["input_ids"], position_ids=batch["position_ids"]).logits
    labels = batch["labels"]
    return torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.size(-1)), labels[:, 1:].reshape(-1),
                                             ignore_index=-100)


def _hand_written_aux_step(module, batch):
    # The same with an MoE model's load-balancing term added (`output_router_logits=True`), as its own loss adds it:
    # the term is the whole rows' (the strategy reduces it over the SP group), the cross-entropy is not.
    out = module.model(input_ids=batch["input_ids"], position_ids=batch["position_ids"])
    logits, labels = out.logits, batch["labels"]
    token_mean = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.size(-1)),
                                                   labels[:, 1:].reshape(-1), ignore_index=-100)
    return token_mean + module.model.config.router_aux_loss_coef * out.aux_loss


# How a test step calls its model (CausalLM(step=...)); the references in test_parity.py mirror each form.
STEP_FORMS = {"batch": _batch_step, "labels_are_input_ids": _labels_are_input_ids_step,
              "built_labels": _built_labels_step, "own_loss": _own_loss_step, "hand_written": _hand_written_step,
              "hand_written_aux": _hand_written_aux_step}
