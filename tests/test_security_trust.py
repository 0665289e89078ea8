"""Issue 14, finding 1 and 8: a plan file is data. Written as the attack: a plan whose model
is ``import`` of ``os:system`` with a command must not run it under any command that reads
the plan, unless the user opts in with ``--trust-model-code``; and ``import:``/``hf:`` inputs
that misbehave give one-line errors."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

import autoplan
from autoplan.cli import main
from autoplan.errors import ConfigError
from autoplan.models.registry import ModelSpec, build_model, resolve
from autoplan.trust import TRUST_ENV, take_trust_flag, trusting

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def base_plan(tmp_path_factory) -> dict:
    plan = autoplan.estimate("mlp-tiny", "local-cpu", global_batch=8)
    path = plan.save(tmp_path_factory.mktemp("plan") / "base.json")
    return json.loads(path.read_text())


def _hostile(base: dict, tmp: Path, marker: Path) -> Path:
    """The attack: a plan naming ``os:system`` with a command that creates ``marker``."""
    spec = ModelSpec("import", "os:system", {"command": f"touch {marker}"})
    doc = dict(base, model=spec.to_dict(), model_fingerprint=spec.fingerprint())
    path = tmp / "hostile.json"
    path.write_text(json.dumps(doc))
    return path


def test_spec_from_a_file_never_imports(tmp_path, base_plan, monkeypatch):
    monkeypatch.delenv(TRUST_ENV, raising=False)
    marker = tmp_path / "pwned"
    plan = autoplan.Plan.load(_hostile(base_plan, tmp_path, marker))   # loading is fine
    spec = ModelSpec.from_dict(plan.model)
    with pytest.raises(ConfigError, match="--trust-model-code"):
        build_model(spec)
    assert not marker.exists()


@pytest.mark.parametrize("command", [["report", "{plan}", "-o", "{tmp}/r.html"],
                                     ["show", "{plan}"], ["export", "{plan}", "--to",
                                                          "torchtitan", "-o", "{tmp}/t.toml"],
                                     ["launch", "{plan}", "--master-addr", "h1"]])
def test_commands_reading_a_plan_never_run_its_code(tmp_path, base_plan, command, capsys,
                                                    monkeypatch):
    monkeypatch.delenv(TRUST_ENV, raising=False)
    marker = tmp_path / "pwned"
    plan = _hostile(base_plan, tmp_path, marker)
    argv = [a.format(plan=plan, tmp=tmp_path) for a in command]
    try:
        main(argv)
    except SystemExit:                # argparse: an option this command lacks
        pass
    assert not marker.exists(), f"`autoplan {' '.join(argv)}` ran the plan's command"


def test_calibrate_never_runs_a_run_dirs_plan_code(tmp_path, base_plan, monkeypatch, capsys):
    monkeypatch.delenv(TRUST_ENV, raising=False)
    marker = tmp_path / "pwned"
    run = tmp_path / "run"
    run.mkdir()
    _hostile(base_plan, tmp_path, marker).rename(run / "plan.json")
    (run / "summary.json").write_text(json.dumps({
        "plan": "plan.json", "warmup_steps": 0,
        "measured": {"step_time_s": 0.1, "peak_memory_bytes": 1e6}}))
    (run / "metrics.jsonl").write_text(json.dumps({"step": 1, "step_time_s": 0.1}) + "\n")
    assert main(["calibrate", str(run), "--dry-run"]) == 2
    assert not marker.exists()
    assert "--trust-model-code" in capsys.readouterr().err


def test_opt_in_lets_the_users_own_model_build(monkeypatch):
    monkeypatch.delenv(TRUST_ENV, raising=False)
    spec = ModelSpec.from_dict(resolve("import:tests.user_model:build").to_dict())
    with pytest.raises(ConfigError, match="plan files are data"):
        build_model(spec)
    with trusting():
        assert sum(p.numel() for p in build_model(spec).parameters()) > 0
    assert TRUST_ENV not in __import__("os").environ


def test_trust_flag_is_taken_anywhere_before_double_dash():
    assert take_trust_flag(["report", "p.json", "--trust-model-code"]) == \
        (["report", "p.json"], True)
    assert take_trust_flag(["run", "p", "--", "--trust-model-code"]) == \
        (["run", "p", "--", "--trust-model-code"], False)


# ---- import: and hf: edge cases: one line each --------------------------------------------

def _module(tmp_path: Path, monkeypatch, name: str, body: bytes) -> None:
    (tmp_path / f"{name}.py").write_bytes(body)
    monkeypatch.syspath_prepend(str(tmp_path))
    sys.modules.pop(name, None)


@pytest.mark.parametrize("body, match", [
    (b"import sys\nsys.exit(0)\n", r"called sys.exit\(0\)"),
    (b"raise RuntimeError('boom at import')\n", "raised RuntimeError: boom at import"),
    (b"x = '\xff\xfe'\n", "raised SyntaxError"),
    (b"def build():\n    raise ValueError('bad width')\n", "raised ValueError: bad width"),
    (b"def build():\n    import sys; sys.exit(3)\n", r"called sys.exit\(3\)"),
])
def test_misbehaving_import_modules_give_one_line(tmp_path, monkeypatch, body, match):
    name = f"evil_{abs(hash(body)) % 10**8}"
    _module(tmp_path, monkeypatch, name, body)
    with pytest.raises(ConfigError, match=match) as info:
        build_model(resolve(f"import:{name}:build"))
    assert "\n" not in str(info.value)


def test_sys_exit_at_import_is_an_error_on_the_command_line(tmp_path, monkeypatch):
    (tmp_path / "exits.py").write_text("import sys\nsys.exit(0)\n")
    proc = subprocess.run([sys.executable, "-m", "autoplan.cli", "estimate", "import:exits:build",
                           "--cluster", "local-cpu", "--global-batch", "8"],
                          cwd=tmp_path, capture_output=True, text=True,
                          env={**__import__("os").environ, "PYTHONPATH": f"{REPO}:{tmp_path}"})
    assert proc.returncode == 2, proc.stderr
    assert "sys.exit(0)" in proc.stderr and "Traceback" not in proc.stderr


@pytest.mark.parametrize("name", ["import:123", "import:os:system;rm", "import:a b:c"])
def test_malformed_import_paths(name):
    with pytest.raises(ConfigError, match="package.module:factory"):
        build_model(resolve(name) if name.startswith("import:") else resolve(name))


@pytest.mark.parametrize("content", [b"\xff\xfe{}", b"5", b"[1, 2]", b"null"])
def test_hf_config_files_that_are_not_objects(tmp_path, content):
    path = tmp_path / "config.json"
    path.write_bytes(content)
    with pytest.raises(ConfigError) as info:
        resolve(f"hf:{path}")
    assert str(path) in str(info.value) and "\n" not in str(info.value)


@pytest.mark.parametrize("value", ["NaN", "Infinity", "-Infinity"])
def test_set_refuses_nan(value, capsys):
    code = main(["estimate", "gpt-tiny", "--cluster", "local-cpu", "--global-batch", "8",
                 "--set", f"dropout={value}"])
    assert code == 2
    assert "--set" in capsys.readouterr().err  # field model.dropout, from --set
    assert not math.isfinite(float(value))


def test_a_spec_rebuilt_from_plan_data_is_not_trusted(tmp_path, base_plan, monkeypatch):
    """The gate holds however a caller turns a plan's model section into a spec."""
    monkeypatch.delenv(TRUST_ENV, raising=False)
    marker = tmp_path / "pwned"
    plan = autoplan.Plan.load(_hostile(base_plan, tmp_path, marker))
    for spec in (ModelSpec(**plan.model), ModelSpec.from_dict(plan.model)):
        with pytest.raises(ConfigError, match="--trust-model-code"):
            build_model(spec)
    assert not marker.exists()
