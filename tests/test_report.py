"""Plan reports: the pipeline simulation, the HTML page (every section, embedded PNGs, no
external assets), the PNG files, and the command."""

from __future__ import annotations

import base64
import io
import json
import re

import pytest
from matplotlib.image import imread

import autoplan
from autoplan.api import prepare
from autoplan.cost.memory import in_flight_micro_batches
from autoplan.plan import Plan
from autoplan.report import build_report, write_report
from autoplan.report.schedule import BACKWARD, FORWARD, makespan, op_order, simulate
from autoplan.report.timing import stage_timing
from tests.workflow_helpers import run_cli

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
SECTIONS = {"summary": "Summary", "mesh": "Device mesh and stage assignment",
            "timeline": "Pipeline timeline of one step", "memory": "Memory per device and stage",
            "time": "Compute and communication per stage",
            "alternatives": "Alternatives considered"}
SMALL = autoplan.resolve_model("gpt", layers=8, hidden=512, heads=8, vocab_size=8192,
                               seq_len=512)


# ---- the schedule simulation (pure) --------------------------------------------------------

@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize("pp, m", [(1, 1), (2, 5), (4, 4), (4, 9)])
def test_uniform_pipeline_takes_m_plus_p_minus_1_slots(schedule, pp, m):
    blocks = simulate(schedule, pp, 1, m, [1.0] * pp, [2.0] * pp)
    assert len(blocks) == 2 * pp * m
    assert makespan(blocks) == pytest.approx((m + pp - 1) * 3.0)


@pytest.mark.parametrize("pp, v, m", [(2, 2, 4), (4, 2, 8), (4, 3, 12), (3, 2, 7), (5, 3, 31)])
def test_interleaved_pipeline(pp, v, m):
    n = pp * v
    blocks = simulate("interleaved_1f1b", pp, v, m, [1.0] * n, [2.0] * n)
    assert len(blocks) == 2 * n * m
    if m % pp == 0:      # Narayanan et al. 2021: m T + (pp - 1) T / v, T = 3 v per micro-batch
        assert makespan(blocks) == pytest.approx(3.0 * v * m + 3.0 * (pp - 1))
    # dependencies hold: a chunk's forward after the previous chunk's, backward after next's
    end = {(b.kind, b.chunk, b.micro_batch): b.end for b in blocks}
    for b in blocks:
        if b.kind == FORWARD and b.chunk > 0:
            assert b.start >= end[(FORWARD, b.chunk - 1, b.micro_batch)] - 1e-12
        if b.kind == BACKWARD and b.chunk < n - 1:
            assert b.start >= end[(BACKWARD, b.chunk + 1, b.micro_batch)] - 1e-12


@pytest.mark.parametrize("schedule, pp, v, m", [("1f1b", 4, 1, 8), ("gpipe", 4, 1, 8),
                                                ("interleaved_1f1b", 4, 2, 8)])
def test_in_flight_micro_batches_match_the_memory_model(schedule, pp, v, m):
    """The orders hold at most as many activations as autoplan.cost.memory charges."""
    for rank in range(pp):
        live = peak = 0
        for kind, _, _ in op_order(schedule, pp, v, m, rank):
            live += 1 if kind == FORWARD else -1
            peak = max(peak, live)
        assert peak / v == pytest.approx(in_flight_micro_batches(schedule, pp, rank, m, v))


def test_op_order_rejects_bad_input():
    with pytest.raises(ValueError, match="schedule"):
        op_order("zero_bubble", 2, 1, 4, 0)
    with pytest.raises(ValueError, match="interleaved"):
        op_order("1f1b", 2, 2, 4, 0)


# ---- a multi-stage plan ----------------------------------------------------------------------

@pytest.fixture(scope="module")
def problem():
    return prepare("gpt-1.7b", "dgx-a100", nodes=4, global_batch=512)


@pytest.fixture(scope="module")
def plan(problem) -> Plan:
    return autoplan.estimate(None, None, global_batch=512, problem=problem, tp=2, pp=4,
                             micro_batch=2, schedule="interleaved_1f1b", virtual_stages=2,
                             checkpoint="full")


@pytest.fixture(scope="module")
def report(plan, problem):
    return build_report(plan, problem=problem)


def test_a_plan_without_stage_times_is_repriced(plan, problem):
    """A version-2 plan (no per-stage times) is re-priced by the Estimator, to the same
    figures the plan would have recorded."""
    from dataclasses import replace

    from autoplan.report.timing import stage_timing

    old = replace(plan, prediction=replace(plan.prediction, stage_times=()))
    timing = stage_timing(old, problem)
    assert timing.source == "estimator"
    recorded = stage_timing(plan, problem)
    assert [c.backward_block for c in timing.chunks] == \
        [c.backward_block for c in recorded.chunks]


def test_timing_and_simulated_step_agree_with_the_prediction(plan, report, problem):
    p = plan.parallel
    # read from the plan (version 3), the Estimator's own chunks: nothing re-traced
    assert report.timing.source == "plan"
    est = problem.estimator()
    assert [(c.forward, c.backward, c.tp_backward, c.send) for c in report.timing.chunks] == [
        (t.forward, t.backward, t.tp_backward, t.send)
        for t in (c.stage_time() for c in est.chunks(p))]
    assert len(report.timing.chunks) == len(plan.stages) == 8
    assert len(report.step.blocks) == 2 * p.num_micro_batches * len(plan.stages)
    # the simulation and the Estimator's closed form (Narayanan et al.) agree within 2%
    assert report.step.step_s == pytest.approx(plan.prediction.step_time_s, rel=0.02)
    for rank in report.step.ranks:
        assert sum(rank.values()) == pytest.approx(report.step.step_s, rel=1e-6)
        assert rank["recompute"] > 0 and rank["TP comm"] > 0


def test_html_has_every_section_and_embedded_pngs(report, tmp_path):
    written = write_report(report, html_path=tmp_path / "report.html")
    html = (tmp_path / "report.html").read_text()
    assert written["html"] == str(tmp_path / "report.html")
    for sid, title in SECTIONS.items():
        assert re.search(rf'<section id="{sid}">\s*<h2>{re.escape(title)}</h2>', html), sid
    images = re.findall(r'src="data:image/png;base64,([A-Za-z0-9+/=]+)"', html)
    assert len(images) == 4              # mesh, timeline, memory, time (no alternatives)
    for data in images:
        raw = base64.b64decode(data, validate=True)
        assert raw.startswith(PNG_MAGIC)
        assert imread(io.BytesIO(raw), format="png").shape[1] > 800
    assert not re.search(r'(src|href)="(https?:|//)', html)      # self-contained
    assert "<script" not in html and "<link" not in html
    assert "dp4 tp2 pp4v2 z0 mb2x64 interleaved_1f1b ckpt" in html
    assert "blocks.21–&lt;post&gt;" in html                       # stage table, escaped
    assert "records no alternatives" in html


def test_png_files(report, tmp_path):
    written = write_report(report, png_dir=tmp_path / "figs")
    names = sorted(p.rsplit("/", 1)[-1] for p in written["pngs"])
    assert names == ["memory.png", "mesh.png", "time.png", "timeline.png"]
    for path in written["pngs"]:
        raw = open(path, "rb").read()
        assert raw.startswith(PNG_MAGIC) and len(raw) > 20_000
        height, width = imread(path).shape[:2]
        assert width >= 1000 and height >= 250


def test_alternatives_section_of_a_searched_plan(tmp_path):
    plan = autoplan.optimize(SMALL, "dgx-a100", nodes=2, global_batch=64, top_k=5)
    report = build_report(plan)
    assert "alternatives" in report.figures
    html = report.html()
    for alt in plan.alternatives[:5]:
        assert f"<td>{alt['parallel']}</td>" in html
    assert f"{plan.parallel.label()} (this plan)" in html


def test_timing_falls_back_when_the_model_cannot_be_rebuilt(plan):
    doc = plan.to_dict()
    doc["model"] = {"source": "import", "name": "no_such_package.models:build", "config": {}}
    assert stage_timing(Plan.from_dict(doc)).source == "plan"     # its own figures: no model
    doc["prediction"]["stage_times"] = []                            # as a version-2 plan
    other = Plan.from_dict(doc)
    timing = stage_timing(other)
    assert timing.source == "approximate" and "approximated" in timing.note
    report = build_report(other)
    assert report.step.step_s == pytest.approx(plan.prediction.step_time_s, rel=0.15)
    assert "approximated" in report.html()


def test_command_writes_html_and_pngs(tmp_path, capsys):
    plan = autoplan.estimate(SMALL, "dgx-a100", nodes=1, global_batch=16, tp=2, pp=2,
                             micro_batch=2, schedule="gpipe")
    path = plan.save(tmp_path / "plan.json")
    out = tmp_path / "r.html"
    assert run_cli(["report", str(path), "-o", str(out), "--png", str(tmp_path / "png"),
                    "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["html"] == str(out) and out.stat().st_size > 50_000
    assert doc["sections"] == list(SECTIONS) and len(doc["pngs"]) == 4
    assert doc["simulated_step_s"] == pytest.approx(doc["predicted_step_s"], rel=0.02)
    assert run_cli(["report", str(path), "--png", str(tmp_path / "only"), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["html"] is None and len(doc["pngs"]) == 4
    assert run_cli(["report", str(path), "--top-k", "-1"]) == 2
    assert capsys.readouterr().err.startswith("error: field '--top-k'")
    assert run_cli(["report", str(tmp_path / "missing.json")]) == 2
    assert "cannot read plan" in capsys.readouterr().err
