"""Shared look of the report's figures: colours, units, PNG encoding.

Figures are built with matplotlib's object API (``matplotlib.figure.Figure``, rendered by
the Agg canvas), never pyplot, so no figure is registered in global state.
"""

from __future__ import annotations

import io
from typing import Sequence

from matplotlib import colormaps
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

DPI = 110
WIDTH_IN = 11.0

#: Colours of the parts of a step (timeline and per-stage time chart).
PART_COLORS = {
    "forward": "#4c72b0", "backward": "#55a868", "recompute": "#c9e3c0",
    "TP comm": "#dd8452", "PP comm": "#8172b3", "DP comm": "#c44e52", "optimizer": "#937860",
    "runtime": "#b0b0b0", "idle (bubble)": "#e5e5e5",
}
#: Colours of the memory parts.
MEMORY_COLORS = {"params": "#4c72b0", "grads": "#55a868", "optimizer": "#c44e52",
                 "activations": "#dd8452", "other": "#8c8c8c"}


def stage_colors(n: int) -> list[tuple[float, ...]]:
    """``n`` distinct colours, one per pipeline rank (tab10, tab20, then a continuous map)."""
    if n <= 10:
        cmap = colormaps["tab10"]
        return [cmap(i) for i in range(n)]
    if n <= 20:
        # tab20's dark shades first, then the light ones: neighbours differ in hue
        colors = colormaps["tab20"].colors
        return [colors[2 * i] if i < 10 else colors[2 * (i - 10) + 1] for i in range(n)]
    cmap = colormaps["viridis"]
    return [cmap(i / max(1, n - 1)) for i in range(n)]


def new_figure(height_in: float, width_in: float = WIDTH_IN) -> Figure:
    fig = Figure(figsize=(width_in, height_in), dpi=DPI, layout="constrained")
    FigureCanvasAgg(fig)
    return fig


def png_bytes(fig: Figure) -> bytes:
    """The figure as PNG bytes."""
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=DPI)
    return buf.getvalue()


def time_unit(seconds: float) -> tuple[str, float]:
    """('s', 1) or ('ms', 1e3) or ('µs', 1e6): the unit that shows ``seconds`` best."""
    if seconds >= 1.0:
        return "s", 1.0
    if seconds >= 1e-3:
        return "ms", 1e3
    return "µs", 1e6


def span_label(names: Sequence[str]) -> str:
    """'blocks.0–blocks.5' or a single name: a stage's layers."""
    if not names:
        return "(none)"
    return names[0] if len(names) == 1 else f"{names[0]}–{names[-1]}"


def plural(n: int, word: str, many: str | None = None) -> str:
    """'1 node', '4 nodes'; ``many`` for irregular plurals ('micro-batches')."""
    return f"{n} {word if n == 1 else (many or word + 's')}"
