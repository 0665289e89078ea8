"""How fast ``autoplan plan`` runs, start to finish, on this machine (issues #2, #18).

Every measurement is a fresh ``python -m autoplan.cli ...`` process, so it includes start-up,
imports and tracing. The primary figure is **CPU seconds** (user + system time of the
process and its children, from ``getrusage(RUSAGE_CHILDREN)``): the planner is
single-threaded, and on a shared machine CPU time is what load does not inflate (much);
wall time and the 1-minute load average are recorded beside it. Tables report medians of
``--repeats`` runs.

Targets (issue #18), on CPU seconds of the whole command:

* ``autoplan plan`` (default planner): GPT-39B on 64 A100s < 5 s, GPT-3 175B on 1,024 A100s
  < 15 s, GPT 1T on 3,072 A100s < 20 s, Llama-3 405B on 16,384 H100s < 20 s;
* an infeasible problem (Llama-3 405B on 8 H100s) rejected in < 1 s, with the numbers;
* ``autoplan --help`` in < 0.5 s;
* with ``--baseline RESULTS.json`` (this script's results at an earlier commit, e.g. run with
  ``--code`` on a checkout of it): every plan's predicted step time within 0.5% of the
  baseline's (no worse), per planner.

Also: tracing GPT-3 175B (< 30 s, < 4 GiB peak RSS; issue #2) and ``--planner uniform`` for
each model beside the default.

    python benchmarks/plan_speed.py [--repeats 3] [--baseline benchmarks/results/X.json]
    python benchmarks/plan_speed.py --code /tmp/old-checkout --name plan_speed_44725ce
    python benchmarks/plan_speed.py --quick          # small models only (tests run this)
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import ROOT, print_table, target, write_results  # noqa: E402

TRACE_SNIPPET = """
import json, resource, sys, time
import torch
from autoplan.models import resolve
from autoplan.trace import trace
t0, c0 = time.perf_counter(), time.process_time()
g = trace(resolve(sys.argv[1]), 1, None, dtype=torch.bfloat16)
dt, cpu = time.perf_counter() - t0, time.process_time() - c0
rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
print(json.dumps({"cpu_seconds": cpu, "wall_seconds": dt, "peak_rss_bytes": rss,
                  "ops": len(g), "layers": len(g.layers), "kinds": len(g.layer_kinds()),
                  "params": g.num_params}))
"""

# key, model, cluster, nodes, global batch, CPU-second target of the default planner
PLANS = [
    ("gpt-39b@64", "gpt-39b", "dgx-a100", 8, 1536, 5.0),
    ("gpt3-175b@1024", "gpt3-175b", "dgx-a100", 128, 1536, 15.0),
    ("gpt-1t@3072", "gpt-1t", "dgx-a100", 384, 3072, 20.0),
    ("llama3-405b@16384", "llama3-405b", "dgx-h100", 2048, 1536, 20.0),
]
QUICK_PLANS = [("gpt-tiny@8", "gpt-tiny", "dgx-a100", 1, 16, None)]
INFEASIBLE = ("llama3-405b@8", "llama3-405b", "dgx-h100", 1, 1536)
QUICK_INFEASIBLE = ("gpt3-175b@8", "gpt3-175b", "dgx-a100", 1, 1536)


def _run(args: list[str], code: Path) -> tuple[subprocess.CompletedProcess, dict]:
    """Run ``python ARGS`` from ``code`` (on PYTHONPATH): (process, CPU/wall/load). Python
    may cache bytecode (``__pycache__``, git-ignored) as an installed package has it: with
    ``PYTHONDONTWRITEBYTECODE`` every start would compile autoplan's sources again (about
    1 CPU s)."""
    env = dict(os.environ, PYTHONPATH=str(code))
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    load0 = os.getloadavg()[0]
    r0 = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, *args], cwd=code, env=env, capture_output=True,
                          text=True)
    wall = time.perf_counter() - t0
    r1 = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (r1.ru_utime + r1.ru_stime) - (r0.ru_utime + r0.ru_stime)
    return proc, {"cpu_seconds": cpu, "wall_seconds": wall,
                  "load_1min": round((load0 + os.getloadavg()[0]) / 2, 2)}


def run_trace(model: str, code: Path) -> dict:
    proc, times = _run(["-c", TRACE_SNIPPET, model], code)
    if proc.returncode:
        raise RuntimeError(proc.stderr[-2000:])
    return {**json.loads(proc.stdout.strip().splitlines()[-1]), "process": times}


def run_plan(model: str, cluster: str, nodes: int, batch: int, planner: str,
             code: Path) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        proc, times = _run(["-m", "autoplan.cli", "plan", model, "--cluster", cluster,
                            "--nodes", str(nodes), "--global-batch", str(batch), "--planner",
                            planner, "-o", f"{tmp}/plan.json", "--json"], code)
    if proc.returncode == 2:        # a user-level error (nothing fits): recorded, not a crash
        return {**times, "exit_status": 2, "message": proc.stderr.strip()[-600:]}
    if proc.returncode:
        raise RuntimeError(f"autoplan plan {model} failed: {proc.stderr[-2000:]}")
    doc = json.loads(proc.stdout)
    return {**times, "in_process_seconds": doc["seconds"],
            "plan": doc["planner"].get("label") or doc["parallel"],
            "note": doc["planner"].get("note"),
            "step_time_s": doc["prediction"]["step_time_s"], "mfu": doc["prediction"]["mfu"],
            # the physical terms alone: what a baseline from before the GPU runtime term
            # (autoplan/cost/runtime.py) predicted
            "modelled_step_s": doc["prediction"]["step_time_s"]
            - doc["prediction"]["time_breakdown_s"].get("runtime", 0.0)}


def run_infeasible(model: str, cluster: str, nodes: int, batch: int, code: Path) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        proc, times = _run(["-m", "autoplan.cli", "plan", model, "--cluster", cluster,
                            "--nodes", str(nodes), "--global-batch", str(batch),
                            "-o", f"{tmp}/plan.json"], code)
    return {**times, "exit_status": proc.returncode, "message": proc.stderr.strip()[-600:]}


def run_help(code: Path) -> dict:
    proc, times = _run(["-m", "autoplan.cli", "--help"], code)
    if proc.returncode:
        raise RuntimeError(proc.stderr[-2000:])
    return times


def _outcome(r: dict) -> str:
    if "step_time_s" in r:
        return f"{r['plan']}: {r['step_time_s']:.5g} s/step"
    return f"exit {r['exit_status']}: {r['message']}"


def _median(runs: list[dict], key: str = "cpu_seconds") -> float:
    return statistics.median(r[key] for r in runs)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--quick", action="store_true",
                    help="small models, one repeat, no trace of GPT-3 (a smoke test)")
    ap.add_argument("--code", type=Path, default=ROOT,
                    help="the checkout to measure (default: this one)")
    ap.add_argument("--name", default=None,
                    help="results file name (default plan_speed, plan_speed_quick)")
    ap.add_argument("--baseline", type=Path,
                    help="an earlier results file of this script: compare step times")
    args = ap.parse_args()
    code = args.code.resolve()
    repeats = 1 if args.quick else args.repeats
    plans_to_run = QUICK_PLANS if args.quick else PLANS
    infeasible = QUICK_INFEASIBLE if args.quick else INFEASIBLE

    _run(["-m", "autoplan.cli", "--help"], code)      # warm-up: imports, bytecode caches
    _run(["-c", "import autoplan.api, autoplan.planner.search.search, autoplan.display"], code)
    traces = [] if args.quick else [run_trace("gpt3-175b", code) for _ in range(repeats)]
    helps = [run_help(code) for _ in range(max(repeats, 3))]
    rejects = [run_infeasible(*infeasible[1:], code) for _ in range(repeats)]
    plans: dict[str, dict[str, list[dict]]] = {}
    for key, model, cluster, nodes, batch, _ in plans_to_run:
        plans[key] = {}
        for planner in ("auto", "uniform"):
            plans[key][planner] = [run_plan(model, cluster, nodes, batch, planner, code)
                                   for _ in range(repeats)]
            r = plans[key][planner][0]
            print(f"{key} --planner {planner}: {_median(plans[key][planner]):.1f} CPU s "
                  f"({_median(plans[key][planner], 'wall_seconds'):.1f} s wall, load "
                  f"{r['load_1min']}) -> {_outcome(r)}", flush=True)

    rows = []
    if traces:
        rows.append(["trace gpt3-175b (mb 1, seq 2048)", f"{_median(traces):.2f}",
                     f"{_median(traces, 'wall_seconds'):.2f}", "",
                     f"{max(t['peak_rss_bytes'] for t in traces) / 2**30:.2f} GiB peak RSS"])
    rows.append(["autoplan --help", f"{_median(helps):.2f}",
                 f"{_median(helps, 'wall_seconds'):.2f}", helps[0]["load_1min"], ""])
    rows.append([f"reject {infeasible[0]}", f"{_median(rejects):.2f}",
                 f"{_median(rejects, 'wall_seconds'):.2f}", rejects[0]["load_1min"],
                 rejects[0]["message"][:90]])
    for key, by_planner in plans.items():
        for planner, runs in by_planner.items():
            rows.append([f"plan {key} ({planner})", f"{_median(runs):.2f}",
                         f"{_median(runs, 'wall_seconds'):.2f}", runs[0]["load_1min"],
                         _outcome(runs[0])[:100]])
    print_table(f"autoplan CPU seconds (median of {repeats}, fresh process each; "
                f"code: {code})", ["what", "CPU s", "wall s", "load", "result"], rows)

    targets = []
    if traces:
        trace_cpu = _median(traces)
        trace_rss = max(t["peak_rss_bytes"] for t in traces)
        targets += [target("trace GPT-3 175B: CPU seconds", "< 30", round(trace_cpu, 2),
                           trace_cpu < 30),
                    target("trace GPT-3 175B: peak RSS GiB", "< 4",
                           round(trace_rss / 2**30, 3), trace_rss < 4 * 2**30)]
    for key, model, cluster, nodes, batch, limit in plans_to_run:
        if limit is not None:
            cpu = _median(plans[key]["auto"])
            targets.append(target(f"autoplan plan {key}: CPU seconds", f"< {limit:g}",
                                  round(cpu, 2), cpu < limit))
    reject_cpu = _median(rejects)
    refused = all(r["exit_status"] == 2 and "model does not fit" in r["message"]
                  for r in rejects)
    targets.append(target(f"reject {infeasible[0]} (exit 2, numbers in the error): CPU s",
                          "< 1", round(reject_cpu, 2), refused and reject_cpu < 1))
    help_cpu = _median(helps)
    targets.append(target("autoplan --help: CPU seconds", "< 0.5", round(help_cpu, 3),
                          help_cpu < 0.5))
    if args.baseline:
        base = json.loads(args.baseline.read_text())["measurements"]["plans"]
        for key, by_planner in plans.items():
            for planner, runs in by_planner.items():
                old = base.get(key, {}).get(planner)
                if not old or "step_time_s" not in old[0]:
                    continue
                if "step_time_s" not in runs[0]:
                    targets.append(target(f"plan {key} ({planner}): a plan, as in "
                                          f"{args.baseline.name}", "a plan",
                                          runs[0]["message"][:80], False))
                    continue
                # like for like: the modelled step where the baseline has it, else the
                # baseline's step (written before the runtime term existed)
                ratio = runs[0].get("modelled_step_s", runs[0]["step_time_s"]) / \
                    old[0].get("modelled_step_s", old[0]["step_time_s"])
                targets.append(target(f"plan {key} ({planner}): step time vs "
                                      f"{args.baseline.name}", "<= 1.005",
                                      round(ratio, 5), ratio <= 1.005))
    name = args.name or ("plan_speed_quick" if args.quick else "plan_speed")
    write_results(name, {"code": str(code), "trace_gpt3_175b": traces, "help": helps,
                         "infeasible": {infeasible[0]: rejects}, "plans": plans}, targets)
    return 0 if all(t["met"] for t in targets) else 1


if __name__ == "__main__":
    sys.exit(main())
