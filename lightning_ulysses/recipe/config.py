"""Hydra/OmegaConf helpers shared by the recipes and the config tests."""

from omegaconf import OmegaConf


def register_resolvers() -> None:
    """`${half:${data.seq_len}}` in YAML: integer half of a value (the copy task's second half starts there)."""
    if not OmegaConf.has_resolver("half"):
        OmegaConf.register_new_resolver("half", lambda value: int(value) // 2)
