"""Issue 14, finding 3 end to end under torchrun: a 2-rank run (ZeRO-3, so every rank holds
its own shards) is killed after step 6; the newest checkpoint's shard gets a flipped bit.
``--resume`` must say which checkpoint it skipped and why, resume from the one before, and
reproduce the uninterrupted run's losses — never train on the damaged weights."""

from __future__ import annotations

import json

import pytest

from engine_helpers import losses, make_plan, torchrun

pytestmark = pytest.mark.multiproc

COMMON = ["--steps", "8", "--lr", "0.003", "--log-every", "4", "--memory", "off",
          "--checkpoint-every", "2", "--checkpoint-keep", "3"]


def _run(plan_path, out, *extra):
    return torchrun(2, ["-m", "engine.run", str(plan_path), "--out", str(out), *COMMON,
                        *extra])


def test_flipped_bit_in_newest_checkpoint_falls_back_under_torchrun(tmp_path):
    plan = make_plan(dp=2, zero=3, num_micro_batches=2).save(tmp_path / "plan.json")
    full = _run(plan, tmp_path / "full")
    assert full.returncode == 0, full.stderr[-4000:]

    out = tmp_path / "killed"
    killed = _run(plan, out, "--kill-after-step", "6")
    assert killed.returncode != 0
    newest = out / "checkpoints" / "step_00000006"
    manifest = json.loads((newest / "manifest.json").read_text())
    shard = sorted(n for n in manifest["files"] if n.endswith(".distcp"))[-1]
    data = bytearray((newest / shard).read_bytes())
    data[len(data) // 2] ^= 0x04
    (newest / shard).write_bytes(bytes(data))

    resumed = _run(plan, out, "--resume")
    assert resumed.returncode == 0, resumed.stderr[-4000:]
    assert f"skipped checkpoint step_00000006: step_00000006/{shard}: SHA-256 differs" \
        in resumed.stdout
    assert "step_00000004 (step 4)" in resumed.stdout
    want, got = losses(tmp_path / "full"), losses(out)
    assert sorted(got) == list(range(1, 9))
    for step in range(5, 9):
        assert got[step] == pytest.approx(want[step], rel=1e-6, abs=0), step


def test_another_plans_checkpoint_is_refused_once_under_torchrun(tmp_path):
    first = make_plan(dp=2, zero=3, num_micro_batches=2).save(tmp_path / "a.json")
    out = tmp_path / "run"
    assert _run(first, out, "--steps", "2").returncode == 0
    other = make_plan(dp=2, zero=1, num_micro_batches=2).save(tmp_path / "b.json")
    proc = _run(other, out, "--resume", "--steps", "4")
    assert proc.returncode != 0
    text = proc.stdout + proc.stderr
    assert text.count("was written by a plan of fingerprint") == 1, text[-4000:]
    assert "Connection closed by peer" not in text and "[rank1]: Traceback" not in text
