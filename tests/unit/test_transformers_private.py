"""The private transformers names of `lightning_ulysses.fences._transformers_private` that the switch to Ulysses
attention, the adapters, the memory engine and the export read still exist and behave as the accessors expect
(those of `from_pretrained`'s loading: test_pretrained.py). A failure here means the installed transformers changed
one: re-check the reason given in the fence and adapt the accessor (not its callers)."""

import importlib

import pytest
import transformers
from transformers import AttentionInterface
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from lightning_ulysses.fences import _transformers_private as private
from tests.distributed.families import tiny_model
from tests.unit.fence_checks import check_attribute_path, check_recorded_version


def test_checked_version_is_recorded():
    check_recorded_version("transformers", transformers.__version__, private.TRANSFORMERS_CHECKED, "_transformers_private")


@pytest.mark.parametrize("module, path", private.FENCED, ids=[f"{m}:{p}" for m, p in private.FENCED])
def test_fenced_names_exist(module, path):
    owner = importlib.import_module(module)
    check_attribute_path(owner, path, f"{module} (transformers {transformers.__version__})")


def test_one_configs_attention_and_a_registered_name():
    model = tiny_model("llama")
    config = model.config
    assert private.attention_implementation(config) == "sdpa" and private.attention_implementation(None, "x") == "x"
    assert private.can_set_attention_implementation(type(model))
    AttentionInterface.register("fence-probe", ALL_ATTENTION_FUNCTIONS["sdpa"])
    AttentionMaskInterface.register("fence-probe", ALL_MASK_ATTENTION_FUNCTIONS["sdpa"])
    model.set_attn_implementation("fence-probe")
    private.set_attention_implementation(config, "sdpa")  # this config alone, as restore() sets a private copy back
    assert config._attn_implementation == "sdpa"
    for interface in (AttentionInterface, AttentionMaskInterface):
        private.unregister_attention(interface, "fence-probe")
        private.unregister_attention(interface, "fence-probe")  # tolerated: already gone
    assert "fence-probe" not in ALL_ATTENTION_FUNCTIONS and "fence-probe" not in ALL_MASK_ATTENTION_FUNCTIONS


def test_an_assigned_loss_function_is_told_from_the_familys():
    model = tiny_model("llama")
    unset = object()
    assert private.assigned_loss_function(model, unset) is unset
    family = model.loss_function

    def loss(*args, **kwargs):
        return None

    model.loss_function = loss
    assert private.assigned_loss_function(model, unset) is loss and model.loss_function is loss
    private.forget_loss_function(model)
    assert private.assigned_loss_function(model, unset) is unset and model.loss_function == family


def test_the_model_internals_read_elsewhere():
    model = tiny_model("llama")
    assert private.checkpoints_with_cache(model.model.layers[0]) is False and not private.checkpoints_with_cache(None)
    assert private.tied_weights_keys(model) == {"lm_head.weight": "model.embed_tokens.weight"}  # 5.x: a mapping
    private.init_weights(model, model.model.norm)  # the family's init of one module runs
