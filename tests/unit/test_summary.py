"""The recipes' end-of-run summary and loss plot (`lightning_ulysses.recipe.summary`, `lightning_ulysses.recipe.plot`) from a
metrics.csv as Lightning's CSV logger writes it. Through a real run: tests/recipes/test_finetune.py."""

from __future__ import annotations

import struct
import zlib
from pathlib import Path

import pytest

from lightning_ulysses.recipe.plot import BLUE, ORANGE
from lightning_ulysses.recipe.summary import read_metrics, run_summary

# Lightning's CSV logger: the union of the columns; a step's training values, learning rates and validation values
# in rows of their own, empty cells elsewhere.
CSV = """epoch,lr/pg1,step,throughput/tokens_per_s,train/loss,val/loss
,0.001,4,,,
0,,4,900.0,5.72,
0,,9,1400.0,5.31,
0,,9,,,5.40
0,,14,1200.0,4.95,
0,,19,1300.0,4.51,
0,,19,,,4.80
"""


def read_png(path: Path) -> tuple[int, int, list[list[tuple[int, int, int]]]]:
    """(width, height, rows of RGB pixels) of an 8-bit RGB, non-interlaced PNG whose rows use no filter (what
    `plot.Canvas.png` writes); anything else fails the test."""
    data = Path(path).read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    at, chunks = 8, {}
    while at < len(data):
        (length,), kind = struct.unpack(">I", data[at:at + 4]), data[at + 4:at + 8]
        body = data[at + 8:at + 8 + length]
        assert struct.unpack(">I", data[at + 8 + length:at + 12 + length])[0] == zlib.crc32(kind + body)
        chunks[kind] = chunks.get(kind, b"") + body
        at += 12 + length
    width, height, depth, color, _, _, interlace = struct.unpack(">IIBBBBB", chunks[b"IHDR"])
    assert (depth, color, interlace) == (8, 2, 0) and b"IEND" in chunks
    raw, stride = zlib.decompress(chunks[b"IDAT"]), 1 + 3 * width
    assert len(raw) == height * stride and all(raw[y * stride] == 0 for y in range(height))
    rows = [[tuple(raw[y * stride + 1 + 3 * x:y * stride + 4 + 3 * x]) for x in range(width)] for y in range(height)]
    return width, height, rows


def curve(rows, color) -> dict[int, list[int]]:
    """Column → the rows where `color` is drawn, below the legend (its first 30 rows)."""
    found: dict[int, list[int]] = {}
    for y, row in enumerate(rows[30:], start=30):
        for x, pixel in enumerate(row):
            if pixel == color:
                found.setdefault(x, []).append(y)
    return found


@pytest.fixture
def run(tmp_path) -> Path:
    (tmp_path / "logs").mkdir()
    (tmp_path / "logs" / "metrics.csv").write_text(CSV)
    return tmp_path


def test_metrics_are_merged_by_step(run):
    metrics = read_metrics(run / "logs" / "metrics.csv")
    assert list(metrics) == [4, 9, 14, 19]
    assert metrics[9] == {"epoch": 0.0, "throughput/tokens_per_s": 1400.0, "train/loss": 5.31, "val/loss": 5.40}


def test_the_summary_says_first_to_last_loss_tokens_per_second_and_where_things_are(run):
    (run / "export").mkdir()
    text = run_summary(run, run / "logs" / "metrics.csv", str(run / "checkpoints" / "last.ckpt"), [run / "export"])
    lines = text.splitlines()
    assert lines[0] == f"Run summary ({run}):"
    assert "  train/loss   5.72 (step 4) → 4.51 (step 19)" in lines
    assert "  val/loss     5.4 (step 9) → 4.8 (step 19)" in lines
    # the median of the steps after the first (900 is its warm-up): 1200, 1300, 1400
    assert "  tokens/s     1,300 (median of 3 logged steps after the first)" in lines
    assert f"  loss plot    {run / 'loss.png'}" in lines
    assert any(line.startswith(f"  checkpoint   {run / 'checkpoints' / 'last.ckpt'} ") for line in lines)
    assert f"  export       {run / 'export'} (AutoModelForCausalLM.from_pretrained)" in lines


def test_a_lora_export_names_its_adapter_and_merged_folders(run):
    for name in ("adapter", "merged"):
        (run / "export" / name).mkdir(parents=True)
    text = run_summary(run, run / "logs" / "metrics.csv", None, [run / "export"])
    assert f"  export       {run / 'export' / 'adapter'} (PeftModel.from_pretrained(base, folder))" in text
    assert f"  export       {run / 'export' / 'merged'} (AutoModelForCausalLM.from_pretrained)" in text
    assert "checkpoint" not in text


def test_the_loss_plot_draws_the_falling_training_loss_and_the_validation_points(run):
    run_summary(run, run / "logs" / "metrics.csv", None, [])
    width, height, rows = read_png(run / "loss.png")
    assert (width, height) == (640, 400)
    train, val = curve(rows, BLUE), curve(rows, ORANGE)
    # the line spans the steps from left to right and falls: its first point is the highest, its last the lowest
    first, last = min(train), max(train)
    assert last - first > 400
    assert max(train[first]) < min(train[last]) - 200
    # two validation markers (7 × 7 squares), the second lower than the first
    columns = sorted(x for x, ys in val.items() if len(ys) >= 7)
    left, right = [x for x in columns if x < width // 2], [x for x in columns if x > width // 2]
    assert len(left) >= 7 and len(right) >= 7
    assert min(val[left[3]]) < min(val[right[3]])


def test_no_plot_without_a_logged_loss(tmp_path):
    (tmp_path / "metrics.csv").write_text("epoch,step,throughput/tokens_per_s\n0,0,10.0\n")
    text = run_summary(tmp_path, tmp_path / "metrics.csv", None, [])
    assert "train/loss   not logged" in text and "tokens/s     10 (one logged step)" in text
    assert not (tmp_path / "loss.png").exists() and "loss plot" not in text
