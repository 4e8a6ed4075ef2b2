"""The DeepSpeed config as `UlyssesDeepSpeedStrategy` reads it: Lightning's, plus the DeepSpeed-Ulysses dialect.

- The `"ulysses"` block of the configs published with DeepSpeed-Ulysses (`{"enable": true,
  "sequence_parallel_world_size": 8}`) is read for the SP size and removed before DeepSpeed sees the config
  (DeepSpeed itself does not know the key).
- `config_overrides` is merged into the config Lightning built from the strategy's arguments, recursively, so a
  recipe can set one nested knob without restating its section; a `None` value means "not set".
- The inference engine (validate/test/predict without `fit`) gets the config Lightning gives it.
"""

from __future__ import annotations

from typing import Any, Mapping, Optional

_ULYSSES_CONFIG_KEYS = {"enable", "sequence_parallel_world_size"}


def split_ulysses_block(config: Mapping[str, Any]) -> tuple[dict[str, Any], Optional[int]]:
    """Strip the `"ulysses"` block of a DeepSpeed-Ulysses style config; return (config, its SP size or None)."""
    config = dict(config)  # the caller's dict is left as it was
    block = config.pop("ulysses", None)
    if block is None:
        return config, None
    if not isinstance(block, Mapping) or set(block) - _ULYSSES_CONFIG_KEYS:
        raise ValueError(
            f'The DeepSpeed config\'s "ulysses" block must look like {{"enable": true, "sequence_parallel_world_size": 8}};'
            f" got {block!r}."
        )
    if not block.get("enable", True):
        return config, 1
    size = block.get("sequence_parallel_world_size")
    if size is None:
        raise ValueError('The DeepSpeed config\'s "ulysses" block enables Ulysses but sets no "sequence_parallel_world_size".')
    return config, size


def read_sequence_parallel_size(
    config: Optional[Mapping[str, Any]], sequence_parallel_size: Optional[int]
) -> tuple[Optional[dict[str, Any]], Optional[int]]:
    """The config without its `"ulysses"` block and the SP size: the argument's, else the block's (they must agree
    when both are given)."""
    if config is None:
        return None, sequence_parallel_size
    config, configured_size = split_ulysses_block(config)
    if sequence_parallel_size is None:
        return config, configured_size
    if configured_size is not None and configured_size != sequence_parallel_size:
        raise ValueError(
            f"sequence_parallel_size={sequence_parallel_size} disagrees with the DeepSpeed config's"
            f" ulysses.sequence_parallel_world_size={configured_size}: set only one of them, or make them equal."
        )
    return config, sequence_parallel_size


def deep_merge(base: Mapping[str, Any], overrides: Mapping[str, Any]) -> dict[str, Any]:
    merged = dict(base)
    for key, value in overrides.items():
        if value is None:  # "not set": lets a recipe list a knob without forcing a value on DeepSpeed
            continue
        if isinstance(value, Mapping) and isinstance(merged.get(key), Mapping):
            merged[key] = deep_merge(merged[key], value)
        else:
            merged[key] = value
    return merged


def inference_config(config: Mapping[str, Any], zero_stage_3: bool) -> dict[str, Any]:
    """The config of an engine without optimizer, exactly as Lightning's `_initialize_deepspeed_inference` builds
    it (lightning 2.6): precision, and the ZeRO section under ZeRO-3 (parameters stay partitioned)."""
    inference = {"train_micro_batch_size_per_gpu": 1}  # Lightning: "required for DeepSpeed throughput timers"
    if "fp16" in config:
        inference["fp16"] = config["fp16"]
    if "bf16" in config:
        inference["bf16"] = config["bf16"]
    if zero_stage_3:
        inference["zero_allow_untested_optimizer"] = config["zero_allow_untested_optimizer"]
        inference["zero_optimization"] = config["zero_optimization"]
    return inference
