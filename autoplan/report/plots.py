"""The report's charts other than the timeline: device mesh, memory, time per stage,
alternatives. Each function returns a :class:`matplotlib.figure.Figure` (or None when the
plan has nothing to show), with labelled axes and units.
"""

from __future__ import annotations

import numpy as np
from matplotlib.colors import ListedColormap
from matplotlib.figure import Figure
from matplotlib.patches import Patch

from autoplan.plan import MemoryBreakdown, Plan
from autoplan.report.step import PARTS, StepModel
from autoplan.report.style import (MEMORY_COLORS, PART_COLORS, new_figure, span_label,
                                   plural, stage_colors, time_unit)

GB = 1e9
UNUSED = (0.85, 0.85, 0.85, 1.0)
MAX_LEGEND = 16


def _rank_coordinates(plan: Plan, rank: int) -> dict[str, int]:
    """Coordinates of ``rank`` along the mesh axes (row-major), e.g. {'pp': 1, 'dp': 0, ...}."""
    out, rest = {}, rank
    for name, size in reversed(list(zip(plan.mesh.axis_names, plan.mesh.shape))):
        out[name] = rest % size
        rest //= size
    return out


def group_label(plan: Plan, ranks: tuple[int, ...]) -> str:
    """'stage 0: <pre>–blocks.2', 'chunks 0, 4: <pre>–blocks.2; blocks.12–blocks.14', or,
    with more chunks, 'chunks 0, 16, 32: 6 layers'."""
    stages = [s for s in plan.stages if tuple(s.ranks) == ranks]
    which = ", ".join(str(s.index) for s in stages)
    if len(stages) == 1:
        return f"stage {which}: {span_label(stages[0].layer_names)}"
    if len(stages) == 2:
        return f"chunks {which}: " + "; ".join(span_label(s.layer_names) for s in stages)
    return f"chunks {which}: {sum(len(s.layer_names) for s in stages)} layers"


def mesh_figure(plan: Plan, groups: tuple[tuple[int, ...], ...]) -> Figure:
    """Nodes × devices, each device coloured by the pipeline rank (stage) it serves."""
    nodes = int(plan.cluster.get("nodes", 1))
    per_node = int(plan.cluster.get("devices_per_node", plan.world_size))
    device = (plan.cluster.get("device") or {}).get("name", "device")
    owner = {r: k for k, g in enumerate(groups) for r in g}
    colors = stage_colors(len(groups))
    grid = np.full((nodes, per_node), len(groups))
    for r, k in owner.items():
        if r < nodes * per_node:
            grid[r // per_node, r % per_node] = k
    fig = new_figure(max(2.6, min(10.0, 0.5 * nodes + 1.6)))
    ax = fig.add_subplot()
    ax.imshow(grid, cmap=ListedColormap(colors + [UNUSED]), vmin=-0.5,
              vmax=len(groups) + 0.5, aspect="auto", interpolation="nearest")
    cells = nodes * per_node
    if cells <= 256:
        axes = [a for a, s in zip(plan.mesh.axis_names, plan.mesh.shape) if a != "pp" and s > 1]
        for r in range(min(cells, plan.world_size)):
            coords = _rank_coordinates(plan, r)
            text = str(r)
            if cells <= 128 and axes:
                text += "\n" + " ".join(f"{a}{coords[a]}" for a in axes)
            ax.text(r % per_node, r // per_node, text, ha="center", va="center",
                    fontsize=8 if cells <= 64 else 6, color="white")
    ax.set_xticks(range(per_node) if per_node <= 32 else [])
    ax.set_yticks(range(0, nodes, -(-nodes // 24)))
    ax.set_xticks(np.arange(-0.5, per_node, 1), minor=True)
    ax.set_yticks(np.arange(-0.5, nodes, 1), minor=True)
    ax.grid(which="minor", axis="x", color="white", linewidth=1.5)
    ax.grid(which="minor", axis="y", color="black", linewidth=2.5)
    ax.tick_params(which="minor", length=0)
    ax.set_xlabel(f"device in node (local rank, {per_node} per node)")
    ax.set_ylabel("node")
    shape = ", ".join(f"{a}={s}" for a, s in zip(plan.mesh.axis_names, plan.mesh.shape))
    ax.set_title(f"{plural(nodes, 'node')} × {per_node} {device}: mesh ({shape}); number = global "
                 "rank, colour = pipeline stage", fontsize=10)
    handles = [Patch(color=colors[k], label=f"pipeline rank {k} — {group_label(plan, g)}")
               for k, g in enumerate(groups[:MAX_LEGEND])]
    if len(groups) > MAX_LEGEND:
        handles.append(Patch(color="white", label=f"... {len(groups) - MAX_LEGEND} more"))
    fig.legend(handles=handles, loc="outside lower center", ncols=2 if len(handles) > 4 else 1,
               fontsize=8, frameon=False)
    return fig


def memory_figure(plan: Plan, groups: tuple[tuple[int, ...], ...]) -> Figure | None:
    """Stacked bars per pipeline rank (GB per device) against the device's memory."""
    pred = plan.prediction
    if pred is None:
        return None
    per_stage: tuple[MemoryBreakdown, ...] = pred.memory_per_stage or (pred.memory,)
    labels = ([f"rank {k}\n({g[0]}–{g[-1]})" for k, g in enumerate(groups)]
              if len(per_stage) == len(groups) else ["worst device"])
    fig = new_figure(4.2)
    ax = fig.add_subplot()
    x = np.arange(len(per_stage))
    bottom = np.zeros(len(per_stage))
    for part, color in MEMORY_COLORS.items():
        values = np.array([getattr(m, part) / GB for m in per_stage])
        ax.bar(x, values, bottom=bottom, color=color, width=0.6,
               label="optimizer states" if part == "optimizer" else part)
        bottom += values
    limit = pred.memory_limit_bytes / GB
    ax.axhline(limit, color="black", linestyle="--", linewidth=1)
    ax.text(len(per_stage) - 0.5, limit, f"device memory {limit:.0f} GB", ha="right",
            va="bottom", fontsize=9)
    if len(per_stage) <= 32:
        for xi, total in zip(x, bottom):
            ax.text(xi, total, f"{total:.1f}", ha="center", va="bottom", fontsize=8)
    ax.set_xticks(x, labels if len(per_stage) <= 16 else [str(i) for i in x],
                  fontsize=8 if len(per_stage) > 8 else 9)
    ax.set_ylim(0, max(limit, float(bottom.max())) * 1.15)
    ax.set_xlim(-0.6, len(per_stage) - 0.4)
    ax.set_xlabel("pipeline rank (global ranks)")
    ax.set_ylabel("memory per device (GB, 1e9 bytes)")
    ax.set_title("Predicted memory per device by pipeline stage (the device that needs most "
                 "in each stage)", fontsize=10)
    ax.grid(axis="y", alpha=0.3)
    handles, labels = ax.get_legend_handles_labels()      # top of the legend = top of a bar
    fig.legend(handles[::-1], labels[::-1], loc="outside right upper", fontsize=9,
               frameon=False)
    return fig


def time_figure(plan: Plan, step: StepModel) -> Figure:
    """Where each pipeline rank's step time goes: compute, communication, idle."""
    unit, scale = time_unit(step.step_s)
    n = len(step.ranks)
    fig = new_figure(max(2.8, 0.45 * n + 1.8))
    ax = fig.add_subplot()
    left = np.zeros(n)
    for part in PARTS:
        values = np.array([r[part] * scale for r in step.ranks])
        if not values.any():
            continue
        ax.barh(np.arange(n), values, left=left, color=PART_COLORS[part], height=0.65,
                label=part)
        left += values
    if n <= 32:
        for i, r in enumerate(step.ranks):
            total = sum(r.values()) or 1.0
            compute = r["forward"] + r["backward"] + r["recompute"]
            comm = r["TP comm"] + r["PP comm"] + r["DP comm"]
            ax.text(left[i], i, f"  compute {100 * compute / total:.0f}%, "
                    f"comm {100 * comm / total:.0f}%", va="center", fontsize=8)
    ax.set_yticks(range(n), [f"rank {k}" for k in range(n)])
    ax.set_ylim(n - 0.5, -0.5)
    ax.set_xlim(0, left.max() * 1.3)
    ax.set_xlabel(f"time per training step ({unit})")
    ax.set_ylabel("pipeline rank")
    ax.set_title("Compute vs communication per pipeline stage (exposed communication; "
                 "DP comm and optimizer: slowest rank's)", fontsize=10)
    ax.grid(axis="x", alpha=0.3)
    fig.legend(loc="outside right upper", fontsize=9, frameon=False)
    return fig


def alternatives_figure(plan: Plan, top_k: int = 8) -> Figure | None:
    """Predicted step time of this plan and the best alternatives the planner kept."""
    if not plan.alternatives or plan.prediction is None:
        return None
    rows = [(plan.label() + "  (this plan)", plan.prediction.step_time_s,
             plan.prediction.memory.total / GB, True)]
    rows += [(a["parallel"], a["step_time_s"], a.get("memory_gb", float("nan")), False)
             for a in plan.alternatives[:top_k]]
    unit, scale = time_unit(max(r[1] for r in rows))
    fig = new_figure(max(2.6, 0.42 * len(rows) + 1.4))
    ax = fig.add_subplot()
    y = np.arange(len(rows))
    values = np.array([r[1] * scale for r in rows])
    ax.barh(y, values, color=["#4c72b0" if r[3] else "#a6bddb" for r in rows], height=0.65)
    best = plan.prediction.step_time_s
    for yi, (label, t, mem, _) in zip(y, rows):
        ax.text(t * scale, yi, f"  {t * scale:.4g} {unit} · {t / best:.3f}× · {mem:.1f} GB",
                va="center", fontsize=8)
    ax.set_yticks(y, [r[0] for r in rows], fontsize=8, family="monospace")
    ax.set_ylim(len(rows) - 0.5, -0.5)
    ax.set_xlim(0, values.max() * 1.45)
    ax.set_xlabel(f"predicted step time ({unit}); text: time · ratio to this plan · memory "
                  "per device")
    info = plan.planner
    feasible = "?" if info.feasible is None else info.feasible
    evaluated = "?" if info.evaluated is None else info.evaluated
    ax.set_title(f"Top {len(rows) - 1} alternatives of {feasible} "
                 f"feasible configurations ({evaluated} evaluated)",
                 fontsize=10)
    ax.grid(axis="x", alpha=0.3)
    return fig
