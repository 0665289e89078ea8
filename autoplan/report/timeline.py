"""The pipeline timeline (Gantt chart) of one training step.

One row per pipeline rank; a block per forward (F) and backward (B) of each model chunk and
micro-batch, placed where :mod:`autoplan.report.schedule` simulates it; the recomputed
forward inside a backward is hatched (where blocks are wide enough to see it); then each
rank's exposed gradient reduction and the optimizer step. Forwards and backwards of a
rank's first, second, ... chunk (interleaved 1F1B) get their own colour pair. With many micro-batches a second panel zooms into the
start of the step (warm-up and the first steady-state operations), where block numbers
(micro-batches, 1-based) are legible.
"""

from __future__ import annotations

from matplotlib import colormaps
from matplotlib.axes import Axes
from matplotlib.collections import PolyCollection
from matplotlib.figure import Figure
from matplotlib.patches import Patch

from autoplan.plan import Plan
from autoplan.report.schedule import BACKWARD, FORWARD, Block
from autoplan.report.step import StepModel
from autoplan.report.style import PART_COLORS, new_figure, plural, time_unit
from autoplan.report.timing import StageTiming

#: Above this many blocks per rank, add a zoomed panel of the start of the step.
ZOOM_ABOVE = 48
#: Minimum block width in pixels to print its micro-batch number.
LABEL_MIN_PX = 14


#: tab20's ten (dark, light) pairs: forward and backward of a rank's 1st, 2nd, ... chunk.
_PAIRS = tuple(colormaps["tab20"].colors)


def _color(kind: str, chunk: int, pp: int):
    return _PAIRS[2 * ((chunk // pp) % 10) + (0 if kind == FORWARD else 1)]


def timeline_figure(plan: Plan, timing: StageTiming, step: StepModel) -> Figure:
    p = plan.parallel
    pp = len(step.groups)
    v = len(plan.stages) // pp
    unit, scale = time_unit(step.step_s)
    per_rank = len(step.blocks) // max(1, pp)
    zoom = per_rank > ZOOM_ABOVE
    row_h = (0.5 if pp <= 8 else 0.3) * pp + 1.0
    fig = new_figure(max(3.0, row_h * (2 if zoom else 1) + 1.4))
    axes = fig.subplots(2 if zoom else 1, 1, squeeze=False)[:, 0]
    ends = [max((b.end for b in step.blocks if b.rank == d), default=0.0) for d in range(pp)]

    _draw(fig, axes[0], step, timing, ends, scale, pp, 0.0, step.step_s * 1.01,
          edges=per_rank <= ZOOM_ABOVE * 2)
    pred = plan.prediction.step_time_s if plan.prediction else None
    micro = plural(p.num_micro_batches, "micro-batch", "micro-batches")
    title = (f"One training step, {p.schedule}: {plural(pp, 'pipeline rank')} × "
             f"{plural(v, 'chunk')}, {micro} of {p.micro_batch}; "
             f"simulated {step.step_s * scale:.4g} {unit}")
    if pred is not None:
        title += f" (plan's prediction {pred * scale:.4g} {unit})"
    axes[0].set_title(title + "\nnumbers: micro-batch; dashed line: end of step", fontsize=10)
    if zoom:
        first = sorted((b for b in step.blocks if b.rank == 0), key=lambda b: b.start)
        warmup = next((i for i, b in enumerate(first) if b.kind == BACKWARD), len(first))
        k = min(len(first), warmup + 2 * pp + 4)
        t_end = first[k - 1].end
        _draw(fig, axes[1], step, timing, ends, scale, pp, 0.0, t_end, edges=True)
        axes[1].set_title(f"zoom: the first {t_end * scale:.3g} {unit} (warm-up and the "
                          "start of the steady state)", fontsize=10)
    axes[-1].set_xlabel(f"time since the start of the step ({unit})")
    fig.legend(handles=_legend(timing, step, v), loc="outside lower center", ncols=4,
               fontsize=9, frameon=False)
    return fig


def _bars(ax: Axes, rows, lefts, widths, *, height: float = 0.8, **style) -> None:
    """Horizontal bars as one PolyCollection (tens of thousands stay fast)."""
    h = height / 2
    verts = [((x, y - h), (x, y + h), (x + w, y + h), (x + w, y - h))
             for y, x, w in zip(rows, lefts, widths)]
    if verts:
        ax.add_collection(PolyCollection(verts, **style))


def _draw(fig: Figure, ax: Axes, step: StepModel, timing: StageTiming, ends: list[float],
          scale: float, pp: int, t0: float, t1: float, *, edges: bool) -> None:
    """Blocks, recomputation hatching, DP sync and optimizer on ``ax`` over [t0, t1] s."""
    blocks = [b for b in step.blocks if b.start < t1]
    for kind in (FORWARD, BACKWARD):
        chosen = [b for b in blocks if b.kind == kind]
        _bars(ax, [b.rank for b in chosen], [b.start * scale for b in chosen],
              [(b.end - b.start) * scale for b in chosen],
              facecolors=[_color(kind, b.chunk, pp) for b in chosen],
              edgecolors="white", linewidths=0.6 if edges else 0)
    hatched = [(b, timing.chunks[b.chunk].recompute + timing.chunks[b.chunk].tp_recompute)
               for b in blocks if b.kind == BACKWARD]
    hatched = [(b, r) for b, r in hatched if r > 0]
    if hatched and edges:
        _bars(ax, [b.rank for b, _ in hatched], [b.start * scale for b, _ in hatched],
              [r * scale for _, r in hatched], facecolors="none", hatch="///",
              edgecolors=[(0, 0, 0, 0.3)], linewidths=0)
    if step.dp_comm_s > 0:
        _bars(ax, range(pp), [e * scale for e in ends], [step.dp_comm_s * scale] * pp,
              facecolors=PART_COLORS["DP comm"])
    if step.optimizer_s > 0:
        _bars(ax, range(pp), [(e + step.dp_comm_s) * scale for e in ends],
              [step.optimizer_s * scale] * pp, facecolors=PART_COLORS["optimizer"])
    if step.runtime_s > 0:
        _bars(ax, range(pp), [(e + step.dp_comm_s + step.optimizer_s) * scale for e in ends],
              [step.runtime_s * scale] * pp, facecolors=PART_COLORS["runtime"])
    ax.axvline(step.step_s * scale, color="black", linestyle="--", linewidth=1)
    ax.set_xlim(t0 * scale, t1 * scale)
    ax.set_yticks(range(pp), [f"rank {d} ({g[0]}–{g[-1]})" for d, g in enumerate(step.groups)],
                  fontsize=9 if pp <= 8 else 7)
    ax.set_ylim(pp - 0.5, -0.5)
    ax.set_ylabel("pipeline rank (devices)")
    ax.grid(axis="x", alpha=0.3)
    _label(fig, ax, blocks, scale, t1 - t0)


def _label(fig: Figure, ax: Axes, blocks: list[Block], scale: float, span_s: float) -> None:
    """Write the (1-based) micro-batch number in blocks wide enough to hold it."""
    width_px = ax.get_position().width * fig.get_figwidth() * fig.dpi
    px_per_s = width_px / span_s
    for b in blocks:
        if (b.end - b.start) * px_per_s < LABEL_MIN_PX:
            continue
        ax.text((b.start + b.end) / 2 * scale, b.rank, str(b.micro_batch + 1),
                ha="center", va="center", fontsize=7, clip_on=True,
                color="white" if b.kind == FORWARD else "black")


def _legend(timing: StageTiming, step: StepModel, v: int) -> list[Patch]:
    pp = len(step.groups)
    handles = []
    for j in range(min(v, 10)):
        suffix = f" (chunk {j + 1} of each rank)" if v > 1 else ""
        handles += [Patch(color=_color(FORWARD, j * pp, pp), label=f"forward{suffix}"),
                    Patch(color=_color(BACKWARD, j * pp, pp), label=f"backward{suffix}")]
    if any(c.recompute > 0 for c in timing.chunks):
        handles.append(Patch(facecolor="white", edgecolor=(0, 0, 0, 0.5), hatch="///",
                             label="recomputed forward (in backward)"))
    if step.dp_comm_s > 0:
        handles.append(Patch(color=PART_COLORS["DP comm"], label="gradient sync (DP, exposed)"))
    if step.optimizer_s > 0:
        handles.append(Patch(color=PART_COLORS["optimizer"], label="optimizer step"))
    if step.runtime_s > 0:
        handles.append(Patch(color=PART_COLORS["runtime"],
                             label="runtime overhead (fitted on published runs)"))
    return handles
