"""Checkpoint and resume: a run killed after step 10 and resumed reproduces steps 11-20.

The killed run saves a DCP checkpoint every 5 steps and is SIGKILLed (every rank, no
cleanup) right after step 10; ``--resume`` loads step 10's sharded model and optimizer state
and RNG, and the data position follows from the step. Its losses for steps 11-20 must equal
the uninterrupted run's.
"""

from __future__ import annotations

import pytest

from engine_helpers import losses, make_plan, torchrun

pytestmark = pytest.mark.multiproc

PLAN = dict(dp=2, zero=3, num_micro_batches=2)
COMMON = ["--steps", "20", "--lr", "0.003", "--log-every", "5", "--memory", "off"]


def _run(plan_path, out, *extra):
    return torchrun(2, ["-m", "engine.run", str(plan_path), "--out", str(out), *COMMON,
                        *extra])


def test_kill_after_step_10_and_resume(tmp_path):
    plan = make_plan(**PLAN).save(tmp_path / "plan.json")
    full = _run(plan, tmp_path / "full")
    assert full.returncode == 0, full.stderr[-4000:]

    killed = _run(plan, tmp_path / "killed", "--checkpoint-every", "5",
                  "--kill-after-step", "10")
    assert killed.returncode != 0                            # SIGKILLed, not a clean exit
    ckpts = sorted(p.name for p in (tmp_path / "killed" / "checkpoints").iterdir())
    assert ckpts == ["step_00000005", "step_00000010"]       # complete ones only, no temp dir
    assert max(losses(tmp_path / "killed")) == 10

    resumed = _run(plan, tmp_path / "killed", "--checkpoint-every", "5", "--resume")
    assert resumed.returncode == 0, resumed.stderr[-4000:]
    assert "resumed from" in resumed.stdout and "step_00000010" in resumed.stdout

    want, got = losses(tmp_path / "full"), losses(tmp_path / "killed")
    assert sorted(got) == list(range(1, 21))
    for step in range(11, 21):
        assert got[step] == pytest.approx(want[step], rel=1e-6, abs=0), step
    # checkpoint_keep=2: the resumed run's saves at 15 and 20 replaced 5 and 10
    ckpts = sorted(p.name for p in (tmp_path / "killed" / "checkpoints").iterdir())
    assert ckpts == ["step_00000015", "step_00000020"]
