"""Issue 14, findings 4 and 5: everything is checked before any process starts, and a rank's
failure reaches the user once, with its rank. Written as the careless user: ``--lr inf``,
``--timeout-s nan``, ``--steps 0``, an output directory that cannot be written or is full,
a search plan edited by hand (seq_len, precision) for the per-op runtime."""

from __future__ import annotations

import json
import shutil
import time
from collections import namedtuple
from pathlib import Path

import pytest

from autoplan.errors import AutoplanError
from autoplan.plan import Plan
from engine import preflight as preflight_mod
from engine.config import RunConfig
from engine.launch import run_local
from engine.preflight import check_out_dir, check_run_options
from engine.rank_errors import earliest, record
from engine_helpers import make_plan


@pytest.fixture(scope="module")
def plan_path(tmp_path_factory) -> Path:
    return make_plan().save(tmp_path_factory.mktemp("pre") / "one.json")


@pytest.mark.parametrize("extra, field", [
    (["--lr", "inf"], "--lr"), (["--lr", "nan"], "--lr"), (["--timeout-s", "nan"], "--timeout-s"),
    (["--timeout-s", "1e300"], "--timeout-s"), (["--eps", "-1"], "--eps"),
    (["--beta2", "1.5"], "--beta2"), (["--weight-decay", "inf"], "--weight-decay"),
    (["--steps", "0"], "steps"), (["--steps", "99999999999"], "--steps"),
])
def test_bad_options_fail_before_torchrun(plan_path, tmp_path, capsys, extra, field):
    t0 = time.process_time()
    steps = None if "--steps" in extra else 2
    assert run_local(plan_path, steps=steps, out_dir=tmp_path / "out", extra_args=extra) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and field in err and err.count("\n") == 1, err
    assert not (tmp_path / "out").exists()                 # checked before the directory
    assert time.process_time() - t0 < 30


def test_output_directory_that_cannot_be_created(plan_path, tmp_path, capsys):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    assert run_local(plan_path, steps=2, out_dir=blocker / "out") == 2
    assert "cannot create" in capsys.readouterr().err
    assert run_local(plan_path, steps=2, out_dir=blocker) == 2
    assert "not a directory" in capsys.readouterr().err


def test_full_output_directory(plan_path, tmp_path, capsys, monkeypatch):
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(preflight_mod.shutil, "disk_usage", lambda p: usage(1 << 30, 0, 4096))
    assert run_local(plan_path, steps=2, out_dir=tmp_path / "out",
                     extra_args=["--checkpoint-every", "1"]) == 2
    assert "MiB free; this run needs" in capsys.readouterr().err


def test_read_only_directory_is_named(tmp_path, monkeypatch):
    def refuse(*a, **k):
        raise PermissionError(13, "Permission denied")
    monkeypatch.setattr(preflight_mod.tempfile, "NamedTemporaryFile", refuse)
    with pytest.raises(AutoplanError, match="cannot write in .*Permission denied"):
        check_out_dir(tmp_path, need_bytes=0)


def test_run_options_unit():
    check_run_options(RunConfig())
    with pytest.raises(AutoplanError, match="--lr"):
        check_run_options(RunConfig(lr=float("inf")))


def _tampered(tmp_path: Path, **edit) -> Path:
    doc = json.loads(make_plan(dp=2).to_json())
    doc["planner"] = {"name": "auto", "runtime": "per_op"}      # the per-op runtime's plan
    for key, value in edit.items():
        if key == "precision":
            doc["precision"]["compute"] = value
        else:
            doc[key] = value
    path = tmp_path / "tampered.json"
    path.write_text(json.dumps(doc))
    Plan.load(path)                                           # it still loads
    return path


@pytest.mark.parametrize("edit, match", [({"seq_len": 4096}, "field 'seq_len' 4096 exceeds"),
                                         ({"precision": "float16"}, "precision.compute"),
                                         ({"precision": "int8"}, "precision.compute")])
def test_tampered_search_plan_is_refused_before_launch(tmp_path, capsys, edit, match):
    path = _tampered(tmp_path, **edit)
    assert run_local(path, steps=2, out_dir=tmp_path / "out") == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and match in err, err
    assert err.startswith("error: plan ") or err.startswith(f"error: {path}"), err


def test_first_rank_error_wins_and_collective_failures_stay_quiet(tmp_path):
    d = tmp_path / "errors"
    assert record(d, 1, "no train state for rank 1", collective=False) is True
    assert record(d, 0, "a collective failed (Connection closed by peer)",
                  collective=True) is False
    assert record(d, 2, "a later error", collective=False) is False
    first = earliest(d)
    assert first["rank"] == 1 and first["message"] == "no train state for rank 1"
    lonely = tmp_path / "lonely"
    assert record(lonely, 0, "a collective failed", collective=True) is True


@pytest.mark.multiproc
def test_a_mismatched_resume_is_one_message_with_its_rank(tmp_path, capsys):
    out = tmp_path / "run"
    first = make_plan(dp=2).save(tmp_path / "a.json")
    assert run_local(first, steps=2, out_dir=out, extra_args=[
        "--checkpoint-every", "2", "--memory", "off"]) == 0
    other = make_plan(tp=2).save(tmp_path / "b.json")          # same model, another layout
    capsys.readouterr()
    code = run_local(other, steps=4, out_dir=out, extra_args=["--resume", "--memory", "off"])
    captured = capsys.readouterr()
    assert code != 0
    text = captured.err
    assert text.count("was written by a plan of fingerprint") <= 2, text[-3000:]
    assert "Connection closed by peer" not in text
    last = text.strip().splitlines()[-1]
    assert last.startswith("error: rank ") and "failed first" in last
    assert "fingerprint" in last
    shutil.rmtree(out)
