"""Readable terminal views of plans and predictions (rich tables), and their JSON twins.

Every view has a ``*_dict`` form used by ``--json``, so the terminal and machine-readable
outputs carry the same numbers.
"""

from __future__ import annotations

from typing import Any

from rich.console import Console
from rich.table import Table

from autoplan.plan import Plan, Prediction

GB = 1e9
TIME_PARTS = ("compute", "recompute", "tp_comm", "dp_comm", "pp_comm", "bubble", "optimizer")


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
        "parallel": plan.label(),
        "config": {k: getattr(plan.parallel, k) for k in (
            "dp", "tp", "pp", "zero", "sequence_parallel", "micro_batch", "num_micro_batches",
            "schedule", "virtual_stages", "checkpoint")},
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
    }


def print_plan(plan: Plan, console: Console | None = None, *, title: str = "plan",
               top_k: int = 5, why: bool = True) -> None:
    console = console or Console()
    cl = plan.cluster
    device = (cl.get("device") or {}).get("name", "?")
    from autoplan.models.names import describe

    console.print(f"[bold]{title}[/bold]: {describe(plan.model)} "
                  f"({plan.num_params / 1e9:.2f}B params) on {cl.get('nodes')} x "
                  f"{cl.get('devices_per_node')} {device}, global batch {plan.global_batch}, "
                  f"seq {plan.seq_len}")
    console.print(f"  [bold cyan]{plan.label()}[/bold cyan]"
                  + (f"  ({plan.planner['label']})" if plan.planner.get("label") else "")
                  + ("" if plan.layout == "uniform" else
                     "  [yellow]stages on submeshes of their own shapes[/yellow]"))
    if plan.prediction:
        print_prediction(plan.prediction, console)
    searched = plan.planner.get("name") == "auto"
    stages = Table(title="pipeline stages", title_justify="left")
    cols = ["stage", "layers", "ranks", "mesh", "recomputed"]
    if searched:
        cols += ["ZeRO", "data axes", "compute / layer comm per micro-batch"]
    for col in cols:
        stages.add_column(col)
    for s in plan.stages[:16]:
        mesh = " x ".join(f"{a}={n}" for a, n in zip(s.axis_names, s.mesh_shape))
        row = [str(s.index), f"{s.layer_names[0]} .. {s.layer_names[-1]} "
               f"({len(s.layer_names)})", f"{s.ranks[0]}-{s.ranks[-1]}", mesh,
               str(len(s.checkpoint_layers))]
        if searched:
            pr = s.predicted
            row += [str(plan.parallel.zero if s.zero is None else s.zero),
                    ",".join(s.data_axes) or "-",
                    f"{1e3 * pr.get('compute_s', 0):.2f} / "
                    f"{1e3 * pr.get('layer_comm_s', 0):.2f} ms"]
        stages.add_row(*row)
    if len(plan.stages) > 16:
        stages.add_row("...", f"{len(plan.stages) - 16} more", *[""] * (len(cols) - 2))
    console.print(stages)
    if plan.planner.get("note"):
        console.print(f"note: {plan.planner['note']}")
    if searched:
        print_weights(plan, console)
        print_comparison(plan, console)
        print_explanation(plan, console)
    if plan.alternatives and top_k:
        print_alternatives(plan, console, top_k=top_k, why=why)


def _short(placements: dict[str, str]) -> str:
    """{'dp': 'Replicate()', 'tp': 'Shard(0)'} -> 'dp:R tp:S(0)'."""
    def one(p: str) -> str:
        return {"Replicate()": "R", "Partial()": "P"}.get(
            p, p.replace("Shard(", "S(").replace("_StridedShard(", "S~("))
    return " ".join(f"{a}:{one(p)}" for a, p in placements.items())


def print_weights(plan: Plan, console: Console, *, stages: int = 4, rows: int = 12) -> None:
    """Per stage, the placement of each weight of the first layer of each kind."""
    names = list(plan.param_placements)
    for s in plan.stages[:stages]:
        t = Table(title=f"stage {s.index}: weights (first layer of each kind)",
                  title_justify="left")
        t.add_column("parameter")
        t.add_column("placement per mesh axis")
        seen_kinds: set[str] = set()
        shown = 0
        for layer in s.layer_names:
            prefix = "" if layer.startswith("<") else layer + "."
            kind = "pre/post" if layer.startswith("<") else layer.split(".")[0]
            if kind in seen_kinds and not layer.startswith("<"):
                continue
            seen_kinds.add(kind)
            for name in names:
                if shown >= rows:
                    break
                if (prefix and name.startswith(prefix)) or (
                        not prefix and name in _layer_params(plan, layer)):
                    t.add_row(name, _short(plan.param_placements[name]))
                    shown += 1
        if shown:
            console.print(t)


def _layer_params(plan: Plan, layer: str) -> set[str]:
    """Parameters of a non-block layer ('<pre>', '<post>'): those no block owns."""
    blocks = {n for s in plan.stages for n in s.layer_names if not n.startswith("<")}
    return {p for p in plan.param_placements
            if not any(p.startswith(b + ".") for b in blocks)}


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
    t = Table(title="why these placements (objective: seconds per step; alternatives priced "
                    "with everything else fixed)", title_justify="left")
    for col in ("layer", "op (module)", "chosen: out <- inputs", "next best", "its cost"):
        t.add_column(col)
    for r in items[:rows]:
        alt = r["alternatives"][0] if r["alternatives"] else None
        t.add_row(r["layer"], f"{r['op']} ({r['module']})", r["chosen"],
                  alt["placement"] if alt else "-",
                  (f"{1e3 * alt['delta_s']:+.3g} ms, {alt['memory_delta_gb']:+.2f} GB"
                   + ("" if alt["fits"] else ", does not fit")) if alt else "-")
    console.print(t)


def print_prediction(pred: Prediction, console: Console) -> None:
    t = Table(title="prediction", title_justify="left", show_header=False)
    t.add_column("what")
    t.add_column("value", justify="right")
    t.add_row("step time", f"{pred.step_time_s:.4g} s")
    t.add_row("throughput", f"{pred.tokens_per_s:,.0f} tokens/s")
    t.add_row("TFLOP/s per device (model / with recompute)",
              f"{pred.model_tflops_per_device:.1f} / {pred.hardware_tflops_per_device:.1f}")
    t.add_row("MFU", f"{100 * pred.mfu:.1f} %")
    m = pred.memory
    t.add_row("memory per device",
              f"{m.total / GB:.2f} of {pred.memory_limit_bytes / GB:.1f} GB")
    t.add_row("  params / grads / optimizer",
              f"{m.params / GB:.2f} / {m.grads / GB:.2f} / {m.optimizer / GB:.2f} GB")
    t.add_row("  activations / other", f"{m.activations / GB:.2f} / {m.other / GB:.2f} GB")
    parts = pred.time.to_dict()
    total = parts["total"] or 1.0
    t.add_row("time breakdown", "  ".join(f"{k} {100 * parts[k] / total:.0f}%"
                                          for k in TIME_PARTS if parts[k] > 0))
    console.print(t)


def why_best(best: dict[str, float], other: dict[str, float]) -> str:
    """The time components where ``other`` loses most against ``best``."""
    diffs = sorted(((other.get(k, 0.0) - best.get(k, 0.0), k) for k in TIME_PARTS), reverse=True)
    worse = [f"+{d:.3g}s {k}" for d, k in diffs if d > 1e-9][:2]
    better = [f"{d:.3g}s {k}" for d, k in sorted(diffs) if d < -1e-9][:1]
    return ", ".join(worse + better)


def print_alternatives(plan: Plan, console: Console, *, top_k: int = 5, why: bool = True) -> None:
    pred = plan.prediction
    t = Table(title=f"next best of {plan.planner.get('feasible', '?')} feasible "
                    f"({plan.planner.get('evaluated', '?')} evaluated)", title_justify="left")
    t.add_column("configuration")
    t.add_column("step time", justify="right")
    t.add_column("vs best", justify="right")
    t.add_column("memory", justify="right")
    if why:
        t.add_column("why slower (vs best)")
    best_time = pred.time.to_dict() if pred else {}
    for alt in plan.alternatives[:top_k]:
        ratio = alt["step_time_s"] / pred.step_time_s if pred else float("nan")
        row = [alt["parallel"], f"{alt['step_time_s']:.4g} s", f"{ratio:.3f}x",
               f"{alt['memory_gb']:.1f} GB"]
        if why:
            row.append(why_best(best_time, alt.get("time", {})))
        t.add_row(*row)
    console.print(t)
