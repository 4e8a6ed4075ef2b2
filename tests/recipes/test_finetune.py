"""`experiment=finetune_cpu`: a user's model folder and data file through `recipes/train.py` at SP 2 on 2 CPU ranks
(ZeRO-3, packed rows, warmup + cosine), as issue 17 describes the newcomer's first run; and the GPU fine-tuning
experiments' plans from a config alone."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from hydra.utils import instantiate
from torch.utils.data import DistributedSampler, default_collate
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig

from lightning_ulysses.checkpoint import consolidated_state_dict
from lightning_ulysses.recipe import plan
from tests.recipes.test_recipes import _compose, _metrics, _recipe


def _finetune(folder, data_file, run, *overrides: str) -> list[str]:
    return ["experiment=finetune_cpu", f"model.pretrained={folder}", f"data.files={data_file}", f"hydra.run.dir={run}",
            "data.seq_len=128", "trainer.log_every_n_steps=1", *overrides]


def _first_batch(command: list[str]) -> dict:
    """The first training batch of the run: its data module as the recipe builds it, the rows in the order of
    Lightning's sampler over the DP group (SP 2 on 2 ranks: one DP replica; seed 0, epoch 0)."""
    cfg = _compose([o for o in command if not o.startswith("hydra.")])
    data = instantiate(cfg.data)
    data.prepare_data()
    data.setup("fit")
    order = list(DistributedSampler(data.train_rows, num_replicas=1, rank=0, shuffle=True, seed=cfg.seed))
    return default_collate([data.train_rows[i] for i in order[: cfg.data.batch_size]])


@torch.no_grad()
def _loss(model, batch: dict, labels: torch.Tensor) -> float:
    """Single-process loss of packed rows, one document at a time (positions restart at 0 per document; a document
    never sees another): the mean over every labelled next token."""
    total, count = torch.zeros((), dtype=torch.float64), 0
    for ids, row_labels, positions in zip(batch["input_ids"], labels, batch["position_ids"]):
        starts = (positions == 0).nonzero().flatten().tolist() + [len(ids)]
        for a, b in zip(starts[:-1], starts[1:]):
            targets = row_labels[a + 1 : b]
            if (targets != -100).any():
                logits = model(input_ids=ids[a:b][None], position_ids=positions[a:b][None]).logits[0, :-1]
                total += F.cross_entropy(logits.double(), targets, ignore_index=-100, reduction="sum")
                count += int((targets != -100).sum())
    return float(total / count)


def test_finetune_cpu_starts_from_the_folder_learns_and_exports(finetune_folder, tmp_path):
    """Text jsonl: the first loss is the pretrained model's single-process loss of the first batch (the weights were
    loaded into the ZeRO-3 partitions), the loss falls, and the export at the end (`export.enabled` in the
    experiment) is a folder `from_pretrained` loads, with its tokenizer, giving exactly the logits of the weights in
    the final checkpoint."""
    run = tmp_path / "text"
    command = _finetune(finetune_folder.model, finetune_folder.text, run, "trainer.max_steps=20",
                        "trainer.val_check_interval=10", "checkpoint.every_n_train_steps=20")
    result = _recipe(*command, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    losses = {step: row["train/loss"] for step, row in _metrics(run / "logs" / "version_0" / "metrics.csv").items()
              if "train/loss" in row}
    assert sorted(losses) == list(range(20))

    pretrained = AutoModelForCausalLM.from_pretrained(finetune_folder.model).eval()
    batch = _first_batch(command)
    assert abs(losses[0] - _loss(pretrained, batch, batch["labels"])) < 1e-5
    assert sum(losses[step] for step in range(17, 20)) / 3 < losses[0] - 0.2  # measured: 5.78 → 5.35

    exported = AutoModelForCausalLM.from_pretrained(run / "export").eval()
    assert len(AutoTokenizer.from_pretrained(run / "export")) == len(finetune_folder.tokenizer)
    trained = AutoModelForCausalLM.from_pretrained(finetune_folder.model).eval()
    weights = consolidated_state_dict(run / "checkpoints" / "last.ckpt")
    trained.load_state_dict({k.removeprefix("model."): v for k, v in weights.items()})
    tokens = batch["input_ids"][:, :64]
    with torch.no_grad():
        assert not torch.equal(exported(input_ids=tokens).logits, pretrained(input_ids=tokens).logits)
        assert torch.equal(exported(input_ids=tokens).logits, trained(input_ids=tokens).logits)


def test_finetune_cpu_on_chat_data_trains_on_the_assistant_tokens(finetune_folder, tmp_path):
    """Chat jsonl (`data.messages_field=messages`): the first loss is the single-process loss over the assistant's
    tokens of the first batch, and differs from the loss over all its tokens."""
    command = _finetune(finetune_folder.model, finetune_folder.chat, tmp_path / "chat", "data.messages_field=messages",
                        "trainer.max_steps=1", "trainer.limit_val_batches=0", "trainer.enable_checkpointing=false",
                        "export.enabled=false")
    result = _recipe(*command, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    first = _metrics(tmp_path / "chat" / "logs" / "version_0" / "metrics.csv")[0]["train/loss"]
    pretrained = AutoModelForCausalLM.from_pretrained(finetune_folder.model).eval()
    batch = _first_batch(command)
    assert abs(first - _loss(pretrained, batch, batch["labels"])) < 1e-5
    every_token = torch.where(batch["position_ids"] == 0, -100, batch["input_ids"])
    assert abs(first - _loss(pretrained, batch, every_token)) > 1e-3  # 100x the tolerance above (measured 5.8e-3)


def test_llama8b_extend_128k_plans_from_the_config_alone(tmp_path):
    """`plan=true` on a folder holding only the 8B checkpoint's config.json: nothing to read but the config."""
    LlamaConfig(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=8192,
                rope_theta=500000.0).save_pretrained(tmp_path)
    report = plan(_compose(["experiment=llama8b_extend_128k", f"model.pretrained={tmp_path}", "data.files=none.jsonl"]))
    assert "dp(1) × sp(8) = world_size(8)" in report
    assert "8.03" in report  # billion parameters
