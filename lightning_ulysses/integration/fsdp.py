"""FSDP2 for the models the module pipeline prepared (`UlyssesFSDPStrategy`): torch's `fully_shard` over every rank.

Each model the memory engine serves (Hugging Face causal LMs, `NativeCausalLM`s) gets one `fully_shard` unit per
decoder layer and one for the rest of the model (embeddings, final norm, head), on a one-dimensional mesh of the
whole world: parameters, gradients and optimizer state are sharded over all DP × SP ranks, as ZeRO-3 does. FSDP2
averages each reduce-scatter over those ranks (`RunSpec.loss_gradient_scale`). What the user already sharded (a
`fully_shard` in `configure_model`) is kept as it is.

Verified on torch 2.13 (CPU, gloo; docs/internals.md): `fully_shard` on a CPU mesh works, its reduce-scatter
averages over the mesh, `clip_grad_norm_` reduces the DTensor norms over all shards, and a one-dimensional mesh of
the whole world reuses the default process group (no new group).
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch
import torch.distributed as dist

from lightning_ulysses.integration.pretrained import ShardedPretrainedLoads
from lightning_ulysses.memory import decoder_layers
from lightning_ulysses.parallel.run_spec import RunSpec


def world_mesh(device_type: str):
    """The one-dimensional mesh of every rank that FSDP2 shards over (the default group: torch reuses it)."""
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh(device_type, (dist.get_world_size(),), mesh_dim_names=("shard",))


def mixed_precision_policy(spec: RunSpec):
    """FSDP2's policy for the run: bf16 compute with fp32 parameters and fp32 gradient reduction under bf16-mixed;
    the parameters' own dtype otherwise."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    return MixedPrecisionPolicy(param_dtype=spec.fsdp_param_dtype, reduce_dtype=torch.float32 if spec.fsdp_param_dtype
                                else None)


def shard_models(root: torch.nn.Module, models: Sequence[torch.nn.Module], mesh, spec: RunSpec,
                 device: torch.device, pretrained: Optional[ShardedPretrainedLoads] = None) -> list[str]:
    """`fully_shard` each of `models` (layer by layer, then the model) unless already sharded; returns the paths of
    the models it sharded. Refuses, before sharding anything (identically on every rank: the module tree alone),
    trainable parameters of `root` outside every model: no FSDP2 unit would own them, and their gradients would not
    be reduced. The models' parameters are first made the same on every rank (rank 0's, as DDP does, through
    `device`): `fully_shard` keeps each rank's own slice of its own copy. `pretrained`: models `from_pretrained`
    built on the meta device in `configure_model`; each rank reads its shards of them once sharded."""
    from torch.distributed.fsdp import FSDPModule, fully_shard

    models = list(models)
    outside = _outside_parameters(root, models)
    if outside:
        raise ValueError(
            f"The FSDP2 strategy shards the models it prepares (Hugging Face causal LMs, NativeCausalLM); trainable"
            f" parameters outside them would not be reduced: {outside[:3]}{' ...' if len(outside) > 3 else ''}. Move"
            " them into the model, or apply torch.distributed.fsdp.fully_shard to the module holding them in your"
            " LightningModule's configure_model (with mesh=self.trainer.strategy.shard_mesh).")
    if pretrained is not None:
        pretrained.check()
    names = {id(module): name for name, module in root.named_modules()}
    options = dict(mesh=mesh, reshard_after_forward=spec.reshard_after_forward, mp_policy=mixed_precision_policy(spec))
    sharded = []
    for model in models:
        if isinstance(model, FSDPModule):
            continue
        _same_on_every_rank(model, device)
        for layer in decoder_layers(model):
            if not isinstance(layer, FSDPModule):
                fully_shard(layer, **options)
        fully_shard(model, **options)
        sharded.append(names.get(id(model), type(model).__name__))
    if pretrained is not None:
        pretrained.read_shards(device)
    return sharded


def _outside_parameters(root: torch.nn.Module, models: list[torch.nn.Module]) -> list[str]:
    from torch.distributed.fsdp import FSDPModule

    owned = {id(p) for model in models for p in model.parameters()}
    owned |= {id(p) for module in root.modules() if isinstance(module, FSDPModule) for p in module.parameters()}
    return [name for name, p in root.named_parameters() if p.requires_grad and id(p) not in owned]


def _same_on_every_rank(model: torch.nn.Module, device: torch.device) -> None:
    """Rank 0's parameters and buffers on every rank (one broadcast per tensor; none on one rank or on meta). Each
    tensor travels through `device` (NCCL broadcasts only CUDA tensors; a model built on the host stays there)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return
    for tensor in [*model.parameters(), *model.buffers()]:
        if tensor.device.type == "meta":
            continue
        moved = tensor.data.to(device)
        dist.broadcast(moved, src=0)
        if moved is not tensor.data:
            tensor.data.copy_(moved)


def full_weights(module: torch.nn.Module, names: Optional[Sequence[str]] = None) -> dict[str, torch.Tensor]:
    """The whole (gathered) value of every parameter of `module` (DTensors gathered: collective, on every rank)."""
    from torch.distributed.tensor import DTensor

    return {name: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
            for name, p in module.named_parameters() if names is None or name in names}
