"""Issue 14, findings 7 and 8: calibration and profiling cannot corrupt the cost model. The
attacks: a stale ``plan.json`` of another model and cluster in the current directory, a run
directory whose plan is not the plan it ran, runs of one cluster name with two specs, fitted
factors that put MFU over 100%, a cluster named ``../../..``, and re-profiling over a shipped
profile."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

import autoplan
from autoplan.calibrate import calibrate, load_run
from autoplan.cli import main
from autoplan.errors import ConfigError
from autoplan.fingerprints import run_identity

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def plans():
    small = autoplan.estimate("gpt-tiny", "local-cpu", global_batch=8)
    big = autoplan.estimate("gpt-1.7b", "dgx-h100", global_batch=64)   # MFU ~50%
    return small, big


@pytest.fixture
def profiles(tmp_path, monkeypatch):
    root = tmp_path / "profiles"
    shutil.copytree(REPO / "profiles", root)
    monkeypatch.setenv("AUTOPLAN_PROFILES", str(root))
    return root


def _run(run_dir: Path, plan, step_s: float, *, copy_plan: bool = True,
         identity: bool = True) -> Path:
    """A run directory as the engine writes it (summary with the plan's identity)."""
    run_dir.mkdir(parents=True)
    if copy_plan:
        plan.save(run_dir / "plan.json")
    with (run_dir / "metrics.jsonl").open("w") as f:
        for i in range(1, 6):
            f.write(json.dumps({"step": i, "step_time_s": step_s, "loss": 1.0}) + "\n")
    summary = {"plan": "plan.json", "label": plan.parallel.label(), "warmup_steps": 1,
               "world_size": plan.world_size, "device": plan.mesh.device_type,
               "measured": {"step_time_s": step_s,
                            "peak_memory_bytes": plan.prediction.memory.total}}
    if identity:
        summary.update(run_identity(plan))
    (run_dir / "summary.json").write_text(json.dumps(summary))
    return run_dir


def test_a_stale_plan_in_the_current_directory_is_never_used(tmp_path, plans, monkeypatch):
    small, big = plans
    run = _run(tmp_path / "run", small, 0.1, copy_plan=False)
    monkeypatch.chdir(tmp_path)
    big.save(tmp_path / "plan.json")                   # the stale plan of the issue
    with pytest.raises(ConfigError, match="not in the run directory"):
        load_run(run)


def test_a_run_dirs_plan_must_be_the_plan_it_ran(tmp_path, plans):
    small, big = plans
    run = _run(tmp_path / "run", small, 0.1)
    big.save(run / "plan.json")                        # swapped after the run
    with pytest.raises(ConfigError, match="is not the plan this run ran: its "
                                          "plan_fingerprint"):
        load_run(run)


def test_runs_of_one_name_but_two_cluster_specs_are_refused(tmp_path, plans, profiles):
    from autoplan.cluster import Cluster, load_cluster

    small, _ = plans
    base = load_cluster("local-cpu").to_dict()
    other = Cluster.from_dict({**base, "devices_per_node": base["devices_per_node"] * 2})
    twin = autoplan.estimate("gpt-tiny", other, global_batch=8)
    a = _run(tmp_path / "a", small, 0.1)
    b = _run(tmp_path / "b", twin, 0.1)
    with pytest.raises(ConfigError, match="different specifications"):
        calibrate([a, b])


def test_factors_beyond_physics_are_refused_and_nothing_is_written(tmp_path, plans, profiles,
                                                                   capsys):
    small, big = plans
    # a big plan that "ran" in a microsecond: the fit would claim MFU far above 100%
    run = _run(tmp_path / "run", big, 1e-6)
    assert main(["calibrate", str(run), "--force"]) == 2
    err = capsys.readouterr().err
    assert "MFU of" in err and "> 100%" in err
    assert not (profiles / "calibration" / f"{big.cluster['name']}.json").exists()


def test_memory_below_the_parameters_is_refused(tmp_path, plans, profiles):
    small, _ = plans
    run = _run(tmp_path / "run", small, small.prediction.step_time_s)
    summary = json.loads((run / "summary.json").read_text())
    summary["measured"]["peak_memory_bytes"] = 1.0       # one byte per device
    (run / "summary.json").write_text(json.dumps(summary))
    with pytest.raises(ConfigError, match="below its parameters' own"):
        calibrate([run])


def test_a_cluster_name_cannot_become_a_path(tmp_path, plans, profiles, capsys):
    small, _ = plans
    doc = json.loads(small.to_json())
    doc["cluster"]["name"] = "../../../escaped"
    run = tmp_path / "run"
    run.mkdir()
    (run / "plan.json").write_text(json.dumps(doc))
    (run / "summary.json").write_text(json.dumps({"plan": "plan.json", "warmup_steps": 0,
                                                  "measured": {"step_time_s": 0.1}}))
    (run / "metrics.jsonl").write_text('{"step": 1, "step_time_s": 0.1}\n')
    assert main(["calibrate", str(run)]) == 2
    assert "cluster.name" in capsys.readouterr().err
    assert not any(p.name == "escaped.json" for p in tmp_path.rglob("*.json"))


def test_shipped_calibration_is_not_replaced_without_force(tmp_path, plans, profiles, capsys):
    small, _ = plans
    shipped = profiles / "calibration" / "local-cpu.json"
    before = shipped.read_bytes()
    run = _run(tmp_path / "run", small, small.prediction.step_time_s)
    assert main(["calibrate", str(run)]) == 2
    assert "--force" in capsys.readouterr().err and shipped.read_bytes() == before
    assert main(["calibrate", str(run), "--out", str(tmp_path / "mine.json")]) == 0
    assert (tmp_path / "mine.json").exists() and shipped.read_bytes() == before


def test_profile_links_does_not_replace_the_shipped_profile(profiles, capsys, monkeypatch):
    import subprocess

    ran = []
    monkeypatch.setattr(subprocess, "call", lambda cmd: ran.append(cmd) or 0)
    assert main(["profile", "links", "--device", "cpu"]) == 2
    assert "--force" in capsys.readouterr().err and not ran
    assert main(["profile", "links", "--device", "cpu", "--force"]) == 0 and ran


def test_a_torn_last_metrics_line_does_not_stop_calibration(tmp_path, plans):
    small, _ = plans
    run = _run(tmp_path / "run", small, 0.1)
    with (run / "metrics.jsonl").open("a") as f:
        f.write('{"step": 6, "step_ti')
    assert len(load_run(run).step_times_s) == 4
    assert os.path.exists(run / "summary.json")
