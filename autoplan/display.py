"""Readable terminal views of plans and predictions (rich tables), and their JSON twins.

Every view has a ``*_dict`` form used by ``--json``, so the terminal and machine-readable
outputs carry the same numbers; the JSON forms are described by
``autoplan/schema/output.schema.json`` (:mod:`autoplan.schema`).

Tables go through :func:`fit_table`, which sizes columns so that no word (a name, a number)
is cut: columns wrap at spaces, and where even that does not fit the console (80 columns in
a pipe), the columns named droppable are left out, and the table's caption says so.
"""

from __future__ import annotations

from typing import Any, Sequence

from rich.console import Console
from rich.table import Table
from rich.text import Text

from autoplan.placement import short
from autoplan.plan import Plan, Prediction
from autoplan.plan_parts import PARTIAL_RECOMPUTE
from autoplan.precision import float8_gemms

GB = 1e9
TIME_PARTS = ("compute", "recompute", "tp_comm", "dp_comm", "pp_comm", "bubble", "optimizer",
              "runtime")


def prediction_dict(pred: Prediction) -> dict[str, Any]:
    """The documented machine-readable prediction (see README, 'Output fields')."""
    return {
        "step_time_s": pred.step_time_s,
        "tokens_per_s": pred.tokens_per_s,
        "samples_per_s": pred.samples_per_s,
        "tflops_per_device": {"model": pred.model_tflops_per_device,
                              "with_recompute": pred.hardware_tflops_per_device},
        "mfu": pred.mfu,
        "memory_per_device_bytes": pred.memory.to_dict(),
        "memory_limit_bytes": pred.memory_limit_bytes,
        "fits": pred.memory.total <= pred.memory_limit_bytes,
        "time_breakdown_s": pred.time.to_dict(),
    }


def plan_dict(plan: Plan) -> dict[str, Any]:
    cluster = plan.cluster
    return {
        "model": plan.model,
        "params": plan.num_params,
        "cluster": {"name": cluster.get("name"), "nodes": cluster.get("nodes"),
                    "devices_per_node": cluster.get("devices_per_node"),
                    "device": (cluster.get("device") or {}).get("name")},
        "global_batch": plan.global_batch,
        "seq_len": plan.seq_len,
        "precision": dict(plan.precision),
        "parallel": plan.label(),
        "config": {k: getattr(plan.parallel, k) for k in (
            "dp", "tp", "pp", "zero", "sequence_parallel", "micro_batch", "num_micro_batches",
            "schedule", "virtual_stages", "checkpoint", "ep", "cp", "tp_comm_overlap")},
        "stages": [{"index": s.index, "layers": [s.layer_names[0], s.layer_names[-1]],
                    "num_layers": len(s.layer_names), "ranks": [s.ranks[0], s.ranks[-1]],
                    "mesh_shape": list(s.mesh_shape), "axis_names": list(s.axis_names),
                    "zero": plan.parallel.zero if s.zero is None else s.zero,
                    "data_axes": list(s.data_axes), "micro_batch": s.micro_batch,
                    "recomputed_layers": len(s.checkpoint_layers), "predicted": s.predicted}
                   for s in plan.stages],
        "prediction": prediction_dict(plan.prediction) if plan.prediction else None,
        "alternatives": plan.alternatives,
        "planner": plan.planner.to_dict(),
        "runtime": plan.runtime,
        "layout": plan.layout,
        "comparison": plan.comparison,
        "pricing": plan.pricing.to_dict() if plan.pricing is not None else None,
        "distinct_devices": plan.distinct_devices(),
    }


def fit_table(console: Console, columns: Sequence[str | tuple[str, str]],
              rows: Sequence[Sequence[Any]], *, title: str | None = None,
              drop: Sequence[str] = (), show_header: bool = True) -> Table:
    """A table whose columns fit ``console.width`` without cutting any word.

    ``columns``: headers, or ``(header, justify)``. Each column is at least as wide as its
    longest word (header or cell, markup stripped) and at most its longest line; the width
    left after the minimums unwraps whole columns, those needing least first. When
    the minimums alone do not fit, the columns in ``drop`` are left out in that order."""
    cols = [(c, "left") if isinstance(c, str) else c for c in columns]
    cells = [[Text.from_markup(c) if isinstance(c, str) else Text(str(c)) for c in row]
             for row in rows]
    keep = list(range(len(cols)))
    dropped: list[str] = []

    def lengths(i: int) -> tuple[int, int]:
        texts = ([cols[i][0]] if show_header else []) + [row[i].plain for row in cells]
        words = max((Text(w).cell_len for t in texts for w in t.split()), default=1)
        lines = max((Text(ln).cell_len for t in texts for ln in t.splitlines() or [""]),
                    default=1)
        return max(words, 1), max(lines, words, 1)

    while True:
        mins, maxs = zip(*(lengths(i) for i in keep)) if keep else ((), ())
        room = console.width - (len(keep) + 1) - 2 * len(keep)      # borders, padding
        pending = [d for d in drop if d in (cols[i][0] for i in keep)]
        if sum(mins) <= room or not pending:
            break
        keep = [i for i in keep if cols[i][0] != pending[0]]
        dropped.append(pending[0])
    widths = list(mins)
    spare = room - sum(widths)
    for k in sorted(range(len(widths)), key=lambda j: maxs[j] - mins[j]):
        grow = max(0, min(spare, maxs[k] - widths[k]))  # unwrap the cheapest columns first
        widths[k] += grow
        spare -= grow
    caption = (f"({', '.join(dropped)} left out at {console.width} columns; "
               "a wider terminal or --json shows all)") if dropped else None
    t = Table(title=title, title_justify="left", show_header=show_header, caption=caption,
              caption_justify="left")
    for i, w in zip(keep, widths):
        t.add_column(cols[i][0], justify=cols[i][1], width=w, overflow="fold")
    for row in cells:
        t.add_row(*(row[i] for i in keep))
    return t


def count(n: float) -> str:
    """269696 -> '269.7K', 1.487e9 -> '1.49B' (parameters, tokens)."""
    for div, unit in ((1e12, "T"), (1e9, "B"), (1e6, "M"), (1e3, "K")):
        if abs(n) >= div:
            return f"{n / div:.3g}{unit}"
    return f"{n:g}"


def nbytes(n: float) -> str:
    """Bytes in the largest decimal unit that keeps a digit before the point: '74.8 GB'."""
    for div, unit in ((1e12, "TB"), (1e9, "GB"), (1e6, "MB"), (1e3, "kB")):
        if abs(n) >= div:
            return f"{n / div:.3g} {unit}"
    return f"{n:.0f} B"


def planner_line(plan: Plan) -> str:
    """Which planner produced ``plan``, and why that one (the grid's fallback says why)."""
    p = plan.planner
    name = p.get("name")
    counted = (f"{p['evaluated']} configurations evaluated, {p.get('feasible', '?')} fit"
               if p.get("evaluated") is not None else "")
    if name == "auto":
        return ("planner: the search (intra-op ILP over each stage's placements + inter-op "
                "stage DP); the uniform grid's best is compared below")
    if name == "uniform" and p.get("note"):
        return (f"planner: the uniform grid ({counted}), not the search, because {p['note']}")
    if name == "uniform":
        return f"planner: the uniform grid of DP/TP/PP/ZeRO configurations ({counted})"
    if name == "estimate":
        return "planner: none: the configuration given, priced by the cost model"
    return f"planner: {name}"


def repeated_work_line(plan: Plan) -> str | None:
    """'warning: ...' when fewer nodes would hold the work some devices only repeat, 'note:
    ...' when some repeat it but every node is needed; None when none repeat."""
    distinct, world = plan.distinct_devices(), plan.world_size
    if distinct >= world:
        return None
    repeated = ((s.index, s.repeated_axes()) for s in plan.stages)
    where = [f"stage {i} on " + ", ".join(f"{a} x{n}" for a, n in axes.items())
             for i, axes in repeated if axes]
    said = (f"{distinct:,} of the {world:,} devices do distinct work; the others repeat it "
            f"({'; '.join(where[:3])}{'; ...' if len(where) > 3 else ''})")
    per_node = plan.cluster.get("devices_per_node") or 1
    nodes = -(-distinct // per_node)
    if nodes >= (plan.cluster.get("nodes") or 1):
        return f"[bold]note[/bold]: {said}"
    return (f"[yellow]warning[/yellow]: only {said}: the global batch of {plan.global_batch} "
            f"and the model cannot be split further. {nodes:,} node{'s' if nodes > 1 else ''} "
            f"({nodes * per_node:,} devices) can hold the same work: plan again with "
            f"--nodes {nodes}.")


def _ms(seconds: float) -> str:
    """Milliseconds, three significant digits, never in exponent form: 1040, 6.84, 0."""
    ms = 1e3 * seconds
    return f"{ms:,.0f}" if abs(ms) >= 100 else f"{ms:.3g}"


def span(first: str, last: str, n: int) -> str:
    return first if n == 1 else f"{first} .. {last} ({n})"


def print_plan(plan: Plan, console: Console | None = None, *, title: str = "plan",
               top_k: int = 5, why: bool = True) -> None:
    console = console or Console()
    cl = plan.cluster
    device = (cl.get("device") or {}).get("name", "?")
    from autoplan.models.names import describe

    console.print(f"[bold]{title}[/bold]: {describe(plan.model)} "
                  f"({count(plan.num_params)} params) on {cl.get('nodes')} x "
                  f"{cl.get('devices_per_node')} {device}, global batch {plan.global_batch}, "
                  f"seq {plan.seq_len}")
    console.print(f"  [bold cyan]{plan.label()}[/bold cyan]"
                  + (f"  ({plan.planner['label']})" if plan.planner.get("label") else "")
                  + ("" if plan.layout == "uniform" else
                     "  [yellow]stages on submeshes of their own shapes[/yellow]"))
    console.print(f"  {planner_line(plan)}", highlight=False)
    repeated = repeated_work_line(plan)
    if repeated:
        console.print(f"  {repeated}", highlight=False)
    if float8_gemms(plan.precision):
        console.print("  precision: mixed-fp8 (the blocks' linear layers in float8, the rest "
                      f"in {plan.precision.get('compute')}; MFU against the "
                      f"{plan.precision.get('compute')} peak)", highlight=False)
    console.print("  priced for: " + (
        plan.pricing.describe(cp=plan.parallel.cp > 1, float8=float8_gemms(plan.precision))
        if plan.pricing is not None else "runtime assumptions not recorded (an older plan)"),
        highlight=False)
    if plan.prediction:
        print_prediction(plan.prediction, console)
    searched = plan.planner.get("name") == "auto"
    cols: list[Any] = ["stage", "layers", "ranks", "mesh", ("recomputed", "right")]
    if searched:
        cols += ["ZeRO", "data axes", ("compute / comm", "right")]
    rows = []
    for s in plan.stages[:16]:
        mesh = " x ".join(f"{a}={n}" for a, n in zip(s.axis_names, s.mesh_shape))
        row = [str(s.index), span(s.layer_names[0], s.layer_names[-1], len(s.layer_names)),
               f"{s.ranks[0]}-{s.ranks[-1]}", mesh,
               str(len(s.checkpoint_layers)) + (
                   f" {plan.parallel.checkpoint}" if s.checkpoint_layers and
                   plan.parallel.checkpoint in PARTIAL_RECOMPUTE else "")]
        if searched:
            pr = s.predicted
            row += [str(plan.parallel.zero if s.zero is None else s.zero),
                    ",".join(s.data_axes) or "-",
                    f"{_ms(pr.get('compute_s', 0))} / {_ms(pr.get('layer_comm_s', 0))}"]
        rows.append(row)
    if len(plan.stages) > 16:
        rows.append(["...", f"{len(plan.stages) - 16} more", *[""] * (len(cols) - 2)])
    console.print(fit_table(console, cols, rows, drop=("data axes", "ZeRO"),
                            title="pipeline stages" + (" (compute / comm: ms per micro-batch, "
                                                        "layer collectives)" if searched else "")))
    if searched:
        print_weights(plan, console)
        print_comparison(plan, console)
        print_explanation(plan, console)
    if plan.alternatives and top_k:
        print_alternatives(plan, console, top_k=top_k, why=why)


def _short(placements: dict[str, str]) -> str:
    """{'dp': 'Replicate()', 'tp': 'Shard(0)'} -> 'dp:R tp:S(0)'."""
    return " ".join(f"{a}:{short(p)}" for a, p in placements.items())


def params_by_layer(plan: Plan) -> dict[str | None, list[str]]:
    """The plan's parameters grouped by the block (pipeline layer) that owns them, in plan
    order; ``None`` holds those no block owns (embeddings, final norm, head). One pass over
    the parameters, each looked up by its dotted prefixes (O(parameters x depth))."""
    blocks = {n for s in plan.stages for n in s.layer_names if not n.startswith("<")}
    out: dict[str | None, list[str]] = {}
    for name in plan.param_placements:
        parts = name.split(".")
        owner = next((p for p in (".".join(parts[:k]) for k in range(1, len(parts)))
                      if p in blocks), None)
        out.setdefault(owner, []).append(name)
    return out


def print_weights(plan: Plan, console: Console, *, stages: int = 4, rows: int = 12) -> None:
    """Per stage, the placement of each weight of the first layer of each kind."""
    owned = params_by_layer(plan)
    for s in plan.stages[:stages]:
        seen_kinds: set[str] = set()
        names: list[str] = []
        for layer in s.layer_names:
            outer = layer.startswith("<")
            kind = "pre/post" if outer else layer.split(".")[0]
            if kind in seen_kinds:
                continue
            seen_kinds.add(kind)
            names += owned.get(None if outer else layer, [])[:rows - len(names)]
            if len(names) >= rows:
                break
        if names:
            console.print(fit_table(
                console, ["parameter", "placement per mesh axis"],
                [[n, _short(plan.param_placements[n])] for n in names],
                title=f"stage {s.index}: weights (first layer of each kind)"))


def print_comparison(plan: Plan, console: Console) -> None:
    cmp = plan.comparison
    if not cmp:
        return
    if not cmp.get("feasible", True):
        console.print(f"best uniform plan: none fits ({cmp.get('message', '')})")
        return
    line = (f"best uniform plan: [bold]{cmp['parallel']}[/bold] {cmp['step_time_s']:.4g} s "
            f"per step; this plan: {plan.prediction.step_time_s:.4g} s — "
            f"[bold green]{cmp['speedup']:.3f}x[/bold green]")
    if cmp.get("repriced_step_time_s"):
        line += (f" (the uniform plan priced by the search's cost model: "
                 f"{cmp['repriced_step_time_s']:.4g} s)")
    console.print(line)


def print_explanation(plan: Plan, console: Console, *, rows: int = 12) -> None:
    """Why each weight's op got its placement: the chosen one against the next best."""
    items = plan.planner.get("explain") or []
    if not items:
        return
    body = []
    for r in items[:rows]:
        alt = r["alternatives"][0] if r["alternatives"] else None
        body.append([r["layer"], f"{r['op']} ({r['module']})", r["chosen"],
                     alt["placement"] if alt else "-",
                     (f"{1e3 * alt['delta_s']:+.3g} ms, {alt['memory_delta_gb']:+.2f} GB"
                      + ("" if alt["fits"] else ", does not fit")) if alt else "-"])
    console.print(fit_table(
        console, ["layer", "op (module)", "chosen: out <- inputs", "next best", "its cost"],
        body, title="why these placements (objective: seconds per step; alternatives priced "
                    "with everything else fixed)"))


def print_prediction(pred: Prediction, console: Console) -> None:
    m = pred.memory
    parts = pred.time.to_dict()
    total = parts["total"] or 1.0
    rows = [
        ["step time", f"{pred.step_time_s:.4g} s"],
        ["throughput", f"{pred.tokens_per_s:,.0f} tokens/s"],
        ["TFLOP/s per device (model / with recompute)",
         f"{pred.model_tflops_per_device:.3g} / {pred.hardware_tflops_per_device:.3g}"],
        ["MFU", f"{100 * pred.mfu:.1f} %"],
        ["memory per device", f"{nbytes(m.total)} of {nbytes(pred.memory_limit_bytes)}"],
        ["  params / grads / optimizer",
         f"{nbytes(m.params)} / {nbytes(m.grads)} / {nbytes(m.optimizer)}"],
        ["  activations / other", f"{nbytes(m.activations)} / {nbytes(m.other)}"],
        ["time breakdown", "  ".join(f"{k} {100 * parts[k] / total:.0f}%"
                                     for k in TIME_PARTS if parts[k] > 0)],
    ]
    console.print(fit_table(console, ["what", ("value", "right")], rows, title="prediction",
                            show_header=False))


def why_best(best: dict[str, float], other: dict[str, float]) -> str:
    """The time components where ``other`` loses most against ``best``."""
    diffs = sorted(((other.get(k, 0.0) - best.get(k, 0.0), k) for k in TIME_PARTS), reverse=True)
    worse = [f"+{d:.3g}s {k}" for d, k in diffs if d > 1e-9][:2]
    better = [f"{d:.3g}s {k}" for d, k in sorted(diffs) if d < -1e-9][:1]
    return ", ".join(worse + better)


def print_alternatives(plan: Plan, console: Console, *, top_k: int = 5, why: bool = True) -> None:
    pred = plan.prediction
    cols: list[Any] = ["configuration", ("step time", "right"), ("vs best", "right"),
                       ("memory", "right")]
    if why:
        cols.append("why slower (vs best)")
    best_time = pred.time.to_dict() if pred else {}
    rows = []
    for alt in plan.alternatives[:top_k]:
        ratio = alt["step_time_s"] / pred.step_time_s if pred else float("nan")
        row = [alt["parallel"], f"{alt['step_time_s']:.4g} s", f"{ratio:.3f}x",
               nbytes(alt["memory_gb"] * GB)]
        if why:
            row.append(why_best(best_time, alt.get("time", {})))
        rows.append(row)
    console.print(fit_table(console, cols, rows, drop=("why slower (vs best)",),
                            title=f"next best of {plan.planner.get('feasible', '?')} feasible "
                                  f"({plan.planner.get('evaluated', '?')} evaluated)"))
