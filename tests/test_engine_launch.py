"""A launch that does not fit the plan fails at once, with one clear message."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest

from engine.launch import run_local, torchrun_command
from engine_helpers import REPO, engine_env, make_plan, torchrun

WANT = ("was made for 4 ranks (mesh pp=1 dp=2 tp=2) but {who} 2; "
        "relaunch with --nproc_per_node=4")


def test_run_local_refuses_wrong_world_size_before_starting_processes(tmp_path, capsys):
    plan = make_plan(dp=2, tp=2).save(tmp_path / "x.json")
    t0 = time.perf_counter()
    assert run_local(plan, nproc=2) == 2
    assert time.perf_counter() - t0 < 20
    err = capsys.readouterr().err
    assert err.startswith(f"error: plan {plan} ")
    assert WANT.format(who="the launch asks for") in err
    assert "Traceback" not in err


@pytest.mark.multiproc
def test_torchrun_with_wrong_world_size_fails_fast(tmp_path):
    plan = make_plan(dp=2, tp=2).save(tmp_path / "x.json")
    t0 = time.perf_counter()
    proc = torchrun(2, ["-m", "engine.run", str(plan), "--out", str(tmp_path / "run")],
                    timeout=120)
    elapsed = time.perf_counter() - t0
    assert proc.returncode != 0
    assert elapsed < 60
    out = proc.stdout + proc.stderr
    assert out.count(f"error: plan {plan} " + WANT.format(who="torchrun started")) == 1
    assert "[rank0]: Traceback" not in out and "[rank1]: Traceback" not in out
    assert not (tmp_path / "run").exists()           # nothing ran, nothing was written


def test_edited_model_section_is_refused(tmp_path, capsys):
    plan = make_plan()
    plan.model["config"]["layers"] = 2                # the fingerprint no longer matches
    path = tmp_path / "edited.json"
    path.write_text(plan.to_json())
    assert run_local(path) == 2
    err = capsys.readouterr().err
    assert "field 'model' hashes to fingerprint" in err and plan.model_fingerprint in err


def test_single_rank_plan_runs_without_torchrun(tmp_path):
    """``python -m engine.run PLAN`` for a 1-rank plan (no torchrun environment)."""
    plan = make_plan().save(tmp_path / "one.json")
    env = {k: v for k, v in engine_env().items()
           if k not in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    proc = subprocess.run([sys.executable, "-m", "engine.run", str(plan), "--steps", "3",
                           "--out", str(tmp_path / "run")], env=env, cwd=REPO,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["steps"] == 3 and summary["world_size"] == 1
    assert "step time (s, median)" in proc.stdout


def test_torchrun_command_is_the_documented_one(tmp_path):
    cmd = torchrun_command("plans/x.json", nproc=4, steps=7, out_dir="runs/x",
                           extra_args=["--resume"])
    assert cmd[1:] == ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node=4",
                       "-m", "engine.run", "plans/x.json", "--steps", "7", "--out", "runs/x",
                       "--resume"]


_STALL = '''
import os, sys, time
import torch, torch.distributed as dist
sys.path.insert(0, {tests!r})
from engine_helpers import make_plan
from engine.mesh import build_mesh, init_distributed

plan = make_plan(dp=2)
device = init_distributed("cpu", 2.0)
pm = build_mesh(plan, device, 2.0)
if pm.rank == 1:
    time.sleep(20)                      # a stuck rank
    sys.exit(0)
t0 = time.perf_counter()
try:
    dist.all_reduce(torch.ones(1), group=pm.dp_mesh.get_group())
except Exception as exc:
    print(f"FAILED after {{time.perf_counter() - t0:.1f}} s: {{type(exc).__name__}}", flush=True)
    os._exit(3)
print("NO TIMEOUT", flush=True)
'''


@pytest.mark.multiproc
def test_mesh_collectives_time_out_instead_of_hanging(tmp_path):
    script = tmp_path / "stall.py"
    script.write_text(_STALL.format(tests=str(REPO / "tests")))
    t0 = time.perf_counter()
    proc = torchrun(2, [str(script)], timeout=120)
    assert proc.returncode != 0
    assert "FAILED after" in proc.stdout, proc.stdout + proc.stderr[-3000:]
    waited = float(proc.stdout.split("FAILED after ")[1].split(" s")[0])
    assert 1.5 <= waited < 10                 # the configured 2 s, not torch's 30 min default
    assert time.perf_counter() - t0 < 20 + 60
