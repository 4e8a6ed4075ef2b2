"""The package's layers are its folders, read from its source (AST, nothing imported): every `import` /
`from ... import` anywhere in a module counts — at the top, inside functions, under `if TYPE_CHECKING:` — since an
import hidden in a function is the same dependency, only found later.

Every module lives in a folder directly under the package, and each folder is one layer; a module may import its own
folder and the folders below it (`LAYERS`, lowest first), never one above:
- `fences/`: each third-party library's private names, behind one accessor each (`_lightning_private`,
  `_deepspeed_private`); they import nothing from the package, so every layer may use them (the memory engine and
  the mixers mark ZeRO-3 leaves through `_deepspeed_private`).
- `parallel/`: the layout, groups and shard order; the run's description (`RunSpec`).
- `adapters/`: the registry of per-family knowledge (`Family` records, which every layer above reads);
  `NativeCausalLM`, how a model that is not Hugging Face's tells the core what it needs.
- `attention/`: the exchanges, the attention core and backends, the batch's rows.
- `mixers/`: token mixers that are not attention, on the exchanges of `attention/`.
- `hf/`: the transformers switch, which prepares both attention and mixers.
- `training/`: the whole sequence's loss, MoE losses, metrics, optimizer setup.
- `batch/`: the batch's cut (it pads labels with the loss's ignore index) and the same-batch check.
- `data/`: data modules and packing.
- `memory/`: the memory engine (its fused logits loss is `training/`'s).
- `planning/`: the memory planner, the step-time model and its calibration, `memory="auto"`, preflight, `plan`.
- `families/`: one module per model family, each declaring its `Family` into the registry (`adapters/`). Above the
  layers whose mechanisms they declare (mixer kinds, the planner's cost parts); nothing but the package's `__init__`
  imports them (`test_only_the_package_imports_the_family_modules`).
- `integration/`: Lightning and DeepSpeed glue: the strategy, the module preparation, the engine, checkpoints and
  export, faults, RNG streams, the notebook launcher, callbacks, the console, serving.
- `recipe/`: the Hydra recipes' side: their driver, resolvers, end-of-run summary, `example-finetune`.
- the package's own `__init__.py` and `__main__.py` (`package`): the public names and the command lines.
- `models/`: examples, written against the package as a user would; nothing in the package imports them (the core
  finds a native model through `adapters.native_model.NativeCausalLM`).
The recipes (`recipes/`, `conf/`) are outside the package, above all of it.

And no import cycle between the package's modules, and no private name of torch, transformers, DeepSpeed or Lightning
outside `fences/` (the rule: above `test_private_library_names_only_in_the_fences`).
"""

from __future__ import annotations

import ast
import functools
import textwrap
from pathlib import Path

PACKAGE = "lightning_ulysses"
SOURCE = Path(__file__).resolve().parents[2] / PACKAGE

LAYERS = ("fences", "parallel", "adapters", "attention", "mixers", "hf", "training", "batch", "data", "memory",
          "planning", "families", "integration", "recipe", "package", "models")
ROOT_MODULES = {"__init__", "__main__"}  # the `package` layer: nothing else sits beside the folders
FENCES = "fences"


def _modules() -> dict[str, Path]:
    """Dotted module name (`lightning_ulysses.memory` for `memory/__init__.py`) → file."""
    found = {}
    for path in SOURCE.rglob("*.py"):
        parts = list(path.relative_to(SOURCE.parent).with_suffix("").parts)
        if parts[-1] == "__init__" and len(parts) > 1:
            parts = parts[:-1]
        found[".".join(parts)] = path
    return found


MODULES = _modules()


def layer_of(module: str) -> str:
    """The folder `module` lives in (its first part under the package); `package` for the package's own files."""
    parts = module.split(".")[1:]
    return "package" if not parts or parts[0] in ROOT_MODULES else parts[0]


def _resolve(name: str) -> str | None:
    """The package module `name` (a module, or a name inside one) loads: the longest existing prefix."""
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name or None


def imports_of(module: str) -> list[tuple[int, str]]:
    """(line, package module) for every import of a package module anywhere in `module`."""
    path = MODULES[module]
    tree = ast.parse(path.read_text(), filename=str(path))
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = ".".join(package.split(".")[:len(package.split(".")) - node.level + 1])
                base = f"{base}.{node.module}" if node.module else base
            else:
                base = node.module or ""
            # `from package import submodule` loads the submodule; `from module import name` loads the module
            names = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in MODULES else base for alias in node.names]
        else:
            continue
        for name in names:
            if name == PACKAGE or name.startswith(f"{PACKAGE}."):
                target = _resolve(name)
                if target is not None and target != module:
                    found.append((node.lineno, target))
    return found


def function_level_imports() -> list[tuple[str, int, str]]:
    """Package imports that are not at a module's top level (inside a function or class body)."""
    found = []
    for module, path in MODULES.items():
        tree = ast.parse(path.read_text())
        top = set()
        stack = list(tree.body)
        while stack:  # module level, also under a top-level `if` / `try`
            node = stack.pop()
            top.add(id(node))
            if isinstance(node, (ast.If, ast.Try)):
                stack += node.body + node.orelse + getattr(node, "finalbody", [])
                stack += [child for handler in getattr(node, "handlers", []) for child in handler.body]
        lines = {line for line, _ in imports_of(module)}
        for node in ast.walk(tree):
            if isinstance(node, (ast.Import, ast.ImportFrom)) and id(node) not in top and node.lineno in lines:
                found.append((module, node.lineno, ast.unparse(node)))
    return found


def _cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan's algorithm, iterative)."""
    index, low, on_stack, stack, components, counter = {}, {}, set(), [], [], 0
    for start in sorted(edges):
        if start in index:
            continue
        work = [(start, iter(sorted(edges[start])))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            node, successors = work[-1]
            for successor in successors:
                if successor not in index:
                    index[successor] = low[successor] = counter
                    counter += 1
                    stack.append(successor)
                    on_stack.add(successor)
                    work.append((successor, iter(sorted(edges.get(successor, ())))))
                    break
                if successor in on_stack:
                    low[node] = min(low[node], index[successor])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        components.append(sorted(component))
    return components


def test_the_analysis_sees_every_kind_of_import():
    """The reader of imports, on a module of its own: relative, function-level and TYPE_CHECKING imports count."""
    assert "lightning_ulysses.memory" in MODULES and "lightning_ulysses.memory.tiled_mlp" in MODULES
    targets = {target for _, target in imports_of("lightning_ulysses.memory")}
    assert {"lightning_ulysses.memory.tiled_mlp", "lightning_ulysses.fences._deepspeed_private"} <= targets
    assert layer_of("lightning_ulysses") == "package" and layer_of("lightning_ulysses.__main__") == "package"
    assert layer_of("lightning_ulysses.models.gpt") == "models" and layer_of("lightning_ulysses.models") == "models"
    assert layer_of("lightning_ulysses.attention.core") == "attention"
    assert layer_of("lightning_ulysses.fences._deepspeed_private") == "fences"
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def test_every_folder_is_a_layer():
    """A new folder is placed among the layers here (and in the README's layout), and no module sits in the package's
    root beside the folders: where a module lives says which layer it is."""
    folders = {path.name for path in SOURCE.iterdir() if (path / "__init__.py").is_file()}
    assert folders == set(LAYERS) - {"package"}, (
        f"folders not in LAYERS: {sorted(folders - set(LAYERS))}; LAYERS without a folder: "
        f"{sorted(set(LAYERS) - {'package'} - folders)}")
    loose = {path.stem for path in SOURCE.glob("*.py")} - ROOT_MODULES
    assert not loose, f"modules in the package's root (move them into the folder of their layer): {sorted(loose)}"
    assert all(module.split(".")[1] in set(LAYERS) | ROOT_MODULES for module in MODULES if module != PACKAGE)


def upward_imports() -> list[str]:
    """Every import of a module of a higher layer, as `file:line: layer module imports layer module`."""
    wrong = []
    for module in sorted(MODULES):
        rank, path = LAYERS.index(layer_of(module)), MODULES[module]
        where = path.relative_to(SOURCE.parent) if path.is_relative_to(SOURCE.parent) else path
        for line, target in imports_of(module):
            if LAYERS.index(layer_of(target)) > rank:
                wrong.append(f"{where}:{line}: {layer_of(module)} {module} imports {layer_of(target)} {target}")
    return wrong


def test_no_layer_imports_a_higher_one():
    wrong = upward_imports()
    assert not wrong, "imports against the layers (see test_layers.py's docstring):\n" + "\n".join(wrong)


def test_an_upward_import_is_found(tmp_path, monkeypatch):
    """The check above is not vacuous: a `parallel/` module importing the strategy (inside a function) is found, and
    a `batch/` module importing a lower folder is not."""
    (tmp_path / "up.py").write_text("def f():\n    from lightning_ulysses.integration import strategy\n")
    (tmp_path / "down.py").write_text("from lightning_ulysses.parallel.layout import ShardOrder\n")
    monkeypatch.setitem(MODULES, f"{PACKAGE}.parallel.planted_upward", tmp_path / "up.py")
    monkeypatch.setitem(MODULES, f"{PACKAGE}.batch.planted_downward", tmp_path / "down.py")
    found = [line for line in upward_imports() if "planted" in line]
    assert found == [f"{tmp_path / 'up.py'}:2: parallel {PACKAGE}.parallel.planted_upward imports integration"
                     f" {PACKAGE}.integration.strategy"]


def test_only_the_package_imports_the_family_modules():
    """The layers read a family through the registry (`adapters.registry`), never its module: a family's knowledge
    has one place, and the layers below `families/` could not import it anyway. Only the package's `__init__` (which
    registers them all) and `families/` itself import them."""
    found = [f"{module}:{line}: imports {target}" for module in sorted(MODULES) for line, target in imports_of(module)
             if layer_of(target) == "families" and module != PACKAGE and layer_of(module) != "families"]
    assert not found, "import the registry (lightning_ulysses.adapters) instead:\n" + "\n".join(found)
    assert any(layer_of(target) == "families" for _, target in imports_of(PACKAGE))


def test_fences_import_nothing_from_the_package():
    fences = [module for module in MODULES if layer_of(module) == FENCES]
    assert f"{PACKAGE}.fences._lightning_private" in fences and f"{PACKAGE}.fences._deepspeed_private" in fences
    for module in fences:
        assert imports_of(module) == [], module


def test_no_import_cycle():
    edges = {module: {target for _, target in imports_of(module)} for module in MODULES}
    cycles = _cycles(edges)
    assert not cycles, f"import cycles between the package's modules: {cycles}"


# -- DeepSpeed's private names stay in their fence ------------------------------------------------------------------
FENCE = f"{PACKAGE}.fences._deepspeed_private"
# Attribute names and string constants (a `getattr` spelling) private to DeepSpeed, and its modules whose only use
# to us is a private global. Read against `_deepspeed_private.FENCED` below, so that a new fenced name is added here.
PRIVATE_DEEPSPEED_NAMES = {"_z3_leaf", "mpu", "__compatible_ops__", "FWD_MODULE_STACK", "__params_to_release",
                           "_PartitionedParameterCoordinator__params_to_release",
                           "_zero3_consolidated_16bit_state_dict", "module_forward_pre_hook",
                           "module_forward_post_hook", "first_dataloader_check"}
PRIVATE_DEEPSPEED_MODULES = {"deepspeed.utils.groups", "deepspeed.runtime.zero.parameter_offload",
                             "deepspeed.runtime.zero.partitioned_param_coordinator"}
# `mpu` is also DeepSpeed's public keyword (`deepspeed.initialize(mpu=...)`) and our own name: only its module counts.
NAMES_CHECKED_BY_MODULE = {"mpu"}


def _fenced_literal() -> tuple[tuple[str, str], ...]:
    tree = ast.parse(MODULES[FENCE].read_text())
    for node in tree.body:
        if isinstance(node, ast.AnnAssign) and getattr(node.target, "id", None) == "FENCED":
            return ast.literal_eval(node.value)
    raise AssertionError("_deepspeed_private.FENCED not found")


def test_the_list_here_covers_the_fence():
    for module, path in _fenced_literal():
        last = path.rpartition(".")[2]
        assert (last in PRIVATE_DEEPSPEED_NAMES or module in PRIVATE_DEEPSPEED_MODULES
                or module == "deepspeed.utils.z3_leaf_module"), (module, path)  # that one: the `_z3_leaf` mark


def test_private_deepspeed_names_only_in_their_fence():
    found = []
    for module, path in sorted(MODULES.items()):
        if module == FENCE:
            continue
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            names = []
            if isinstance(node, ast.Attribute):
                names = [node.attr]
            elif isinstance(node, ast.Name):
                names = [node.id]
            elif isinstance(node, ast.Constant) and isinstance(node.value, str):
                names = [node.value]
            elif isinstance(node, ast.Import):
                names = [f"module:{alias.name}" for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                names = [f"module:{node.module}.{alias.name}" for alias in node.names] + [f"module:{node.module}"]
                names += list({alias.name for alias in node.names} & PRIVATE_DEEPSPEED_NAMES)
            for name in names:
                private = (name.removeprefix("module:") in PRIVATE_DEEPSPEED_MODULES if name.startswith("module:")
                           else name in PRIVATE_DEEPSPEED_NAMES - NAMES_CHECKED_BY_MODULE)
                if private:
                    found.append(f"{path.relative_to(SOURCE.parent)}:{node.lineno}: {name}")
    assert not found, "private DeepSpeed names outside _deepspeed_private (add an accessor there):\n" + "\n".join(found)


# -- every private name of torch / transformers / DeepSpeed / Lightning stays in the fences --------------------------
# The rule, read from the source (AST) of every module outside `fences/`:
# 1. an import from those libraries of a private module or name (`import torch._dynamo`,
#    `from torch.distributed import _symmetric_memory`, `from lightning... import _update_dataloader`);
# 2. any `obj._name` attribute (one leading underscore or a name-mangled one; dunders are Python's), on whatever
#    object: an attribute chain rooted at a library (`torch._C._set_sdp_priority_order`) and an attribute of an object
#    a library hands us (`config._attn_implementation_internal`, `module._parameters`) alike, since which library an
#    object comes from cannot be read from the source;
# 3. any string spelling such a name (the `getattr` / `__dict__` spelling: `model.__dict__.pop("_loss_function")`).
# A name is exempt only when the package itself defines it (a class, function, module or class-level name, an
# attribute it assigns on `self`/`cls`, one it sets with `setattr(self, ...)`, or any name starting with
# `_lightning_ulysses`) and no class of those libraries that the package's objects derive from, nor their core classes
# (`CORE_CLASSES`), has an attribute of that name; or when it is another library's (`OTHER_LIBRARIES`, each with
# its owner). What the rule cannot see: a private library name we also define ourselves that none of those classes
# carries (a rename away), and DeepSpeed's dunder-spelled private (`__compatible_ops__`), which the DeepSpeed test
# above lists by name.
PRIVATE_LIBRARIES = {"torch", "transformers", "deepspeed", "lightning", "pytorch_lightning", "lightning_fabric"}
OWN_PREFIX = "_lightning_ulysses"
# Private spellings of other libraries and of Python itself, each its owner's public API or outside the four.
OTHER_LIBRARIES = {
    "_exit": "os._exit: Python's documented exit without cleanup",
    "_fields": "namedtuple's documented field names",
    "_target_": "Hydra's documented instantiation key",
    "_flash_attn_fwd": "flash-attn's CuTe interface (flash_attn.cute.interface), not one of the four libraries",
    "_flash_attn_bwd": "flash-attn's CuTe interface (flash_attn.cute.interface), not one of the four libraries",
}


def _is_private(name: str) -> bool:
    return name.startswith("_") and name != "_" and not (name.startswith("__") and name.endswith("__")) \
        and name.replace("_", "a").isidentifier()


def _outside_fences() -> dict[str, Path]:
    return {module: path for module, path in MODULES.items() if layer_of(module) != FENCES}


@functools.cache
def _own_private_names() -> frozenset[str]:
    """Private names the package itself defines, outside the fences (see the rule above)."""
    own = set()
    for path in _outside_fences().values():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                own.add(node.name)
            body = node.body if isinstance(node, (ast.Module, ast.ClassDef)) else []
            for statement in body:
                targets = statement.targets if isinstance(statement, ast.Assign) else \
                    [statement.target] if isinstance(statement, ast.AnnAssign) else []
                own.update(target.id for target in targets if isinstance(target, ast.Name))
            if isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
                for target in node.targets if isinstance(node, ast.Assign) else [node.target]:
                    own.update(part.attr for part in ast.walk(target) if isinstance(part, ast.Attribute)
                               and isinstance(part.value, ast.Name) and part.value.id in ("self", "cls"))
            if isinstance(node, ast.Call) and ast.unparse(node.func) in ("setattr", "object.__setattr__") \
                    and len(node.args) >= 2 and ast.unparse(node.args[0]) == "self" \
                    and isinstance(node.args[1], ast.Constant) and isinstance(node.args[1].value, str):
                own.add(node.args[1].value)
    return frozenset(name for name in own if _is_private(name))


@functools.cache
def _library_names() -> frozenset[str]:
    """Private attribute names of the libraries' classes the package's objects derive from, and of their core
    classes: a name there is the library's even where the package also defines it."""
    import importlib
    import inspect

    import torch
    from lightning.pytorch import LightningModule, Trainer
    from lightning.pytorch.strategies import Strategy
    from transformers import PreTrainedConfig, PreTrainedModel

    classes = {torch.Tensor, torch.nn.Module, torch.nn.Parameter, torch.autograd.Function, PreTrainedModel,
               PreTrainedConfig, LightningModule, Trainer, Strategy}
    for module in MODULES:
        if layer_of(module) == FENCES:
            continue
        for value in vars(importlib.import_module(module)).values():
            if inspect.isclass(value) and value.__module__.startswith(f"{PACKAGE}."):
                classes.update(base for base in value.__mro__
                               if base.__module__.split(".")[0] in PRIVATE_LIBRARIES)
    classes = {base for cls in classes for base in cls.__mro__ if base.__module__.split(".")[0] in PRIVATE_LIBRARIES}
    names = {name for cls in classes for name in dir(cls) if _is_private(name)}
    for cls in classes:  # and the attributes their methods set on instances (`nn.Module._parameters`, ...)
        try:
            source = textwrap.dedent(inspect.getsource(cls))
        except (OSError, TypeError):  # built in C
            continue
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store) \
                    and isinstance(node.value, ast.Name) and node.value.id == "self" and _is_private(node.attr):
                names.add(node.attr)
            elif isinstance(node, ast.Call) and ast.unparse(node.func).endswith("__setattr__") and node.args \
                    and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str):
                names.add(node.args[0].value)  # `super().__setattr__("_parameters", {})`
    return frozenset(names)


def private_library_names(modules: dict[str, Path] | None = None) -> list[str]:
    """Every use outside the fences the rule above flags, as `file:line: what`."""
    exempt = (_own_private_names() - _library_names()) | set(OTHER_LIBRARIES)
    found = []
    for module, path in sorted((modules or _outside_fences()).items()):
        where = path.relative_to(SOURCE.parent) if path.is_relative_to(SOURCE.parent) else path
        for node in sorted(ast.walk(ast.parse(path.read_text())), key=lambda node: getattr(node, "lineno", 0)):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names if alias.name.split(".")[0] in PRIVATE_LIBRARIES
                         and any(_is_private(part) for part in alias.name.split("."))]
                found += [f"{where}:{node.lineno}: import {name}" for name in names]
            elif isinstance(node, ast.ImportFrom) and not node.level and node.module \
                    and node.module.split(".")[0] in PRIVATE_LIBRARIES:
                if any(_is_private(part) for part in node.module.split(".")) \
                        or any(_is_private(alias.name) for alias in node.names):
                    found.append(f"{where}:{node.lineno}: {ast.unparse(node)}")
            elif isinstance(node, ast.Attribute) and _is_private(node.attr) and node.attr not in exempt \
                    and not node.attr.startswith(OWN_PREFIX):
                found.append(f"{where}:{node.lineno}: {ast.unparse(node)}")
            elif isinstance(node, ast.Constant) and isinstance(node.value, str) and _is_private(node.value) \
                    and node.value not in exempt and not node.value.startswith(OWN_PREFIX):
                found.append(f"{where}:{node.lineno}: {node.value!r}")
    return found


def test_private_library_names_only_in_the_fences():
    found = private_library_names()
    assert not found, ("private torch / transformers / DeepSpeed / Lightning names outside fences/ (add an accessor"
                       " there, pinned to the version it was checked on):\n" + "\n".join(found))


def test_a_private_library_name_is_found(tmp_path):
    """The check above is not vacuous: each form is found in a planted module, and the package's own private
    names (and a library name the package also defines) are told apart."""
    planted = tmp_path / "planted.py"
    planted.write_text(
        "import torch\n"
        "import torch._dynamo\n"
        "from torch.distributed import _symmetric_memory\n"
        "from torch.cuda._pin_memory_utils import pin_memory\n"
        "from lightning.pytorch.utilities.data import _update_dataloader\n"
        "torch._C._set_sdp_priority_order([])\n"
        "def f(config, module, model, lightning_module):\n"
        "    config._attn_implementation_internal = 'sdpa'\n"
        "    model.__dict__.pop('_loss_function', None)\n"
        "    module._parameters.clear()\n"
        "    lightning_module._device_mesh = None\n"
        "    return model._lightning_ulysses, model.__dict__, module._BINDING_ATTRIBUTE\n")
    found = private_library_names({f"{PACKAGE}.attention.planted": planted})
    assert [line.partition(": ")[2] for line in found] == [
        "import torch._dynamo", "from torch.distributed import _symmetric_memory",
        "from torch.cuda._pin_memory_utils import pin_memory",
        "from lightning.pytorch.utilities.data import _update_dataloader",
        "torch._C._set_sdp_priority_order", "torch._C", "config._attn_implementation_internal", "'_loss_function'",
        "module._parameters", "lightning_module._device_mesh"], found
    assert "_BINDING_ATTRIBUTE" in _own_private_names() and "_buffers" in _library_names()


def test_no_function_level_imports_of_the_package():
    """A package module imported inside a function is the same dependency as one at the top (the tests above count
    it), only hidden until it runs; and it saves nothing at import time, since the package's `__init__` loads the
    strategy and with it nearly every module. Third-party imports inside functions (transformers, peft, DeepSpeed)
    are not counted: those do defer a cost."""
    found = function_level_imports()
    assert not found, "import these at the top of the module:\n" + "\n".join(
        f"  {module}:{line}: {text}" for module, line, text in found)


def test_function_level_imports_are_found(tmp_path, monkeypatch):
    """The count above is not vacuous: an import inside a function of a package module is found."""
    module = tmp_path / "lazy.py"
    module.write_text("def f():\n    from lightning_ulysses.training.loss import IGNORE_INDEX\n"
                      "    return IGNORE_INDEX\n")
    monkeypatch.setitem(MODULES, f"{PACKAGE}.lazy", module)
    found = [entry for entry in function_level_imports() if entry[0] == f"{PACKAGE}.lazy"]
    assert found == [(f"{PACKAGE}.lazy", 2, "from lightning_ulysses.training.loss import IGNORE_INDEX")]


def test_the_modules_users_import_by_their_short_names_still_import():
    # the README's API table names these by their short paths; their modules moved into the layers' folders
    import importlib

    for short, layered in (("metrics", "training.metrics"), ("optim", "training.optim"),
                           ("inference", "integration.inference"), ("planner", "planning.planner"),
                           ("callbacks", "integration.callbacks")):
        assert importlib.import_module(f"{PACKAGE}.{short}") is importlib.import_module(f"{PACKAGE}.{layered}")
