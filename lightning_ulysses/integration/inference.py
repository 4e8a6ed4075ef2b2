"""Outputs of a sequence-parallel forward pass, as a predict step wants them.

Each SP rank holds the logits of its shard only, `[batch, seq/P, vocab]`. Gathering them is the one thing that
needs memory proportional to `seq × vocab` on one rank, so it happens only when asked for:

- `"last"`: the logits at the last real position of every row, `[batch, vocab]`, on every rank;
- `"log_probs"`: the log-probability of every target token, `[batch, seq]`: at position t, that of label t+1
  (0 where that label is ignored, and at the last position);
- `"full"`: all logits, `[batch, seq, vocab]`, on every rank.

Lengths include the padding the strategy added to reach a multiple of the SP size (its labels are ignored).
With a ring (`ring_size > 1`) the shards are zig-zag chunks: pass `order=strategy.parallel_groups.shard_order`
so that the gathered outputs come back in sequence order.

For serving outside the Trainer, `prepare(model, sequence_parallel_size)` switches a Hugging Face model to Ulysses
attention on an existing process group, and `generate` prefills a prompt with sequence parallelism (each rank
keeps the KV cache of its shard) and decodes greedily.
"""

from __future__ import annotations

import inspect
from typing import Literal, Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F

from lightning_ulysses.attention.all_to_all import all_gather_sequence
from lightning_ulysses.hf import DecodeState, binding_of, prepare_hf_model
from lightning_ulysses.parallel.layout import ParallelLayout, SequenceParallelGroups, ShardOrder
from lightning_ulysses.training.loss import IGNORE_INDEX, shift_sharded_labels

OutputKind = Literal["last", "log_probs", "full"]


def sequence_outputs(
    logits: torch.Tensor,
    kind: OutputKind,
    sequence_parallel_group=None,
    labels: Optional[torch.Tensor] = None,
    attention_mask: Optional[torch.Tensor] = None,
    ignore_index: int = IGNORE_INDEX,
    order: Optional[ShardOrder] = None,
    sequence_length: Optional[int] = None,
) -> torch.Tensor:
    """Assemble `kind` from this rank's `logits` shard (see the module docstring).

    `labels` (this rank's shard of the batch's labels, unshifted, as the strategy delivers them; shifted here across
    shard boundaries) are needed for `"log_probs"`;
    `attention_mask` (this rank's shard) tells `"last"` where each row really ends; without one, `sequence_length`
    (the rows' length before the sharder padded them to a multiple of the SP size: `SequenceSharder.unpadded_length`)
    does, else the last position of the padded rows. `order`: how the batch was cut
    (`strategy.parallel_groups.shard_order`; None: contiguous shards).
    """
    group = sequence_parallel_group
    if kind == "full":
        return all_gather_sequence(logits, group, 1, order)
    if kind == "log_probs":
        if labels is None:
            raise ValueError("sequence_outputs(kind='log_probs') needs the labels of the batch")
        targets = shift_sharded_labels(labels, group, order, ignore_index, sequence_length)
        valid = targets != ignore_index
        targets = targets.masked_fill(~valid, 0).unsqueeze(-1)
        log_probs = torch.log_softmax(logits.float(), dim=-1).gather(-1, targets).squeeze(-1) * valid
        return all_gather_sequence(log_probs, group, 1, order)
    if kind == "last":
        return _last_position_logits(logits, group, attention_mask, order, sequence_length)
    raise ValueError(f"kind must be 'last', 'log_probs' or 'full', got {kind!r}")


def _last_position_logits(logits: torch.Tensor, group, attention_mask: Optional[torch.Tensor],
                          order: Optional[ShardOrder], sequence_length: Optional[int] = None) -> torch.Tensor:
    batch, local_len, _ = logits.shape
    size = 1 if group is None else dist.get_world_size(group)
    rank = 0 if group is None else dist.get_rank(group)
    if attention_mask is None:
        real = torch.arange(local_len * size, device=logits.device) < (sequence_length or local_len * size)
        full_mask = real.expand(batch, -1)
    else:
        full_mask = all_gather_sequence(attention_mask.bool(), group, 1, order)
    # Index of the last real token of each row (right padding), in global positions.
    positions = torch.arange(full_mask.size(1), device=logits.device)
    last = (full_mask * positions).amax(dim=1)
    # Where that position sits in this rank's shard, if it does.
    local_positions = (order or ShardOrder(size)).positions(full_mask.size(1), rank, device=logits.device)
    here = local_positions[None, :] == last[:, None]
    rows = torch.arange(batch, device=logits.device)
    picked = logits[rows, here.int().argmax(dim=1)] * here.any(dim=1).unsqueeze(-1).to(logits.dtype)
    if group is not None and size > 1:
        # Exactly one rank contributes each row; the others add zeros.
        dist.all_reduce(picked, group=group)
    return picked


# -- serving outside the Trainer --------------------------------------------------------------------------------


class SequenceParallelModel:
    """A Hugging Face model prepared for sequence-parallel inference on an existing process group."""

    def __init__(self, model, groups, prepared):
        self.model, self.groups, self._prepared = model, groups, prepared

    @property
    def sequence_parallel_group(self):
        return self.groups.sequence_parallel_group if self.groups.sequence_parallel_world_size > 1 else None

    def generate(self, input_ids: torch.Tensor, max_new_tokens: int) -> torch.Tensor:
        return generate(self.model, input_ids, max_new_tokens, self.groups)

    def restore(self) -> None:
        """Give the model its own attention back and release the process groups `prepare` created (on every rank,
        as `prepare` was called: after a barrier, the groups are destroyed in creation order)."""
        self._prepared.restore()
        if not self.groups.released:
            dist.barrier()  # no collective on the groups is pending on any rank
            self.groups.release()


def prepare(model, sequence_parallel_size: int) -> SequenceParallelModel:
    """Prepare `model` (a Hugging Face causal LM) for sequence-parallel inference on the running process group.

    For serving scripts: call it on every rank after `torch.distributed.init_process_group` (torchrun, or any
    launcher); SP groups are blocks of `sequence_parallel_size` contiguous ranks, as in training. Every rank of an
    SP group must then be given the same full-length prompts.
    """
    if not dist.is_initialized():
        raise RuntimeError("lightning_ulysses.integration.inference.prepare needs torch.distributed initialised (e.g. torchrun).")
    groups = SequenceParallelGroups.build(ParallelLayout(dist.get_world_size(), sequence_parallel_size))
    group = groups.sequence_parallel_group if sequence_parallel_size > 1 else None
    return SequenceParallelModel(model, groups, prepare_hf_model(model, group))


@torch.no_grad()
def generate(model, input_ids: torch.Tensor, max_new_tokens: int, groups) -> torch.Tensor:
    """Greedy generation: the prompt is prefilled with sequence parallelism (each rank keeps the KV cache of its
    shard of the prompt), then each new token attends to the cache across the SP group without gathering it.

    `model` is a Hugging Face causal LM prepared by `prepare` (or by the strategy); `input_ids` `[batch, prompt]`
    are the same full prompts on every rank of the SP group (no padding inside them). Returns `[batch, prompt +
    max_new_tokens]`, identical on every rank and to the same model's non-parallel greedy output.
    """
    from transformers import DynamicCache

    size, rank = groups.sequence_parallel_world_size, groups.sequence_parallel_rank
    if groups.ring_size > 1:
        raise NotImplementedError(
            "generate() decodes from contiguous prompt shards (pure Ulysses); this model runs with a ring"
            f" (ring_size={groups.ring_size}). Prepare it with lightning_ulysses.integration.inference.prepare, which uses ring_size=1."
        )
    group = groups.sequence_parallel_group if size > 1 else None
    batch, prompt_length = input_ids.shape
    shard = -(-prompt_length // size)
    padded = F.pad(input_ids, (0, shard * size - prompt_length))
    order = ShardOrder(size)  # the prompt is cut as training cuts batches (pure Ulysses: contiguous shards)
    positions = order.positions(shard * size, rank, device=input_ids.device).expand(batch, -1)
    binding = binding_of(model)
    if size > 1 and binding is None:
        raise ValueError("generate() needs a model prepared for sequence parallelism: lightning_ulysses.integration.inference.prepare")
    state = DecodeState(prompt_length=prompt_length, shard_length=shard, first_position=int(positions[0, 0]),
                        rank=rank)
    cache = DynamicCache(config=model.config)
    cache_argument = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    if binding is not None:
        binding.decode = state
    try:
        # Only the rank holding the prompt's last token needs logits, and only there: never materialise
        # [prompt, vocab] (65 GB in fp32 for a 128K prompt and a 128K vocabulary).
        last_index = prompt_length - 1 - int(positions[0, 0])
        owner = 0 <= last_index < shard
        keep = torch.tensor([min(max(last_index, 0), shard - 1)], device=input_ids.device)
        next_logits = model(input_ids=order.shard(padded, rank, dim=1), position_ids=positions, use_cache=True, logits_to_keep=keep,
                            **{cache_argument: cache}).logits[:, -1]
        if not owner:
            next_logits = torch.zeros_like(next_logits)
        if group is not None:
            dist.all_reduce(next_logits, group=group)  # exactly one rank contributes
        state.prefilled = True
        tokens = []
        for step in range(max_new_tokens):
            token = next_logits.argmax(dim=-1, keepdim=True)
            tokens.append(token)
            if step + 1 == max_new_tokens:
                break
            position = torch.full((batch, 1), prompt_length + step, device=input_ids.device)
            next_logits = model(input_ids=token, position_ids=position, use_cache=True,
                                **{cache_argument: cache}).logits[:, -1]
    finally:
        if binding is not None:
            binding.decode = None
    return torch.cat([input_ids, *tokens], dim=1)
