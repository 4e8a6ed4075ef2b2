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


# -- FSDP2: `from_pretrained` in configure_model, each rank reading its shards (`ShardedPretrainedLoads`) -------------
# One process, a world of 1 (gloo): what is deferred, what falls back to transformers' own load, what is refused, and
# the fence's private names. The sharded reads at worlds of 2 and 4: test_fsdp.py `-pretrained*` (`loaded` claim).
import inspect  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from lightning_ulysses.fences import _transformers_private as transformers_private  # noqa: E402
from lightning_ulysses.integration.pretrained import ShardedPretrainedLoads  # noqa: E402


@pytest.fixture
def world_of_one(tmp_path):
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def _tiny_llama(tied: bool = False):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=tied))


def _load(folder, loads: ShardedPretrainedLoads):
    from transformers import AutoModelForCausalLM

    with loads.deferring():
        return AutoModelForCausalLM.from_pretrained(folder)


def test_the_fence_names_exist_in_the_installed_transformers():
    assert transformers_private.pretrained_load_parameters()[:4] == transformers_private.PRETRAINED_LOAD_PARAMETERS[:4]
    info, offload_index = transformers_private.nothing_loaded({"lm_head.weight"})
    assert info.missing_keys == {"lm_head.weight"} and offload_index is None
    from transformers import PreTrainedModel
    from transformers.integrations import hub_kernels

    assert transformers_private.KERNELS_DEVICE in inspect.getsource(hub_kernels.kernelize)
    assert "_finalize_model_loading" in inspect.getsource(PreTrainedModel.from_pretrained)
    original = inspect.getattr_static(PreTrainedModel, transformers_private.PRETRAINED_LOAD)
    with pytest.raises(KeyError):
        with transformers_private.pretrained_load_replaced(lambda *args: None):
            raise KeyError("configure_model failed")
    assert inspect.getattr_static(PreTrainedModel, transformers_private.PRETRAINED_LOAD) is original


@pytest.mark.parametrize("tied", [False, True])
def test_deferred_on_meta_then_read_exactly(world_of_one, tmp_path, tied):
    saved = _tiny_llama(tied)
    saved.save_pretrained(tmp_path / "model")
    loads = ShardedPretrainedLoads()
    model = _load(tmp_path / "model", loads)
    assert len(loads.pending) == 1 and all(p.is_meta for p in model.parameters())
    assert not model.model.rotary_emb.inv_freq.is_meta  # transformers computed the buffer the file lacks
    assert (model.lm_head.weight is model.model.embed_tokens.weight) == tied
    loads.check()
    loads.read_shards(torch.device("cpu"))
    assert not loads.pending
    for (name, value), (_, expected) in zip(model.state_dict().items(), saved.state_dict().items()):
        assert torch.equal(value, expected), name
    assert torch.equal(model.model.rotary_emb.inv_freq, saved.model.rotary_emb.inv_freq)


def test_lora_on_the_deferred_model(world_of_one, tmp_path):
    """`models.lora.with_lora` after the deferred load gives the adapters peft's own initial values (as on a model
    loaded whole), which the shard reading keeps; peft's `get_peft_model` alone leaves them valueless on the meta
    device: refused, naming the fix."""
    from peft import get_peft_model
    from transformers import AutoModelForCausalLM

    from lightning_ulysses.models.lora import LoraSettings, with_lora

    _tiny_llama().save_pretrained(tmp_path / "model")
    settings = LoraSettings(r=2, alpha=4, target_modules=["q_proj", "down_proj"], seed=1)
    expected = with_lora(AutoModelForCausalLM.from_pretrained(tmp_path / "model"), settings).state_dict()
    loads = ShardedPretrainedLoads()
    adapted = with_lora(_load(tmp_path / "model", loads), settings)
    loads.check()
    loads.read_shards(torch.device("cpu"))
    assert adapted.state_dict().keys() == expected.keys()
    for name, value in adapted.state_dict().items():
        assert torch.equal(value, expected[name]), name
    loads = ShardedPretrainedLoads()
    get_peft_model(_load(tmp_path / "model", loads), settings.peft_config())
    with pytest.raises(ValueError, match=r"no values to read: \['model.layers.0.self_attn.q_proj.lora_A.*with_lora"):
        loads.check()


def test_checkpoints_not_read_as_they_are_load_whole(world_of_one, tmp_path):
    """Tensors transformers converts (Qwen3-MoE's per-expert files, fused on load), or a folder holding other
    safetensors files: transformers' own load, every tensor on the host."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    moe = Qwen3MoeForCausalLM(Qwen3MoeConfig(vocab_size=64, hidden_size=32, intermediate_size=48,
                                             moe_intermediate_size=16, num_experts=4, num_experts_per_tok=2,
                                             num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2))
    moe.save_pretrained(tmp_path / "moe")
    _tiny_llama().save_pretrained(tmp_path / "extra")
    _tiny_llama().save_pretrained(tmp_path / "extra", safe_serialization=True, variant="copy")
    for folder in ("moe", "extra"):
        loads = ShardedPretrainedLoads()
        model = _load(tmp_path / folder, loads)
        assert not loads.pending and not any(p.is_meta for p in model.parameters()), folder
