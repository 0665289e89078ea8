"""Measured profiles in the cost model, the shared-core composition, and calibration:
profile plumbing (exact hits equal the table, batch scaling, fallbacks and their counts),
link times per group size, GPU clusters unchanged, calibration fit/apply/files, and run
directories (good and malformed). No engine runs."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from autoplan.calibrate import calibrate, fit, load_run
from autoplan.cluster import load_cluster
from autoplan.cost.batch_scale import batch_tensors, scaled_node
from autoplan.cost.calibration import (Calibration, design_row, fit_memory_factor,
                                       fit_time_factors, load_calibration)
from autoplan.cost.comm import CommModel, Group
from autoplan.cost.compute import ComputeModel, op_kind
from autoplan.cost.profiled import cost_models_for, device_profile
from autoplan.cost.shared_cores import tp_collectives
from autoplan.errors import ConfigError
from autoplan.hostload import HostLoad
from autoplan.models.registry import resolve
from autoplan.plan import ParallelConfig
from autoplan.planner.grid.estimate import Estimator
from autoplan.profile.lookup import OpTimeTable
from autoplan.profile.store import LinkProfile, ProfileError
from autoplan.trace import trace

REPO = Path(__file__).resolve().parents[1]
PROFILES = REPO / "profiles"
OPS = PROFILES / "ops" / "cpu-amd-epyc.json"
LINKS = PROFILES / "links" / "local-cpu.json"


@pytest.fixture(scope="module")
def tiny():
    return trace(resolve("gpt-tiny"), 1, None, dtype=torch.float32)


@pytest.fixture(scope="module")
def tiny2():
    return trace(resolve("gpt-tiny"), 2, None, dtype=torch.float32)


@pytest.fixture(scope="module")
def local():
    return load_cluster("local-cpu")


def _costed(graph):
    return [n for n in graph.nodes.values() if op_kind(n) not in ("view", "comm")]


@pytest.fixture
def profiles(tmp_path, monkeypatch):
    """A private copy of profiles/ (AUTOPLAN_PROFILES points at it)."""
    root = tmp_path / "profiles"
    shutil.copytree(PROFILES, root, ignore=shutil.ignore_patterns("calibration"))
    monkeypatch.setenv("AUTOPLAN_PROFILES", str(root))
    return root


# ---- profile plumbing ----------------------------------------------------------------------

def test_device_maps_to_its_op_profile_and_cores():
    dev = device_profile("cpu-local", PROFILES)
    assert dev.op_profile == OPS and dev.cores == 2
    assert dev.tp_matmul_overhead_s > 0 and dev.dp_module_overhead_s > 0
    assert device_profile("a100-80gb", PROFILES).op_profile is None


def test_exact_hits_equal_the_table_divided_by_the_core_share(tiny, local, profiles):
    compute, _, prov = cost_models_for(local, "fp32")
    assert prov.op_profile == OPS.name and prov.share == 0.5      # 4 ranks on 2 cores
    table = OpTimeTable.load(OPS, dtype="float32")
    checked = 0
    for node in _costed(tiny):
        for tp in (1, 2, 4):
            t = tp if node.tp_role != "replicated" else 1
            found = table.explain(node, t)
            if found.source != "exact":
                continue
            fwd, bwd = compute.op_time_at(node, tiny, t, 1.0)
            assert fwd == pytest.approx(found.fwd_s / 0.5)
            assert bwd == pytest.approx(found.bwd_s / 0.5)
            checked += 1
    assert checked > 50
    assert prov.op_times.coverage(tiny) == {"exact": len(_costed(tiny))}


def test_micro_batch_is_looked_up_at_its_own_shapes(tiny, tiny2, local, profiles):
    """gpt-tiny traced at 1, asked at micro-batch 2, hits the entries measured at 2."""
    flags = batch_tensors(tiny)
    scaled = {n.name: scaled_node(n, flags[n.name], 2) for n in tiny.nodes.values()}
    same = [n for n in tiny2.nodes.values() if n.name in scaled]
    assert len(same) >= len(tiny2.nodes) - 3
    for node in same:
        s = scaled[node.name]
        assert [m.shape for m in s.input_meta] == [m.shape for m in node.input_meta], node.name
        assert [m.shape for m in s.output_meta] == [m.shape for m in node.output_meta]
    compute, _, _ = cost_models_for(local, "fp32")
    table = OpTimeTable.load(OPS, dtype="float32")
    for node in _costed(tiny2):
        if node.name in scaled:
            expect = table.lookup(node, 1)
            got = compute.op_time_at(tiny.nodes[node.name], tiny, 1, 2.0)
            assert got == pytest.approx((expect[0] / 0.5, expect[1] / 0.5)), node.name


def test_missing_ops_fall_back_to_the_roofline_and_are_counted(tiny, local, profiles):
    data = json.loads(OPS.read_text())
    data["entries"] = {k: v for k, v in data["entries"].items()
                       if v["op"] == "aten.addmm.default"}
    (profiles / "ops" / OPS.name).write_text(json.dumps(data))
    compute, _, prov = cost_models_for(local, "fp32")
    roofline = ComputeModel(local.device, dtype="float32")
    gelu = next(n for n in tiny.nodes.values() if n.op == "aten.gelu.default")
    assert compute.op_time_at(gelu, tiny, 1, 1.0) == roofline.op_time(gelu)
    counts = prov.op_times.coverage(tiny)
    assert counts["roofline"] > 0 and counts["exact"] > 0
    assert prov.op_counts["roofline"] >= 1
    assert "roofline" in prov.summary()


def test_link_times_per_group_size_with_core_share(local, profiles):
    _, comm, prov = cost_models_for(local, "fp32")
    links = LinkProfile.load(LINKS)
    for n, slowdown in ((4, 1.0), (2, 2.0)):    # 2 of 4 ranks on 2 cores: half a core each
        t = comm.time("all_reduce", 1 << 20, Group(n, n))
        assert t == pytest.approx(links.predict("all_reduce", "intra", 1 << 20, n) * slowdown)
    assert prov.link_counts == {"measured": 2}
    two_nodes = load_cluster("local-cpu", nodes=2)       # inter level: not measured here
    _, comm2, prov2 = cost_models_for(two_nodes, "fp32")
    assert comm2.time("all_reduce", 1 << 20, Group(2, 1)) == \
        CommModel(two_nodes).time("all_reduce", 1 << 20, Group(2, 1))
    assert prov2.link_counts == {"cluster file": 1}


def test_gpu_clusters_are_predicted_as_before(tiny):
    """No op profile for A100s, and the dgx-a100 link profile is published, not measured."""
    cluster = load_cluster("dgx-a100")
    compute, comm, prov = cost_models_for(cluster, "mixed")
    assert prov.op_profile is None and prov.link_profile is None and prov.composer is None
    assert any("published" in note for note in prov.notes)
    graph = trace(resolve("gpt-tiny"), 1, None, dtype=torch.bfloat16)
    p = ParallelConfig(dp=2, tp=4, micro_batch=1, num_micro_batches=4)
    default = Estimator(graph, cluster).predict(p)
    plain = Estimator(graph, cluster, compute=ComputeModel(cluster.device, "bfloat16"),
                      comm=CommModel(cluster)).predict(p)
    assert default == plain


def test_tp_collectives_are_one_per_sharded_matmul(tiny):
    block = tiny.blocks()[0]
    assert tp_collectives(block, tiny) == (2, 4)          # o, fc2 forward; q, k, v, fc1 back


def test_shared_cores_bound_the_step_by_total_work(tiny, local, profiles):
    est = Estimator(tiny, local, precision="fp32")
    p = ParallelConfig(pp=4, micro_batch=1, num_micro_batches=8)
    pred = est.predict(p)
    # the same chunks composed without the shared-core property (a GPU's composition)
    from autoplan.cost.step import StepModel
    raw = StepModel(est.compute, est.comm, precision="fp32", memory_limit_bytes=1.0,
                    peak_flops=est.peak).compose(est.chunks(p), est.workload(p))
    t = pred.time
    assert t.total == pytest.approx(pred.step_time_s)
    assert pred.step_time_s >= 0.5 * raw.step_time_s - 1e-12          # T >= s * T_dep
    assert t.bubble == pytest.approx(0.0, abs=1e-12)                   # capacity binds
    assert pred.step_time_s < raw.step_time_s                          # the bubble is free


# ---- calibration ---------------------------------------------------------------------------

def test_fit_recovers_factors_and_pins_unidentified_terms_to_one():
    rows = [{"compute": 1.0, "tp_comm": 0.5}, {"compute": 2.0, "dp_comm": 1.0},
            {"compute": 1.0, "tp_comm": 1.0}, {"compute": 3.0}]
    truth = {"compute": 1.5, "tp_comm": 3.0, "dp_comm": 0.5}
    y = [sum(truth.get(k, 1.0) * v for k, v in r.items()) for r in rows]
    f = fit_time_factors(rows, y, ridge=1e-8)
    for k, v in truth.items():
        assert f[k] == pytest.approx(v, rel=1e-4)
    assert f["pp_comm"] == 1.0
    assert fit_memory_factor([100.0, 200.0], [110.0, 220.0]) == pytest.approx(1.1)


def test_apply_matches_the_design_row_and_scales_memory(tiny, local, profiles):
    pred = Estimator(tiny, local, precision="fp32").predict(
        ParallelConfig(dp=2, pp=2, micro_batch=1, num_micro_batches=4))
    cal = Calibration(cluster="local-cpu", factors={"compute": 1.5, "dp_comm": 2.0,
                                                    "pp_comm": 0.5, "memory": 1.2})
    out = cal.apply(pred)
    row = design_row(pred.time)
    assert out.step_time_s == pytest.approx(sum(cal.factor(k) * v for k, v in row.items()))
    assert out.memory.total == pytest.approx(1.2 * pred.memory.total)
    assert out.tokens_per_s * out.step_time_s == pytest.approx(pred.tokens_per_s
                                                              * pred.step_time_s)
    assert Calibration(cluster="x").apply(pred) is pred


def test_calibration_files_reject_bad_terms_and_factors(tmp_path):
    path = tmp_path / "calibration" / "local-cpu.json"
    Calibration(cluster="local-cpu", factors={"compute": 2.0}).save(path)
    assert load_calibration("local-cpu", tmp_path).factor("compute") == 2.0
    assert load_calibration("other", tmp_path).is_identity
    doc = json.loads(path.read_text())
    doc["factors"] = {"compute": 2.0, "bubbles": 1.0}
    path.write_text(json.dumps(doc))
    with pytest.raises(ProfileError, match=r"local-cpu.json.*factors.bubbles"):
        load_calibration("local-cpu", tmp_path)
    doc["factors"] = {"compute": -1.0}
    path.write_text(json.dumps(doc))
    with pytest.raises(ProfileError, match=r"factors.compute"):
        load_calibration("local-cpu", tmp_path)


# ---- run directories -----------------------------------------------------------------------

def _fake_run(run_dir: Path, plan, step_s: float, peak: float, warmup: int = 2) -> Path:
    run_dir.mkdir(parents=True)
    plan.save(run_dir / "plan.json")
    steps = [step_s * f for f in (3.0, 1.5, 1.02, 0.98, 1.0, 1.01, 0.99)]
    with (run_dir / "metrics.jsonl").open("w") as f:
        for i, t in enumerate(steps, 1):
            f.write(json.dumps({"step": i, "step_time_s": t, "loss": 1.0,
                                "memory_tracked": i == warmup}) + "\n")
    summary = {"plan": "plan.json", "label": plan.parallel.label(), "warmup_steps": warmup,
               "measured": {"step_time_s": step_s, "peak_memory_bytes": peak},
               "predicted": None}
    (run_dir / "summary.json").write_text(json.dumps(summary))
    return run_dir


def test_calibration_moves_predictions_to_the_runs_and_the_next_plan_uses_them(
        tmp_path, profiles):
    import autoplan
    from autoplan.api import prepare

    problem = prepare("gpt-tiny", "local-cpu", global_batch=8)
    configs = [{}, {"tp": 2}, {"pp": 2}, {"tp": 4}, {"zero": 3}]
    plans = [autoplan.estimate("gpt-tiny", "local-cpu", global_batch=8, problem=problem, **kw)
             for kw in configs]
    truth = {"compute": 1.8, "tp_comm": 2.5, "dp_comm": 1.3, "pp_comm": 1.0}
    dirs = []
    for i, plan in enumerate(plans):
        row = design_row(plan.prediction.time)
        measured = sum(truth[k] * v for k, v in row.items())
        dirs.append(_fake_run(tmp_path / f"run{i}", plan, measured,
                              1.1 * plan.prediction.memory.total))
    cal, runs, raw = calibrate(dirs)
    assert cal.cluster == "local-cpu" and len(cal.runs) == len(dirs)
    for k in ("compute", "tp_comm"):           # the weak pull to 1 keeps them a little short
        assert cal.factor(k) == pytest.approx(truth[k], rel=0.1)
    assert cal.factor("memory") == pytest.approx(1.1, rel=1e-6)
    for r, p in zip(runs, raw):
        before = abs(p.step_time_s - r.step_time_s)
        after = abs(cal.apply(p).step_time_s - r.step_time_s)
        assert after < 0.2 * before
    cal.save(profiles / "calibration" / "local-cpu.json")
    again = autoplan.estimate("gpt-tiny", "local-cpu", global_batch=8,
                              problem=prepare("gpt-tiny", "local-cpu", global_batch=8))
    assert again.prediction.step_time_s == pytest.approx(cal.apply(raw[0]).step_time_s)
    assert again.prediction.step_time_s == pytest.approx(runs[0].step_time_s, rel=0.05)
    assert again.prediction.memory.total == pytest.approx(runs[0].peak_memory_bytes,
                                                          rel=1e-6)


def test_loaded_run_reads_timed_steps_and_host_load(tmp_path, profiles):
    import autoplan
    from autoplan import hostload

    plan = autoplan.estimate("gpt-tiny", "local-cpu", global_batch=8)
    d = _fake_run(tmp_path / "run", plan, 0.5, 1e8)
    hostload.write(d, HostLoad(wall_s=10.0, own_cpu_s=12.0, machine_busy_s=18.0, cores=2,
                               load_avg_before=(3.0, 3.0, 3.0), load_avg_after=(4, 4, 4)))
    run = load_run(d)
    assert run.step_time_s == 0.5 and len(run.step_times_s) == 5      # 7 steps - 2 warm-up
    assert run.load.external_cores == pytest.approx(0.6)
    assert run.load.available_cores == pytest.approx(1.4)


@pytest.mark.parametrize("breakage, match", [
    ("no summary", r"run/summary.json: no such file"),
    ("bad json", r"run/summary.json: not valid JSON"),
    ("no step time", r"run/summary.json: field 'measured.step_time_s'"),
    ("no metrics", r"run/metrics.jsonl: no such file"),
    ("bad metrics line", r"run/metrics.jsonl: line 2 lacks"),
    ("no plan", r"run/summary.json: field 'plan'"),
    ("bad host load", r"run/host_load.json: not valid JSON"),
])
def test_malformed_run_dirs_name_the_file(tmp_path, breakage, match):
    import autoplan

    plan = autoplan.estimate("gpt-tiny", "local-cpu", global_batch=8)
    d = _fake_run(tmp_path / "run", plan, 0.5, 1e8)
    summary = json.loads((d / "summary.json").read_text())
    if breakage == "no summary":
        (d / "summary.json").unlink()
    elif breakage == "bad json":
        (d / "summary.json").write_text("{not json")
    elif breakage == "no step time":
        del summary["measured"]["step_time_s"]
        (d / "summary.json").write_text(json.dumps(summary))
    elif breakage == "no metrics":
        (d / "metrics.jsonl").unlink()
    elif breakage == "bad metrics line":
        lines = (d / "metrics.jsonl").read_text().splitlines()
        lines[1] = json.dumps({"loss": 1.0})
        (d / "metrics.jsonl").write_text("\n".join(lines))
    elif breakage == "no plan":
        (d / "plan.json").unlink()
    elif breakage == "bad host load":
        (d / "host_load.json").write_text("[")
    with pytest.raises(ConfigError, match=match):
        load_run(d)


def test_fit_refuses_no_runs():
    with pytest.raises(ConfigError, match="no runs"):
        fit([], [], cluster="local-cpu")
