"""Mixture-of-experts load-balancing losses of the whole sequence, with the right gradient, under sequence parallelism.

With `output_router_logits=True` a Hugging Face MoE model adds `router_aux_loss_coef · aux_loss` to its loss, where
`load_balancing_loss_func` (Switch Transformer's loss) averages, over all tokens of the batch (padding excluded) and
over all MoE layers, the fraction of tokens routed to each expert and the mean router probability of each expert:
`aux_loss = num_experts · Σ_e fraction_e · probability_e`. Under sequence parallelism each rank sees only its
shard's tokens, so the unchanged function returns a different loss on every rank, none of them the model's.

`SequenceParallelRouterLoss` computes the same two means from sums over the SP group: the token counts and the
number of tokens are all-reduced as constants (the top-k choice has no gradient), the router probability sums through
`loss._SumOverGroup`, so every rank returns the whole sequence's value while its backward carries only its own
tokens' share, scaled for ZeRO like the main loss (`RunSpec.loss_gradient_scale`). DeepSpeed's sum over the SP ranks
then gives the unsharded model's gradient.

The modeling code looks the function up by name in its module's globals when it runs, so that is where it is
swapped (`exact_router_loss`), for the families whose function is transformers' shared implementation (Mixtral's,
copied verbatim into 31 families in transformers 5.24: Mixtral, Qwen2-MoE, Qwen3-MoE, Qwen3-Next, Qwen3.5-MoE,
Qwen3-VL-MoE, Qwen3-Omni-MoE, GPT-OSS, OLMoE, FlexOlmo, PhiMoE, DBRX, Jamba, JetMoE, GraniteMoE (and its shared,
hybrid and SWA variants), MiniMax (M2, M3-VL), ERNIE 4.5 MoE (and VL), GLM-4V-MoE, DeepSeek-V4, ...). The swap is
one stand-in per modeling module, shared by the prepared models of that family and removed with the last of them;
it acts only while a prepared model's own forward runs (a context variable its forward hooks set), so any other
model of the family in the process, and the same model once restored, computes its loss as before. A family whose
function is different code (Doge, ...) is refused with `output_router_logits=True` at SP > 1.
"""

from __future__ import annotations

import contextvars
import functools
from typing import Callable, Optional

import torch
import torch.distributed as dist

from lightning_ulysses.attention.rows import BatchRowsSlot
from lightning_ulysses.parallel.layout import ShardOrder
from lightning_ulysses.training.loss import _SumOverGroup

FUNCTION_NAME = "load_balancing_loss_func"
# Whose load-balancing loss runs while a prepared model's forward is running (None: the family's own function).
_ACTIVE: contextvars.ContextVar[Optional[Callable]] = contextvars.ContextVar("lightning_ulysses_router_loss",
                                                                             default=None)


class SequenceParallelRouterLoss:
    """`load_balancing_loss_func(gate_logits, num_experts, top_k, attention_mask)` of the whole sharded sequence.

    `group`: the SP group; `gradient_scale`: the main loss's (`RunSpec.loss_gradient_scale`). `real_tokens(local_length)`
    returns which of this shard's positions are tokens of the batch as the user made it (False: padding the sharder
    appended to reach a multiple of the SP size, which the unsharded model never sees), or None when all are.
    """

    def __init__(self, group, gradient_scale: float,
                 real_tokens: Optional[Callable[[int], Optional[torch.Tensor]]] = None):
        self.group, self.gradient_scale, self.real_tokens = group, gradient_scale, real_tokens

    def __call__(self, gate_logits, num_experts=None, top_k=2, attention_mask=None, *, row_shape=None):
        """`row_shape`: (batch, shard length) of the forward's input (the gate logits come flattened)."""
        if gate_logits is None or not isinstance(gate_logits, tuple):
            return 0
        device = gate_logits[0].device
        if attention_mask is not None:  # the sharder extends a given mask with zeros over its padding
            weights = attention_mask.reshape(-1).to(device=device, dtype=torch.float32)
        else:
            weights = torch.ones(gate_logits[0].size(0), dtype=torch.float32, device=device)
            real = None if self.real_tokens is None or row_shape is None else self.real_tokens(row_shape[1])
            if real is not None:
                weights = real.to(device=device, dtype=torch.float32).repeat(row_shape[0])
        counts = torch.zeros(num_experts + 1, dtype=torch.float32, device=device)  # per expert, then tokens
        probability_sums = torch.zeros(num_experts, dtype=torch.float32, device=device)
        for layer_gate in gate_logits:
            routing_weights = torch.softmax(layer_gate.to(device), dim=-1)
            _, selected_experts = torch.topk(routing_weights, top_k, dim=-1)
            counts[:num_experts].scatter_add_(0, selected_experts.reshape(-1), weights.repeat_interleave(top_k))
            counts[num_experts] += weights.sum()
            probability_sums = probability_sums + (routing_weights.float() * weights.unsqueeze(-1)).sum(dim=0)
        if self.group is not None:
            dist.all_reduce(counts, group=self.group)  # constants: which experts were chosen has no gradient
        probability_sums = _SumOverGroup.apply(probability_sums, self.group, self.gradient_scale)
        tokens = counts[num_experts]
        return num_experts * torch.sum((counts[:num_experts] / tokens) * (probability_sums / tokens))

    def __deepcopy__(self, memo):  # holds a process group: share it
        return self


class _Switch:
    """Stands in for one modeling module's `load_balancing_loss_func`: the prepared model's loss while its forward
    runs, the family's own function otherwise."""

    def __init__(self, original: Callable):
        self.original = original
        self.users = 0

    def __call__(self, *args, **kwargs):
        active = _ACTIVE.get()
        return self.original(*args, **kwargs) if active is None else active(*args, **kwargs)


def _is_shared_implementation(function: Callable) -> bool:
    """Whether `function` is the same code as transformers' Mixtral `load_balancing_loss_func` (docstring and line
    numbers aside): the implementation `SequenceParallelRouterLoss` reproduces."""
    from transformers.models.mixtral import modeling_mixtral

    mine, reference = getattr(function, "__code__", None), modeling_mixtral.load_balancing_loss_func.__code__
    if mine is None:
        return False
    return (mine.co_code == reference.co_code and mine.co_names == reference.co_names
            and mine.co_varnames == reference.co_varnames and mine.co_consts[1:] == reference.co_consts[1:])


def _modeling_globals(model: torch.nn.Module) -> list[dict]:
    """The module globals in which `model`'s classes look up `load_balancing_loss_func` (one per modeling file)."""
    found: dict[int, dict] = {}
    for module in model.modules():
        namespace = getattr(type(module).forward, "__globals__", None)
        if namespace is not None and FUNCTION_NAME in namespace:
            found[id(namespace)] = namespace
    return list(found.values())


def validate_router_loss(model: torch.nn.Module) -> None:
    """Refuse, before any collective, a family whose load-balancing loss is not the shared one when its config
    asks for router logits (asked per call instead, it raises in the forward, alike on every rank)."""
    if not _knows_router_loss(model) and getattr(model.config.get_text_config(), "output_router_logits", False):
        _Refusal(type(model).__name__)()


def _knows_router_loss(model: torch.nn.Module) -> bool:
    return all(_is_shared_implementation(getattr(ns[FUNCTION_NAME], "original", ns[FUNCTION_NAME]))
               for ns in _modeling_globals(model))


def exact_router_loss(model: torch.nn.Module, router_loss: SequenceParallelRouterLoss) -> Callable[[], None]:
    """Make `model`'s load-balancing loss the whole sequence's (`router_loss`) while its forward runs (a family
    whose function is not the shared one: refused when asked for); returns the callable that undoes it."""
    validate_router_loss(model)
    namespaces = _modeling_globals(model)
    if not namespaces:
        return lambda: None  # not a model with a load-balancing loss
    if not _knows_router_loss(model):
        router_loss = _Refusal(type(model).__name__)
    switches = []
    for namespace in namespaces:
        switch = namespace[FUNCTION_NAME]
        if not isinstance(switch, _Switch):
            switch = namespace[FUNCTION_NAME] = _Switch(switch)
        switch.users += 1
        switches.append((namespace, switch))
    tokens: list[contextvars.Token] = []

    def enter(module, args, kwargs):
        inputs = next((t for t in (kwargs.get("input_ids"), kwargs.get("inputs_embeds"), *args[:1])
                       if isinstance(t, torch.Tensor)), None)
        row_shape = None if inputs is None else tuple(inputs.shape[:2])
        tokens.append(_ACTIVE.set(functools.partial(router_loss, row_shape=row_shape)))

    def leave(module, args, output):
        _ACTIVE.reset(tokens.pop())

    hooks = [model.register_forward_pre_hook(enter, with_kwargs=True),
             model.register_forward_hook(leave, always_call=True)]  # reset even when the forward raises

    def restore() -> None:
        for hook in hooks:
            hook.remove()
        for namespace, switch in switches:
            switch.users -= 1
            if switch.users == 0 and namespace.get(FUNCTION_NAME) is switch:
                namespace[FUNCTION_NAME] = switch.original

    return restore


class _Refusal:
    """The load-balancing loss of a family whose function is not the shared one: refused when it is asked for."""

    def __init__(self, model_name: str):
        self.model_name = model_name

    def __call__(self, *args, **kwargs):
        raise NotImplementedError(
            f"{self.model_name} computes its MoE load-balancing loss (output_router_logits=True) with code"
            " lightning_ulysses does not know, which would average each sequence-parallel shard's tokens instead of"
            " the whole sequence's. Set output_router_logits=False (config or call), or train it without sequence"
            " parallelism."
        )


def batch_padding(batch_rows: BatchRowsSlot, order: ShardOrder, rank: int) -> Callable[[int], Optional[torch.Tensor]]:
    """`real_tokens` for `SequenceParallelRouterLoss` from the rows the sharder published for the current batch
    (`BatchRows.unpadded_length`): this shard's positions (SP rank `rank`, cut in `order`) below the length the rows
    had before the sharder padded them."""

    def real_tokens(local_length: int) -> Optional[torch.Tensor]:
        rows = batch_rows.rows
        unpadded = None if rows is None else rows.unpadded_length
        padded = local_length * order.sequence_parallel_size
        if unpadded is None or unpadded >= padded:
            return None
        return order.positions(padded, rank) < unpadded

    return real_tokens
