"""`experiment=finetune_cpu`: a user's model folder and data file through `recipes/train.py` at SP 2 on 2 CPU ranks
(ZeRO-3, packed rows, warmup + cosine), the newcomer's first run: on the folder `python -m lightning_ulysses
example-finetune` writes, with the command it prints, the run's summary, loss plot and export; what is refused before
the run folder exists; and the fine-tuning experiments' plans from a config alone (also with `memory=auto`)."""

from __future__ import annotations

import re
import shlex

import pytest
import torch
import torch.nn.functional as F
from hydra import compose, initialize_config_dir
from hydra.utils import instantiate
from torch.utils.data import DistributedSampler, default_collate
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig

from lightning_ulysses.integration.checkpoint.command_line import main as checkpoint_command
from lightning_ulysses.integration.checkpoint.protocol import consolidated_state_dict
from lightning_ulysses.recipe.config import register_resolvers
from lightning_ulysses.recipe.driver import RecipeError, check_before_run, plan
from tests.recipes.test_recipes import CONF, _compose, _metrics, _recipe
from tests.unit.test_summary import curve, read_png


def _finetune(folder, data_file, run, *overrides: str) -> list[str]:
    return ["experiment=finetune_cpu", f"model.pretrained={folder}", f"data.files={data_file}", f"hydra.run.dir={run}",
            "data.seq_len=128", "trainer.log_every_n_steps=1", *overrides]


def _printed_overrides(command: str) -> list[str]:
    """The Hydra overrides of a `bash scripts/run.sh train ...` line `example-finetune` printed."""
    words = shlex.split(command)
    assert words[:3] == ["bash", "scripts/run.sh", "train"], command
    return words[3:]


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
    """The command `example-finetune` printed for its text jsonl (shortened to 20 steps): the first loss is the
    pretrained model's single-process loss of the first batch (the weights were loaded into the ZeRO-3 partitions),
    the loss falls, the console ends with the run's summary (first → last loss, tokens/s, where things went) and
    `loss.png` draws the falling loss; the export at the end (`export.enabled` in the experiment) is a folder
    `from_pretrained` loads, with its tokenizer, giving exactly the logits of the weights in the final checkpoint,
    and `checkpoint export` of that checkpoint writes the same folder, laid out alike."""
    run = tmp_path / "text"
    printed = _printed_overrides(finetune_folder.commands[0])
    assert printed == ["experiment=finetune_cpu", f"model.pretrained={finetune_folder.model}",
                       f"data.files={finetune_folder.text}"]
    command = [*printed, f"hydra.run.dir={run}", "data.seq_len=128", "trainer.log_every_n_steps=1",
               "trainer.max_steps=20", "trainer.val_check_interval=10", "checkpoint.every_n_train_steps=20"]
    result = _recipe(*command, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    metrics = _metrics(run / "logs" / "version_0" / "metrics.csv")
    losses = {step: row["train/loss"] for step, row in metrics.items() if "train/loss" in row}
    assert sorted(losses) == list(range(20))

    summary = result.stdout[result.stdout.index(f"Run summary ({run}):"):].splitlines()
    assert f"  train/loss   {losses[0]:.4g} (step 0) → {losses[19]:.4g} (step 19)" in summary
    validated = [step for step, row in metrics.items() if "val/loss" in row]
    assert (f"  val/loss     {metrics[validated[0]]['val/loss']:.4g} (step {validated[0]}) →"
            f" {metrics[validated[-1]]['val/loss']:.4g} (step {validated[-1]})") in summary
    assert re.search(r"^  tokens/s     [\d,]+ \(median of 19 logged steps after the first\)$", "\n".join(summary), re.M)
    for line in (f"  metrics      {run}/logs/version_0/metrics.csv", f"  loss plot    {run}/loss.png",
                 f"  export       {run}/export (AutoModelForCausalLM.from_pretrained)"):
        assert line in summary, line
    assert any(line.startswith(f"  checkpoint   {run}/checkpoints/last.ckpt ") for line in summary)
    _, _, pixels = read_png(run / "loss.png")
    line = curve(pixels, (31, 119, 180))  # plot.BLUE: train/loss from step 0 (left) to 19 (right)
    assert max(line[min(line)]) < min(line[max(line)]) - 50

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

    # The command line's export of the checkpoint: the recipe's folder, plus the consolidated state dict.
    cli = tmp_path / "cli_export"
    assert checkpoint_command(["export", str(run / "checkpoints" / "last.ckpt"), str(cli),
                               "--tokenizer", str(finetune_folder.model)]) == 0
    assert sorted(p.name for p in cli.iterdir()) == sorted([p.name for p in (run / "export").iterdir()] + ["model.pt"])
    with torch.no_grad():
        logits = AutoModelForCausalLM.from_pretrained(cli).eval()(input_ids=tokens).logits
        assert torch.equal(logits, trained(input_ids=tokens).logits)


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


def _compose_as_run(overrides: list[str]):
    """The config as `recipes/train.py` gets it, with Hydra's own node (the experiment's name: `hydra.runtime`)."""
    register_resolvers()
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return compose(config_name="train", overrides=overrides, return_hydra_config=True)


REFUSALS = [
    ([], r"^experiment=finetune_cpu needs model\.pretrained and data\.files, which are not set .*\n  model\.pretrained:"
         r" .*python -m lightning_ulysses example-finetune <folder>"),
    (["model.pretrained={missing}", "data.files={text}"],
     r"^model\.pretrained={missing}: the folder {missing} does not exist\..*python -m lightning_ulysses"
     r" example-finetune <folder>"),
    (["model.pretrained={empty}", "data.files={text}"], r"^model\.pretrained={empty}: {empty} holds no config\.json"),
    (["model.pretrained={model}", "data.files={chat}"],
     r"holds chat conversations in its field 'messages' .* set data\.messages_field=messages \("),
    (["model.pretrained={model}", "data.files={chat}", "data.text_field=messages"],
     r"data\.text_field='messages' holds chat conversations .* set data\.messages_field=messages instead"),
    (["model.pretrained={model}", "data.files={folder}/nothing*.jsonl"], r"no data files match"),
]


@pytest.mark.parametrize("overrides, message", REFUSALS, ids=["no model", "missing folder", "not a model folder",
                                                                "chat without messages_field", "chat as text_field",
                                                                "no data files"])
def test_what_cannot_run_is_refused_before_the_run_folder_naming_the_fix(finetune_folder, tmp_path, overrides,
                                                                          message):
    """`check_before_run`: what `recipes/train.py` checks before Hydra makes the run folder (its callback; the exit
    without traceback and without folder: test_recipes.py `test_bad_overrides_fail_before_training`)."""
    (tmp_path / "empty").mkdir()
    paths = {"missing": tmp_path / "no_such_model", "empty": tmp_path / "empty", "model": finetune_folder.model,
             "text": finetune_folder.text, "chat": finetune_folder.chat, "folder": finetune_folder.model.parent}
    cfg = _compose_as_run(["experiment=finetune_cpu", *(o.format(**paths) for o in overrides)])
    with pytest.raises(RecipeError) as refused:
        check_before_run(cfg)
    assert re.search(message.format(**{k: re.escape(str(v)) for k, v in paths.items()}), str(refused.value),
                     re.S | re.M), str(refused.value)
    assert "data.text_field to" not in str(refused.value)  # never advice to read conversations as text


def test_example_finetune_writes_into_a_new_or_empty_folder_only(tmp_path, capsys):
    from lightning_ulysses.recipe.example import main

    (tmp_path / "notes.txt").write_text("mine")
    assert main([str(tmp_path)]) == 1
    assert "already exists and is not an empty folder" in capsys.readouterr().err
    assert [p.name for p in tmp_path.iterdir()] == ["notes.txt"]


def test_a_hub_name_is_left_to_transformers_and_a_folder_passes(finetune_folder):
    """A name that can only be a Hub name is not refused as a missing folder (transformers decides); a folder
    `save_pretrained` wrote, with its data, passes every check."""
    from lightning_ulysses.models.hf import check_pretrained_folder

    check_pretrained_folder("meta-llama/Llama-3.2-1B")
    check_before_run(_compose_as_run(["experiment=finetune_cpu", f"model.pretrained={finetune_folder.model}",
                                      f"data.files={finetune_folder.chat}", "data.messages_field=messages"]))


AUTO_WITH_FREE_MEMORY = ["~strategy.memory", "+strategy.memory={{auto: true, free_memory: [{device}, 1.2e11]}}"]


def _gib(report: str, pattern: str) -> float:
    return float(re.search(pattern, report).group(1))


def test_plan_with_memory_auto_shows_autos_choice_and_plans_it():
    """`plan=true strategy.memory=auto` prints what auto would choose for the free memory it is given (per rank) and
    plans that choice: less memory, more features, a smaller plan within it; auto was ignored before (the plan of no
    features whatever the memory)."""
    reports = {}
    for device in (1.48e11, 6e10):
        overrides = [o.format(device=device) for o in AUTO_WITH_FREE_MEMORY]
        reports[device] = plan(_compose(["experiment=llama8b_long", "plan=true", *overrides]))
    for device, report in reports.items():
        assert 'lightning_ulysses memory="auto" (decided once, the same on every rank)' in report
        assert f"device {device / 2**30:.1f} GiB" in report
        planned = _gib(report, r"memory/GPU:\s+([\d.]+) GiB")
        assert abs(planned - _gib(report, r"predicted: device peak ([\d.]+) GiB")) < 0.06
        assert planned <= 0.98 * device / 2**30
    roomy, tight = reports[1.48e11], reports[6e10]
    assert _gib(tight, r"memory/GPU:\s+([\d.]+) GiB") < _gib(roomy, r"memory/GPU:\s+([\d.]+) GiB")
    chosen = {report: set(re.search(r"features: (.*)", report).group(1).split(", ")) for report in (roomy, tight)}
    assert chosen[tight] > chosen[roomy]  # measured: + tiled_mlp, tiled_logits_loss


def test_plan_with_memory_auto_measures_a_cpu_run_and_refuses_a_gpu_run_it_cannot_measure(finetune_folder,
                                                                                        monkeypatch):
    cpu = plan(_compose(["experiment=finetune_cpu", f"model.pretrained={finetune_folder.model}",
                         "data.files=none.jsonl", "plan=true", "strategy.memory=auto"]))
    assert "memory=auto:  free memory of this machine's host" in cpu and "no host offload on CPU" in cpu
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(RecipeError, match=r"this machine has no GPU to measure: .*free_memory: \[<device>, <host>\]"):
        check_before_run(_compose_as_run(["experiment=llama8b_long", "plan=true", "strategy.memory=auto"]))


def test_llama8b_extend_128k_plans_from_the_config_alone(tmp_path):
    """`plan=true` on a folder holding only the 8B checkpoint's config.json: nothing to read but the config."""
    LlamaConfig(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=8192,
                rope_theta=500000.0).save_pretrained(tmp_path)
    report = plan(_compose(["experiment=llama8b_extend_128k", f"model.pretrained={tmp_path}", "data.files=none.jsonl"]))
    assert "dp(1) × sp(8) = world_size(8)" in report
    assert "8.03" in report  # billion parameters
