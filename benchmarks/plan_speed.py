"""How fast autoplan traces and plans big models on this machine.

Targets (issue #2): a 175B-parameter GPT traces in under 30 s using under 4 GiB of memory,
and ``autoplan plan`` for it on 1024 A100s finishes in under 60 s. Each measurement runs in
a fresh subprocess (so peak RSS is the process's own, imports included) and is repeated;
the table reports medians.

    python benchmarks/plan_speed.py [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import print_table, target, write_results  # noqa: E402

TRACE_SNIPPET = """
import json, resource, sys, time
import torch
from autoplan.models import resolve
from autoplan.trace import trace
t0 = time.perf_counter()
g = trace(resolve(sys.argv[1]), 1, None, dtype=torch.bfloat16)
dt = time.perf_counter() - t0
rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
print(json.dumps({"seconds": dt, "peak_rss_bytes": rss, "ops": len(g), "layers": len(g.layers),
                  "kinds": len(g.layer_kinds()), "params": g.num_params}))
"""

PLANS = [  # model, cluster, nodes, global batch
    ("gpt-39b", "dgx-a100", 8, 1536),
    ("gpt3-175b", "dgx-a100", 128, 1536),
    ("llama3-70b", "dgx-h100", 8, 512),
]


def run_trace(model: str) -> dict:
    out = subprocess.run([sys.executable, "-c", TRACE_SNIPPET, model], check=True,
                         capture_output=True, text=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def run_plan(model: str, cluster: str, nodes: int, batch: int) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.perf_counter()
        out = subprocess.run([sys.executable, "-m", "autoplan.cli", "plan", model, "--cluster",
                              cluster, "--nodes", str(nodes), "--global-batch", str(batch),
                              "-o", f"{tmp}/plan.json", "--json"],
                             check=True, capture_output=True, text=True)
        wall = time.perf_counter() - t0
    child = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024
    doc = json.loads(out.stdout)
    return {"wall_seconds": wall, "trace_seconds": doc["seconds"]["trace"],
            "search_seconds": doc["seconds"]["search"], "choice": doc["parallel"],
            "evaluated": doc["planner"]["evaluated"], "feasible": doc["planner"]["feasible"],
            "step_time_s": doc["prediction"]["step_time_s"], "mfu": doc["prediction"]["mfu"],
            "max_child_rss_bytes": child}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()

    traces = [run_trace("gpt3-175b") for _ in range(args.repeats)]
    trace_s = statistics.median(t["seconds"] for t in traces)
    trace_rss = max(t["peak_rss_bytes"] for t in traces)
    plans = {}
    for model, cluster, nodes, batch in PLANS:
        runs = [run_plan(model, cluster, nodes, batch) for _ in range(args.repeats)]
        plans[f"{model}@{nodes}x{cluster}"] = runs
    rows = [["trace gpt3-175b (mb 1, seq 2048)", f"{trace_s:.2f} s",
             f"{trace_rss / 2**30:.2f} GiB", f"{traces[0]['ops']} ops, "
             f"{traces[0]['layers']} layers, {traces[0]['kinds']} kinds"]]
    for key, runs in plans.items():
        wall = statistics.median(r["wall_seconds"] for r in runs)
        r0 = runs[0]
        rows.append([f"autoplan plan {key}", f"{wall:.2f} s",
                     f"trace {r0['trace_seconds']:.1f} s + search {r0['search_seconds']:.2f} s",
                     f"{r0['evaluated']} configs -> {r0['choice']}"])
    print_table(f"planning speed (median of {args.repeats}, fresh process each)",
                ["what", "time", "memory / split", "detail"], rows)
    plan175 = statistics.median(r["wall_seconds"] for r in plans["gpt3-175b@128xdgx-a100"])
    targets = [
        target("trace GPT-3 175B: seconds", "< 30", round(trace_s, 2), trace_s < 30),
        target("trace GPT-3 175B: peak RSS GiB", "< 4", round(trace_rss / 2**30, 3),
               trace_rss < 4 * 2**30),
        target("autoplan plan GPT-3 175B on 1024 A100: seconds", "< 60", round(plan175, 2),
               plan175 < 60),
    ]
    write_results("plan_speed", {"trace_gpt3_175b": traces, "plans": plans}, targets)
    return 0 if all(t["met"] for t in targets) else 1


if __name__ == "__main__":
    sys.exit(main())
