"""Every private DeepSpeed name the package uses (`lightning_ulysses.fences._deepspeed_private`) still exists and behaves as
the accessor expects. A failure here means the installed DeepSpeed changed one: re-check the reason given in
`_deepspeed_private` and adapt the accessor (not its callers)."""

import functools
import importlib
import inspect
import warnings
from types import SimpleNamespace

import deepspeed
import pytest
import torch
from deepspeed.runtime.engine import DeepSpeedEngine
from deepspeed.runtime.zero import parameter_offload
from deepspeed.runtime.zero.partitioned_param_coordinator import PartitionedParameterCoordinator

from lightning_ulysses.fences import _deepspeed_private as private
from lightning_ulysses.integration import console


def test_checked_version_is_recorded():
    assert private.DEEPSPEED_CHECKED.count(".") == 2
    if deepspeed.__version__ != private.DEEPSPEED_CHECKED:
        warnings.warn(f"deepspeed {deepspeed.__version__} is installed; _deepspeed_private was checked against"
                      f" {private.DEEPSPEED_CHECKED}: the tests below say whether anything it uses changed.")


@pytest.mark.parametrize("module, path", private.FENCED, ids=[f"{m}:{p}" for m, p in private.FENCED])
def test_fenced_names_exist(module, path):
    owner = importlib.import_module(module)
    if path == "__compatible_ops__":  # a lazy module attribute (the module's `__getattr__`): read it quietly
        with console.quiet_compiler_probes():
            getattr(owner, path)
    for name in path.split("."):
        assert hasattr(owner, name), f"{module}.{path} is gone in deepspeed {deepspeed.__version__}"
        owner = getattr(owner, name)


def test_z3_leaf_mark_is_deepspeeds():
    from deepspeed.utils import set_z3_leaf_module, z3_leaf_module

    ours, theirs = torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)
    assert not private.is_z3_leaf(ours) and not z3_leaf_module(ours)
    private.mark_z3_leaf(ours)
    set_z3_leaf_module(theirs, True)
    assert z3_leaf_module(ours) and private.is_z3_leaf(theirs)


def test_registered_mpu(monkeypatch):
    from deepspeed.utils import groups

    monkeypatch.setattr(groups, "mpu", None)
    mpu = object()
    private.register_mpu(mpu)
    assert groups.mpu is mpu and private.registered_mpu() is mpu
    private.register_mpu(None)
    assert groups.mpu is None


def test_compatible_ops_is_what_the_shared_memory_build_reads():
    with console.quiet_compiler_probes():
        ops = private.compatible_ops()
    assert ops is deepspeed.ops.__compatible_ops__ and isinstance(ops, dict)
    deepspeed_torch_backend = importlib.import_module("deepspeed.comm.torch")  # (`deepspeed.comm.torch` is torch)
    assert "deepspeed.ops.__compatible_ops__" in inspect.getsource(deepspeed_torch_backend.build_shm_op)


def test_forward_module_stack(monkeypatch):
    one, other = torch.nn.Linear(1, 1), torch.nn.Linear(1, 1)
    monkeypatch.setattr(parameter_offload, "FWD_MODULE_STACK", [one, other, one])
    private.forget_forward_module(one)
    assert parameter_offload.FWD_MODULE_STACK == [other]
    # the global DeepSpeed's ZeRO-3 forward hooks push onto (not a copy bound elsewhere)
    source = inspect.getsource(parameter_offload.DeepSpeedZeRoOffload)
    assert "FWD_MODULE_STACK.append(" in source and "FWD_MODULE_STACK.pop()" in source


def test_params_to_release_cache_is_cleared(monkeypatch):
    """The `lru_cache` is found (directly, or in the closure of DeepSpeed's non-`wraps` wrapper) and cleared."""
    cached = PartitionedParameterCoordinator._PartitionedParameterCoordinator__params_to_release
    caches = [cached] if hasattr(cached, "cache_clear") else [
        cell.cell_contents for cell in cached.__closure__ or () if hasattr(cell.cell_contents, "cache_clear")]
    assert len(caches) == 1, "the lru_cache under __params_to_release is no longer where the accessor looks"
    assert isinstance(caches[0].cache_info(), functools._CacheInfo)
    cleared = []
    monkeypatch.setattr(caches[0], "cache_clear", lambda: cleared.append(True))
    private.clear_params_to_release_cache()
    assert cleared == [True]


def test_engine_hook_handles_are_the_engines():
    source = inspect.getsource(DeepSpeedEngine)
    for name in private.ENGINE_HOOK_HANDLES:
        assert f"self.{name} = " in source, f"DeepSpeedEngine no longer keeps {name}"
    removed = []
    handle = SimpleNamespace(remove=lambda: removed.append(1))
    engine = SimpleNamespace(module_forward_pre_hook=handle, module_forward_post_hook=handle, first_dataloader_check=None)
    private.remove_engine_hooks(engine)
    assert removed == [1, 1]


def test_consolidated_state_dict():
    method = DeepSpeedEngine._zero3_consolidated_16bit_state_dict
    assert tuple(inspect.signature(method).parameters) == ("self", "exclude_frozen_parameters")
    assert "_zero3_consolidated_16bit_state_dict(" in inspect.getsource(DeepSpeedEngine.save_16bit_model)
    engine = SimpleNamespace(_zero3_consolidated_16bit_state_dict=lambda: {"w": 1})
    assert private.consolidated_16bit_state_dict(engine) == {"w": 1}
