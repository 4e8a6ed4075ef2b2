"""One place per family: a model family's knowledge is its module in lightning_ulysses/families/ (one `Family`
record, registered in `adapters.registry`), and the layers read the registry.

Read from the source (AST, as test_layers.py does): outside `families/`, no module compares a `model_type` with a
family's name, keys a table by model types or lists them, or names a family's classes (a class name starting with
the name of a model family transformers maps, like `FalconAttention`, or a registered token-mixer fragment used as
a pattern). And the
registry holds what the layers used to branch on, so that a family left out of `families/__init__.py` is noticed.
"""

from __future__ import annotations

import ast
import re

import pytest
from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES, MODEL_MAPPING_NAMES

from lightning_ulysses.adapters import registry
from lightning_ulysses.mixers import gated_deltanet, kimi_delta, lightning_attention, mamba, mamba2, rg_lru, short_conv
from tests.distributed.families import family_model
from tests.unit.test_layers import MODULES, PACKAGE, SOURCE, layer_of

FAMILIES = "families"
MODEL_TYPES = frozenset(CONFIG_MAPPING_NAMES)


def _class_prefixes() -> list[str]:
    """The family part of every model class transformers maps (`Falcon` of `FalconForCausalLM`), longest first."""
    prefixes = set()
    for mapping in (MODEL_FOR_CAUSAL_LM_MAPPING_NAMES, MODEL_MAPPING_NAMES):
        for names in mapping.values():
            for name in (names if isinstance(names, (tuple, list)) else (names,)):
                match = re.fullmatch(r"(\w+?)(ForCausalLM|LMHeadModel|Model)", name)
                if match:
                    prefixes.add(match.group(1))
    return sorted(prefixes, key=len, reverse=True)


# a family's class name: a mapped family's name followed by more of a class name (`FalconAttention`, `Gemma3RMSNorm`)
CLASS_NAME = re.compile(r"(?<![A-Za-z0-9])(?:%s)(?=[A-Z0-9])\w*" % "|".join(map(re.escape, _class_prefixes())))


def _strings(node: ast.AST) -> list[str]:
    """The string constants in an expression (a set, tuple, list or `frozenset({...})` of them included)."""
    return [child.value for child in ast.walk(node) if isinstance(child, ast.Constant) and isinstance(child.value, str)]


def _mentions_model_type(node: ast.AST) -> bool:
    return any(isinstance(child, ast.Name) and child.id == "model_type"
               or isinstance(child, ast.Attribute) and child.attr == "model_type"
               or isinstance(child, ast.Constant) and child.value == "model_type" for child in ast.walk(node))


def family_knowledge_outside_families(modules: dict[str, object]) -> list[str]:
    """`file:line: what` for every family-specific branch or name in the modules outside `families/`. The fences
    are exempt: a private transformers name pinned there (`BloomAttention._reshape`) names its class, and the family
    module is the one that reads it."""
    fragments = {name for family in registry.families() for name in family.token_mixer_names}
    found = []
    for module, path in sorted(modules.items()):
        if layer_of(module) in (FAMILIES, "fences"):
            continue
        tree = ast.parse(path.read_text())
        where = path.relative_to(SOURCE.parent) if path.is_relative_to(SOURCE.parent) else path
        docstrings = {id(node.body[0].value) for node in ast.walk(tree)
                      if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
                      and node.body and isinstance(node.body[0], ast.Expr)
                      and isinstance(node.body[0].value, ast.Constant)}
        for node in ast.walk(tree):
            if isinstance(node, ast.Compare) and _mentions_model_type(node):
                named = [value for value in _strings(node) if value in MODEL_TYPES]
                if named:
                    found.append(f"{where}:{node.lineno}: a model_type compared with {named}")
            elif isinstance(node, (ast.Set, ast.Tuple, ast.List)) and node.elts and all(
                    isinstance(element, ast.Constant) and element.value in MODEL_TYPES for element in node.elts):
                found.append(f"{where}:{node.lineno}: a set of model types {_strings(node)}")
            elif isinstance(node, ast.Dict):
                keys = [key.value for key in node.keys if isinstance(key, ast.Constant) and key.value in MODEL_TYPES]
                if keys:
                    found.append(f"{where}:{node.lineno}: a table keyed by model types {keys}")
            elif isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings:
                names = CLASS_NAME.findall(node.value)
                pieces = set(node.value.split("|")) & fragments
                if names or pieces:
                    found.append(f"{where}:{node.lineno}: a family's class names {sorted({*names, *pieces})}")
    return found


def test_no_family_knowledge_outside_the_family_modules():
    found = family_knowledge_outside_families(MODULES)
    assert not found, ("declare it in the family's module (lightning_ulysses/families/, docs/adding-a-family.md) and"
                       " read it through adapters.registry:\n" + "\n".join(found))


@pytest.mark.parametrize("planted", [
    'def f(config):\n    return config.model_type == "qwen3_next"\n',
    'def f(config):\n    return getattr(config, "model_type", None) in ("bloom", "mpt")\n',
    'LAYERS = {"nemotron_h": 1}\n',
    'ENCODERS = frozenset({"bert-generation", "xlnet"})\n',
    'def f(module):\n    return type(module).__name__ in ("FalconAttention", "FalconFlashAttention2")\n',
    'import re\nNAMES = re.compile(r"Mamba|DeltaNet")\n',
])
def test_a_family_branch_outside_the_family_modules_is_found(tmp_path, planted):
    """The check above is not vacuous: each way a layer used to name a family is found in a planted module, and the
    same text in a family module is not."""
    docstring = '"""FalconAttention, model_type == "bloom": a docstring is prose."""'
    (tmp_path / "planted.py").write_text(f"{docstring}\n{planted}")
    found = family_knowledge_outside_families({f"{PACKAGE}.hf.planted": tmp_path / "planted.py"})
    path = tmp_path / "planted.py"
    assert found and all(line.startswith(f"{path}:") and not line.startswith(f"{path}:1:") for line in found), found
    assert family_knowledge_outside_families({f"{PACKAGE}.{FAMILIES}.planted": tmp_path / "planted.py"}) == []


def test_the_registry_holds_what_the_layers_read():
    """What the layers used to branch on themselves is declared by the families: their inline attention, query
    correction and position rule, the planner's hybrids, the mixer kinds, the token-mixer names, the refusals."""
    by_type = {model_type: family for family in registry.families() for model_type in family.model_types}
    assert {name for name, family in by_type.items() if family.inline_attention} == {
        "bloom", "mpt", "falcon", "gpt_neo", "xglm"}
    assert by_type["llama4_text"].query_adjustment is not None and by_type["opt"].position_rule is not None
    assert {name for name, family in by_type.items() if family.planner_layers} == {"qwen3_next", "nemotron_h"}
    assert set(registry.token_mixer_kinds()) == {gated_deltanet, short_conv, mamba2, mamba, kimi_delta,
                                                 lightning_attention, rg_lru}
    pattern = registry.token_mixer_names()
    for name in ("MambaMixer", "BambaMixer", "Qwen3NextGatedDeltaNet", "KimiLinearDeltaAttention", "Lfm2ShortConv",
                 "MiniMaxLightningAttention", "RecurrentGemmaRglru", "RecurrentGemmaRecurrentBlock", "RwkvBlock",
                 "xLSTMBlock", "mLSTMLayer"):
        assert pattern.search(name), name
    assert not pattern.search("LlamaAttention")
    assert registry.attention_the_exchange_cannot_carry("DogeAttention")
    assert registry.attention_the_exchange_cannot_carry("DoryAttention")
    assert registry.attention_the_exchange_cannot_carry("LlamaAttention") is None
    assert registry.encoder_model_types() == {"bert-generation", "trocr", "xlnet"}
    assert registry.family_of(type("Config", (), {"model_type": "llama"})()) is None


def test_a_family_registers_once():
    with pytest.raises(ValueError, match="registered twice"):
        registry.register(registry.Family(name="another_bloom", model_types=frozenset({"bloom"})))
    assert "another_bloom" not in {family.name for family in registry.families()}


# One family of each mixer kind, and the variants a kind tells apart by structure (Qwen3.5's and OLMo-hybrid's
# Gated DeltaNet, Falcon-H1's Mamba2, Jamba's Mamba, Bailing-hybrid's KDA).
ONE_OF_EACH_KIND = ("qwen3_next", "qwen3_5_text", "olmo_hybrid", "lfm2", "mamba2", "falcon_h1", "mamba", "jamba",
                    "kimi_linear", "bailing_hybrid", "minimax", "recurrent_gemma")


@pytest.mark.parametrize("name", ONE_OF_EACH_KIND)
def test_no_module_is_taken_by_two_mixer_kinds(name):
    """The kinds are tried in the order the families first declare them (`registry.token_mixer_kinds`): that order
    must not matter, so each mixer is recognised by one kind alone."""
    kinds = registry.token_mixer_kinds()
    taken = {path: [kind.__name__ for kind in kinds if kind.matches(module)]
             for path, module in family_model(name).named_modules()}
    assert any(taken.values()), (name, "no mixer recognised")
    assert all(len(names) <= 1 for names in taken.values()), {path: names for path, names in taken.items()
                                                              if len(names) > 1}
