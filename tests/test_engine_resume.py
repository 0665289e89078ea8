"""Checkpoint and resume: a run killed after step 6 and resumed reproduces steps 7-12.

The killed run saves a DCP checkpoint every 3 steps and is SIGKILLed (every rank, no
cleanup) right after step 6; ``--resume`` loads step 6's sharded model and optimizer state
and RNG, and the data position follows from the step. Its losses for steps 7-12 must equal
the uninterrupted run's.
"""

from __future__ import annotations

import pytest

from engine_helpers import losses, make_plan, torchrun

pytestmark = pytest.mark.multiproc

PLAN = dict(dp=2, zero=3, num_micro_batches=2)
COMMON = ["--steps", "12", "--lr", "0.003", "--log-every", "3", "--memory", "off"]


def _run(plan_path, out, *extra):
    return torchrun(2, ["-m", "engine.run", str(plan_path), "--out", str(out), *COMMON,
                        *extra])


def test_kill_after_step_6_and_resume(tmp_path):
    plan = make_plan(**PLAN).save(tmp_path / "plan.json")
    full = _run(plan, tmp_path / "full")
    assert full.returncode == 0, full.stderr[-4000:]

    killed = _run(plan, tmp_path / "killed", "--checkpoint-every", "3",
                  "--kill-after-step", "6")
    assert killed.returncode != 0                            # SIGKILLed, not a clean exit
    ckpts = sorted(p.name for p in (tmp_path / "killed" / "checkpoints").iterdir())
    assert ckpts == ["step_00000003", "step_00000006"]       # complete ones only, no temp dir
    assert max(losses(tmp_path / "killed")) == 6

    resumed = _run(plan, tmp_path / "killed", "--checkpoint-every", "3", "--resume")
    assert resumed.returncode == 0, resumed.stderr[-4000:]
    assert "resumed from" in resumed.stdout and "step_00000006" in resumed.stdout

    want, got = losses(tmp_path / "full"), losses(tmp_path / "killed")
    assert sorted(got) == list(range(1, 13))
    for step in range(7, 13):
        assert got[step] == pytest.approx(want[step], rel=1e-6, abs=0), step
    # checkpoint_keep=2: the resumed run's saves at 9 and 12 replaced 3 and 6
    ckpts = sorted(p.name for p in (tmp_path / "killed" / "checkpoints").iterdir())
    assert ckpts == ["step_00000009", "step_00000012"]
