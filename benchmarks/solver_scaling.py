"""How long the Alpa-style search takes as models and clusters grow (issue #5).

For each (model, cluster) the model is traced once (timed apart: the uniform planner needs
the same trace), then :func:`autoplan.planner.search.search` runs from scratch — DTensor
strategy enumeration on a fake process group, the intra-op ILPs, the stage tables and DP,
the exact pricing of the candidates — ``--repeats`` times; the table reports the median.
Times are CPU seconds (``time.process_time``: the search is single-threaded, and CPU time is
what the load of a shared machine does not inflate), with the wall seconds and the load
beside them. The uniform grid search runs once beside it for the predicted speed-up. The
whole ``autoplan plan`` command (start-up, trace, grid and search) is timed by
``benchmarks/plan_speed.py``.

Targets, on this 2-core machine (Alpa, OSDI'22, needed about 40 minutes for GPT-39B on 64
GPUs, most of it compiling and profiling stages):

* GPT-39B on 64 A100s in under 10 s;
* GPT-3 175B on 1024 A100s in under 60 s;
* a 1T-parameter GPT (preset ``gpt-1t``) on 3072 A100s in under 120 s.

    python benchmarks/solver_scaling.py [--repeats 3] [--plot-only] [--quick]

Writes ``benchmarks/results/solver_scaling.json`` and ``solver_scaling.png`` (search seconds
against GPUs, one point per model; ``--quick``: GPT-tiny on one node, results in
``solver_scaling_quick.json``, no plot).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import RESULTS, print_table, target, write_results  # noqa: E402

# model, DGX A100 nodes, global batch, target seconds (None: a point of the curve only)
RUNS = [
    ("gpt-1.7b", 4, 512, None),
    ("gpt-7.5b", 16, 512, None),
    ("gpt-39b", 8, 1024, 10.0),
    ("gpt-39b", 64, 1536, None),
    ("gpt3-175b", 128, 1536, 60.0),
    ("gpt-1t", 384, 3072, 120.0),
]
QUICK_RUNS = [("gpt-tiny", 1, 16, None)]


def measure(name: str, nodes: int, batch: int, repeats: int) -> dict:
    from autoplan.api import plan_problem, prepare
    from autoplan.planner.search.search import search
    from autoplan.planner.search.to_plan import choice_label

    c0 = time.process_time()
    problem = prepare(name, "dgx-a100", nodes=nodes, global_batch=batch)
    trace_s = time.process_time() - c0
    runs, walls, result = [], [], None
    for _ in range(repeats):
        t1, c1 = time.perf_counter(), time.process_time()
        result = search(problem.spec, problem.graph, problem.cluster, global_batch=batch)
        runs.append(time.process_time() - c1)
        walls.append(time.perf_counter() - t1)
    c2 = time.process_time()
    _, uniform = plan_problem(problem, top_k=0)
    uniform_s = time.process_time() - c2
    pred = result.prediction
    return {"model": name, "params": problem.graph.num_params, "gpus": problem.cluster.world_size,
            "global_batch": batch, "trace_s": trace_s, "search_s": statistics.median(runs),
            "search_runs_s": runs, "search_wall_s": statistics.median(walls),
            "load_1min": os.getloadavg()[0],
            "search_parts_wall_s": result.seconds, "stats": result.stats,
            "plan": choice_label(result.best), "step_time_s": pred.step_time_s, "mfu": pred.mfu,
            "uniform_plan": uniform.best.parallel.label(),
            "uniform_step_time_s": uniform.best.prediction.step_time_s,
            "uniform_search_s": uniform_s,
            "speedup_vs_uniform": uniform.best.prediction.step_time_s / pred.step_time_s}


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.5, 4.5))
    for k, r in enumerate(rows):
        ax.scatter(r["gpus"], r["search_s"], s=40)
        size = r["params"] / 1e9
        label = f"{size / 1e3:.1f}T" if size >= 1e3 else f"{size:.3g}B"
        ax.annotate(f"{r['model']} ({label})", (r["gpus"], r["search_s"]),
                    textcoords="offset points", xytext=(-20, 10 if k % 2 else -14),
                    fontsize=8)
    for name, nodes, _, limit in RUNS:
        if limit is not None:
            ax.scatter(nodes * 8, limit, marker="_", s=300, color="red")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("GPUs (DGX A100 nodes x 8)")
    ax.set_ylabel("search CPU seconds (median)")
    ax.set_title("Alpa-style search time on a 2-core machine (red: targets)")
    ax.grid(True, which="both", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--plot-only", action="store_true",
                    help="redraw the PNG from the last results file")
    ap.add_argument("--quick", action="store_true", help="GPT-tiny only (a smoke test)")
    args = ap.parse_args()
    runs_to_do = QUICK_RUNS if args.quick else RUNS
    if args.plot_only:
        import json

        plot(json.loads((RESULTS / "solver_scaling.json").read_text())["measurements"],
             RESULTS / "solver_scaling.png")
        return 0
    rows = []
    for name, nodes, batch, _ in runs_to_do:
        rows.append(measure(name, nodes, batch, 1 if args.quick else args.repeats))
        r = rows[-1]
        print(f"{name} on {r['gpus']} GPUs: search {r['search_s']:.1f} CPU s "
              f"({r['search_wall_s']:.1f} s wall, load {r['load_1min']:.1f}; trace "
              f"{r['trace_s']:.1f} CPU s) -> {r['plan']}", flush=True)
    print_table(f"search CPU seconds (median of {args.repeats}) and what it found",
                ["model", "GPUs", "trace CPU s", "search CPU s", "wall s", "load",
                 "analyse / ILP / DP (wall) s", "plan", "step s", "vs uniform"],
                [[r["model"], r["gpus"], f"{r['trace_s']:.1f}", f"{r['search_s']:.1f}",
                  f"{r['search_wall_s']:.1f}", f"{r['load_1min']:.1f}",
                  " / ".join(f"{r['search_parts_wall_s'][k]:.1f}"
                             for k in ("analyse", "intra_op", "inter_op")),
                  r["plan"], f"{r['step_time_s']:.4g}", f"{r['speedup_vs_uniform']:.3f}x"]
                 for r in rows])
    png = RESULTS / "solver_scaling.png"
    if not args.quick:
        plot(rows, png)
    targets = []
    for (name, nodes, _, limit), r in zip(runs_to_do, rows):
        if limit is not None:
            targets.append(target(f"search {name} on {nodes * 8} GPUs: CPU seconds",
                                  f"< {limit:g}", round(r["search_s"], 2),
                                  r["search_s"] < limit))
    targets.append(target("search at least as fast as the best uniform plan (predicted)",
                          "speedup >= 1.0 on every run",
                          round(min(r["speedup_vs_uniform"] for r in rows), 4),
                          all(r["speedup_vs_uniform"] >= 1 - 1e-9 for r in rows)))
    write_results("solver_scaling_quick" if args.quick else "solver_scaling", rows, targets,
                  extra=None if args.quick else {"plot": png.name})
    return 0 if all(t["met"] for t in targets) else 1


if __name__ == "__main__":
    sys.exit(main())
