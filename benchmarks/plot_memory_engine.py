"""Plot tokens/s and peak GPU memory against sequence length from memory_engine.py JSON lines.

    python benchmarks/plot_memory_engine.py OUT.png FILE.jsonl...

Points shorter than 4,096 tokens are left out: they are the short steps run first so that the long step finds
DeepSpeed's optimizer state already allocated, not measurements.
"""

import json
import sys
from collections import defaultdict
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

SHORTEST_MEASURED = 4096


def main(out: str, *paths: str) -> None:
    series = defaultdict(list)
    for path in paths:
        for line in Path(path).read_text().splitlines():
            if not line.startswith("{"):  # DeepSpeed prints its warnings to stdout, between our JSON lines
                continue
            record = json.loads(line)
            if record.get("status") == "ok" and record["seq"] >= SHORTEST_MEASURED:
                label = f"{record['model']} {record['features']}"
                if record["offload_optimizer"]:
                    label += f" (optimizer {record['offload_optimizer']:.0%} on host)"
                if record.get("sdpa_backend", "default") != "default":
                    label += f" [{record['sdpa_backend']} attention]"
                series[label].append(record)
    figure, (speed, memory) = plt.subplots(1, 2, figsize=(13, 5))
    for label, records in sorted(series.items()):
        records.sort(key=lambda r: r["seq"])
        seqs = [r["seq"] / 1024 for r in records]
        speed.plot(seqs, [r["tokens_per_s"] for r in records], marker="o", label=label)
        memory.plot(seqs, [r["peak_allocated_gib"] for r in records], marker="o", label=label)
        memory.scatter(seqs, [r["predicted_gpu_gib"] for r in records], marker="x", color="black", zorder=3)
    for axis, title in ((speed, "tokens/s"), (memory, "peak GPU memory, GiB (x: planner)")):
        axis.set_xscale("log", base=2)
        axis.set_xlabel("sequence length (K tokens)")
        axis.set_title(title)
        axis.grid(alpha=0.3)
    memory.axhline(139, color="red", linestyle="--", linewidth=1)
    speed.legend(fontsize=7)
    figure.suptitle("Memory engine on one H200 (bf16, DeepSpeed ZeRO-3, random init)")
    figure.tight_layout()
    figure.savefig(out, dpi=110)


if __name__ == "__main__":
    main(*sys.argv[1:])
