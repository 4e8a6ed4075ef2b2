"""The strategy's check that no LoRA adapter weight kept the random values ZeRO-3 left it (see
`check_adapters_initialised`), and the mark `models.lora` sets on the weights it initialised.

Here rather than in `models/lora.py`: the strategy runs the check on every LightningModule, and the package's core
and integration do not import its example models (tests/unit/test_layers.py).
"""

from __future__ import annotations

import torch

# Set on an adapter weight whose initial values are known to be peft's: given by `models.lora._initialise_adapter`,
# or whole (not partitioned) when peft initialised it. `check_adapters_initialised` refuses partitioned adapter
# weights without it.
INITIALISED_MARK = "lightning_ulysses_lora_initialised"


def check_adapters_initialised(root: torch.nn.Module) -> None:
    """Refuses LoRA adapter weights in `root` that ZeRO-3 partitioned at creation (`zero.Init`: `configure_model`)
    and none of `models.lora`'s functions initialised: peft's own initialisation of them was a no-op (see
    `models.lora._initialise_adapter`), so they hold random values the user never asked for. Decided from the module
    tree alone (the same on every rank: no collective). A weight that is whole here got peft's own values and is
    marked, so that once DeepSpeed has partitioned it (a model built in `__init__`) a later setup (validate after
    fit) does not refuse it. Nothing to do without peft or without adapters."""
    try:
        from peft.tuners.lora import LoraLayer
    except ImportError:
        return
    unset: dict[str, str] = {}  # adapter name -> one of its weights
    for path, layer in root.named_modules():
        if not isinstance(layer, LoraLayer):
            continue
        for kind in layer.adapter_layer_names:
            for adapter, part in getattr(layer, kind, {}).items():
                weights = part.named_parameters() if isinstance(part, torch.nn.Module) else [("", part)]
                for weight_name, weight in weights:
                    if getattr(weight, INITIALISED_MARK, False):
                        continue
                    if not hasattr(weight, "ds_id"):
                        setattr(weight, INITIALISED_MARK, True)
                    else:
                        unset.setdefault(adapter, ".".join(filter(None, (path, kind, adapter, weight_name))))
    if unset:
        raise ValueError(
            f"The LoRA adapters {sorted(unset)} were created partitioned by ZeRO-3 (in configure_model, under"
            f" deepspeed.zero.Init) and their initial values were never set ({next(iter(unset.values()))}, ...):"
            " peft initialises an adapter after ZeRO-3 has emptied its tensors, so `B` keeps a random init instead of"
            " zero and the model no longer starts as the pretrained one. Add adapters with"
            " lightning_ulysses.models.lora.add_adapter(peft_model, name, LoraSettings(...)) instead of peft's"
            " peft_model.add_adapter(name, config) (and the first with lightning_ulysses.models.lora.with_lora"
            " instead of get_peft_model): they give peft's values in the partitions.")
