"""Draw the README's two pictures as SVG, from the library's own layout code (no plotting dependency).

    python docs/figures.py [OUTPUT_DIR]      (default docs/figures; scripts/docs.sh runs this)

- `data-flow.svg`: one training step of one SP group of 4 ranks, from the batch to ZeRO. Which tokens each rank
  keeps after the cut comes from `ShardOrder.runs` (lightning_ulysses/parallel/layout.py), the arithmetic the sharder uses.
- `groups.svg`: 8 ranks at `sequence_parallel_size=4`: the SP groups, the DP groups and, with `ring_size=2`, the
  Ulysses and ring sub-groups, all read from `ParallelLayout` (the same object the strategy builds its groups from).

The output is deterministic (same code, same bytes), so the committed SVGs change only when the layout code or this
script does.
"""

from __future__ import annotations

import importlib.util
import sys
from html import escape
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _layout_module():
    """lightning_ulysses/parallel/layout.py alone (it needs only torch), without importing the whole package."""
    spec = importlib.util.spec_from_file_location("_ulysses_layout", ROOT / "lightning_ulysses" / "parallel" / "layout.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


layout = _layout_module()

RANK_COLOURS = ["#4C78A8", "#F58518", "#54A24B", "#B279A2"]
LIGHT = {"#4C78A8": "#DCE6F2", "#F58518": "#FDE5CC", "#54A24B": "#DDEFD9", "#B279A2": "#EEE1EB"}
EMPTY, EDGE, INK, GREY = "#F2F2F2", "#C8C8C8", "#222222", "#6B6B6B"
FONT = "Helvetica, Arial, sans-serif"


class Svg:
    def __init__(self, width: int, height: int):
        self.width, self.height, self.items = width, height, []

    def rect(self, x, y, w, h, fill, stroke=EDGE, rx=0, width=1.0):
        self.items.append(f'<rect x="{x:g}" y="{y:g}" width="{w:g}" height="{h:g}" rx="{rx:g}" fill="{fill}"'
                          f' stroke="{stroke}" stroke-width="{width:g}"/>')

    def line(self, x1, y1, x2, y2, stroke=GREY, width=1.0, dash=None, marker=False):
        extra = f' stroke-dasharray="{dash}"' if dash else ""
        extra += ' marker-end="url(#arrow)"' if marker else ""
        self.items.append(f'<line x1="{x1:g}" y1="{y1:g}" x2="{x2:g}" y2="{y2:g}" stroke="{stroke}"'
                          f' stroke-width="{width:g}"{extra}/>')

    def path(self, d, stroke=GREY, width=1.0, fill="none"):
        self.items.append(f'<path d="{d}" stroke="{stroke}" stroke-width="{width:g}" fill="{fill}"/>')

    def text(self, x, y, content, size=13, colour=INK, anchor="start", weight="normal", mono=False):
        family = "Menlo, Consolas, monospace" if mono else FONT
        self.items.append(f'<text x="{x:g}" y="{y:g}" font-family="{family}" font-size="{size}" fill="{colour}"'
                          f' text-anchor="{anchor}" font-weight="{weight}">{escape(content)}</text>')

    def lines(self, x, y, rows, size=13, colour=INK, leading=1.3, **kwargs):
        for i, row in enumerate(rows):
            self.text(x, y + i * size * leading, row, size, colour, **kwargs)

    def render(self) -> str:
        head = (f'<svg xmlns="http://www.w3.org/2000/svg" width="{self.width}" height="{self.height}"'
                f' viewBox="0 0 {self.width} {self.height}">\n'
                '<defs><marker id="arrow" viewBox="0 0 10 10" refX="9" refY="5" markerWidth="7" markerHeight="7"'
                f' orient="auto-start-reverse"><path d="M0,0 L10,5 L0,10 z" fill="{GREY}"/></marker></defs>\n'
                f'<rect x="0" y="0" width="{self.width}" height="{self.height}" fill="white"/>\n')
        return head + "\n".join(self.items) + "\n</svg>\n"


def data_flow() -> str:
    P, heads, tokens = 4, 4, 16  # SP ranks, attention heads, sequence length (one chunk of N/P = 4 per rank)
    order = layout.ShardOrder(P)
    chunk = tokens // P
    # The chunk each rank holds after the cut, from the sharder's own arithmetic (contiguous without a ring).
    held = [[start // chunk for start, _ in order.runs(tokens, rank)] for rank in range(P)]
    assert held == [[r] for r in range(P)], held

    left, text_w, col_w, cell, size, leading = 20, 400, 130, 18, 13, 17
    grid_x0 = left + text_w + 20
    svg = Svg(grid_x0 + P * col_w + 10, 0)
    svg.text(left, 28, "One training step of one SP group (sequence_parallel_size = 4)", 18, weight="bold")
    svg.text(left, 50, "Grids: columns = the N tokens in 4 chunks, rows = the H attention heads; colour = the rank whose"
             " shard the tokens are after the cut.", 12, GREY)

    def centre(rank):
        return grid_x0 + rank * col_w + col_w / 2

    for rank in range(P):
        svg.text(centre(rank), 82, f"rank {rank}", 13, RANK_COLOURS[rank], "middle", "bold")

    def strip(rank, y, filled, label):
        x0 = centre(rank) - P * 24 / 2
        for c in range(P):
            fill = "#9E9E9E" if filled == "all" else (RANK_COLOURS[c] if c in filled else EMPTY)
            svg.rect(x0 + c * 24, y, 24, cell, fill)
        svg.text(centre(rank), y + cell + 16, label, 11, GREY, "middle")
        return cell + 20

    def grid(rank, y, colour_of, label=None):
        x0 = centre(rank) - P * cell / 2
        for h in range(heads):
            for c in range(P):
                svg.rect(x0 + c * cell, y + h * cell, cell, cell, colour_of(h, c) or EMPTY)
        if label:
            svg.text(centre(rank), y + heads * cell + 15, label, 11, GREY, "middle")
        return heads * cell + (20 if label else 0)

    def describe(y, number, rows, source=None):
        svg.text(left, y + 13, number, 15, weight="bold")
        svg.lines(left + 24, y + 13, rows, size, leading=leading / size)
        height = len(rows) * leading
        if source:
            svg.text(left + 24, y + 13 + height, source, 11, GREY, mono=True)
            height += leading
        return height

    def exchange(y0, y1):
        for a in range(P):
            for b in range(P):
                svg.line(centre(a), y0, centre(b), y1, "#A0A0A0", 0.8)

    def spanning(y, h, fill, stroke, rows):
        svg.rect(grid_x0, y, P * col_w - 10, h, fill, stroke, rx=6)
        svg.lines(grid_x0 + 12, y + 22, rows, 12, leading=1.35)

    gap = 26
    y = 100
    h = describe(y, "1", ["Batch: every rank of the SP group loads the same", "full-length rows [B, N]: the sampler splits",
                          "over DP ranks only"], "strategy.py  distributed_sampler_kwargs")
    for rank in range(P):
        g = strip(rank, y, "all", "N tokens")
    y += max(h, g) + gap

    h = describe(y, "2", ["Fill in global position_ids, pad N to a multiple", "of P, then cut every sequence key (labels",
                          "as given, unshifted) along the sequence:", "rank s keeps tokens [s·N/P, (s+1)·N/P)"],
                 "sharding.py  SequenceSharder")
    for rank in range(P):
        g = strip(rank, y, held[rank], "N/P tokens")
    y += max(h, g) + gap

    h = describe(y, "3", ["The model runs on its shard (embeddings, norms", "and MLPs work per token); q, k, v hold N/P",
                          "tokens of all H heads: [B, H, N/P, d]"], "attention/core.py  ulysses_attention")
    for rank in range(P):
        g = grid(rank, y, lambda hd, c, rank=rank: RANK_COLOURS[c] if c in held[rank] else None)
    y += max(h, g) + 8

    h = describe(y + 10, "4", ["All-to-all over the SP group: heads scattered,", "tokens gathered (fewer KV heads than P:",
                               "replicated first)"], "attention/all_to_all.py  start_exchange")
    exchange(y, y + h + 10)
    y += h + 18

    h = describe(y, "5", ["Local attention, unchanged (sdpa, flash, flex):", "all N tokens of H/P heads, [B, H/P, N, d];",
                          "packed documents and padding read from the", "whole rows the sharder published"],
                 "attention/backends.py, documents.py")
    for rank in range(P):
        g = grid(rank, y, lambda hd, c, rank=rank: RANK_COLOURS[c] if hd == rank else None, f"head {rank}, all tokens")
    y += max(h, g) + 8

    h = describe(y + 10, "6", ["All-to-all back: N/P tokens of all H heads,", "[B, N/P, H, d]; the rest of the model",
                               "runs per token on the shard"])
    exchange(y, y + h + 10)
    y += h + 18
    for rank in range(P):
        g = grid(rank, y, lambda hd, c, rank=rank: RANK_COLOURS[c] if c in held[rank] else None, "N/P tokens, all heads")
    y += g + gap

    h = describe(y, "7", ["SP loss: labels shifted across shard boundaries", "(target of t = label t+1); each rank sums its",
                          "shard's token losses over the all-reduced target", "count; every rank logs the whole mean"],
                 "loss.py  sequence_parallel_cross_entropy")
    spanning(y - 4, h + 4, "#FFF7E0", "#E0C060", ["value: Σ over the SP group of (local sum / global count)",
                                                  "backward: only the local share, × the ZeRO scale",
                                                  "(SP under ZeRO-3's reduce-scatter, else 1)"])
    y += h + gap

    h = describe(y, "8", ["ZeRO over DP × SP: DeepSpeed gets an mpu, so", "ZeRO partitions its state over all ranks of",
                          "every SP and DP group, and reduces the", "gradients over all of them"],
                 "layout.py  DeepSpeedSequenceParallelMPU")
    spanning(y - 4, h + 4, "#E8F1E4", "#8DBB80", ["ZeRO-3 (default): parameters, gradients and",
                                                  "optimizer state, 1/(DP·SP) on each rank;",
                                                  "the update: the mean over DP of whole-sequence gradients"])
    y += h + 16
    svg.height = int(y)
    return svg.render()


def groups() -> str:
    world, sp, devices_per_node = 8, 4, 4
    plan = layout.ParallelLayout(world_size=world, sequence_parallel_size=sp)
    hybrid = plan.with_ring_size(2)
    sp_groups, dp_groups = plan.sequence_parallel_groups(), plan.data_parallel_groups()

    left, box_w, box_h, gap, node_gap = 40, 84, 54, 14, 44
    svg = Svg(940, 0)
    svg.text(20, 30, f"{world} ranks, sequence_parallel_size = {sp}: {plan}", 18, weight="bold")
    svg.text(20, 52, "SP groups are blocks of contiguous ranks (inside a node when SP divides the devices per node, the"
             " default); DP groups stride across them.", 12, GREY)

    def x_of(rank):
        return left + rank * (box_w + gap) + (rank // devices_per_node) * node_gap

    node_top, sp_top = 70, 96
    top = sp_top + 28  # the ranks
    for node in range(world // devices_per_node):
        first, last = node * devices_per_node, (node + 1) * devices_per_node - 1
        x0, x1 = x_of(first) - 14, x_of(last) + box_w + 14
        svg.rect(x0, node_top, x1 - x0, top + box_h + 14 - node_top, "white", "#9A9A9A", rx=8, width=1.2)
        svg.text(x0 + 8, node_top + 17, f"node {node}: {devices_per_node} GPUs", 12, GREY)
    for index, members in enumerate(sp_groups):
        x0, x1 = x_of(members[0]) - 6, x_of(members[-1]) + box_w + 6
        svg.rect(x0, sp_top, x1 - x0, top + box_h + 6 - sp_top, "#F4F4F4", "#777777", rx=6)
        svg.text((x0 + x1) / 2, sp_top + 18, f"SP group {index}: {members} — one sequence, its all-to-alls", 12,
                 INK, "middle")
    for rank in range(world):
        colour = RANK_COLOURS[plan.sequence_parallel_rank(rank)]
        x = x_of(rank)
        svg.rect(x, top, box_w, box_h, LIGHT[colour], colour, rx=4, width=1.6)
        svg.text(x + box_w / 2, top + 22, f"rank {rank}", 14, INK, "middle", "bold")
        svg.text(x + box_w / 2, top + 41, f"SP {plan.sequence_parallel_rank(rank)} · DP {plan.data_parallel_rank(rank)}",
                 11, GREY, "middle")
    # DP groups: arcs joining the ranks of each, below the nodes
    base = top + box_h + 30
    for index, members in enumerate(dp_groups):
        colour = RANK_COLOURS[index]
        depth = 30 + 16 * index
        for a, b in zip(members, members[1:]):
            xa, xb = x_of(a) + box_w / 2, x_of(b) + box_w / 2
            svg.line(xa, top + box_h, xa, base, colour, 1.8)
            svg.line(xb, top + box_h, xb, base, colour, 1.8)
            svg.path(f"M{xa:g},{base:g} C{xa:g},{base + depth:g} {xb:g},{base + depth:g} {xb:g},{base:g}", colour, 1.8)
    y = base + 30 + 16 * len(dp_groups) + 10
    x = 20
    svg.text(x, y, "DP groups:", 12, INK, weight="bold")
    x += 78
    for index, members in enumerate(dp_groups):
        svg.text(x, y, f"{members}", 12, RANK_COLOURS[index], weight="bold")
        x += 62
    svg.text(x + 6, y, "— the same SP rank of every SP group: different samples, the same shard positions", 12, INK)
    y += 22
    svg.rect(20, y, svg.width - 40, 30, "#E8F1E4", "#8DBB80", rx=6)
    svg.text(svg.width / 2, y + 20, f"ZeRO partitions its state over all {world} ranks (DP × SP) and reduces gradients"
             " over all of them", 12, INK, "middle")
    y += 60
    svg.text(20, y, f"With ring_size = 2 (hybrid, for SP sizes the heads cannot follow): {hybrid}", 13, INK,
             weight="bold")
    svg.text(20, y + 22, "Ulysses sub-groups (all-to-alls, adjacent ranks):", 12)
    svg.text(340, y + 22, f"{hybrid.ulysses_groups()}", 12, mono=True)
    svg.text(20, y + 42, "ring sub-groups (K/V blocks passed around):", 12)
    svg.text(340, y + 42, f"{hybrid.ring_groups()}", 12, mono=True)
    svg.height = int(y + 58)
    return svg.render()


def main(argv: list[str]) -> int:
    output = Path(argv[0]) if argv else ROOT / "docs" / "figures"
    output.mkdir(parents=True, exist_ok=True)
    for name, draw in (("data-flow.svg", data_flow), ("groups.svg", groups)):
        (output / name).write_text(draw(), encoding="utf-8")
        print(output / name)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
