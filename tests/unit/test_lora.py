"""LoRA wiring (`lightning_ulysses.models.lora`) and the end-of-training export (`lightning_ulysses.integration.export`) in one
process, and `checkpoint export` of a LoRA model (its adapter configs recorded in the checkpoint), also of one with
several adapters, and with `--tokenizer`. Under ZeRO-3 at SP 2 (adapters partitioned at creation, weights gathered
for the export): tests/distributed/test_parity.py `-pretrained-lora` (two adapters: `-pretrained-lora2`) and the
`-export` and `-checkpoint_export` claims."""

from __future__ import annotations

import contextlib
import copy
import json
import re
import warnings
from types import SimpleNamespace

import pytest
import torch
from peft import LoraConfig, PeftConfig, PeftModel, get_peft_model
from peft.tuners.lora import LoraLayer
from transformers import AutoModelForCausalLM, AutoTokenizer

from lightning_ulysses.integration.checkpoint import command_line, protocol
from lightning_ulysses.integration.export import (ExportPretrained, PeftAdapters, adapter_configs,
                                                  save_pretrained_folders)
from lightning_ulysses.integration.preparation import check_adapters_initialised
from lightning_ulysses.models import CausalLMModule
from lightning_ulysses.models.lora import LoraSettings, _peft_initial_pair, add_adapter, with_lora
from tests.distributed.common import tiny_llama
from tests.finetune_fixtures import save_tiny_pretrained, save_tiny_tokenizer

LORA = {"r": 4, "alpha": 8, "target_modules": ["q_proj", "v_proj", "down_proj"], "seed": 5}


@pytest.fixture(scope="module")
def pretrained(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny_pretrained")
    save_tiny_pretrained(folder)
    return folder


def _lora_module(folder, **lora):
    module = CausalLMModule.from_pretrained(str(folder), lora={**LORA, **lora})
    module.configure_model()
    return module


def test_only_the_adapters_train_and_reach_the_optimizer(pretrained):
    module = _lora_module(pretrained)
    trainable = {name for name, p in module.named_parameters() if p.requires_grad}
    # 2 layers × 3 targets × (A, B), nothing else
    assert len(trainable) == 12 and all(".lora_A." in name or ".lora_B." in name for name in trainable)
    assert {name.split(".")[-4] for name in trainable} == {"q_proj", "v_proj", "down_proj"}
    optimized = {id(p) for group in module.configure_optimizers().param_groups for p in group["params"]}
    assert optimized == {id(p) for p in module.parameters() if p.requires_grad}


def test_the_adapters_start_as_peft_initialises_them_and_the_model_as_the_pretrained_one(pretrained):
    """`with_lora` gives peft's own values for the same seed, without moving the run's generator; `B` = 0, so the
    logits are the pretrained model's. `_peft_initial_pair` (what ZeRO-3 partitions are re-initialised with) replays
    peft's draws exactly."""
    torch.manual_seed(123)
    module = _lora_module(pretrained)
    after = torch.rand(1)
    torch.manual_seed(123)
    assert torch.equal(torch.rand(1), after)  # the run's generator did not move
    torch.manual_seed(LORA["seed"])
    plain = get_peft_model(AutoModelForCausalLM.from_pretrained(pretrained),
                           LoraConfig(r=4, lora_alpha=8, target_modules=LORA["target_modules"], task_type="CAUSAL_LM"))
    for (name, mine), (_, theirs) in zip(module.model.named_parameters(), plain.named_parameters(), strict=True):
        assert torch.equal(mine, theirs), name
    generator = torch.Generator().manual_seed(LORA["seed"])
    for layer in (m for m in plain.modules() if isinstance(m, LoraLayer)):
        a, b = layer.lora_A["default"].weight, layer.lora_B["default"].weight
        replayed = _peft_initial_pair(a.shape, b.shape, generator)
        assert torch.equal(replayed[0], a) and torch.equal(replayed[1], b)
    tokens = torch.arange(24).reshape(2, 12)
    base = AutoModelForCausalLM.from_pretrained(pretrained).eval()
    with torch.no_grad():
        assert torch.equal(module.model.eval()(input_ids=tokens).logits, base(input_ids=tokens).logits)


@pytest.mark.parametrize("targets, unmatched", [(["q_proj", "qproj"], "['qproj']"), ("layers\\.9\\..*", "layers")])
def test_a_target_that_matches_no_layer_is_refused(pretrained, targets, unmatched):
    with pytest.raises(ValueError, match=r"match no layer of LlamaForCausalLM; its linear layers are named \['down_proj'"):
        _lora_module(pretrained, target_modules=targets)


# `add_adapter`'s second adapter: another rank and seed, and a layer the first does not adapt (`o_proj`).
ADDED = LoraSettings(r=2, alpha=6, target_modules=("q_proj", "o_proj"), seed=7)


@pytest.fixture
def zero3_init(monkeypatch):
    """`deepspeed.zero.Init` of ZeRO-3 in this process (a gloo group of one rank, torn down afterwards): modules
    built inside it are partitioned at creation, as in `configure_model` under the strategy."""
    import socket

    import deepspeed

    from lightning_ulysses.integration.engine import skip_shared_memory_all_reduce_build

    with socket.socket() as free:
        free.bind(("127.0.0.1", 0))
        port = free.getsockname()[1]
    for key, value in dict(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", LOCAL_RANK="0",
                           WORLD_SIZE="1").items():
        monkeypatch.setenv(key, value)
    skip_shared_memory_all_reduce_build()
    deepspeed.init_distributed(dist_backend="gloo")
    config = {"zero_optimization": {"stage": 3}, "train_micro_batch_size_per_gpu": 1}
    # `zero.Init` leaves its ZeRO-3 linear in place of torch's for the rest of the process (integration/process_state.py):
    # put torch's back afterwards, for the tests that follow in this process
    monkeypatch.setattr(torch.nn.functional, "linear", torch.nn.functional.linear)
    yield lambda: deepspeed.zero.Init(config_dict_or_path=config, remote_device="cpu")
    torch.distributed.destroy_process_group()


def _added(model, name: str) -> dict[str, torch.Tensor]:
    """The values of adapter `name`'s weights, gathered where ZeRO-3 partitioned them."""
    params = {key: p for key, p in model.named_parameters() if f".{name}." in key}
    gathered = contextlib.nullcontext()
    if hasattr(next(iter(params.values())), "ds_id"):
        import deepspeed

        gathered = deepspeed.zero.GatheredParameters(list(params.values()))
    with gathered:
        return {key: p.detach().clone() for key, p in params.items()}


def _plain_two_adapters():
    """The reference: what a plain process's peft gives, seeded as `LoraSettings.seed` says."""
    torch.manual_seed(LORA["seed"])
    plain = get_peft_model(tiny_llama(2), LoraSettings(**LORA).peft_config())
    torch.manual_seed(ADDED.seed)
    plain.add_adapter("second", ADDED.peft_config())
    return plain


@pytest.mark.parametrize("partitioned", [False, True], ids=["whole", "zero3-partitioned"])
def test_an_added_adapter_starts_with_peft_values_also_partitioned_by_zero3(partitioned, request):
    """`add_adapter` gives the adapter exactly the values a plain process's seeded peft `add_adapter` gives (`B`
    zero, `A` peft's draws), also when ZeRO-3 partitions it at creation, where peft's own leaves `B` random
    (measured: non-zero, `nn.Linear`'s init); inactive and frozen as peft's; the run's generator does not move."""
    context = request.getfixturevalue("zero3_init") if partitioned else contextlib.nullcontext
    with context():
        model = with_lora(tiny_llama(2), LoraSettings(**LORA))
        torch.manual_seed(123)
        add_adapter(model, "second", ADDED)
        after = torch.rand(1)
    torch.manual_seed(123)
    assert torch.equal(torch.rand(1), after)
    expected = _added(_plain_two_adapters(), "second")
    values = _added(model, "second")
    assert list(values) == list(expected) and len(values) == 8  # 2 layers x (q_proj, o_proj) x (A, B)
    for key, value in values.items():
        assert torch.equal(value, expected[key]), key
    assert all(not p.requires_grad for key, p in model.named_parameters() if ".second." in key)
    assert model.active_adapters == ["default"]
    check_adapters_initialised(model)


def test_an_adapter_peft_adds_partitioned_by_zero3_is_refused_naming_the_fix(zero3_init):
    """peft's own `add_adapter` under ZeRO-3's `zero.Init` leaves `B` random: refused (the check the strategy runs at
    setup), naming `add_adapter`; the first adapter (`with_lora`'s) is not named."""
    with zero3_init():
        model = with_lora(tiny_llama(2), LoraSettings(**LORA))
        model.add_adapter("second", ADDED.peft_config())
    assert any(value.abs().max() > 0 for key, value in _added(model, "second").items() if ".lora_B." in key)
    fix = "lightning_ulysses.models.lora.add_adapter(peft_model, name, LoraSettings(...))"
    with pytest.raises(ValueError, match=r"The LoRA adapters \['second'\] were created partitioned by ZeRO-3 .*"
                                         + re.escape(fix)):
        check_adapters_initialised(model)


def test_an_adapter_peft_adds_whole_is_not_refused_even_once_deepspeed_partitions_it():
    """Outside `zero.Init` peft's own values stand: not refused; the check marks them, so that once DeepSpeed has
    partitioned them (a model built in `__init__`, at `deepspeed.initialize`) a later setup (validate after fit)
    does not refuse them either."""
    model = with_lora(tiny_llama(2), LoraSettings(**LORA))
    model.add_adapter("second", ADDED.peft_config())
    check_adapters_initialised(model)
    for p in model.parameters():
        p.ds_id = 0  # what DeepSpeed's partitioning adds
    check_adapters_initialised(model)


def _trained(module):
    """Move every trainable weight, as training would (B no longer zero: the adapters change the logits)."""
    with torch.no_grad():
        for p in module.parameters():
            if p.requires_grad:
                p.add_(torch.randn_like(p) * 0.1)
    return module.model.eval()


def _logits(model, tokens):
    with torch.no_grad():
        return model.eval()(input_ids=tokens).logits


def test_full_export_round_trip_with_tokenizer(pretrained, tmp_path):
    module = CausalLMModule.from_pretrained(str(pretrained))
    module.configure_model()
    model = _trained(module)
    (folder,) = save_pretrained_folders(model.config, model.state_dict(), tmp_path, tokenizer=str(pretrained))
    tokens = torch.arange(24).reshape(2, 12)
    assert torch.equal(_logits(AutoModelForCausalLM.from_pretrained(folder), tokens), _logits(model, tokens))
    assert AutoTokenizer.from_pretrained(folder).get_vocab() == AutoTokenizer.from_pretrained(pretrained).get_vocab()


def test_lora_export_round_trip_adapter_and_merged(pretrained, tmp_path):
    model = _trained(_lora_module(pretrained))
    folders = save_pretrained_folders(model.get_base_model().config, model.state_dict(), tmp_path,
                                      lora=model.peft_config["default"], merged=True, tokenizer=str(pretrained))
    assert folders == [tmp_path / "adapter", tmp_path / "merged"]
    assert {p.name for p in folders[0].iterdir()} >= {"adapter_config.json", "adapter_model.safetensors",
                                                      "tokenizer_config.json"}
    _check_lora_folders(model, pretrained, folders)


def _check_lora_folders(model, pretrained, folders):
    """`adapter/` on the pretrained base gives the trained PEFT model's logits, `merged/` those of peft's merge of it
    (within 1e-5 of the unmerged ones: merging changes the order of the sums)."""
    tokens = torch.arange(24).reshape(2, 12)
    expected = _logits(model, tokens)
    adapter = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(pretrained), folders[0])
    assert torch.equal(_logits(adapter, tokens), expected)
    merged = _logits(AutoModelForCausalLM.from_pretrained(folders[1]), tokens)
    assert torch.equal(_logits(model, tokens), expected)  # the merge left the trained model as it was
    assert torch.equal(merged, _logits(model.merge_and_unload(), tokens))
    assert (merged - expected).abs().max() < 1e-5


# Where the strategy records a LoRA module's model: the Hugging Face model inside the PeftModel at `module.model`.
RECORDED = "model.base_model.model"


def _checkpoint_export(module, config_dir, output):
    """What `checkpoint export --merged` does with the one model of a checkpoint, recorded at RECORDED, given the
    module's whole state dict (the consolidated checkpoint's, in a real checkpoint): its folders in `output`."""
    return command_line._export_hf_model(config_dir, module.state_dict(), RECORDED, output, merged=True)


def test_a_checkpoint_records_the_lora_config_and_exports_the_callbacks_folders(pretrained, tmp_path):
    """A checkpoint of a LoRA module records peft's adapter config beside the config of the model it adapts;
    `checkpoint export` then writes `adapter/` and `merged/` into the folder it is given, as `ExportPretrained`
    does (the adapter naming the base the run loaded). The distributed round trip: test_parity.py's `-pretrained-lora`
    `checkpoint_export` claim."""
    module = _lora_module(pretrained)
    model = _trained(module)
    assert adapter_configs(module) == {RECORDED: PeftAdapters({"default": model.peft_config["default"]}, ("default",))}
    protocol.save_hf_configs(tmp_path / "ckpt", {RECORDED: model.get_base_model().config}, module)
    config_dir = tmp_path / "ckpt" / "hf" / RECORDED
    assert sorted(p.name for p in config_dir.iterdir()) == ["adapter_config.json", "adapters.json", "config.json"]
    folders = _checkpoint_export(module, config_dir, tmp_path / "export")
    assert folders == [tmp_path / "export" / "adapter", tmp_path / "export" / "merged"]
    assert PeftConfig.from_pretrained(folders[0]).base_model_name_or_path == str(pretrained)
    _check_lora_folders(model, pretrained, folders)


def test_a_lora_checkpoint_without_its_adapter_config_is_refused_naming_the_fix(pretrained, tmp_path):
    """A checkpoint written before the adapter config was recorded holds peft's names for the weights: refused
    with the file to write; writing it as the message says makes the export work."""
    module = _lora_module(pretrained)
    model = _trained(module)
    config_dir = tmp_path / "ckpt" / "hf" / RECORDED
    model.get_base_model().config.save_pretrained(config_dir)  # what such a checkpoint holds
    fix = f"LoraSettings(**lora).peft_config().save_pretrained('{config_dir}')"
    with pytest.raises(ValueError, match=r"trained with PEFT \(LoRA\) adapters .*" + re.escape(fix)):
        _checkpoint_export(module, config_dir, tmp_path / "export")
    LoraSettings(**LORA).peft_config().save_pretrained(config_dir)
    _check_lora_folders(model, pretrained, _checkpoint_export(module, config_dir, tmp_path / "export"))


def test_recipe_keys_compose_into_lora_and_export(pretrained, tmp_path):
    """`model.lora=...` and `export.enabled=true` in the recipes: the module gets the adapters, the Trainer the export
    callback, with the pretrained folder's tokenizer and `<run directory>/export` by default."""
    from hydra import compose, initialize_config_dir
    from hydra.utils import instantiate

    from lightning_ulysses.recipe.config import register_resolvers
    from lightning_ulysses.recipe.driver import export_callbacks
    from tests.recipes.test_recipes import CONF

    register_resolvers()
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        cfg = compose(config_name="train", overrides=[
            "model=hf_pretrained", f"model.pretrained={pretrained}", "export.enabled=true", "export.merged=true",
            "model.lora={r: 4, alpha: 8, target_modules: [q_proj, v_proj]}"])
    module = instantiate(cfg.model)
    module.configure_model()
    assert isinstance(module.model, PeftModel) and module.model.peft_config["default"].r == 4
    (callback,) = export_callbacks(cfg.export, module.spec, tmp_path)
    assert isinstance(callback, ExportPretrained) and callback.merged
    assert (callback.directory, callback.tokenizer) == (tmp_path / "export", str(pretrained))
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        assert export_callbacks(compose(config_name="train").export, module.spec, tmp_path) == []


# A second adapter of another rank, also on a layer the first does not adapt (`o_proj`).
SECOND = LoraConfig(r=2, lora_alpha=6, target_modules=["q_proj", "o_proj"], task_type="CAUSAL_LM")


def _two_adapter_module(pretrained, active):
    """A LoRA module whose PeftModel has a second adapter (`add_adapter`), both trained, `active` active."""
    module = _lora_module(pretrained)
    module.model.add_adapter("second", SECOND)
    with torch.no_grad():  # peft freezes an inactive adapter: move every adapter weight, as training both would
        for name, p in module.named_parameters():
            if ".lora_" in name:
                p.add_(torch.randn_like(p) * 0.1)
    module.model.base_model.set_adapter(list(active))
    return module


def _check_two_adapter_folders(model, pretrained, folders, active):
    """`adapter/` holds `default` at its root and `second` in `adapter/second` (peft's layout); loaded as peft loads
    several adapters, each adapter alone and the active ones together give the trained model's logits exactly.
    `merged/` is peft's merge of the active adapters, within 1e-5 of the trained model (merging reorders the sums)."""
    assert {p.name for p in folders[0].iterdir()} >= {"adapter_config.json", "adapter_model.safetensors", "second"}
    assert {p.name for p in (folders[0] / "second").iterdir()} == {"adapter_config.json", "adapter_model.safetensors"}
    tokens = torch.arange(24).reshape(2, 12)
    expected = _logits(model, tokens)
    merged = _logits(AutoModelForCausalLM.from_pretrained(folders[1]), tokens)
    assert torch.equal(merged, _logits(copy.deepcopy(model).merge_and_unload(), tokens))
    assert (merged - expected).abs().max() < 1e-5
    loaded = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(pretrained), folders[0])
    loaded.load_adapter(folders[0] / "second", adapter_name="second")
    for adapters in (["default"], ["second"], list(active)):
        for peft_model in (model, loaded):
            peft_model.base_model.set_adapter(adapters)
        assert torch.equal(_logits(loaded, tokens), _logits(model, tokens)), adapters
    assert torch.equal(_logits(loaded, tokens), expected)


@pytest.mark.parametrize("active", [("second",), ("default", "second")])
def test_the_callback_exports_every_adapter_and_merges_the_active_ones(pretrained, tmp_path, active):
    """`ExportPretrained` on a PeftModel with two adapters: both in `adapter/` (peft's layout), `merged/` the active
    ones merged (what the trained model computes); an adapter left out of `merged/` is named in a warning."""
    module = _two_adapter_module(pretrained, active)
    trainer = SimpleNamespace(is_global_zero=True, strategy=SimpleNamespace(barrier=lambda name: None))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ExportPretrained(str(tmp_path), merged=True, tokenizer=str(pretrained)).on_train_end(trainer, module)
    left_out = [str(w.message) for w in caught if "not the inactive ['default']" in str(w.message)]
    assert len(left_out) == (active == ("second",)), [str(w.message) for w in caught]
    assert (tmp_path / "adapter" / "tokenizer_config.json").exists()
    _check_two_adapter_folders(module.model.eval(), pretrained, [tmp_path / "adapter", tmp_path / "merged"], active)


def test_a_checkpoint_records_every_adapter_and_exports_them_as_the_callback_does(pretrained, tmp_path):
    """Every adapter's config is recorded in peft's layout beside the config, with their names and the active ones
    (`adapters.json`); `checkpoint export` then rebuilds the PEFT model with all of them and writes the callback's
    folders, every adapter naming the base the run loaded."""
    module = _two_adapter_module(pretrained, ["second"])
    model = module.model.eval()
    protocol.save_hf_configs(tmp_path / "ckpt", {RECORDED: model.get_base_model().config}, module)
    config_dir = tmp_path / "ckpt" / "hf" / RECORDED
    assert json.loads((config_dir / "adapters.json").read_text()) == {"adapters": ["default", "second"],
                                                                      "active": ["second"]}
    assert PeftConfig.from_pretrained(config_dir / "second").r == SECOND.r
    with pytest.warns(UserWarning, match=r"not the inactive \['default'\]"):
        folders = _checkpoint_export(module, config_dir, tmp_path / "export")
    assert folders == [tmp_path / "export" / "adapter", tmp_path / "export" / "merged"]
    for folder in (folders[0], folders[0] / "second"):
        assert PeftConfig.from_pretrained(folder).base_model_name_or_path == str(pretrained)
    _check_two_adapter_folders(model, pretrained, folders, ["second"])


def test_a_checkpoint_missing_adapters_its_weights_hold_is_refused_naming_the_fix(pretrained, tmp_path):
    """A checkpoint of a two-adapter model written before several adapters were recorded (only `adapter_config.json`
    beside the config): refused, naming the files to write; writing them as it says makes the export work."""
    module = _two_adapter_module(pretrained, ["default"])
    model = module.model.eval()
    config_dir = tmp_path / "ckpt" / "hf" / RECORDED
    model.get_base_model().config.save_pretrained(config_dir)
    model.peft_config["default"].save_pretrained(config_dir)  # what such a checkpoint holds
    refusal = (r"LoRA adapters \['default', 'second'\], and this checkpoint records the config of \['default'\] only"
               r".*" + re.escape(f"{config_dir}/<adapter>") + ".*" + re.escape(str(config_dir / "adapters.json")))
    with pytest.raises(ValueError, match=refusal):
        _checkpoint_export(module, config_dir, tmp_path / "export")
    SECOND.save_pretrained(config_dir / "second")
    (config_dir / "adapters.json").write_text(json.dumps({"adapters": ["default", "second"], "active": ["default"]}))
    with pytest.warns(UserWarning, match=r"not the inactive \['second'\]"):
        folders = _checkpoint_export(module, config_dir, tmp_path / "export")
    _check_two_adapter_folders(model, pretrained, folders, ["default"])


def test_checkpoint_export_saves_the_tokenizer_given_on_the_command_line(pretrained, tmp_path, monkeypatch):
    """`checkpoint export <ckpt> <folder> --tokenizer <folder>` saves that tokenizer beside the weights, as the
    callback's `tokenizer` does. The checkpoint is a complete one as the strategy commits it (manifest, recorded
    config), the consolidation of its stand-in shards replaced by the trained module's state dict."""
    module = CausalLMModule.from_pretrained(str(pretrained))
    module.configure_model()
    model = _trained(module)
    tokenizer = save_tiny_tokenizer(tmp_path / "tokenizer", vocab_size=300)  # not the pretrained folder's (320)
    path = _committed_checkpoint(tmp_path / "last.ckpt", module, {"model": model}, monkeypatch)
    command = ["export", str(path), str(tmp_path / "export"), "--tokenizer", str(tmp_path / "tokenizer")]
    assert command_line.main(command) == 0
    exported = tmp_path / "export"  # the one model's folder is the output itself, as the recipes' export is
    assert AutoTokenizer.from_pretrained(exported).get_vocab() == tokenizer.get_vocab()
    tokens = torch.arange(24).reshape(2, 12)
    assert torch.equal(_logits(AutoModelForCausalLM.from_pretrained(exported), tokens), _logits(model, tokens))


def _committed_checkpoint(path, module, models: dict, monkeypatch):
    """A complete checkpoint as the strategy commits it (manifest, the configs of `models` by module path), the
    consolidation of its stand-in shards replaced by `module`'s state dict."""
    staging = protocol.prepare_staging(path)
    (staging / protocol.DEEPSPEED_TAG).mkdir()
    torch.save({}, staging / protocol.DEEPSPEED_TAG / "mp_rank_00_model_states.pt")
    protocol.save_hf_configs(staging, {name: model.config for name, model in models.items()}, module)
    protocol.commit(path, protocol.CheckpointManifest(
        world_size=1, sequence_parallel_size=1, data_parallel_size=1, zero_stage=0, epoch_samples_consumed=0,
        hf_models=tuple(models)))
    monkeypatch.setattr(command_line, "consolidated_state_dict", lambda checkpoint: module.state_dict())
    return path


def test_checkpoint_export_puts_several_models_side_by_side(tmp_path, monkeypatch):
    """One model is exported into the output folder itself (above, as the recipes' `export.enabled` does); a module
    with two Hugging Face models gets one `save_pretrained` folder per module path, beside `model.pt`."""
    module = torch.nn.Module()
    module.student, module.teacher = tiny_llama(2, seed=1), tiny_llama(4, seed=2)
    path = _committed_checkpoint(tmp_path / "last.ckpt", module, {"student": module.student,
                                                                    "teacher": module.teacher}, monkeypatch)
    assert command_line.main(["export", str(path), str(tmp_path / "export")]) == 0
    assert sorted(p.name for p in (tmp_path / "export").iterdir()) == ["model.pt", "student", "teacher"]
    tokens = torch.arange(24).reshape(2, 12)
    for name in ("student", "teacher"):
        exported = AutoModelForCausalLM.from_pretrained(tmp_path / "export" / name)
        assert torch.equal(_logits(exported, tokens), _logits(getattr(module, name), tokens)), name
