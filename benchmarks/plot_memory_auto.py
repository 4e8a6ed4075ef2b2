"""Plot memory_auto.jsonl: tokens/s of memory="auto", the hand-picked configuration and plain HF + DeepSpeed per
point, and auto's predicted against measured step time and GPU peak.

    python benchmarks/plot_memory_auto.py OUT.png benchmarks/results/2026-12-02-h200-memory-auto/memory_auto.jsonl

A run's tokens/s is its last timed step's (the first steps after the warm-up still settle: 8B 8K's two steps were
1.75 and 1.47 s); out-of-memory runs are drawn as an empty bar marked "OOM".
"""

import json
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

VARIANTS = {"auto": "memory=\"auto\"", "hand": "hand-picked", "raw": "plain HF + DeepSpeed"}


def main(out: str, *files: str) -> None:
    runs = [json.loads(line) for name in files for line in open(name) if line.strip()]
    # the same-run baselines of a change (`--zero3-leaf-layers off`, `--mlp-recompute run`) are not auto's own runs
    runs = [r for r in runs if r.get("zero3_leaf_layers", "on") == "on" and r.get("mlp_recompute", "left-out")
            == "left-out"]
    points = sorted({(r["shape"], r["seq"]) for r in runs}, key=lambda p: (p[0] != "1b", p[1]))
    fig, (speed, model) = plt.subplots(1, 2, figsize=(12, 4.5))
    width = 0.8 / len(VARIANTS)
    for v, (variant, label) in enumerate(VARIANTS.items()):
        for p, point in enumerate(points):
            run = next((r for r in runs if (r["shape"], r["seq"]) == point and r["variant"] == variant
                        and (r.get("step_times_s") or r.get("error", "").startswith("OOM"))), None)
            if run is None:
                continue
            x = p + (v - 1) * width
            if run.get("step_times_s"):
                speed.bar(x, run["seq"] / run["step_times_s"][-1], width, color=f"C{v}", label=label if p == 0 or
                          label not in speed.get_legend_handles_labels()[1] else None)
            else:
                speed.annotate("OOM", (x, 0.02), xycoords=("data", "axes fraction"), rotation=90, ha="center",
                               va="bottom", fontsize=8, color=f"C{v}")
    speed.set_xticks(range(len(points)), [f"{s.upper()}\n{n // 1024}K" for s, n in points])
    speed.set_ylabel("tokens/s (one H200)")
    speed.set_yscale("log")
    speed.legend()
    speed.set_title("memory=\"auto\" against the alternatives")
    auto = [r for r in runs if r["variant"] == "auto" and r.get("step_times_s") and r.get("choice")]
    auto = [r for i, r in enumerate(auto) if all((q["shape"], q["seq"]) != (r["shape"], r["seq"]) for q in auto[:i])]
    for r in auto:
        measured, predicted = r["step_times_s"][-1], r["choice"]["predicted_step_s"]
        model.scatter(predicted, measured, color="C0")
        model.annotate(f"{r['shape'].upper()} {r['seq'] // 1024}K\npeak {r['peak_memory_gib']:.1f} GiB (pred. "
                       f"{r['choice']['predicted_device_bytes'] / 2**30:.1f} at run time)", (predicted, measured), fontsize=8,
                       textcoords="offset points", xytext=(8, -24) if r["shape"] == "1b" else (8, -4))
    limits = [0.2, 80]
    model.plot(limits, limits, "k--", linewidth=0.8, label="predicted = measured")
    model.set_xscale("log")
    model.set_yscale("log")
    model.set_xlabel("predicted step (s)")
    model.set_ylabel("measured step (s)")
    model.legend(loc="upper left")
    model.set_title("the step-time and memory model")
    fig.tight_layout()
    fig.savefig(out, dpi=110)


if __name__ == "__main__":
    main(*sys.argv[1:])
