"""Faults in a run (issue #7): a dead rank, a stuck rank, a crash in the middle of a save.

Faults are injected with the engine's test-only ``RunConfig`` options ``fault`` /
``fault_step`` / ``fault_rank``; they fire on torchrun's first attempt only, so a run
relaunched by ``torchrun --max-restarts`` goes on cleanly. Every run is the 2-rank ZeRO-3
plan of ``test_engine_resume.py`` on the tiny GPT, 8 steps, and is compared step by step with
one uninterrupted reference run (shared by the module).

* one rank SIGKILLed after step 5 under ``--max-restarts=1 --resume``: torchrun relaunches
  both ranks, they resume from step 3's checkpoint and reproduce steps 4-8;
* one rank that stops answering before step 3: the run exits with status 3 within the
  configured ``--timeout-s`` (plus start-up), instead of hanging (``test_engine_launch.py``
  covers the mesh's collectives on their own; this is the whole ``engine.run``);
* one rank SIGKILLed inside step 6's checkpoint save (shards written, not renamed): the
  half-written ``.step_00000006.tmp`` is ignored, ``--resume`` picks step 3, reproduces
  steps 4-8 and the next save replaces the stale temp dir.
"""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from engine_helpers import REPO, engine_env, losses, make_plan

pytestmark = pytest.mark.multiproc

PLAN = dict(dp=2, zero=3, num_micro_batches=2)
STEPS = 8
COMMON = ["--steps", str(STEPS), "--lr", "0.003", "--log-every", "1", "--memory", "off",
          "--checkpoint-every", "3"]

#: torchrun's agent hosts the c10d store its workers share (torch >= 2.5's default) and keeps
#: that one store, at the same MASTER_PORT, across ``--max-restarts`` relaunches; the workers
#: use it with no per-attempt prefix. So a relaunched rank finds the keys its dead
#: predecessors wrote -- among them gloo's listening address of each rank -- and, when it
#: reads a peer's key before the relaunched peer has overwritten it (likely on a loaded
#: machine), connects to a dead process: connectFullMesh "Connection refused", every spare
#: restart alike, and the last attempt hangs until the subprocess timeout. With sharing off
#: each attempt's rank 0 hosts a fresh store (pytorch/pytorch#135712).
RESTART_SAFE_ENV = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}


def _run(plan_path, out, *extra, restarts: int = 0, timeout: float = 180):
    pre = [f"--max-restarts={restarts}"] if restarts else []
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           *pre, "-m", "engine.run", str(plan_path), "--out", str(out), *COMMON, *extra]
    return subprocess.run(cmd, env={**engine_env(), **RESTART_SAFE_ENV}, cwd=REPO,
                          capture_output=True, text=True, timeout=timeout)


def _ckpts(out):
    return sorted(p.name for p in (out / "checkpoints").iterdir())


def _assert_same_losses(got: dict[int, float], want: dict[int, float], steps) -> None:
    for step in steps:
        assert got[step] == pytest.approx(want[step], rel=1e-6, abs=0), step


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The plan file and the losses of an uninterrupted run."""
    root = tmp_path_factory.mktemp("faults")
    plan = make_plan(**PLAN).save(root / "plan.json")
    full = _run(plan, root / "full")
    assert full.returncode == 0, full.stderr[-4000:]
    want = losses(root / "full")
    assert sorted(want) == list(range(1, STEPS + 1))
    return plan, want


def test_killed_rank_is_restarted_and_resumes_from_last_checkpoint(reference, tmp_path):
    plan, want = reference
    out = tmp_path / "run"
    proc = _run(plan, out, "--resume", "--fault", "kill", "--fault-step", "5",
                "--fault-rank", "1", restarts=1)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    # attempt 1 found no checkpoint and started fresh; the next attempt resumed step 3's
    assert "no checkpoint" in proc.stdout
    assert proc.stdout.count("resumed from") == 1, proc.stdout[-3000:]
    assert proc.stdout.count("step_00000003 (step 3)") == 1
    # the steps after the restart are those of the uninterrupted run
    got = losses(out)
    assert sorted(got) == list(range(1, STEPS + 1))
    _assert_same_losses(got, want, range(1, STEPS + 1))
    assert _ckpts(out) == ["step_00000003", "step_00000006"]


def test_stuck_rank_fails_the_run_within_the_timeout(reference, tmp_path):
    plan, _ = reference
    out = tmp_path / "run"
    t0 = time.perf_counter()
    proc = _run(plan, out, "--timeout-s", "4", "--fault", "hang", "--fault-step", "3",
                "--fault-rank", "1", timeout=120)
    elapsed = time.perf_counter() - t0
    assert proc.returncode != 0, proc.stdout[-2000:]
    assert elapsed < 60, elapsed                  # not torch's 30 min default, not forever
    err = proc.stderr
    assert "fault injection: rank 1 hangs before step 3" in err
    assert "error: rank 0: a collective failed" in err, err[-4000:]
    assert "exitcode  : 3" in err                 # torchrun's report: engine.run's status 3
    assert max(losses(out)) == 2                  # step 3 never completed


def test_crash_during_save_leaves_previous_checkpoint_usable(reference, tmp_path):
    plan, want = reference
    out = tmp_path / "run"
    crashed = _run(plan, out, "--fault", "save_crash", "--fault-step", "6",
                   "--fault-rank", "1")
    assert crashed.returncode != 0
    # step 6's save died half-way: DCP shards in the temp dir, no rename, no step_6
    assert _ckpts(out) == [".step_00000006.tmp", "step_00000003"]
    tmp = out / "checkpoints" / ".step_00000006.tmp"
    assert any(tmp.glob("*.distcp"))
    assert not (tmp / "train_state" / "rank00001.pt").exists()
    assert max(losses(out)) == 6

    resumed = _run(plan, out, "--resume")
    assert resumed.returncode == 0, resumed.stderr[-4000:]
    assert "step_00000003 (step 3)" in resumed.stdout
    got = losses(out)
    assert sorted(got) == list(range(1, STEPS + 1))
    _assert_same_losses(got, want, range(4, STEPS + 1))
    assert _ckpts(out) == ["step_00000003", "step_00000006"]  # stale temp dir replaced
