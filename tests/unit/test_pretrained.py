"""`lightning_ulysses.integration.pretrained.zero3_loading`: transformers sees ZeRO-3 inside the context only, and a user's own
`HfDeepSpeedConfig` is left alone. (Loading into partitions through the strategy: test_parity.py `-pretrained`.)"""

from transformers.integrations import HfDeepSpeedConfig, deepspeed_config, is_deepspeed_zero3_enabled
from transformers.integrations.deepspeed import unset_hf_deepspeed_config

from lightning_ulysses.integration.pretrained import zero3_loading

ZERO3 = {"zero_optimization": {"stage": 3}, "train_micro_batch_size_per_gpu": 1}


def test_transformers_sees_zero3_inside_the_context_only():
    assert not is_deepspeed_zero3_enabled()
    with zero3_loading(ZERO3):
        assert is_deepspeed_zero3_enabled()
        assert deepspeed_config() == ZERO3 and deepspeed_config() is not ZERO3  # a copy: DeepSpeed may edit it
    assert not is_deepspeed_zero3_enabled() and deepspeed_config() is None
    with zero3_loading(None):  # not ZeRO-3: nothing registered
        assert deepspeed_config() is None


def test_the_registration_is_undone_when_the_body_raises():
    try:
        with zero3_loading(ZERO3):
            raise KeyError("configure_model failed")
    except KeyError:
        pass
    assert deepspeed_config() is None


def test_a_users_own_hf_deepspeed_config_is_left_alone():
    own = HfDeepSpeedConfig({"zero_optimization": {"stage": 2}})
    try:
        with zero3_loading(ZERO3):
            assert deepspeed_config() is own.config
        assert deepspeed_config() is own.config
    finally:
        unset_hf_deepspeed_config()
