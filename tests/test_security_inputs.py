"""Issue 14, findings 6 and 8 (and 1 for ``autoplan run``): bounded work for user-given
numbers, control characters refused in profiles, a plan's ``import:`` model refused by the
engine launcher unless trusted."""

from __future__ import annotations

import json
import math
import time
from pathlib import Path

import pytest

from autoplan.errors import ConfigError
from autoplan.models.registry import ModelSpec
from autoplan.planner.search.library import closest_divisor
from autoplan.trust import TRUST_ENV

REPO = Path(__file__).resolve().parents[1]


def _brute(n: int, target: int) -> int:
    return min((d for d in range(1, n + 1) if n % d == 0), key=lambda d: (abs(d - target), -d))


@pytest.mark.parametrize("n", [1, 2, 12, 36, 97, 360, 1024, 5040])
def test_closest_divisor_matches_brute_force(n):
    for target in (0, 1, 2, 5, 7, 64, n // 2, n, n + 9):
        assert closest_divisor(n, target) == _brute(n, target), (n, target)


@pytest.mark.parametrize("n", [2 ** 31, 2 ** 31 - 1, 2 ** 31 - 2])
def test_closest_divisor_at_2_to_the_31_is_quick(n):
    t0 = time.process_time()
    d = closest_divisor(n, 48)
    assert n % d == 0
    assert time.process_time() - t0 < 1.0            # was a walk over 2**31 integers
    if n == 2 ** 31:
        assert d == 64 and closest_divisor(n, 40) == 32
    if n == 2 ** 31 - 1:                              # a prime
        assert d == 1


def test_closest_divisor_refuses_zero():
    with pytest.raises(ValueError):
        closest_divisor(0, 4)


def test_control_characters_in_profile_names_are_refused(tmp_path):
    from autoplan.profile.files import ProfileError
    from autoplan.profile.store import LinkProfile

    doc = json.loads((REPO / "profiles" / "links" / "local-cpu.json").read_text())
    doc["cluster"] = "local\ncpu"
    path = tmp_path / "links.json"
    path.write_text(json.dumps(doc))
    with pytest.raises(ProfileError, match="field 'cluster'.*control character"):
        LinkProfile.load(path)


def test_a_control_character_is_named_by_a_printable_path_through_every_level():
    from autoplan.trust import find_control_chars

    # the empty key keeps its level ("") and the offending key is escaped, so the message
    # naming the field prints no control character (a fuzzed op profile found both)
    assert find_control_chars({"": {"a.b": {"\x7fop": 1}}}) == ('"".a.b.\\x7fop', "\x7f")
    assert find_control_chars({"x": {"": "a\x01"}}) == ('x.""', "\x01")
    assert find_control_chars({"x": ["ok", "a\n"]}) == ("x[1]", "\n")
    assert find_control_chars({"notes": "free\ttext", "x": [1]}) is None


def test_run_refuses_a_plans_import_model_without_trust(tmp_path, capsys, monkeypatch):
    import autoplan
    from engine.launch import run_local

    monkeypatch.delenv(TRUST_ENV, raising=False)
    marker = tmp_path / "pwned"
    plan = autoplan.estimate("mlp-tiny", "local-cpu", global_batch=8)
    spec = ModelSpec("import", "os:system", {"command": f"touch {marker}"})
    doc = dict(json.loads(plan.to_json()), model=spec.to_dict(),
               model_fingerprint=spec.fingerprint())
    path = tmp_path / "hostile.json"
    path.write_text(json.dumps(doc))
    assert run_local(path, steps=1, out_dir=tmp_path / "out") == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "os:system" in err and "Traceback" not in err
    assert not marker.exists()


def test_nan_is_never_written_by_set(tmp_path):
    from autoplan.cli import _parse_value

    with pytest.raises(ConfigError, match="NaN"):
        _parse_value("NaN")
    assert _parse_value("[1, 2]") == [1, 2] and _parse_value("abc") == "abc"
    assert math.isfinite(_parse_value("1e308"))


@pytest.mark.parametrize("kind", ["fifo", "device", "directory", "too-large"])
def test_files_users_pass_are_regular_and_bounded(tmp_path, monkeypatch, capsys, kind):
    """A plan, cluster YAML, profile, Hugging Face config or nodes file that is a named
    pipe (opening it blocks), a link to a device that never ends, a directory, or a file
    over the size limit: one line naming the file, at once (autoplan.user_files)."""
    import os

    from autoplan import user_files
    from autoplan.cli import main
    from autoplan.multinode.torchrun import read_hosts
    from autoplan.profile.files import read_json
    from engine_helpers import deadline

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(user_files, "MAX_BYTES", 1000)
    for name in ("plan.json", "cluster.yaml", "config.json", "hosts"):
        path = tmp_path / name
        if kind == "fifo":
            os.mkfifo(path)
        elif kind == "device":
            path.symlink_to("/dev/zero")
        elif kind == "directory":
            path.mkdir()
        else:
            path.write_text(" " * 1001)
    why = {"fifo": "a named pipe, not a regular file", "device": "a character device",
           "directory": "a directory, not a regular file", "too-large": "larger than 1,000"}
    with deadline(60):
        assert main(["show", "plan.json"]) == 2
        assert main(["plan", "gpt-tiny", "--cluster", "cluster.yaml", "--global-batch",
                     "8"]) == 2
        assert main(["plan", "hf:config.json", "--cluster", "dgx-a100", "--global-batch",
                     "8"]) == 2
        errors = capsys.readouterr().err.strip().splitlines()
        for error, name in zip(errors, ("plan.json", "cluster.yaml", "config.json")):
            said = why[kind]
            if kind == "directory" and name == "config.json":   # hf:DIR reads DIR/config.json
                said = "No such file"
            assert error.startswith(f"error: {name}") and said in error, errors
        assert len(errors) == 3, errors
        with pytest.raises(ConfigError, match=f"plan.json.*{why[kind]}"):
            read_json(tmp_path / "plan.json")
        from autoplan.errors import AutoplanError
        with pytest.raises(AutoplanError, match=f"hosts.*{why[kind]}"):
            read_hosts(tmp_path / "hosts", 1)


def test_writing_to_a_pipe_nobody_reads_or_a_full_device_is_one_line(tmp_path, capsys):
    """``-o`` naming a named pipe with no reader is refused at once instead of blocking;
    a device that fails the write (``/dev/full``) is named in the error."""
    import os

    from autoplan.cli import main
    from engine_helpers import deadline

    pipe = tmp_path / "pipe"
    os.mkfifo(pipe)
    with deadline(60):
        assert main(["plan", "gpt-tiny", "--cluster", "local-cpu", "--global-batch", "8",
                     "-o", str(pipe)]) == 2
    assert capsys.readouterr().err.strip() == f"error: {pipe}: a named pipe that no process reads"
    if os.path.exists("/dev/full"):
        assert main(["plan", "gpt-tiny", "--cluster", "local-cpu", "--global-batch", "8",
                     "-o", "/dev/full"]) == 2
        assert capsys.readouterr().err.strip().startswith("error: /dev/full: ")
