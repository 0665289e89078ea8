"""Plans are deterministic (issue #7): the same model, cluster, batch and profiles give a
byte-identical plan file in every run -- across separate Python processes with different
hash seeds (set and str-keyed dict iteration order), wherever the profiles folder lives --
and a plan records the autoplan and torch versions that made it.

The problem, planned by ``autoplan plan`` (whichever planner is its default) in each process:
a GPT on the local-cpu preset, whose cost model reads measured op and link profiles and a
calibration (in-process determinism of the search itself: tests/test_planner.py).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import torch

import autoplan
from autoplan.plan import Plan
from fuzz_helpers import PROFILES, REPO

PROBLEMS = {
    "gpt-tiny-local-cpu.json": ["gpt-tiny", "--cluster", "local-cpu", "--global-batch", "8"],
}

SCRIPT = """
import sys
from autoplan.cli import main

out, problems = sys.argv[1], sys.argv[2:]
for name, argv in zip(problems[::2], problems[1::2]):
    assert main(["plan", *argv.split(), "-o", f"{out}/{name}", "--json"]) == 0
"""


def _plan_in_subprocess(out: Path, hash_seed: str, profiles: Path | None) -> subprocess.Popen:
    out.mkdir()
    env = {**os.environ, "PYTHONHASHSEED": hash_seed}
    env.pop("AUTOPLAN_PROFILES", None)
    if profiles is not None:
        env["AUTOPLAN_PROFILES"] = str(profiles)
    args = [x for name, argv in PROBLEMS.items() for x in (name, " ".join(argv))]
    return subprocess.Popen([sys.executable, "-c", SCRIPT, str(out), *args], cwd=REPO, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)


def test_same_inputs_give_byte_identical_plans_across_processes(tmp_path):
    # the second process reads a copy of the profiles from elsewhere: no path may leak in
    copy = tmp_path / "profiles-copy"
    shutil.copytree(PROFILES, copy, ignore=shutil.ignore_patterns(".*.lock"))
    procs = {"a": _plan_in_subprocess(tmp_path / "a", "0", None),
             "b": _plan_in_subprocess(tmp_path / "b", "4242", copy)}
    for key, proc in procs.items():
        _, err = proc.communicate(timeout=300)
        assert proc.returncode == 0, f"process {key}: {err[-2000:]}"
    versions = {"autoplan": autoplan.__version__, "torch": torch.__version__.split("+")[0]}
    for name in PROBLEMS:
        a = (tmp_path / "a" / name).read_bytes()
        b = (tmp_path / "b" / name).read_bytes()
        assert a == b, f"{name} differs between processes"
        doc = json.loads(a)
        assert doc["created_by"] == versions
        # stable through load -> save, with no clock or path in it
        assert Plan.load(tmp_path / "a" / name).to_json().encode() == a
        text = a.decode()
        assert str(tmp_path) not in text and str(REPO) not in text
