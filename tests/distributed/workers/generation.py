"""Worker: greedy generation with a sequence-parallel prefill (sharded KV cache) via inference.prepare."""

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from lightning_ulysses.integration import inference
from tests.distributed.common import VOCAB, tiny_llama
from tests.distributed.families import tiny_model

PROMPT_LENGTH, NEW_TOKENS = 13, 6  # 13 is not a multiple of 2 or 4: the last shard holds padding


def prompts() -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, PROMPT_LENGTH), generator=torch.Generator().manual_seed(3))


def refusal(run) -> str:
    """The message of the NotImplementedError `run()` raises ("" when it raises none)."""
    try:
        run()
    except NotImplementedError as error:
        return str(error)
    return ""


def _generate_hybrid(sp: int) -> None:
    """A hybrid model (Qwen3-Next: Gated DeltaNet layers) cannot decode from an SP prefill: its mixers would need
    the state of every token, which they do not record under SP."""
    served = inference.prepare(tiny_model("qwen3_next"), sequence_parallel_size=sp)
    try:
        served.generate(prompts()[:, :12], 2)
    finally:
        served.restore()


def _decode_by_hand(sp: int) -> None:
    """A user's own decoding loop under SP: a prefill through the prepared model, then one token from its cache."""
    served = inference.prepare(tiny_llama(4, seed=5), sequence_parallel_size=sp)
    rank, shard = served.groups.sequence_parallel_rank, 12 // sp
    try:
        with torch.no_grad():
            ids = prompts()[:, :12]
            prefill = served.model(input_ids=ids[:, rank * shard:(rank + 1) * shard], use_cache=True,
                                   position_ids=torch.arange(rank * shard, (rank + 1) * shard).expand(2, -1))
            served.model(input_ids=ids[:, -1:], position_ids=torch.full((2, 1), 12),
                         past_key_values=prefill.past_key_values)
    finally:
        served.restore()


def main():
    spec = json.loads(Path(sys.argv[1]).read_text())
    if not dist.is_initialized():  # a part of a shared launch (workers/parts.py) may find it set up
        dist.init_process_group("gloo")
    output = {}
    for sp in spec["sequence_parallel_sizes"]:
        for kv_heads in (4, 1):
            served = inference.prepare(tiny_llama(kv_heads, seed=5), sequence_parallel_size=sp)
            output[(sp, kv_heads)] = served.generate(prompts(), NEW_TOKENS)
            served.restore()
            output[("released", sp, kv_heads)] = served.groups.released
        output[("hybrid", sp)] = refusal(lambda: _generate_hybrid(sp))
        output[("own decoding", sp)] = refusal(lambda: _decode_by_hand(sp))
    torch.save(output, Path(sys.argv[2]) / f"result_{dist.get_rank()}.pt")


if __name__ == "__main__":
    main()
