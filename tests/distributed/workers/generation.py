"""Worker: greedy generation with a sequence-parallel prefill (sharded KV cache) via inference.prepare."""

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from lightning_ulysses import inference
from tests.distributed.common import VOCAB, tiny_llama

PROMPT_LENGTH, NEW_TOKENS = 13, 6  # 13 is not a multiple of 2 or 4: the last shard holds padding


def prompts() -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, PROMPT_LENGTH), generator=torch.Generator().manual_seed(3))


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
    torch.save(output, Path(sys.argv[2]) / f"result_{dist.get_rank()}.pt")


if __name__ == "__main__":
    main()
