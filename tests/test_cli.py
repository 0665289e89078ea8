"""The CLI: plan / show / estimate / trace with --json, and one-line errors (exit 2)."""

from __future__ import annotations

import json
from pathlib import Path
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
    """The documented plan fields (`parallel`, `config`, `prediction.*`, `stages`) for the
    configuration given; autoplan's own plan under `autoplan`."""
    doc = _json(capsys, ["estimate", *SMALL, "--cluster", "dgx-a100", "--global-batch", "64",
                         "--tp", "8", "--micro-batch", "1", "--json"])
    assert doc["config"]["tp"] == 8 and doc["parallel"].split()[1] == "tp8"
    assert doc["prediction"]["step_time_s"] > 0 and doc["stages"]
    assert doc["autoplan"]["speedup"] >= 1.0 - 1e-9
    assert doc["autoplan"]["prediction"]["step_time_s"] <= doc["prediction"]["step_time_s"]


def test_estimate_takes_the_backward_only_tp_overlap(capsys):
    """``--tp-comm-overlap`` alone: the decomposed overlap (needs --sp); ``--tp-comm-overlap
    backward``: Megatron-LM's default, with or without SP, cheaper than none; any other
    value is a one-line usage error."""
    argv = ["estimate", *SMALL, "--cluster", "dgx-a100", "--global-batch", "64", "--tp", "8",
            "--no-compare", "--json"]
    none = _json(capsys, argv)
    bwd = _json(capsys, [*argv, "--tp-comm-overlap", "backward"])
    assert bwd["config"]["tp_comm_overlap"] == "backward" and "tpoverlap-bwd" in bwd["parallel"]
    assert bwd["prediction"]["step_time_s"] < none["prediction"]["step_time_s"]
    full = _json(capsys, [*argv, "--sp", "--tp-comm-overlap"])
    assert full["config"]["tp_comm_overlap"] is True
    with pytest.raises(SystemExit) as exc:
        main([*argv, "--tp-comm-overlap", "forward"])
    assert exc.value.code == 2 and "expected 'backward'" in capsys.readouterr().err


def _piped(*argv: str, timeout: int = 600) -> str:
    """``autoplan ARGV | cat`` at COLUMNS=80: what a pipe or a log gets."""
    import os

    env = {**os.environ, "COLUMNS": "80"}
    proc = subprocess.run([sys.executable, "-m", "autoplan.cli", *argv], env=env,
                          capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return proc.stdout


def test_tables_are_readable_at_80_columns_in_a_pipe(tmp_path):
    """No name or number cut (the issue: `dgx-a100-40…`, `525,336,…`, `recompu…`)."""
    clusters = _piped("clusters")
    traced = _piped("trace", "llama3-8b", "--layers", "2")
    models = _piped("models")
    plan = tmp_path / "p.json"
    assert main(["plan", "gpt-tiny", "--cluster", "local-cpu", "--global-batch", "8", "-o",
                 str(plan), "--json"]) == 0
    shown = _piped("show", str(plan))
    for out in (clusters, traced, models, shown):
        assert "…" not in out
        assert max(len(line) for line in out.splitlines()) <= 80
    assert "dgx-a100-40gb" in clusters
    assert "525,336,576" in traced                   # llama3-8b's embedding, whole
    assert "kv_heads=None" not in models and "kv_heads=32" in models
    assert "recomputed" in shown and "planner: the search" in shown.replace("\n", " ")


def test_plan_says_which_planner_produced_it(capsys, tmp_path):
    assert main(["plan", "gpt-tiny", "--cluster", "local-cpu", "--global-batch", "8",
                 "--planner", "uniform", "-o", str(tmp_path / "p.json")]) == 0
    out = capsys.readouterr().out
    assert "best plan" not in out
    assert "planner: the uniform grid" in out


def test_trace_json(capsys):
    doc = _json(capsys, ["trace", *SMALL, "--json"])
    assert doc["layers"] == 6 and doc["params"] > 0
    assert list(doc["layer_kinds"].values()).count(4) == 1


@pytest.mark.parametrize("argv, needle", [
    (["plan", "gpt-5", "--cluster", "dgx-a100", "--global-batch", "8"], "unknown model 'gpt-5'"),
    # a Hugging Face config given without its hf: prefix: how to name it, not the presets
    (["plan", "my/config.json", "--cluster", "dgx-a100", "--global-batch", "8"],
     "given as hf:my/config.json"),
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


def test_autoplan_trace_is_callable_after_importing_the_subpackage():
    """The README's `autoplan.trace(autoplan.resolve_model(...), batch_size=1)` once anything
    imported `autoplan.trace` (which binds the attribute to the package)."""
    import autoplan
    import autoplan.trace

    graph = autoplan.trace(autoplan.resolve_model("gpt-tiny"), batch_size=1)
    assert type(graph).__name__ == "OpGraph"
    assert autoplan.trace.trace_module is not None


@pytest.mark.parametrize("argv, steps, out, extra", [
    (["run", "p.json", "--steps", "3", "--out", "d"], 3, "d", []),
    (["run", "--steps", "3", "--out", "d", "p.json"], 3, "d", []),
    (["run", "p.json", "--out=d", "--", "--lr", "0.1"], 20, "d", ["--lr", "0.1"]),
    (["run", "p.json", "--", "--steps", "9"], 20, None, ["--steps", "9"]),
])
def test_run_options_after_the_plan_are_runs_own(monkeypatch, tmp_path, argv, steps, out,
                                                 extra):
    """``autoplan run plan.json --steps 3 --out d`` (the README's order): the run directory
    the CLI reads and reports is the one the engine writes; what follows ``--`` is the
    engine's."""
    import engine.launch

    seen = {}

    def fake(plan, *, steps, out_dir, extra_args):
        seen.update(plan=plan, steps=steps, out=str(out_dir), extra=list(extra_args))
        return 0

    monkeypatch.setattr(engine.launch, "run_local", fake)
    monkeypatch.chdir(tmp_path)
    assert main(argv) == 0
    assert seen == {"plan": "p.json", "steps": steps,
                    "out": out if out is not None else str(Path("runs") / "p"),
                    "extra": extra}


def test_a_cluster_the_batch_cannot_feed_says_which_devices_repeat_work(tmp_path, capsys):
    """Global batch 8 on 32 nodes: the search's plan keeps a 32-way axis on which every op
    is replicated, so 248 of the 256 devices repeat the work of the other 8. The plan says
    so (``distinct_devices``; ``show`` warns and names the node count that holds the work),
    and planning again on that many nodes predicts the same step time. On 64 nodes, more
    devices than the planners split a step (8 samples x 8 devices of a node x 6 layers =
    384 ways): refused at once, naming the node count (was: on 2M nodes, a 291 MB plan
    autoplan could not read back, after a minute and 3 GB)."""
    out = tmp_path / "plan.json"
    big = _json(capsys, ["plan", "gpt-tiny", "--cluster", "dgx-a100", "--nodes", "32",
                         "--global-batch", "8", "-o", str(out), "--json"])
    assert big["distinct_devices"] == 8
    assert main(["show", str(out)]) == 0
    shown = " ".join(capsys.readouterr().out.split())
    assert "warning: only 8 of the 256 devices do distinct work" in shown
    assert "plan again with --nodes 1." in shown
    small = _json(capsys, ["plan", "gpt-tiny", "--cluster", "dgx-a100", "--nodes", "1",
                           "--global-batch", "8", "--json"])
    assert small["distinct_devices"] == 8
    assert small["prediction"]["step_time_s"] <= big["prediction"]["step_time_s"] * (1 + 1e-9)
    assert main(["plan", "gpt-tiny", "--cluster", "dgx-a100", "--nodes", "64",
                 "--global-batch", "8", "-o", str(tmp_path / "none.json")]) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert "cannot keep 512 devices busy: the planners split a step at most 384 ways" in err
    assert "plan on --nodes 48 or fewer" in err and not (tmp_path / "none.json").exists()


def test_a_plan_larger_than_autoplan_reads_back_is_not_written(tmp_path, monkeypatch):
    from autoplan import user_files
    from autoplan.errors import PlanError
    from engine_helpers import make_plan

    plan = make_plan(dp=2)
    assert plan.save(tmp_path / "fits.json").stat().st_size > 1000
    monkeypatch.setattr(user_files, "MAX_BYTES", 1000)
    with pytest.raises(PlanError, match="more than the 1,000 autoplan reads back"):
        plan.save(tmp_path / "p.json")
    assert not (tmp_path / "p.json").exists()
