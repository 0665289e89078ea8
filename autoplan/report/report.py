"""Build a plan's report (figures, tables) and write it as HTML and/or PNG files.

    from autoplan.report import build_report, write_report
    report = build_report(Plan.load("plan.json"))
    write_report(report, html_path="report.html", png_dir="figures/")

Sections (HTML ids): ``summary``, ``mesh`` (device mesh and stage assignment), ``timeline``
(one step of the pipeline schedule), ``memory`` (per-stage memory against the device limit),
``time`` (compute vs communication per stage), ``alternatives`` (the planner's next best).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import autoplan
from autoplan.display import why_best
from autoplan.models.names import describe
from autoplan.plan import Plan, atomic_write_bytes, atomic_write_text
from autoplan.plan_parts import PARTIAL_RECOMPUTE
from autoplan.report.html import Section, Table, render_page
from autoplan.report.plots import (alternatives_figure, group_label, memory_figure,
                                   mesh_figure, time_figure)
from autoplan.report.step import PARTS, StepModel, step_model
from autoplan.report.style import png_bytes, span_label, time_unit
from autoplan.report.timeline import timeline_figure
from autoplan.report.timing import StageTiming, stage_timing

GB = 1e9
SECTION_IDS = ("summary", "mesh", "timeline", "memory", "time", "alternatives")


@dataclass(frozen=True)
class Report:
    title: str
    subtitle: str
    sections: tuple[Section, ...]
    figures: dict[str, bytes]           # figure name -> PNG (mesh, timeline, memory, ...)
    notes: tuple[str, ...]
    timing: StageTiming
    step: StepModel

    def html(self) -> str:
        return render_page(self.title, self.subtitle, list(self.sections), list(self.notes))


def build_report(plan: Plan, *, problem=None, top_k: int = 8) -> Report:
    """Everything the report shows. ``problem``: the plan's model already traced
    (:func:`autoplan.api.prepare`), to skip re-tracing it for per-stage times."""
    timing = stage_timing(plan, problem)
    step = step_model(plan, timing)
    figures = {"mesh": png_bytes(mesh_figure(plan, step.groups)),
               "timeline": png_bytes(timeline_figure(plan, timing, step)),
               "time": png_bytes(time_figure(plan, step))}
    memory = memory_figure(plan, step.groups)
    if memory is not None:
        figures["memory"] = png_bytes(memory)
    alternatives = alternatives_figure(plan, top_k)
    if alternatives is not None:
        figures["alternatives"] = png_bytes(alternatives)
    cl = plan.cluster
    title = f"autoplan report: {describe(plan.model)} on {cl.get('name', 'cluster')}"
    subtitle = (f"{plan.label()} — {cl.get('nodes')} × {cl.get('devices_per_node')} "
                f"{(cl.get('device') or {}).get('name', '')}, global batch {plan.global_batch}"
                f", sequence {plan.seq_len}")
    sections = (_summary(plan), _mesh(plan, timing, step, figures),
                _timeline(plan, step, figures), _memory(plan, step, figures),
                _time(step, figures), _alternatives(plan, figures, top_k))
    notes = (timing.note,
             "All figures are predictions of autoplan's cost model; `autoplan run PLAN` "
             "(or torchrun -m engine.run PLAN) measures the real step time and memory.",
             f"autoplan {autoplan.__version__}; plan by {plan.planner.name or '?'}.")
    return Report(title, subtitle, sections, figures, notes, timing, step)


def write_report(report: Report, *, html_path: str | os.PathLike | None = None,
                 png_dir: str | os.PathLike | None = None) -> dict[str, object]:
    """Write the HTML page and/or one PNG per figure (atomically); returns what was written."""
    out: dict[str, object] = {"html": None, "pngs": []}
    if html_path is not None:
        out["html"] = str(atomic_write_text(html_path, report.html()))
    if png_dir is not None:
        folder = Path(png_dir)
        out["pngs"] = [str(atomic_write_bytes(folder / f"{name}.png", data))
                       for name, data in report.figures.items()]
    return out


# ---- sections ----------------------------------------------------------------------------

def _summary(plan: Plan) -> Section:
    cl = plan.cluster
    rows = [("model", f"{describe(plan.model)} ({plan.num_params / 1e9:.2f} B parameters)"),
            ("cluster", f"{cl.get('nodes')} nodes × {cl.get('devices_per_node')} "
                        f"{(cl.get('device') or {}).get('name', '?')} ({cl.get('name')})"),
            ("batch", f"global batch {plan.global_batch} samples, sequence {plan.seq_len}"),
            ("configuration", plan.label()),
            ("precision", ", ".join(f"{k} {v}" for k, v in sorted(plan.precision.items())))]
    pred = plan.prediction
    if pred is not None:
        fits = "fits" if pred.memory.total <= pred.memory_limit_bytes else "does NOT fit"
        parts = pred.time.to_dict()
        total = parts.pop("total") or 1.0
        rows += [("step time", f"{pred.step_time_s:.4g} s"),
                 ("throughput", f"{pred.tokens_per_s:,.0f} tokens/s, "
                                f"{pred.samples_per_s:,.1f} samples/s"),
                 ("TFLOP/s per device", f"{pred.model_tflops_per_device:.1f} model, "
                                        f"{pred.hardware_tflops_per_device:.1f} with recompute"),
                 ("MFU", f"{100 * pred.mfu:.1f} %"),
                 ("memory per device", f"{pred.memory.total / GB:.2f} GB of "
                                       f"{pred.memory_limit_bytes / GB:.0f} GB "
                                       f"({fits})"),
                 ("time breakdown", ", ".join(f"{k} {100 * v / total:.0f}%"
                                              for k, v in parts.items() if v > 0))]
    planner = plan.planner
    if planner.name:          # which planner, and why the grid's plan if it stands in
        from autoplan.display import planner_line

        rows.append(("planner", planner_line(plan).removeprefix("planner: ")))
    return Section("summary", "Summary", tables=(Table(("what", "value"), tuple(rows)),))


def _mesh(plan: Plan, timing: StageTiming, step: StepModel, figures: dict) -> Section:
    owner = {tuple(g): k for k, g in enumerate(step.groups)}
    rows = []
    for st, c in zip(plan.stages, timing.chunks):
        rows.append((str(st.index), str(owner[tuple(st.ranks)]), span_label(st.layer_names),
                     str(len(st.layer_names)), f"{st.ranks[0]}–{st.ranks[-1]}",
                     str(tuple(st.mesh_shape)),
                     str(len(st.checkpoint_layers)) + (
                         f" ({plan.parallel.checkpoint})" if st.checkpoint_layers
                         and plan.parallel.checkpoint in PARTIAL_RECOMPUTE else ""),
                     f"{c.forward_block * 1e3:.3g}", f"{c.backward_block * 1e3:.3g}"))
    table = Table(("stage", "pipeline rank", "layers", "count", "ranks", "mesh (dp, tp)",
                   "recomputed", "forward ms / micro-batch", "backward ms / micro-batch"),
                  tuple(rows), caption="Stages (model chunks)", numeric=(3, 6, 7, 8))
    text = ("Each cell is one device (number: global rank), coloured by the pipeline stage it "
            "runs. " + "; ".join(f"pipeline rank {k}: {group_label(plan, g)}"
                                 for k, g in enumerate(step.groups[:8]))
            + ("; ..." if len(step.groups) > 8 else "."))
    return Section("mesh", "Device mesh and stage assignment", text, figures["mesh"],
                   "device mesh coloured by stage", (table,))


def _timeline(plan: Plan, step: StepModel, figures: dict) -> Section:
    p = plan.parallel
    idle = sum(r["idle (bubble)"] for r in step.ranks) / max(1, len(step.ranks))
    text = (f"Schedule {p.schedule}, {p.num_micro_batches} micro-batches of {p.micro_batch} "
            f"per data-parallel rank. Simulated pipeline time {step.pipeline_s:.4g} s, of "
            f"which {100 * idle / step.pipeline_s:.1f}% is idle (bubble) on the average rank; "
            f"then gradient synchronisation {step.dp_comm_s:.3g} s and the optimizer "
            f"{step.optimizer_s:.3g} s"
            + (f", and {step.runtime_s:.3g} s of runtime overhead no term prices (a GPU "
               "step's share fitted on published runs)" if step.runtime_s > 0 else "")
            + f": {step.step_s:.4g} s per step.")
    if plan.prediction is not None:
        text += f" The plan's prediction: {plan.prediction.step_time_s:.4g} s."
    return Section("timeline", "Pipeline timeline of one step", text, figures["timeline"],
                   "pipeline schedule Gantt chart")


def _memory(plan: Plan, step: StepModel, figures: dict) -> Section:
    pred = plan.prediction
    if pred is None:
        return Section("memory", "Memory per device", "The plan carries no prediction.")
    per_stage = pred.memory_per_stage or (pred.memory,)
    rows = []
    for k, m in enumerate(per_stage):
        rows.append((str(k), *(f"{getattr(m, f) / GB:.2f}" for f in
                                ("params", "grads", "optimizer", "activations", "other")),
                     f"{m.total / GB:.2f}", f"{100 * m.total / pred.memory_limit_bytes:.0f}%"))
    table = Table(("pipeline rank", "params GB", "grads GB", "optimizer GB", "activations GB",
                   "other GB", "total GB", "of device"), tuple(rows),
                  numeric=tuple(range(1, 8)))
    return Section("memory", "Memory per device and stage",
                   f"Predicted bytes per device (1 GB = 1e9 bytes); device memory "
                   f"{pred.memory_limit_bytes / GB:.0f} GB.", figures.get("memory"),
                   "stacked memory per stage", (table,))


def _time(step: StepModel, figures: dict) -> Section:
    unit, scale = time_unit(step.step_s)
    rows = tuple((str(k), *(f"{r[p] * scale:.4g}" for p in PARTS))
                 for k, r in enumerate(step.ranks))
    table = Table(("pipeline rank", *(f"{p} ({unit})" for p in PARTS)), rows,
                  numeric=tuple(range(1, len(PARTS) + 1)))
    return Section("time", "Compute and communication per stage",
                   "Seconds of one step on each pipeline rank: compute (forward, backward, "
                   "recomputation), communication not hidden behind compute (tensor-parallel "
                   "collectives, stage-to-stage sends, gradient reduction), optimizer, and "
                   "idle time in the pipeline bubble.", figures["time"],
                   "compute vs communication per stage", (table,))


def _alternatives(plan: Plan, figures: dict, top_k: int) -> Section:
    if not plan.alternatives or plan.prediction is None:
        return Section("alternatives", "Alternatives considered",
                       "This plan records no alternatives (it was estimated for a given "
                       "configuration, not searched); `autoplan plan` keeps the next best.")
    best = plan.prediction
    rows = [(plan.label() + " (this plan)", f"{best.step_time_s:.4g}", "1.000",
             f"{100 * best.mfu:.1f}", f"{best.memory.total / GB:.1f}", "")]
    for a in plan.alternatives[:top_k]:
        rows.append((a["parallel"], f"{a['step_time_s']:.4g}",
                     f"{a['step_time_s'] / best.step_time_s:.3f}",
                     f"{100 * a.get('mfu', 0.0):.1f}", f"{a.get('memory_gb', 0.0):.1f}",
                     why_best(best.time.to_dict(), a.get("time", {}))))
    table = Table(("configuration", "step time (s)", "vs this plan", "MFU %", "memory GB",
                   "why slower (vs this plan)"), tuple(rows), numeric=(1, 2, 3, 4))
    return Section("alternatives", "Alternatives considered",
                   f"The {len(rows) - 1} fastest other configurations that fit, of "
                   f"{'?' if plan.planner.feasible is None else plan.planner.feasible} feasible.",
                   figures.get("alternatives"), "predicted step times of alternatives",
                   (table,))
