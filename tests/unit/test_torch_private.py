"""Every private torch name the package uses (`lightning_ulysses.fences._torch_private`) still exists and behaves as
the accessor expects. A failure here means the installed torch changed one: re-check the reason given in
`_torch_private` and adapt the accessor (not its callers)."""

import importlib

import pytest
import torch

from lightning_ulysses.fences import _torch_private as private
from tests.unit.fence_checks import check_attribute_path, check_recorded_version


def test_checked_version_is_recorded():
    check_recorded_version("torch", torch.__version__, private.TORCH_CHECKED, "_torch_private")


@pytest.mark.parametrize("module, path", private.FENCED, ids=[f"{m}:{p}" for m, p in private.FENCED])
def test_fenced_names_exist(module, path):
    owner = torch.ops.aten if module == "torch.ops.aten" else importlib.import_module(module)
    check_attribute_path(owner, path, f"{module} (torch {torch.__version__})")


def test_the_sdp_priority_order_round_trips():
    assert private.has_sdp_priority_order()
    order = private.sdp_priority_order()
    private.set_sdp_priority_order(list(reversed(order)))
    try:
        assert private.sdp_priority_order() == list(reversed(order))
    finally:
        private.set_sdp_priority_order(order)
    assert private.sdp_priority_order() == order


def test_tensor_and_autograd_internals():
    tensor = torch.zeros(3)
    version = private.version_counter(tensor)
    tensor.add_(1)
    assert private.version_counter(tensor) == version + 1

    class Twice(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return 2 * x

        @staticmethod
        def backward(ctx, grad):
            return 2 * grad

    x = torch.ones(2, requires_grad=True)
    assert private.forward_class_of(Twice.apply(x).grad_fn) is Twice
    assert private.forward_class_of((x * 2).grad_fn) is None
    saved = private.saved_values_of((x * x).grad_fn)  # MulBackward0 keeps both factors
    assert sum(torch.is_tensor(value) for value in saved) == 2
    assert [argument.name for argument in private.op_schema(torch.ops.aten.mm.default).arguments] == ["self", "mat2"]


def test_a_bare_module_copy():
    module = torch.nn.Sequential(torch.nn.Linear(2, 2))
    module.register_buffer("scale", torch.ones(1))
    module.register_forward_hook(lambda *args: None)
    copy = private.bare_copy(module)
    assert type(copy) is type(module) and not copy._forward_hooks
    assert private.parameter_table(copy) is not private.parameter_table(module)
    assert private.child_table(copy) == private.child_table(module) and private.child_table(copy) is not module._modules
    assert private.buffer_table(copy)["scale"] is module.scale and private.buffer_table(copy) is not module._buffers
    assert isinstance(torch.nn.BatchNorm1d(2), private.NormBase)


def test_fork_and_compile_backend_queries():
    assert private.in_bad_fork() is False
    private.lookup_compile_backend("eager")
    with pytest.raises(Exception):
        private.lookup_compile_backend("no-such-backend")
