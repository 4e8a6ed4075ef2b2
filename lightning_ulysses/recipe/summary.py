"""The end of a recipe run on the console (global rank 0): the training loss from first to last, tokens per second,
where the logs, the loss plot, the checkpoint and the export went; and `loss.png` in the run folder.

Everything is read back from the CSV logger's `metrics.csv` (what the run logged, every `log_every_n_steps`
optimizer steps), so the summary shows what the logs hold.
"""

from __future__ import annotations

import csv
import statistics
from pathlib import Path
from typing import Iterable, Mapping, Optional

from lightning_ulysses.recipe.plot import BLUE, ORANGE, Series, line_plot_png

TRAIN_LOSS, VAL_LOSS, TOKENS_PER_S = "train/loss", "val/loss", "throughput/tokens_per_s"
LOSS_PLOT = "loss.png"


def read_metrics(path: Path) -> dict[int, dict[str, float]]:
    """`metrics.csv` by optimizer step: every column with a value at that step (Lightning writes a step's training
    and validation values in rows of their own; they are merged)."""
    steps: dict[int, dict[str, float]] = {}
    with open(path, newline="") as handle:
        for row in csv.DictReader(handle):
            if row.get("step"):
                steps.setdefault(int(float(row["step"])), {}).update(
                    {key: float(value) for key, value in row.items() if value and key != "step"})
    return dict(sorted(steps.items()))


def column(metrics: Mapping[int, Mapping[str, float]], name: str) -> list[tuple[int, float]]:
    """(step, value) of every step that logged `name`, in step order."""
    return [(step, values[name]) for step, values in metrics.items() if name in values]


def write_loss_plot(metrics: Mapping[int, Mapping[str, float]], path: Path) -> Optional[Path]:
    """`train/loss` (a line) and `val/loss` (markers) against the optimizer step, as PNG at `path`; None (nothing
    written) when neither was logged."""
    series = [Series(TRAIN_LOSS, column(metrics, TRAIN_LOSS), BLUE),
              Series(VAL_LOSS, column(metrics, VAL_LOSS), ORANGE, markers=True)]
    if not any(s.points for s in series):
        return None
    return line_plot_png(series, path, x_label="step")


def _from_to(points: list[tuple[int, float]]) -> str:
    (first_step, first), (last_step, last) = points[0], points[-1]
    return f"{first:.4g} (step {first_step}) → {last:.4g} (step {last_step})"


def summary_lines(metrics: Mapping[int, Mapping[str, float]]) -> list[str]:
    """The loss from the first to the last logged step (training, and validation when it ran) and the median
    tokens/s of the logged steps after the first one (its time holds the warm-up)."""
    lines = []
    for name in (TRAIN_LOSS, VAL_LOSS):
        points = column(metrics, name)
        if points:
            lines.append(f"{name:<13}{_from_to(points)}")
    if not lines:
        lines.append(f"{TRAIN_LOSS:<13}not logged")
    speeds = [value for _, value in column(metrics, TOKENS_PER_S)]
    timed = speeds[1:] or speeds
    if timed:
        which = ("one logged step" if len(speeds) == 1 else "the logged step after the first" if len(timed) == 1
                 else f"median of {len(timed)} logged steps after the first")
        lines.append(f"{'tokens/s':<13}{statistics.median(timed):,.0f} ({which})")
    return lines


def run_summary(run_dir: Path, metrics_csv: Optional[Path], checkpoint: Optional[str],
                exports: Iterable[Path]) -> str:
    """What a recipe prints at the end of a run (see the module docstring); writes `run_dir/loss.png`."""
    lines = [f"Run summary ({run_dir}):"]
    plot = None
    if metrics_csv is not None and Path(metrics_csv).is_file():
        metrics = read_metrics(Path(metrics_csv))
        lines += [f"  {line}" for line in summary_lines(metrics)]
        plot = write_loss_plot(metrics, Path(run_dir) / LOSS_PLOT)
    lines.append(f"  {'metrics':<13}{metrics_csv if metrics_csv is not None else 'no CSV logger'}")
    if plot is not None:
        lines.append(f"  {'loss plot':<13}{plot}")
    if checkpoint:
        lines.append(f"  {'checkpoint':<13}{checkpoint} (weights and save_pretrained folders: python -m"
                     f" lightning_ulysses checkpoint export {checkpoint} <folder>)")
    for folder in map(Path, exports):
        if (folder / "adapter").is_dir():  # a LoRA model's folders (lightning_ulysses.integration.export)
            written = [f"{folder / 'adapter'} (PeftModel.from_pretrained(base, folder))"]
            if (folder / "merged").is_dir():
                written.append(f"{folder / 'merged'} (AutoModelForCausalLM.from_pretrained)")
        else:
            written = [f"{folder} (AutoModelForCausalLM.from_pretrained)"]
        lines += [f"  {'export':<13}{entry}" for entry in written]
    return "\n".join(lines)
