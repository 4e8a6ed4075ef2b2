"""Per-model facts live on each prepared model, never in module globals: the all-to-all transport and the mask
configuration of one model are not seen by another model (or another Trainer) in the same process.

Single process: models prepared at SP 1 (their attention is switched and bound at every SP size), and for the
sharded mask path the stand-in bindings of test_masks.py (no collective runs here).
"""

from __future__ import annotations

import copy
import io
import pickle
from types import SimpleNamespace

import torch
from transformers import LlamaConfig
from transformers import masking_utils as hf_masks
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from lightning_ulysses.attention.core import UlyssesAttention
from lightning_ulysses.attention.documents import AttentionPattern
from lightning_ulysses.attention.rows import BatchRowsSlot
from lightning_ulysses.batch.sharding import SequenceSharder
from lightning_ulysses.hf import ULYSSES_ATTENTION, binding_of, prepare_hf_model
from lightning_ulysses.hf import forward as hf_forward
from lightning_ulysses.hf.forward import register_model_attention, unregister_model_attention
from lightning_ulysses.hf.mask_interface import _unmark
from lightning_ulysses.integration import preparation
from lightning_ulysses.memory import MemoryOptions
from lightning_ulysses.training.loss import SequenceParallelCausalLMLoss
from tests.distributed.families import tiny_model


def _transports_seen(monkeypatch) -> list:
    """Record the transport every "ulysses" attention call hands the core (then run the core as it is)."""
    seen = []
    core = hf_forward.ulysses_attention

    def recording(*args, transport=None, **kwargs):
        seen.append(transport)
        return core(*args, transport=transport, **kwargs)

    monkeypatch.setattr(hf_forward, "ulysses_attention", recording)
    return seen


def test_two_models_keep_their_own_transport(monkeypatch):
    seen = _transports_seen(monkeypatch)
    first, second = tiny_model("llama"), tiny_model("llama", seed=1)
    copy_transport, other_transport = object(), object()
    prepared = [prepare_hf_model(first, None, transport=copy_transport),
                prepare_hf_model(second, None, transport=other_transport)]
    tokens = torch.randint(0, 100, (1, 8))
    for model, transport in ((first, copy_transport), (second, other_transport), (first, copy_transport)):
        seen.clear()
        model(input_ids=tokens)
        assert seen and all(t is transport for t in seen), "a model exchanged over another model's transport"
    for p in prepared:
        p.restore()
    assert binding_of(first) is None and binding_of(second) is None


class _Holder(torch.nn.Module):
    def __init__(self, *modules):
        super().__init__()
        self.held = torch.nn.ModuleList(modules)


def _runtime(transport) -> preparation.SequenceParallelRuntime:
    groups = SimpleNamespace(sequence_parallel_world_size=1, ulysses_size=1, ring_size=1, ulysses_group=None,
                             ring_group=None)
    slot = BatchRowsSlot()
    return preparation.SequenceParallelRuntime(groups, SequenceSharder(1, 0, batch_rows=slot), slot,
                                               SequenceParallelCausalLMLoss(None, 1.0, batch_rows=slot),
                                               MemoryOptions.coerce(None), transport=transport)


def test_two_runs_hand_their_transport_to_their_own_modules_only():
    """Two Trainers' preparations in one process: each run's transport reaches its HF model's binding and its
    native attention layers, and restoring one run leaves the other's in place."""
    runs = []
    for transport in (object(), object()):
        model, native = tiny_model("llama"), UlyssesAttention("sdpa")
        runs.append((transport, model, native,
                     preparation.scan(_Holder(model, native), 1).prepare(_runtime(transport))))
    for transport, model, native, _ in runs:
        assert binding_of(model).transport is transport and native._transport is transport
    runs[0][3].restore()
    transport, model, native, _ = runs[1]
    assert binding_of(model).transport is transport and native._transport is transport
    assert binding_of(runs[0][1]) is None and runs[0][2]._transport is None


def _stand_in_binding(sequence_parallel_size: int):
    return SimpleNamespace(group=SimpleNamespace(world_size=sequence_parallel_size), backend="sdpa",
                           ring=SimpleNamespace(world_size=1), decode=None, sharded=sequence_parallel_size > 1)


def _windowed_config(name: str) -> LlamaConfig:
    config = LlamaConfig(hidden_size=8, num_attention_heads=2, attention_chunk_size=None, sliding_window=5)
    config._attn_implementation = name  # as prepare_hf_model names a prepared model's configs
    return config


def _sliding_mask(config):
    return hf_masks.create_sliding_window_causal_mask(
        config=config, inputs_embeds=torch.zeros(2, 8, 8), attention_mask=torch.ones(2, 8, dtype=torch.long),
        cache=None, position_ids=None)


def test_each_model_builds_masks_from_its_own_binding():
    """One model sharded over 2 ranks, one at SP 1, same family and window: the sharded one's windowed layers get
    the window carried to the whole rows; the SP 1 one's get transformers' own mask, as unprepared."""
    names = [register_model_attention("TinyModel", _stand_in_binding(size)) for size in (2, 1)]
    sharded, unsharded = map(_windowed_config, names)
    padding, pattern = _unmark(_sliding_mask(sharded))
    assert pattern == AttentionPattern(sliding_window=5) and padding.shape == (2, 8)
    own = _sliding_mask(unsharded)
    assert _unmark(own)[1] is None and own.dim() == 4  # the model's own sdpa mask, the window applied in it
    # A deep copy of a prepared model (an EMA copy) shares its modules' binding, and so its configs' too: the copy's
    # windowed layers still get their window (with a table keyed by the config's id the copy found none).
    assert _unmark(_sliding_mask(copy.deepcopy(sharded)))[1] == AttentionPattern(sliding_window=5)
    for name in names:
        unregister_model_attention(name)


def test_a_prepared_config_saves_prints_and_pickles_as_before():
    model = tiny_model("llama")
    prepared = prepare_hf_model(model, None)
    config = model.config
    name = config._attn_implementation
    assert type(name) is str and name == prepared.attention_name and name.startswith(f"{ULYSSES_ATTENTION}-")
    assert hf_masks.ALL_MASK_ATTENTION_FUNCTIONS[name].args[1] is binding_of(model)  # the mask function's binding
    assert "_attn_implementation" not in config.to_json_string() and "LlamaConfig" in repr(config)
    assert pickle.loads(pickle.dumps(config))._attn_implementation == name  # a plain name, no groups
    prepared.restore()
    assert config._attn_implementation == ULYSSES_ATTENTION  # the private copy names no binding
    assert name not in hf_masks.ALL_MASK_ATTENTION_FUNCTIONS and name not in ALL_ATTENTION_FUNCTIONS
    assert model.config._attn_implementation == "sdpa"


def _saved_and_loaded(value):
    """`value` through `torch.save` and `torch.load` with its default arguments (weights only)."""
    buffer = io.BytesIO()
    torch.save(value, buffer)
    buffer.seek(0)
    return torch.load(buffer)


def test_a_prepared_config_loads_with_torch_load_defaults():
    """A prepared config holds plain strings: a checkpoint holding its attention implementation, or the config itself
    (its class allowlisted, as an unprepared config needs), loads with `torch.load`'s weights-only defaults."""
    model = tiny_model("llama")
    prepared = prepare_hf_model(model, None)
    config = model.config
    saved = {"attn_implementation": config._attn_implementation, "config": config.to_dict()}
    assert _saved_and_loaded(saved) == saved
    with torch.serialization.safe_globals([type(config)]):
        loaded = _saved_and_loaded(config)
    assert loaded._attn_implementation == config._attn_implementation and loaded.to_dict() == config.to_dict()
    prepared.restore()


def test_no_str_subclass_in_the_package():
    """State travels in arguments and bindings, never smuggled inside a string (a `str` subclass in a config pickles
    as a call of `str`, which `torch.load`'s weights-only mode refuses)."""
    import ast
    import importlib
    import inspect
    import pkgutil
    from pathlib import Path

    import lightning_ulysses

    found = []
    for module_info in pkgutil.walk_packages(lightning_ulysses.__path__, "lightning_ulysses."):
        module = importlib.import_module(module_info.name)
        for name, value in vars(module).items():
            if inspect.isclass(value) and value.__module__ == module.__name__ and issubclass(value, str):
                found.append(f"{module.__name__}.{name}")
    # and classes defined inside functions, which no module lists: any class naming `str` among its bases
    for path in Path(lightning_ulysses.__file__).parent.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef) and any(ast.unparse(base) in {"str", "builtins.str"} for base in node.bases):
                found.append(f"{path}:{node.lineno}: {node.name}")
    assert not found, f"str subclasses in the package: {found}"
