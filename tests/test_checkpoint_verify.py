"""Issue 14, finding 3: checkpoints are verified before use. One small real checkpoint is
written once (a 1-rank run); each test attacks a copy — the flipped bit, the truncated or
deleted file of each kind, another model's checkpoint, a torn metrics line, a second run on
the same directory, a pickle in the train state — and checks the verifier's answer."""

from __future__ import annotations

import json
import os
import pickle
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from autoplan.errors import ConfigError
from autoplan.plan import Plan
from engine.manifest import (MANIFEST, CheckpointError, CheckpointMismatch, choose,
                             plan_fingerprint, verify, write_manifest)
from engine.metrics import read_metrics, truncate_metrics
from engine.rundir import check_unlocked, hold
from engine_helpers import deadline, engine_env, make_plan

STEPS = ["--steps", "4", "--checkpoint-every", "2", "--memory", "off", "--log-every", "4"]


def _engine(plan_path: Path, out: Path, *extra: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in engine_env().items()
           if k not in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    return subprocess.run([sys.executable, "-m", "engine.run", str(plan_path), "--out",
                           str(out), *STEPS, *extra], env=env, capture_output=True, text=True,
                          timeout=300)


@pytest.fixture(scope="module")
def real(tmp_path_factory) -> tuple[Path, Path, Plan]:
    """(plan file, run dir with checkpoints at steps 2 and 4, plan)."""
    root = tmp_path_factory.mktemp("ckpt")
    plan = make_plan()
    path = plan.save(root / "plan.json")
    proc = _engine(path, root / "run")
    assert proc.returncode == 0, proc.stderr[-3000:]
    return path, root / "run", plan


def _copy(real, tmp_path) -> tuple[Path, Plan]:
    _, run, plan = real
    shutil.copytree(run / "checkpoints", tmp_path / "checkpoints")
    return tmp_path / "checkpoints", plan


def _ids(plan: Plan) -> dict:
    return dict(world_size=1, plan_fp=plan_fingerprint(plan), model_fp=plan.model_fingerprint)


def _steps(root: Path) -> list[tuple[int, Path]]:
    return [(int(p.name.split("_")[1]), p) for p in sorted(root.glob("step_*"))]


def test_a_fresh_checkpoint_verifies(real, tmp_path):
    root, plan = _copy(real, tmp_path)
    doc = verify(root / "step_00000004", step=4, **_ids(plan))
    kinds = {Path(n).suffix or n for n in doc["files"]}
    assert {".distcp", ".metadata", ".pt"} <= kinds


FILE_KINDS = ["__0_0.distcp", ".metadata", "train_state/rank00000.pt", MANIFEST]


@pytest.mark.parametrize("name", FILE_KINDS)
@pytest.mark.parametrize("damage", ["flip", "truncate", "delete", "append", "fifo", "device"])
def test_damage_falls_back_to_the_previous_checkpoint(real, tmp_path, name, damage):
    """A file damaged, or replaced by a named pipe (opening it would block) or a link to a
    device that never ends: an error for that checkpoint, the previous one resumed."""
    root, plan = _copy(real, tmp_path)
    target = root / "step_00000004" / name
    data = bytearray(target.read_bytes())
    if damage in ("fifo", "device"):
        target.unlink()
        os.mkfifo(target) if damage == "fifo" else target.symlink_to("/dev/zero")
    elif damage == "flip":
        data[len(data) // 2] ^= 0x10
        target.write_bytes(bytes(data))
    elif damage == "truncate":
        target.write_bytes(bytes(data[: len(data) // 3]))
    elif damage == "append":
        target.write_bytes(bytes(data) + b"\0")
    else:
        target.unlink()
    with deadline(60):                   # a regression fails instead of hanging
        with pytest.raises(CheckpointError):
            verify(root / "step_00000004", step=4, **_ids(plan))
        found, notes = choose(_steps(root), **_ids(plan))
    assert found == (2, root / "step_00000002")
    assert len(notes) == 1 and "step_00000004" in notes[0]


def test_another_model_is_refused_with_both_fingerprints(real, tmp_path):
    root, plan = _copy(real, tmp_path)
    other = make_plan(model={**plan.model["config"], "dropout": 0.5})   # same shapes
    assert other.num_params == plan.num_params
    with pytest.raises(CheckpointMismatch) as info:
        choose(_steps(root), **_ids(other))
    assert plan.model_fingerprint in str(info.value)
    assert other.model_fingerprint in str(info.value)


def test_another_plan_or_world_size_is_refused(real, tmp_path):
    root, plan = _copy(real, tmp_path)
    other = make_plan(num_micro_batches=2)
    with pytest.raises(CheckpointMismatch, match=plan_fingerprint(other)):
        choose(_steps(root), **_ids(other))
    with pytest.raises(CheckpointMismatch, match="written by 1 ranks, this run has 4"):
        choose(_steps(root), **{**_ids(plan), "world_size": 4})


def test_a_forged_manifest_field_is_damage_not_a_mismatch(real, tmp_path):
    root, plan = _copy(real, tmp_path)
    path = root / "step_00000004" / MANIFEST
    doc = json.loads(path.read_text())
    doc["model_fingerprint"] = "0" * 16
    path.write_text(json.dumps(doc))
    found, notes = choose(_steps(root), **_ids(plan))
    assert found[0] == 2 and "checksum" in notes[0]


def test_every_checkpoint_damaged_is_an_error_on_resume(real, tmp_path):
    plan_path, _, plan = real
    out = tmp_path / "run"
    shutil.copytree(real[1], out)
    for step_dir in (out / "checkpoints").glob("step_*"):
        (step_dir / ".metadata").write_bytes(b"junk")
    proc = _engine(plan_path, out, "--resume", "--steps", "6")
    assert proc.returncode == 2
    assert "no checkpoint in" in proc.stderr and "verifies" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_resume_skips_a_flipped_shard_and_says_so(real, tmp_path):
    plan_path, _, plan = real
    out = tmp_path / "run"
    shutil.copytree(real[1], out)
    shard = out / "checkpoints" / "step_00000004" / "__0_0.distcp"
    data = bytearray(shard.read_bytes())
    data[100] ^= 1
    shard.write_bytes(bytes(data))
    proc = _engine(plan_path, out, "--resume")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "skipped checkpoint step_00000004" in proc.stdout
    assert "__0_0.distcp: SHA-256 differs" in proc.stdout
    assert "resumed from" in proc.stdout and "step_00000002" in proc.stdout
    want = {r["step"]: r["loss"] for r in read_metrics(real[1] / "metrics.jsonl")[0]}
    got = {r["step"]: r["loss"] for r in read_metrics(out / "metrics.jsonl")[0]}
    assert got == pytest.approx(want, rel=1e-6)           # steps 3-4 re-run identically


class _Evil:
    def __reduce__(self):
        return (os.system, (f"touch {os.environ.get('EVIL_MARKER', '/nonexistent')}",))


def test_train_state_is_not_unpickled(real, tmp_path):
    """Even a checkpoint whose manifest was rewritten to match (someone with write access)
    cannot run code through the train state: it is loaded with weights_only=True."""
    plan_path, _, plan = real
    out = tmp_path / "run"
    shutil.copytree(real[1], out)
    marker = tmp_path / "pwned"
    step = out / "checkpoints" / "step_00000004"
    os.environ["EVIL_MARKER"] = str(marker)
    try:
        with open(step / "train_state" / "rank00000.pt", "wb") as f:
            pickle.dump({"step": 4, "x": _Evil()}, f)
    finally:
        del os.environ["EVIL_MARKER"]
    write_manifest(step, step=4, world_size=1, plan_fp=plan_fingerprint(plan),
                   model_fp=plan.model_fingerprint)
    proc = _engine(plan_path, out, "--resume")
    assert proc.returncode != 0
    assert not marker.exists()


def test_metrics_tolerate_a_torn_last_line(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1, "loss": 1.0}\n{"step": 2, "loss": 0.9}\n{"step": 3, "lo')
    records, note = read_metrics(path)
    assert [r["step"] for r in records] == [1, 2] and "torn last line 3" in note
    assert truncate_metrics(path, keep_until=2) is not None
    assert path.read_text().count("\n") == 2 and read_metrics(path)[1] is None
    path.write_text('{"step": 1}\ngarbage\n{"step": 3}\n')
    with pytest.raises(ConfigError, match="line 2"):
        read_metrics(path)


def test_a_torn_metrics_line_does_not_block_resume(real, tmp_path):
    plan_path = real[0]
    out = tmp_path / "run"
    shutil.copytree(real[1], out)
    with open(out / "metrics.jsonl", "a") as f:
        f.write('{"step": 5, "loss": 4.')
    proc = _engine(plan_path, out, "--resume", "--steps", "6")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert sorted(r["step"] for r in read_metrics(out / "metrics.jsonl")[0]) == \
        list(range(1, 7))


def test_one_run_per_output_directory(tmp_path):
    lock = hold(tmp_path / "run")
    try:
        with pytest.raises(ConfigError, match=f"in use by another run \\(pid {os.getpid()}"):
            check_unlocked(tmp_path / "run")
    finally:
        lock.close()
    check_unlocked(tmp_path / "run")


def test_a_second_run_on_a_locked_directory_is_refused(real, tmp_path):
    plan_path = real[0]
    lock = hold(tmp_path / "run")
    try:
        proc = _engine(plan_path, tmp_path / "run")
    finally:
        lock.close()
    assert proc.returncode == 2
    assert "in use by another run" in proc.stderr
    assert not (tmp_path / "run" / "metrics.jsonl").exists()
