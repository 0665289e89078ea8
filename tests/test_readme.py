"""The README as a new user follows it: every command and Python snippet, in order, in a
scratch directory, then test files that once depended on the working directory, run from
that directory (the README leaves plan.json, llama70b.json, runs/ ... there).

Commands run as written unless :data:`SMALL` gives them smaller settings (fewer layers,
nodes or steps: the same command line otherwise) or a reason they do not run here. A README
command missing from both runs as written; an entry of :data:`SMALL` the README no longer
has fails the test, so the two stay in step.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"

#: README command -> the command run here (smaller settings), or (None, why it is not run)
SMALL: dict[str, str | tuple[None, str]] = {
    "pip install -e .": (None, "the tests run from a checkout already installed"),
    'pip install -e ".[test]"': (None, "the tests run from a checkout already installed"),
    "autoplan demo": "autoplan demo --steps 3",
    "python -m pytest": (None, "the suite itself; the test runs test files that read or "
                               "write the working directory from the scratch directory"),
    "autoplan plan llama3-70b --cluster dgx-h100 --nodes 8 --global-batch 512 -o llama70b.json":
        "autoplan plan llama3-70b --layers 2 --cluster dgx-h100 --nodes 2 --global-batch 64 "
        "-o llama70b.json",
    "autoplan estimate llama3-70b --cluster dgx-h100 --nodes 8 --global-batch 512 --tp 8 "
    "--pp 2 --zero 1 --sp --checkpoint full -o mine.json":
        "autoplan estimate llama3-70b --layers 2 --cluster dgx-h100 --nodes 2 --global-batch "
        "64 --tp 8 --pp 2 --zero 1 --sp --checkpoint full -o mine.json",
    "autoplan plan gpt-7.5b --cluster dgx-a100 --nodes 16 --global-batch 512 -o plan.json":
        "autoplan plan gpt-7.5b --layers 2 --cluster dgx-a100 --nodes 2 --global-batch 64 "
        "-o plan.json",
    "autoplan plan gpt-7.5b --cluster dgx-a100 --nodes 16 --global-batch 512 --planner uniform":
        "autoplan plan gpt-7.5b --layers 2 --cluster dgx-a100 --nodes 2 --global-batch 64 "
        "--planner uniform",
    "autoplan plan gpt --layers 24 --hidden 2048 --heads 16 --vocab 51200 --seq-len 2048 "
    "--cluster dgx-h100 --nodes 4 --global-batch 256 -o plan.json":
        "autoplan plan gpt --layers 2 --hidden 2048 --heads 16 --vocab 51200 --seq-len 2048 "
        "--cluster dgx-h100 --nodes 1 --global-batch 32 -o plan.json",
    "autoplan plan hf:gpt2 --set n_layer=24 --cluster dgx-a100 --global-batch 64":
        "autoplan plan hf:gpt2 --set n_layer=2 --cluster dgx-a100 --global-batch 64",
    "autoplan trace llama3-8b": "autoplan trace llama3-8b --layers 2",
    "autoplan estimate gpt-7.5b --cluster dgx-a100 --nodes 16 --global-batch 512 --tp 4 "
    "--micro-batch 2 --checkpoint full":
        "autoplan estimate gpt-7.5b --layers 2 --cluster dgx-a100 --nodes 2 --global-batch 64 "
        "--tp 4 --micro-batch 2 --checkpoint full",
    "autoplan run runs/demo/plan.json --steps 20": "autoplan run runs/demo/plan.json --steps 3",
    "torchrun --nproc_per_node=8 --nnodes=2 --rdzv-endpoint=HOST:29500 -m engine.run plan.json":
        (None, "two nodes of eight devices; `autoplan run` above starts the same entry point"),
    "autoplan profile ops gpt-small --batch-size 1,2,4,8 --tp 1,2,4":
        "autoplan profile ops gpt-small --batch-size 1 --tp 1 --limit 4 --repeats 2 "
        "--out profiles-here/ops.json",
    "autoplan profile links --nproc 4":
        (None, "four ranks benchmarking collectives for ~90 s; tests/test_profile.py covers it"),
    "autoplan estimate gpt-7.5b --cluster dgx-a100 --nodes 16 --global-batch 512 --tp 4 --json "
    '| python -c "import json, sys; print(json.load(sys.stdin)[\'prediction\'][\'step_time_s\'])"':
        "autoplan estimate gpt-7.5b --layers 2 --cluster dgx-a100 --nodes 2 --global-batch 64 "
        "--tp 4 --json "
        '| python -c "import json, sys; print(json.load(sys.stdin)[\'prediction\'][\'step_time_s\'])"',
    "autoplan plan mixtral-8x7b --cluster dgx-h100 --nodes 8 --global-batch 256 --seq-len 4096 "
    "--planner uniform":
        "autoplan plan mixtral-8x7b --set num_hidden_layers=2 --cluster dgx-h100 --nodes 1 "
        "--global-batch 16 --seq-len 512 --planner uniform",
    "autoplan estimate mixtral-8x7b --cluster dgx-h100 --nodes 8 --global-batch 256 --seq-len 4096 "
    "--ep 8 --pp 4 --zero 1 --no-compare":
        "autoplan estimate mixtral-8x7b --set num_hidden_layers=2 --cluster dgx-h100 --nodes 1 "
        "--global-batch 16 --seq-len 512 --ep 4 --pp 2 --zero 1 --no-compare",
    "autoplan estimate llama3-405b-128k --cluster dgx-h100 --nodes 2048 --global-batch 128 "
    "--tp 8 --pp 16 --cp 16 --sp --zero 1 --schedule interleaved_1f1b --virtual-stages 7 "
    "--no-compare":
        "autoplan estimate llama3-405b-128k --layers 4 --set seq_len=16384 --seq-len 16384 "
        "--cluster dgx-h100 --nodes 4 --global-batch 2 --tp 8 --pp 2 --cp 2 --sp --zero 1 "
        "--schedule interleaved_1f1b --virtual-stages 2 --no-compare",
    "autoplan run moe.json --steps 20": "autoplan run moe.json --steps 3",
    "autoplan run long.json --steps 20": "autoplan run long.json --steps 3",
    **{f"python benchmarks/{name}.py": (None, "minutes each, and it rewrites the checkout's "
                                              "benchmarks/results/; run by hand")
       for name in ("megatron_sc21", "plan_speed", "engine_overhead", "solver_scaling",
                    "search_vs_uniform", "search_measured", "cost_model_accuracy",
                    "fuzz_counts", "moe_cp", "published_runs", "recompute",
                    "trace_replicate", "hf_types")},
    "PYTHONPATH=.:/path/to/zoo-deps python benchmarks/model_zoo.py --jobs 2":
        (None, "needs torchvision and timm (a CPU build beside the CPU torch) and minutes per "
               "model; run by hand"),
}

#: the Python snippet with smaller settings: (README text, text run here)
SNIPPET_SMALL = [
    ('"gpt-7.5b", "dgx-a100", nodes=16, global_batch=512',
     'autoplan.resolve_model("gpt-7.5b", layers=2), "dgx-a100", nodes=2, global_batch=64'),
    ('autoplan.resolve_model("gpt-1.7b")', 'autoplan.resolve_model("gpt-1.7b", layers=2)'),
]

#: test files that read or write the working directory's contents (plan.json, runs/, ...)
CWD_SENSITIVE = ["tests/test_calibrate.py", "tests/test_plan.py"]


def readme_steps(text: str) -> list[tuple[str, str]]:
    """``(language, command or snippet)`` in README order: each line of a bash block (joined
    across ``\\`` continuations, comments dropped, ``a && b`` split), each python and yaml
    block whole."""
    steps = []
    for lang, body in re.findall(r"```(\w+)\n(.*?)```", text, flags=re.S):
        if lang != "bash":
            steps.append((lang, body))
            continue
        for line in body.replace("\\\n", " ").splitlines():
            line = re.sub(r"(^|\s+)#\s.*$", "", line).strip()
            if line:
                steps += [("bash", " ".join(part.split())) for part in line.split(" && ")]
    return steps


def _autoplan_in_process(cmd: str, cwd: Path) -> tuple[int, str]:
    """``autoplan ARGS`` run by autoplan.cli.main in this process (no interpreter start-up
    per command), from ``cwd``, stdout captured as a pipe would get it (80 columns)."""
    from autoplan.cli import main

    out = io.StringIO()
    old = Path.cwd()
    os.chdir(cwd)
    try:
        with contextlib.redirect_stdout(out):
            status = main(shlex.split(cmd)[1:])
    finally:
        os.chdir(old)
    return status, out.getvalue()


def _shell(cmd: str, cwd: Path, env: dict[str, str], timeout: int = 900) -> tuple[int, str]:
    proc = subprocess.run(["bash", "-c", cmd], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=timeout)
    return proc.returncode, proc.stdout + proc.stderr


def test_small_settings_name_readme_commands():
    """Every entry of SMALL is a README command (so a README edit cannot leave it stale),
    and every small command is its README command with smaller numbers or fewer layers."""
    commands = {c for lang, c in readme_steps(README.read_text()) if lang == "bash"}
    stale = [c for c in SMALL if c not in commands]
    assert not stale, f"SMALL names commands the README no longer has: {stale}"
    for original, small in SMALL.items():
        if isinstance(small, str):
            assert small.split()[:2] == original.split()[:2], (original, small)


@pytest.mark.slow
def test_readme_in_order_in_a_scratch_directory(tmp_path, monkeypatch):
    cpu0 = _cpu_seconds()
    scratch = tmp_path / "newcomer"
    (scratch / "tests").mkdir(parents=True)
    # the README's "your module": a user's own file in their directory
    shutil.copy(ROOT / "tests" / "user_model.py", scratch / "tests" / "user_model.py")
    env = {**os.environ, "COLUMNS": "80",
           "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH"))
                                         if p)}
    monkeypatch.setenv("COLUMNS", "80")
    ran, skipped = [], []
    for lang, step in readme_steps(README.read_text()):
        if lang == "yaml":                        # the cluster file example: valid as shown
            from autoplan.cluster import load_cluster

            path = scratch / "my-cluster.yaml"
            path.write_text(step)
            assert load_cluster(str(path)).world_size == 32
            continue
        if lang == "python" and "torchrun" in step.splitlines()[0]:
            # a training script for torchrun around the user's own module (MyModule is
            # theirs); tests/test_engine_generic.py runs the same calls under torchrun
            skipped.append(("python: the autoplan.parallelize training script",
                            "a torchrun script around the reader's own module; "
                            "test_engine_generic.py::test_parallelize_in_a_user_training_loop "
                            "runs it"))
            continue
        if lang == "python":
            code = step
            for old, new in SNIPPET_SMALL:
                assert old in code, f"the README's snippet no longer has {old!r}"
                code = code.replace(old, new)
            status, out = _shell(f"{shlex.quote(sys.executable)} -c {shlex.quote(code)}",
                                 scratch, env)
            assert status == 0, f"README python snippet failed:\n{out[-3000:]}"
            ran.append("python snippet")
            continue
        small = SMALL.get(step, step)
        if isinstance(small, tuple):
            skipped.append((step, small[1]))
            continue
        if small.startswith("autoplan ") and "|" not in small:
            status, out = _autoplan_in_process(small, scratch)
            assert "…" not in out, f"{small}: cut at 80 columns:\n{out}"
            if small.startswith("autoplan plan ") and status == 0:
                assert "planner: " in out and "best plan" not in out, out
        else:
            status, out = _shell(small.replace("python ", f"{sys.executable} ", 1)
                                 if small.startswith("python ") else small, scratch, env)
        assert status == 0, f"README command failed: {small}\n{out[-3000:]}"
        ran.append(small)

    assert len(ran) >= 20, ran
    # what the README says these commands leave behind
    for name in ("plan.json", "llama70b.json", "llama70b.html", "job.sbatch", "mine.json",
                 "runs/demo/summary.json", "runs/demo/host_load.json",
                 "runs/plan/host_load.json", "profiles-here/ops.json"):
        assert (scratch / name).is_file(), name
    load = json.loads((scratch / "runs/demo/host_load.json").read_text())
    assert load["cores"] >= 1 and load["wall_s"] > 0
    jsonschema = pytest.importorskip("jsonschema")
    from autoplan.schema import schema_for

    jsonschema.Draft202012Validator(schema_for("host_load")).validate(load)

    # the test suite does not depend on the working directory's contents
    status, out = _shell(f"{shlex.quote(sys.executable)} -m pytest -q -x -p no:cacheprovider "
                         f"-m 'not slow and not multiproc' "
                         + " ".join(str(ROOT / f) for f in CWD_SENSITIVE), scratch, env)
    assert status == 0, f"tests run from the README's directory failed:\n{out[-4000:]}"
    print(f"README: {len(ran)} commands and snippets run, {len(skipped)} not run here "
          f"({'; '.join(sorted({why for _, why in skipped}))}); "
          f"{_cpu_seconds() - cpu0:.0f} s of CPU (this process and its children)")


def _cpu_seconds() -> float:
    import resource

    return sum(r.ru_utime + r.ru_stime for r in (
        resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)))
