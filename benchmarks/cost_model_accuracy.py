"""Cost-model accuracy: predicted vs measured step time and peak memory of real engine runs.

gpt-small (8 layers, hidden 256, vocabulary 4096, sequence 128; 8.4M parameters) on the
``local-cpu`` cluster (4 gloo ranks on this machine), global batch 8, float32. Each plan is
made by ``autoplan.estimate`` — so it carries the planner's prediction, from the measured op
and link profiles and the committed calibration — and run through the engine
(``engine.launch.run_local``, ``--steps`` steps; the engine reports the median step time after
its warm-up steps and the peak live-tensor memory of the busiest rank).

    python benchmarks/cost_model_accuracy.py                 # ~5-10 minutes
    python benchmarks/cost_model_accuracy.py --reuse         # re-analyse runs/cost_model_accuracy
    python benchmarks/cost_model_accuracy.py --write-calibration   # also refit the committed
                                                             # profiles/calibration/local-cpu.json

Three predictions per plan, all with the same measured profiles:

* ``raw`` — the cost model with no calibration, for an idle machine;
* ``loo`` (the one the targets judge) — calibrated *leave-one-out*: the factors are fitted
  (``autoplan.calibrate.fit``) on the other plans' runs of this session and applied to this
  plan's raw prediction, which is made for the cores other users' processes left the run
  (``autoplan.hostload``, measured during the run: the machine is shared, and a run gets
  ``C - external`` of the ``C`` cores); no plan's own run enters its prediction;
* ``separate`` — the committed calibration (``profiles/calibration/local-cpu.json``, fitted
  on an earlier session's runs; refused if it lists any run of this session) applied to this
  plan's raw prediction at the run's cores: calibration from separate runs;
* ``plan`` — the prediction stored in the plan when it was made (the committed calibration,
  for an idle machine: it ignores what other users took, so it is slower on a busy machine).

Targets (with the local profile): Spearman rank correlation of predicted vs measured step
time >= 0.9; median absolute relative error <= 15% (time) and <= 10% (peak memory); the plan
predicted fastest measures within 10% of the measured fastest.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.common import RESULTS, print_table, target, write_results  # noqa: E402

MODEL, CLUSTER, GLOBAL_BATCH = "gpt-small", "local-cpu", 8
#: name -> autoplan.estimate keyword arguments (4 ranks: dp = 4 / (tp * pp))
PLANS: dict[str, dict[str, Any]] = {
    "dp4": {},
    "dp4_z1": {"zero": 1},
    "dp4_z3": {"zero": 3},
    "dp4_ckpt": {"checkpoint": "full"},
    "dp4_mb2": {"micro_batch": 2},
    "tp2_dp2": {"tp": 2},
    "pp2_dp2": {"pp": 2},
    "pp4": {"pp": 4},
    "pp2_tp2": {"pp": 2, "tp": 2},
    "tp4": {"tp": 4},
}
TIME_MDAPE, MEM_MDAPE, SPEARMAN, BEST_WITHIN = 0.15, 0.10, 0.9, 0.10


# ---- running ----------------------------------------------------------------------------

def make_plans(out: Path) -> dict[str, Path]:
    import autoplan
    from autoplan.api import prepare

    problem = prepare(MODEL, CLUSTER, global_batch=GLOBAL_BATCH)
    paths = {}
    for name, kw in PLANS.items():
        plan = autoplan.estimate(MODEL, CLUSTER, global_batch=GLOBAL_BATCH, problem=problem,
                                 **kw)
        est = problem.estimator()
        plan.planner.details["cost_model"] = est.cost_provenance.to_dict() \
            if est.cost_provenance else None
        paths[name] = out / f"{name}.json"
        plan.save(paths[name])
    return paths


def run_all(plans: dict[str, Path], runs: Path, steps: int, reuse: bool) -> None:
    from autoplan import hostload
    from engine.launch import run_local

    for name, path in plans.items():
        run_dir = runs / name
        if reuse and (run_dir / "summary.json").exists():
            continue
        if run_dir.exists():
            shutil.rmtree(run_dir)
        run_dir.mkdir(parents=True)
        shutil.copy(path, run_dir / "plan.json")
        print(f"[{time.strftime('%H:%M:%S')}] {name}: load {os.getloadavg()[0]:.2f}", flush=True)
        with hostload.HostLoadMeter() as meter:
            rc = run_local(run_dir / "plan.json", steps=steps, out_dir=run_dir,
                           extra_args=["--log-every", str(steps)])
        if rc != 0:
            raise SystemExit(f"engine run of {name} failed with status {rc}")
        hostload.write(run_dir, meter.result)


# ---- analysis ---------------------------------------------------------------------------

def spearman(x: list[float], y: list[float]) -> float:
    """Spearman's rho: Pearson correlation of the ranks (ties get their mean rank)."""
    import numpy as np

    def ranks(v: list[float]) -> np.ndarray:
        order = np.argsort(v, kind="stable")
        r = np.empty(len(v))
        r[order] = np.arange(len(v), dtype=float)
        for value in set(v):                          # mean rank for ties
            idx = [i for i, w in enumerate(v) if w == value]
            r[idx] = r[idx].mean()
        return r

    rx, ry = ranks(x), ranks(y)
    return float(np.corrcoef(rx, ry)[0, 1])


def analyse(runs_dir: Path) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    from autoplan.calibrate import Reestimator, fit, load_run

    names = [n for n in PLANS if (runs_dir / n / "summary.json").exists()]
    runs = [load_run(runs_dir / n) for n in names]
    est = Reestimator()
    raw_idle = [est.predict(r, use_load=False) for r in runs]
    raw_load = [est.predict(r) for r in runs]
    cluster = runs[0].plan.cluster["name"]
    rows = []
    for i, (name, run) in enumerate(zip(names, runs)):
        others = [j for j in range(len(runs)) if j != i]
        cal = fit([runs[j] for j in others], [raw_load[j] for j in others], cluster=cluster)
        loo = cal.apply(raw_load[i])
        plan_pred = run.plan.prediction
        rows.append({
            "plan": name, "config": run.label,
            "measured_step_s": run.step_time_s,
            "measured_step_min_max_s": [min(run.step_times_s), max(run.step_times_s)],
            "predicted_step_s": loo.step_time_s,
            "predicted_raw_idle_step_s": raw_idle[i].step_time_s,
            "predicted_raw_at_load_step_s": raw_load[i].step_time_s,
            "predicted_by_plan_step_s": plan_pred.step_time_s if plan_pred else None,
            "measured_peak_memory_bytes": run.peak_memory_bytes,
            "predicted_memory_bytes": loo.memory.total,
            "predicted_raw_memory_bytes": raw_idle[i].memory.total,
            "predicted_by_plan_memory_bytes": plan_pred.memory.total if plan_pred else None,
            "raw_breakdown_at_load_s": raw_load[i].time.to_dict(),
            "raw_memory_breakdown_bytes": raw_idle[i].memory.to_dict(),
            "loo_factors": dict(cal.factors),
            "external_cores": run.load.external_cores if run.load else None,
            "load_avg_before": list(run.load.load_avg_before) if run.load else None,
        })
    separate = committed_calibration(cluster, runs_dir)
    for row, raw in zip(rows, raw_load):
        pred = separate.apply(raw) if separate else None
        row["predicted_separate_step_s"] = pred.step_time_s if pred else None
        row["predicted_separate_memory_bytes"] = pred.memory.total if pred else None
    full = fit(runs, raw_load, cluster=cluster)
    return rows, {"full": full, "runs": runs, "raw_load": raw_load, "separate": separate}


def committed_calibration(cluster: str, runs_dir: Path):
    """The committed calibration of ``cluster`` if it was fitted on other runs, else None."""
    from autoplan.yaml_files import profiles_root
    from autoplan.cost.calibration import load_calibration

    cal = load_calibration(cluster, profiles_root())
    if cal.source is None:
        return None
    mine = {str((runs_dir / n).resolve()) for n in PLANS}
    used = {str(Path(r.get("run", "")).resolve()) for r in cal.runs}
    return None if mine & used else cal


def run_load(runs: list) -> dict[str, Any]:
    """The machine's load over the engine runs (from each run's host_load.json)."""
    loads = [r.load for r in runs if r.load is not None]
    if not loads:
        return {}
    return {"load_avg_1min": [min(l.load_avg_before[0] for l in loads),
                              max(l.load_avg_after[0] for l in loads)],
            "external_cores": [round(min(l.external_cores for l in loads), 3),
                               round(max(l.external_cores for l in loads), 3)],
            "cores": loads[0].cores,
            "engine_wall_s": round(sum(l.wall_s for l in loads), 1)}


def metrics(rows: list[dict[str, Any]], key_t: str, key_m: str) -> dict[str, float]:
    meas_t = [r["measured_step_s"] for r in rows]
    pred_t = [r[key_t] for r in rows]
    err_t = [abs(p - m) / m for p, m in zip(pred_t, meas_t)]
    mem = [(r[key_m], r["measured_peak_memory_bytes"]) for r in rows
           if r[key_m] and r["measured_peak_memory_bytes"]]
    err_m = [abs(p - m) / m for p, m in mem]
    best_pred = min(range(len(rows)), key=lambda i: pred_t[i])
    return {"spearman_time": spearman(pred_t, meas_t),
            "median_abs_error_time": statistics.median(err_t),
            "median_abs_error_memory": statistics.median(err_m) if err_m else float("nan"),
            "predicted_best": rows[best_pred]["plan"],
            "predicted_best_over_measured_best": meas_t[best_pred] / min(meas_t)}


def plot(rows: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    fig, axes = plt.subplots(1, 2, figsize=(12, 5.5))
    panels = [("step time (s)", "measured_step_s", "predicted_step_s", 1.0),
              ("peak memory per rank (MB)", "measured_peak_memory_bytes",
               "predicted_memory_bytes", 1e-6)]
    for ax, (title, mk, pk, scale) in zip(axes, panels):
        xs = [r[mk] * scale for r in rows if r[mk] and r[pk]]
        ys = [r[pk] * scale for r in rows if r[mk] and r[pk]]
        names = [r["plan"] for r in rows if r[mk] and r[pk]]
        lo, hi = min(xs + ys) / 1.3, max(xs + ys) * 1.3
        ax.plot([lo, hi], [lo, hi], color="grey", lw=1, label="y = x")
        band = TIME_MDAPE if "time" in title else MEM_MDAPE
        ax.fill_between([lo, hi], [lo * (1 - band), hi * (1 - band)],
                        [lo * (1 + band), hi * (1 + band)], color="grey", alpha=0.12,
                        label=f"±{band:.0%}")
        ax.scatter(xs, ys, color="tab:blue", zorder=3)
        placed: list[tuple[float, float]] = []
        offsets = [(5, 4), (5, -11), (-48, 4), (-48, -11)]
        for x, y, n in zip(xs, ys, names):
            near = sum(abs(x / px - 1) < 0.06 and abs(y / py - 1) < 0.06 for px, py in placed)
            ax.annotate(n, (x, y), textcoords="offset points", xytext=offsets[near % 4],
                        fontsize=8)
            placed.append((x, y))
        ax.set_xscale("log")
        ax.set_yscale("log")
        for axis in (ax.xaxis, ax.yaxis):
            axis.set_major_formatter(matplotlib.ticker.FormatStrFormatter("%g"))
            axis.set_minor_formatter(matplotlib.ticker.FormatStrFormatter("%g"))
        ax.set_xlim(lo, hi)
        ax.set_ylim(lo, hi)
        ax.set_xlabel(f"measured {title}")
        ax.set_ylabel(f"predicted {title} (leave-one-out calibrated)")
        ax.set_title(title)
        ax.legend(loc="upper left", fontsize=8)
    fig.suptitle(f"{MODEL} on {CLUSTER} (4 ranks), global batch {GLOBAL_BATCH}: "
                 "predicted vs measured")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=10, help="engine steps per plan (2 warm-up)")
    ap.add_argument("--runs", type=Path, default=ROOT / "runs" / "cost_model_accuracy",
                    help="where the run directories go")
    ap.add_argument("--reuse", action="store_true", help="keep runs that finished already")
    ap.add_argument("--write-calibration", action="store_true",
                    help="write profiles/calibration/local-cpu.json fitted on all these runs")
    args = ap.parse_args(argv)

    t0 = time.perf_counter()
    load_start = os.getloadavg()
    plans_dir = args.runs / "plans"
    plans_dir.mkdir(parents=True, exist_ok=True)
    if not (args.reuse and all((args.runs / n / "plan.json").exists() for n in PLANS)):
        plans = make_plans(plans_dir)
        run_all(plans, args.runs, args.steps, args.reuse)
    rows, extra = analyse(args.runs)
    load_end = os.getloadavg()

    print_table(f"{MODEL} on {CLUSTER}: predicted (leave-one-out calibrated) vs measured",
                ["plan", "config", "measured s", "predicted s", "err", "raw idle s",
                 "by plan s", "mem meas MB", "mem pred MB", "err ", "other cores"],
                [[r["plan"], r["config"], r["measured_step_s"], r["predicted_step_s"],
                  f"{(r['predicted_step_s'] / r['measured_step_s'] - 1):+.0%}",
                  r["predicted_raw_idle_step_s"], r["predicted_by_plan_step_s"],
                  (r["measured_peak_memory_bytes"] or 0) / 1e6,
                  r["predicted_memory_bytes"] / 1e6,
                  f"{(r['predicted_memory_bytes'] / r['measured_peak_memory_bytes'] - 1):+.0%}"
                  if r["measured_peak_memory_bytes"] else "-",
                  r["external_cores"]] for r in rows])
    m = metrics(rows, "predicted_step_s", "predicted_memory_bytes")
    m_plan = metrics(rows, "predicted_by_plan_step_s", "predicted_by_plan_memory_bytes") \
        if all(r["predicted_by_plan_step_s"] for r in rows) else None
    m_raw = metrics(rows, "predicted_raw_idle_step_s", "predicted_raw_memory_bytes")
    m_sep = metrics(rows, "predicted_separate_step_s", "predicted_separate_memory_bytes") \
        if all(r["predicted_separate_step_s"] for r in rows) else None
    targets = [
        target("Spearman rho, predicted vs measured step time", f">= {SPEARMAN}",
               round(m["spearman_time"], 3), m["spearman_time"] >= SPEARMAN),
        target("median |error| of step time", f"<= {TIME_MDAPE:.0%}",
               round(m["median_abs_error_time"], 3), m["median_abs_error_time"] <= TIME_MDAPE),
        target("median |error| of peak memory", f"<= {MEM_MDAPE:.0%}",
               round(m["median_abs_error_memory"], 3),
               m["median_abs_error_memory"] <= MEM_MDAPE),
        target("predicted-best plan's measured time / measured best", f"<= {1 + BEST_WITHIN}",
               round(m["predicted_best_over_measured_best"], 3),
               m["predicted_best_over_measured_best"] <= 1 + BEST_WITHIN),
    ]
    full = extra["full"]
    if args.write_calibration:
        from autoplan.yaml_files import profiles_root
        from autoplan.cost.calibration import calibration_path

        path = full.save(calibration_path(full.cluster, profiles_root()))
        print(f"calibration written to {path.relative_to(ROOT)}")
    png = RESULTS / "cost_model_accuracy.png"
    plot(rows, png)
    write_results("cost_model_accuracy", rows, targets, extra={
        "setup": {"model": MODEL, "cluster": CLUSTER, "ranks": 4, "global_batch": GLOBAL_BATCH,
                  "steps": args.steps, "warmup_steps": 2, "precision": "fp32"},
        "method": ("predicted_step_s / predicted_memory_bytes: leave-one-out calibration "
                   "(factors fitted on the other plans' runs), raw prediction made for the "
                   "cores other processes left each run (host_load.json); targets judge these"),
        "metrics": {"loo_calibrated": m, "separate_calibration": m_sep, "raw_idle": m_raw,
                    "as_planned": m_plan},
        "separate_calibration": (extra["separate"].to_dict()["factors"] | {
            "date": extra["separate"].date, "runs": [r["run"] for r in extra["separate"].runs]})
        if extra["separate"] else None,
        "calibration_all_runs": full.to_dict()["factors"],
        "machine_load_during_runs": run_load(extra["runs"]),
        "load_avg_at_analysis": {"start": [round(x, 2) for x in load_start],
                                 "end": [round(x, 2) for x in load_end]},
        "reused_runs": args.reuse,
        "seconds": round(time.perf_counter() - t0, 1), "plot": png.name})
    print_table("other predictions (same metrics)", ["prediction", "spearman", "time err",
                                                     "memory err", "best/measured best"],
                [[k, v["spearman_time"], v["median_abs_error_time"],
                  v["median_abs_error_memory"], v["predicted_best_over_measured_best"]]
                 for k, v in (("separate calibration, at load", m_sep), ("raw idle", m_raw),
                              ("as planned (idle)", m_plan)) if v])
    return 0


if __name__ == "__main__":
    sys.exit(main())
