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

And no import cycle between the package's modules, and no private DeepSpeed name outside its fence.
"""

from __future__ import annotations

import ast
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
