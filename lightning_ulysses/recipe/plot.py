"""Line plots written as PNG with the standard library alone (zlib): the recipes' loss plot, without matplotlib.

The recipes draw one small plot per run (`summary.write_loss_plot`); matplotlib is not a dependency of the project
(nor of its extras), and a plot of a few hundred points needs only lines, axes and digits. So this module draws on an
RGB raster: Bresenham lines, square markers, and text in a 5×7 pixel font (digits, the letters of the axis and
legend labels; other characters are left blank), and writes it as an 8-bit RGB PNG (one IDAT chunk, no filter).
"""

from __future__ import annotations

import math
import struct
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

Color = tuple[int, int, int]
BLACK, GREY, WHITE = (0, 0, 0), (215, 215, 215), (255, 255, 255)
BLUE, ORANGE = (31, 119, 180), (255, 127, 14)

# 5×7 glyphs: 7 rows of 5 columns each, top to bottom ('#' = ink).
_GLYPHS = {
    "0": ".###. #...# #..## #.#.# ##..# #...# .###.", "1": "..#.. .##.. ..#.. ..#.. ..#.. ..#.. .###.",
    "2": ".###. #...# ....# ...#. ..#.. .#... #####", "3": "##### ...#. ..#.. ...#. ....# #...# .###.",
    "4": "...#. ..##. .#.#. #..#. ##### ...#. ...#.", "5": "##### #.... ####. ....# ....# #...# .###.",
    "6": "..##. .#... #.... ####. #...# #...# .###.", "7": "##### ....# ...#. ..#.. .#... .#... .#...",
    "8": ".###. #...# #...# .###. #...# #...# .###.", "9": ".###. #...# #...# .#### ....# ...#. .##..",
    ".": "..... ..... ..... ..... ..... .##.. .##..", "-": "..... ..... ..... ##### ..... ..... .....",
    "+": "..... ..#.. ..#.. ##### ..#.. ..#.. .....", "/": "..... ....# ...#. ..#.. .#... #.... .....",
    "a": "..... ..... .###. ....# .#### #...# .####", "e": "..... ..... .###. #...# ##### #.... .###.",
    "i": "..#.. ..... .##.. ..#.. ..#.. ..#.. .###.", "l": ".##.. ..#.. ..#.. ..#.. ..#.. ..#.. .###.",
    "n": "..... ..... #.##. ##..# #...# #...# #...#", "o": "..... ..... .###. #...# #...# #...# .###.",
    "p": "..... ..... ####. #...# ####. #.... #....", "r": "..... ..... #.##. ##..# #.... #.... #....",
    "s": "..... ..... .#### #.... .###. ....# ####.", "t": ".#... .#... ###.. .#... .#... .#..# ..##.",
    "v": "..... ..... #...# #...# #...# .#.#. ..#..",
}
_GLYPH_W, _GLYPH_H = 5, 7


@dataclass(frozen=True)
class Series:
    """One curve: `points` (x, y), drawn as a line, or as square markers joined by a thin line (`markers`)."""

    label: str
    points: Sequence[tuple[float, float]]
    color: Color
    markers: bool = False


class Canvas:
    """An RGB raster, white, `width` × `height` pixels; (0, 0) is the top left."""

    def __init__(self, width: int, height: int) -> None:
        self.width, self.height = width, height
        self.pixels = bytearray(WHITE * (width * height))

    def dot(self, x: int, y: int, color: Color, size: int = 1) -> None:
        for dy in range(size):
            for dx in range(size):
                px, py = x + dx - size // 2, y + dy - size // 2
                if 0 <= px < self.width and 0 <= py < self.height:
                    at = 3 * (py * self.width + px)
                    self.pixels[at:at + 3] = bytes(color)

    def line(self, x0: int, y0: int, x1: int, y1: int, color: Color, size: int = 1) -> None:
        """Bresenham's line, each point a `size`-pixel square."""
        dx, dy = abs(x1 - x0), -abs(y1 - y0)
        sx, sy = (1 if x0 < x1 else -1), (1 if y0 < y1 else -1)
        error = dx + dy
        while True:
            self.dot(x0, y0, color, size)
            if x0 == x1 and y0 == y1:
                return
            twice = 2 * error
            if twice >= dy:
                error, x0 = error + dy, x0 + sx
            if twice <= dx:
                error, y0 = error + dx, y0 + sy

    def text(self, x: int, y: int, text: str, color: Color = BLACK, scale: int = 2, align: str = "left") -> None:
        """`text` with its top at `y`, starting at `x` (`align="right"`: ending there; `"center"`: centred on it)."""
        advance = (_GLYPH_W + 1) * scale
        width = advance * len(text) - scale
        x -= {"left": 0, "right": width, "center": width // 2}[align]
        for index, char in enumerate(text):
            glyph = _GLYPHS.get(char, "").replace(" ", "")
            for cell in range(len(glyph)):
                if glyph[cell] == "#":
                    row, column = divmod(cell, _GLYPH_W)
                    for dy in range(scale):
                        for dx in range(scale):
                            self.dot(x + index * advance + column * scale + dx, y + row * scale + dy, color)

    def png(self) -> bytes:
        """The raster as an 8-bit RGB PNG."""
        stride = 3 * self.width
        rows = b"".join(b"\x00" + bytes(self.pixels[y * stride:(y + 1) * stride]) for y in range(self.height))

        def chunk(kind: bytes, data: bytes) -> bytes:
            return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

        header = struct.pack(">IIBBBBB", self.width, self.height, 8, 2, 0, 0, 0)  # 8 bits, RGB, no interlace
        return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(rows, 9))
                + chunk(b"IEND", b""))


def _ticks(low: float, high: float, count: int = 5) -> list[float]:
    """About `count` round values (1, 2 or 5 × a power of ten apart) covering [low, high]."""
    if high <= low:
        return [low]
    raw = (high - low) / count
    power = 10 ** math.floor(math.log10(raw))
    step = next(m * power for m in (1, 2, 5, 10) if m * power >= raw)
    first = math.ceil(low / step - 1e-9) * step
    return [first + i * step for i in range(int((high - first) / step + 1e-9) + 1)]


def _label(value: float, step: float) -> str:
    decimals = max(0, -math.floor(math.log10(step))) if step > 0 else 0
    return f"{value:.{min(decimals, 6)}f}"


def line_plot_png(series: Sequence[Series], path: Path, x_label: str, width: int = 640,
                  height: int = 400) -> Path:
    """`series` on shared axes (x and y from their data, y padded by 5%), with tick labels, `x_label` under the x
    axis and a legend above the plot, written to `path` as PNG. Series without points are left out."""
    series = [s for s in series if s.points]
    xs = [x for s in series for x, _ in s.points] or [0.0]
    ys = [y for s in series for _, y in s.points] or [0.0]
    x_low, x_high = min(xs), max(xs)
    if x_high == x_low:
        x_high = x_low + 1
    pad = (max(ys) - min(ys)) * 0.05 or max(abs(max(ys)) * 0.05, 1e-3)
    y_low, y_high = min(ys) - pad, max(ys) + pad
    left, right, top, bottom = 86, width - 20, 40, height - 52
    canvas = Canvas(width, height)

    def at(x: float, y: float) -> tuple[int, int]:
        return (round(left + (x - x_low) / (x_high - x_low) * (right - left)),
                round(bottom - (y - y_low) / (y_high - y_low) * (bottom - top)))

    y_ticks = [t for t in _ticks(y_low, y_high) if y_low <= t <= y_high]
    for tick in y_ticks:
        _, y = at(x_low, tick)
        canvas.line(left, y, right, y, GREY)
        canvas.text(left - 8, y - 7, _label(tick, y_ticks[1] - y_ticks[0] if len(y_ticks) > 1 else tick), align="right")
    x_ticks = [t for t in _ticks(x_low, x_high, 6) if x_low <= t <= x_high]
    for tick in x_ticks:
        x, _ = at(tick, y_low)
        canvas.line(x, bottom, x, bottom + 5, BLACK)
        canvas.text(x, bottom + 10, _label(tick, max(1.0, x_ticks[1] - x_ticks[0]) if len(x_ticks) > 1 else 1.0),
                    align="center")
    canvas.line(left, top, left, bottom, BLACK)
    canvas.line(left, bottom, right, bottom, BLACK)
    canvas.text((left + right) // 2, height - 20, x_label, align="center")
    legend_x = left
    for s in series:
        canvas.line(legend_x, 18, legend_x + 24, 18, s.color, 3)
        if s.markers:
            canvas.dot(legend_x + 12, 18, s.color, 7)
        canvas.text(legend_x + 32, 12, s.label)
        legend_x += 32 + (_GLYPH_W + 1) * 2 * len(s.label) + 24
    for s in series:
        points = [at(x, y) for x, y in sorted(s.points)]
        for (x0, y0), (x1, y1) in zip(points, points[1:]):
            canvas.line(x0, y0, x1, y1, s.color, 1 if s.markers else 2)
        for x, y in points if s.markers or len(points) == 1 else ():
            canvas.dot(x, y, s.color, 7)
    path = Path(path)
    path.write_bytes(canvas.png())
    return path
