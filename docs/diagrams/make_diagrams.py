"""Draws the documentation's diagrams as plain SVG (no dependencies, no network):

    python docs/diagrams/make_diagrams.py      # rewrites docs/diagrams/*.svg

* ``data-flow.svg``: one layer's forward, backward and optimizer step on 3 ranks (concepts.md).
* ``z2-z3.svg``: when each layer's packed buffer is broadcast and how long it lives, Z2 against Z3.
* ``hsdp.svg``: HSDP's two stages on 2 replica groups x 2 shard ranks.

Each is drawn narrow (480 units) with 14-16 unit text, so it stays legible when a phone scales it
to ~350 px; the pages link each file for a full-size view. tests/test_docs.py checks that the
committed files are what this script draws.
"""

from __future__ import annotations

import os
from html import escape

HERE = os.path.dirname(os.path.abspath(__file__))
WIDTH = 480
INK, MUTED, LINE = "#1f2328", "#57606a", "#8c959f"
WEIGHT_COLOURS = {"A": "#4c78a8", "B": "#f58518", "C": "#54a24b"}
FONT = 'font-family="DejaVu Sans, Helvetica, Arial, sans-serif"'


class Svg:
    """A list of SVG elements with the few shapes the diagrams use."""

    def __init__(self, height: int, title: str):
        self.height, self.title, self.parts = height, title, []

    def text(self, x, y, s, *, size=15, anchor="middle", weight="normal", fill=INK):
        self.parts.append(
            f'<text x="{x}" y="{y}" font-size="{size}" text-anchor="{anchor}" '
            f'font-weight="{weight}" fill="{fill}">{escape(s)}</text>'
        )

    def box(self, x, y, w, h, *, fill="#ffffff", stroke=LINE, label=None, size=15, colour=INK, dash=False):
        extra = ' stroke-dasharray="5 4"' if dash else ""
        self.parts.append(
            f'<rect x="{x}" y="{y}" width="{w}" height="{h}" rx="5" fill="{fill}" '
            f'stroke="{stroke}" stroke-width="1.5"{extra}/>'
        )
        if label is not None:
            self.text(x + w / 2, y + h / 2 + size * 0.35, label, size=size, fill=colour)

    def arrow(self, x1, y1, x2, y2, *, colour=INK, width=2.0):
        self.parts.append(
            f'<line x1="{x1}" y1="{y1}" x2="{x2}" y2="{y2}" stroke="{colour}" '
            f'stroke-width="{width}" marker-end="url(#head)"/>'
        )

    def line(self, x1, y1, x2, y2, *, colour=LINE, width=1.5):
        self.parts.append(f'<line x1="{x1}" y1="{y1}" x2="{x2}" y2="{y2}" stroke="{colour}" stroke-width="{width}"/>')

    def render(self) -> str:
        head = (
            '<defs><marker id="head" viewBox="0 0 10 10" refX="9" refY="5" markerWidth="7" markerHeight="7" '
            f'orient="auto-start-reverse"><path d="M0,0 L10,5 L0,10 z" fill="{INK}"/></marker></defs>'
        )
        svg = (
            f'<svg xmlns="http://www.w3.org/2000/svg" viewBox="0 0 {WIDTH} {self.height}" '
            f'width="{WIDTH}" height="{self.height}" role="img" aria-label="{escape(self.title)}" {FONT}>\n'
            f"<title>{escape(self.title)}</title>\n{head}\n"
            f'<rect width="{WIDTH}" height="{self.height}" fill="#ffffff"/>\n' + "\n".join(self.parts) + "\n</svg>\n"
        )
        return svg


def _packed(svg: Svg, x, y, w, h, prefix=""):
    """A packed per-layer buffer: the layer's three weights side by side."""
    third = w / 3
    for i, name in enumerate("ABC"):
        svg.box(
            x + i * third,
            y,
            third,
            h,
            fill=WEIGHT_COLOURS[name],
            stroke="#ffffff",
            label=prefix + name,
            colour="#ffffff",
            size=14,
        )


def data_flow() -> Svg:
    """Forward: owners broadcast into every rank's packed buffer; backward: each gradient is reduced
    to its owner; step: each owner updates what it owns, with no collective."""
    svg = Svg(690, "DMuon's data flow for one layer on 3 ranks: forward, backward, step")
    cols = [20 + i * 150 for i in range(3)]
    col_w = 140
    svg.text(WIDTH / 2, 24, "One layer with weights A, B, C on 3 ranks", size=16, weight="bold")
    for i, x in enumerate(cols):
        svg.text(x + col_w / 2, 48, f"rank {i}", size=15, weight="bold", fill=MUTED)

    # forward
    y = 66
    svg.text(10, y + 12, "1  Forward", size=15, anchor="start", weight="bold")
    for _i, (x, name) in enumerate(zip(cols, "ABC")):
        svg.box(
            x + 20, y + 24, col_w - 40, 30, fill="#ffffff", stroke=WEIGHT_COLOURS[name], label=f"owns {name}", size=14
        )
        svg.arrow(x + col_w / 2, y + 56, x + col_w / 2, y + 78)
    svg.box(20, y + 82, 440, 26, fill="#eef1f4", label="broadcast from the owners (one launch per layer)", size=14)
    for x in cols:
        svg.arrow(x + col_w / 2, y + 110, x + col_w / 2, y + 130)
        _packed(svg, x, y + 134, col_w, 28)
    svg.text(WIDTH / 2, y + 184, "every rank runs the layer on its full weights", size=14, fill=MUTED)

    # backward
    y = 276
    svg.line(10, y - 8, WIDTH - 10, y - 8)
    svg.text(10, y + 12, "2  Backward", size=15, anchor="start", weight="bold")
    for x in cols:
        _packed(svg, x, y + 24, col_w, 28, prefix="∇")
        svg.arrow(x + col_w / 2, y + 54, x + col_w / 2, y + 76)
    svg.box(20, y + 80, 440, 26, fill="#eef1f4", label="reduce (average) each gradient to its owner", size=14)
    for x, name in zip(cols, "ABC"):
        svg.arrow(x + col_w / 2, y + 108, x + col_w / 2, y + 128)
        svg.box(
            x + 20,
            y + 132,
            col_w - 40,
            28,
            fill=WEIGHT_COLOURS[name],
            stroke="#ffffff",
            label=f"mean ∇{name}",
            colour="#ffffff",
            size=14,
        )
    svg.text(WIDTH / 2, y + 182, "the other ranks drop their copies", size=14, fill=MUTED)

    # step
    y = 484
    svg.line(10, y - 8, WIDTH - 10, y - 8)
    svg.text(10, y + 12, "3  Optimizer step", size=15, anchor="start", weight="bold")
    for x, name in zip(cols, "ABC"):
        svg.box(x + 5, y + 24, col_w - 10, 84, fill="#ffffff", stroke=WEIGHT_COLOURS[name])
        svg.text(x + col_w / 2, y + 46, f"momentum of {name}", size=14)
        svg.text(x + col_w / 2, y + 70, "Newton–Schulz", size=14)
        svg.text(x + col_w / 2, y + 94, f"update {name}", size=14)
    svg.text(WIDTH / 2, y + 132, "no collective: each matrix is orthogonalised", size=14, fill=MUTED)
    svg.text(WIDTH / 2, y + 152, "once, by its owner; the next forward", size=14, fill=MUTED)
    svg.text(WIDTH / 2, y + 172, "broadcasts the updated weights", size=14, fill=MUTED)
    return svg


def _gantt(svg: Svg, y0: int, title: str, keep_until_backward: bool, note: list[str]):
    """Layers 1-4 as rows, the step's 8 phases (forward 1-4, backward 4-1) as columns: a bar where
    the layer's packed buffer lives, a dot where it is broadcast."""
    layers, x0, cell, row = 4, 92, 46, 30
    phases = [f"F{i}" for i in range(1, layers + 1)] + [f"B{i}" for i in range(layers, 0, -1)]
    svg.text(10, y0 + 16, title, size=15, anchor="start", weight="bold")
    for j, p in enumerate(phases):
        svg.text(x0 + j * cell + cell / 2, y0 + 40, p, size=14, fill=MUTED)
    for layer in range(1, layers + 1):
        y = y0 + 50 + (layer - 1) * row
        svg.text(x0 - 8, y + 19, f"layer {layer}", size=14, anchor="end")
        fwd, bwd = layer - 1, 2 * layers - layer  # column of the layer's forward and backward
        spans = [(fwd, bwd)] if keep_until_backward or layer == layers else [(fwd, fwd), (bwd, bwd)]
        for a, b in spans:
            svg.box(x0 + a * cell + 3, y + 4, (b - a + 1) * cell - 6, row - 8, fill="#9ecae9", stroke="#4c78a8")
            svg.parts.append(f'<circle cx="{x0 + a * cell + 12}" cy="{y + row / 2}" r="6" fill="#e45756"/>')
    svg.line(x0 + layers * cell, y0 + 26, x0 + layers * cell, y0 + 50 + layers * row, colour=INK)
    for k, s in enumerate(note):
        svg.text(10, y0 + 50 + layers * row + 22 + 20 * k, s, size=14, anchor="start")


def z2_z3() -> Svg:
    svg = Svg(540, "When each layer's packed buffer is broadcast and held: DMuon-Z2 against DMuon-Z3")
    svg.parts.append('<circle cx="20" cy="20" r="6" fill="#e45756"/>')
    svg.text(32, 25, "broadcast from the owners", size=14, anchor="start")
    svg.box(250, 11, 36, 18, fill="#9ecae9", stroke="#4c78a8")
    svg.text(294, 25, "buffer held", size=14, anchor="start")
    _gantt(
        svg,
        44,
        "DMuon-Z2 (reshard_after_forward=False)",
        True,
        ["1 broadcast per layer: the traffic floor", "end of forward: every layer's weights (P_M)"],
    )
    svg.line(10, 300, WIDTH - 10, 300)
    _gantt(
        svg,
        306,
        "DMuon-Z3 (reshard_after_forward=True)",
        False,
        ["2 broadcasts per layer, 1 for the last layer", "at most two layers' weights at a time"],
    )
    return svg


def hsdp() -> Svg:
    svg = Svg(580, "HSDP's two stages for one matrix on 2 replica groups x 2 shard ranks")
    svg.text(WIDTH / 2, 24, "Weight A on 2 replica groups × 2 shard ranks", size=16, weight="bold")

    def groups(y, labels):
        """Two dashed replica groups of two ranks; returns the rank boxes' (left, right, top, bottom)."""
        for g in range(2):
            gx = 20 + g * 230
            svg.box(gx, y, 210, 150, fill="#f6f8fa", dash=True)
            svg.text(gx + 105, y + 20, f"replica group {g}", size=14, fill=MUTED)
            for s in range(2):
                colour = WEIGHT_COLOURS["A"] if s == 0 else LINE
                svg.box(gx + 15, y + 30 + s * 70, 180, 40, fill="#ffffff", stroke=colour, label=labels[g][s], size=14)

    y = 44
    svg.text(10, y + 14, "1  Backward: reduce twice", size=15, anchor="start", weight="bold")
    top = y + 26
    groups(top, [["rank (0,0): global owner", "rank (0,1)"], ["rank (1,0): shard owner", "rank (1,1)"]])
    for gx in (20, 250):
        svg.arrow(gx + 105, top + 99, gx + 105, top + 73)
        svg.text(gx + 115, top + 91, "①", size=15, anchor="start")
    svg.arrow(263, top + 50, 217, top + 50)
    svg.text(240, top + 42, "②", size=15)
    svg.text(10, y + 200, "① to the shard owner in each group (divisor N)", size=14, anchor="start")
    svg.text(10, y + 220, "② across the groups to one global owner (R · N in all)", size=14, anchor="start")
    svg.text(10, y + 240, "which alone keeps the momentum, runs Newton–Schulz", size=14, anchor="start")

    y = 318
    svg.line(10, y - 12, WIDTH - 10, y - 12)
    svg.text(10, y + 14, "2  After the step: broadcast to the replicas", size=15, anchor="start", weight="bold")
    top = y + 26
    groups(top, [["rank (0,0): updates A", "rank (0,1)"], ["rank (1,0): receives A", "rank (1,1)"]])
    svg.arrow(217, top + 50, 263, top + 50)
    svg.text(240, top + 42, "③", size=15)
    svg.text(10, y + 200, "③ the global owner broadcasts the new A into its", size=14, anchor="start")
    svg.text(10, y + 220, "R − 1 replica peers; the next forward broadcasts it", size=14, anchor="start")
    svg.text(10, y + 240, "inside each group, as on one group", size=14, anchor="start")
    return svg


DIAGRAMS = {"data-flow.svg": data_flow, "z2-z3.svg": z2_z3, "hsdp.svg": hsdp}


def render_all(write: bool = True) -> dict[str, str]:
    """Every diagram's SVG text (and, with ``write``, the files)."""
    out = {}
    for name, draw in DIAGRAMS.items():
        out[name] = draw().render()
        if write:
            with open(os.path.join(HERE, name), "w", encoding="utf-8") as f:
                f.write(out[name])
    return out


if __name__ == "__main__":
    for name in render_all():
        print(f"wrote docs/diagrams/{name}")
