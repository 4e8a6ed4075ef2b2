"""Turn the strategy-overhead JSON lines into results.md (table) and overhead.png (plot, needs matplotlib).

    python benchmarks/summarize_strategy_overhead.py benchmarks/results/2026-11-29-h200-strategy-overhead
"""

import json
import sys
from pathlib import Path

LABELS = {"raw": "(a) DeepSpeed ZeRO-3 + HF", "lightning-stock": "(c) Lightning DeepSpeedStrategy",
          "lightning": "(b) UlyssesDeepSpeedStrategy SP 1"}


def main(folder: Path) -> None:
    rows = []
    for path in sorted(folder.glob("*.jsonl")):
        runs = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        for point in sorted({(r["shape"], r["seq"]) for r in runs}):
            by_variant = {r["variant"]: r for r in runs if (r["shape"], r["seq"]) == point}
            raw = by_variant.get("raw")
            for variant, r in by_variant.items():
                ratio = r["step_time_median_s"] / raw["step_time_median_s"] if raw else float("nan")
                rows.append((path.stem, *point, variant, r, ratio))
    lines = ["| run | shape | seq | variant | step (s, median) | ratio to (a) | tokens/s | MFU | peak GiB |",
             "|---|---|---|---|---|---|---|---|---|"]
    for run, shape, seq, variant, r, ratio in rows:
        lines.append(f"| {run} | {shape} | {seq} | {LABELS[variant]} | {r['step_time_median_s']:.4f} | {ratio:.4f} |"
                     f" {r['tokens_per_s']:.0f} | {r['mfu']:.3f} | {r['peak_memory_gib']:.1f} |")
    (folder / "table.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    labels = [f"{run.split('-')[0]}\n{shape} {seq // 1024}K" for run, shape, seq, variant, _, _ in rows if variant == "raw"]
    figure, axis = plt.subplots(figsize=(8, 3.5))
    width = 0.27
    for offset, variant in enumerate(["raw", "lightning-stock", "lightning"]):
        values = [ratio for run, shape, seq, v, _, ratio in rows if v == variant]
        positions = [i + (offset - 1) * width for i, (run, shape, seq, v, _, _) in
                     enumerate([row for row in rows if row[3] == "raw"])
                     if any(row[0] == run and row[1] == shape and row[2] == seq and row[3] == variant for row in rows)]
        axis.bar(positions, values, width, label=LABELS[variant])
    axis.axhline(1.01, color="gray", linestyle="--", linewidth=1, label="target 1.01")
    axis.set_xticks(range(len(labels)), labels)
    axis.set_ylim(0.85, 1.1)
    axis.set_ylabel("step time / (a)")
    axis.set_title("Step-time overhead on one H200 (bf16, ZeRO-3, activation checkpointing)")
    axis.legend(fontsize=7, loc="lower right")
    figure.tight_layout()
    figure.savefig(folder / "overhead.png", dpi=120)


if __name__ == "__main__":
    main(Path(sys.argv[1]))
