"""The CLI: plan / show / estimate / trace with --json, and one-line errors (exit 2)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from autoplan.cli import main

SMALL = ["gpt", "--layers", "4", "--hidden", "512", "--heads", "8", "--vocab", "8192",
         "--seq-len", "512"]


def _json(capsys, argv) -> dict:
    assert main(argv) == 0
    return json.loads(capsys.readouterr().out)


def test_plan_show_roundtrip(tmp_path, capsys):
    out = tmp_path / "plan.json"
    doc = _json(capsys, ["plan", *SMALL, "--cluster", "dgx-a100", "--nodes", "2",
                         "--global-batch", "64", "-o", str(out), "--json"])
    assert out.exists()
    pred = doc["prediction"]
    for key in ("step_time_s", "tokens_per_s", "mfu", "memory_per_device_bytes",
                "time_breakdown_s", "tflops_per_device", "fits"):
        assert key in pred
    assert pred["fits"] is True
    assert set(pred["tflops_per_device"]) == {"model", "with_recompute"}
    assert doc["config"]["dp"] * doc["config"]["tp"] * doc["config"]["pp"] == 16
    shown = _json(capsys, ["show", str(out), "--json"])
    assert shown["parallel"] == doc["parallel"]
    assert shown["prediction"] == doc["prediction"]
    # the human view renders without error and names the configuration
    assert main(["show", str(out)]) == 0
    assert doc["parallel"] in capsys.readouterr().out


def test_estimate_compares_with_autoplan(capsys):
    doc = _json(capsys, ["estimate", *SMALL, "--cluster", "dgx-a100", "--global-batch", "64",
                         "--tp", "8", "--micro-batch", "1", "--json"])
    assert doc["yours"]["config"]["tp"] == 8
    assert doc["autoplan"]["speedup"] >= 1.0 - 1e-9


def test_trace_json(capsys):
    doc = _json(capsys, ["trace", *SMALL, "--json"])
    assert doc["layers"] == 6 and doc["params"] > 0
    assert list(doc["layer_kinds"].values()).count(4) == 1


@pytest.mark.parametrize("argv, needle", [
    (["plan", "gpt-5", "--cluster", "dgx-a100", "--global-batch", "8"], "unknown model 'gpt-5'"),
    (["plan", *SMALL, "--cluster", "no-such-cluster", "--global-batch", "8"], "no-such-cluster"),
    (["show", "/nonexistent.json"], "cannot read plan"),
    (["estimate", *SMALL, "--cluster", "dgx-a100", "--global-batch", "64", "--tp", "3"], "tp"),
])
def test_user_errors_are_one_line(argv, needle, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and needle in err
    assert len(err.splitlines()) == 1


def test_bad_cluster_yaml_names_file_and_field(tmp_path, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: bad\nnodes: 0\ndevices_per_node: 8\ndevice: a100-80gb\n")
    assert main(["plan", *SMALL, "--cluster", str(bad), "--global-batch", "8"]) == 2
    err = capsys.readouterr().err
    assert "bad.yaml" in err and "nodes" in err


def test_console_script_no_traceback(tmp_path):
    out = subprocess.run([sys.executable, "-m", "autoplan.cli", "show", str(tmp_path / "x.json")],
                         capture_output=True, text=True)
    assert out.returncode == 2
    assert "Traceback" not in out.stderr and out.stderr.startswith("error: ")


def test_console_script_imports_a_module_of_the_current_directory(tmp_path):
    """``autoplan plan import:pkg.mod:fn`` as the README writes it: the console script does
    not put the current directory on sys.path, autoplan does (as ``python -m`` would)."""
    import os
    import shutil
    import subprocess
    from pathlib import Path

    exe = shutil.which("autoplan")
    if exe is None:
        pytest.skip("the autoplan console script is not installed")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    out = tmp_path / "plan.json"
    proc = subprocess.run([exe, "plan", "import:tests.user_model:build", "--cluster",
                           "local-cpu", "--global-batch", "8", "--planner", "uniform", "-o",
                           str(out), "--json"], cwd=Path(__file__).resolve().parent.parent,
                          env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert out.is_file()
