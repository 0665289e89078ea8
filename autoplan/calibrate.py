"""``autoplan calibrate RUN_DIR [RUN_DIR ...]``: fit the cost model's factors to engine runs.

    autoplan run plans/a.json --steps 12 --out runs/a      # runs on the cluster, any plans
    autoplan run plans/b.json --steps 12 --out runs/b
    autoplan calibrate runs/a runs/b                        # -> profiles/calibration/<cluster>.json
    autoplan calibrate runs/* --force                       # replace an existing one
    autoplan calibrate runs/* --dry-run                     # the table, nothing written

For every run directory (what ``engine.run`` wrote, with its own copy of the plan it ran:
``plan.json``, checked against the fingerprints ``summary.json`` recorded; a plan elsewhere,
such as the current directory, is never used):

1. **measured** — the median step time after warm-up (``summary.json``; ``metrics.jsonl``
   gives the per-step spread) and the peak memory of the busiest rank;
2. **predicted, term by term** — the run's plan is re-estimated with today's profiles and
   *without* calibration (:func:`raw_prediction`): compute (forward, backward, recomputation,
   optimizer), TP, DP and pipeline communication, bubble; if the run directory has
   ``host_load.json`` (:mod:`autoplan.hostload`: what other processes took of the machine
   during the run), at the cores the run was left with;
3. **fit** — one multiplicative factor per term, least squares on the relative step-time
   errors of all runs with a weak pull to 1 (:func:`autoplan.cost.calibration.
   fit_time_factors`), and the geometric mean of measured / predicted peak memory.

The factors and the runs they came from are written to ``profiles/calibration/<cluster>.json``;
every later estimate for that cluster applies them (:class:`autoplan.cost.calibration.
Calibration`). The engine does not time phases separately, so the terms are separated by
the runs' different mixes (a DP-only run pins compute, TP and PP runs their communication):
give it runs of different configurations. A factor whose term is negligible in every run
stays 1.

Factors that make a run's calibrated prediction impossible — MFU above 100%, memory below
the parameters' own bytes — are refused (:func:`check_physical`), and nothing is written.

Runs used to calibrate must not be the runs an accuracy figure is computed on:
``benchmarks/cost_model_accuracy.py`` fits leave-one-out.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

from autoplan import hostload
from autoplan.cost.calibration import (TERMS, Calibration, calibration_path, design_row,
                                       fit_memory_factor, fit_time_factors)
from autoplan.errors import ConfigError
from autoplan.plan import Plan, Prediction
from autoplan.precision import PRECISIONS, priced_as
from autoplan.user_files import read_text

SUMMARY, METRICS = "summary.json", "metrics.jsonl"


@dataclass
class RunRecord:
    """What one engine run measured, and the plan it ran."""

    run_dir: Path
    plan: Plan
    plan_path: Path
    step_time_s: float                 # median after warm-up (summary.json)
    step_times_s: list[float]          # the timed steps (metrics.jsonl)
    peak_memory_bytes: float | None    # the busiest rank
    load: hostload.HostLoad | None

    @property
    def label(self) -> str:
        return self.plan.parallel.label()


def _read_json(path: Path) -> Any:
    if not path.exists():
        raise ConfigError("no such file (is this a run directory written by `autoplan run` "
                          "/ engine.run?)", source=str(path))
    try:
        return json.loads(read_text(path))
    except json.JSONDecodeError as exc:
        raise ConfigError(f"not valid JSON (line {exc.lineno}: {exc.msg})",
                          source=str(path)) from None
    except OSError as exc:
        raise ConfigError(f"cannot read ({exc.strerror})", source=str(path)) from None
    except (UnicodeDecodeError, RecursionError) as exc:
        raise ConfigError(f"not valid JSON ({type(exc).__name__})", source=str(path)) from None


def _number(d: Any, key: str, source: Path, where: str) -> float:
    value = d.get(key) if isinstance(d, dict) else None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise ConfigError(f"must be a positive number, got {value!r}", source=str(source),
                          field=f"{where}{key}")
    return float(value)


def _timed_steps(path: Path, warmup: int) -> list[float]:
    if not path.exists():
        raise ConfigError("no such file (the engine writes one line per step)",
                          source=str(path))
    times = []
    try:
        lines = read_text(path).splitlines()
    except OSError as exc:
        raise ConfigError(f"cannot read ({exc.strerror})", source=str(path)) from None
    except UnicodeDecodeError:
        raise ConfigError("not UTF-8 text", source=str(path)) from None
    for i, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError as exc:
            if not any(rest.strip() for rest in lines[i:]):
                break                   # a torn last line: a crash mid-append
            raise ConfigError(f"line {i} is not valid JSON ({exc.msg})",
                              source=str(path)) from None
        if not isinstance(rec, dict) or "step" not in rec or "step_time_s" not in rec:
            raise ConfigError(f"line {i} lacks 'step' or 'step_time_s'", source=str(path))
        if rec["step"] > warmup and not rec.get("memory_tracked", False):
            times.append(float(rec["step_time_s"]))
    if not times:
        raise ConfigError(f"no timed steps (all {len(lines)} lines are warm-up or "
                          "memory-tracked steps); run more steps", source=str(path))
    return times


def _find_plan(run_dir: Path, summary: dict) -> Path:
    """The run directory's own copy of its plan (the engine writes it): never a path
    resolved elsewhere (the current directory may hold another plan.json)."""
    path = run_dir / "plan.json"
    if path.is_file():
        return path
    named = summary.get("plan")
    raise ConfigError(f"the plan it ran ({named!r}) is not in the run directory; copy that "
                      f"plan to {path}"[:400], source=str(run_dir / SUMMARY), field="plan")


def _check_identity(run_dir: Path, summary: dict, plan: Plan, plan_path: Path) -> None:
    """The run directory's plan is the plan the run ran: what summary.json recorded of it
    (fingerprints, cluster, ranks, device, layout; each where recorded) must match."""
    from autoplan.fingerprints import run_identity

    got = {**run_identity(plan), "world_size": plan.world_size,
           "device": plan.mesh.device_type, "label": plan.parallel.label()}
    for key, value in got.items():
        if key in summary and summary[key] != value:
            raise ConfigError(f"{plan_path} is not the plan this run ran: its {key} is "
                              f"{value!r}, the run recorded {summary[key]!r}"[:400],
                              source=str(run_dir / SUMMARY), field=key)


def load_run(run_dir: str | Path) -> RunRecord:
    """Read one run directory; errors name the file and field."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise ConfigError("not a directory", source=str(run_dir))
    spath = run_dir / SUMMARY
    summary = _read_json(spath)
    if not isinstance(summary, dict):
        raise ConfigError("must be a JSON object", source=str(spath))
    measured = summary.get("measured")
    if not isinstance(measured, dict):
        raise ConfigError("missing (not a finished run?)", source=str(spath), field="measured")
    step = _number(measured, "step_time_s", spath, "measured.")
    peak = measured.get("peak_memory_bytes")
    if peak is not None:
        peak = _number(measured, "peak_memory_bytes", spath, "measured.")
    warmup = summary.get("warmup_steps", 0)
    if isinstance(warmup, bool) or not isinstance(warmup, int) or warmup < 0:
        raise ConfigError(f"must be a non-negative integer, got {warmup!r}", source=str(spath),
                          field="warmup_steps")
    steps = _timed_steps(run_dir / METRICS, warmup)
    plan_path = _find_plan(run_dir, summary)
    plan = Plan.load(plan_path)
    _check_identity(run_dir, summary, plan, plan_path)
    return RunRecord(run_dir=run_dir, plan=plan, plan_path=plan_path, step_time_s=step,
                     step_times_s=steps, peak_memory_bytes=peak, load=hostload.read(run_dir))


# ---- re-estimating -------------------------------------------------------------------------

class Reestimator:
    """Raw (uncalibrated) predictions of runs' plans with the current profiles; traces each
    model once."""

    def __init__(self, profiles_dir: str | Path | None = None, *, use_load: bool = True):
        self.profiles_dir = profiles_dir
        self.use_load = use_load
        self._graphs: dict[str, Any] = {}

    def _graph(self, plan: Plan, precision: str):
        import torch

        from autoplan.models.registry import ModelSpec
        from autoplan.trace.replicate import trace_replicated as trace

        key = json.dumps([plan.model, plan.seq_len, precision], sort_keys=True)
        if key not in self._graphs:
            spec = ModelSpec.from_dict(plan.model)
            dtype = getattr(torch, PRECISIONS[precision].compute)
            self._graphs[key] = trace(spec, 1, plan.seq_len, dtype=dtype)
        return self._graphs[key]

    def predict(self, run: RunRecord, cores: float | None = None, *,
                use_load: bool | None = None) -> Prediction:
        """The run's plan re-estimated without calibration; at ``cores`` if given, else at
        the cores the run's host load left it (when recorded and ``use_load``, which
        defaults to the Reestimator's), else for an idle machine."""
        use_load = self.use_load if use_load is None else use_load
        from autoplan.cluster import Cluster
        from autoplan.cost.profiled import cost_models_for
        from autoplan.planner.grid.estimate import Estimator

        plan = run.plan
        precision = priced_as(plan.precision).name
        cluster = Cluster.from_dict(plan.cluster, source=str(run.plan_path))
        if cores is None and use_load and run.load is not None:
            cores = available_cores(run.load, cluster, self.profiles_dir)
        compute, comm, prov = cost_models_for(cluster, precision, self.profiles_dir,
                                              calibrate=False, cores=cores)
        pricing = plan.pricing.to_dict() if plan.pricing is not None else {}
        est = Estimator(self._graph(plan, precision), cluster, precision=precision,
                        compute=compute, comm=comm, provenance=prov, **pricing)
        return est.predict(plan.parallel)


def available_cores(load: hostload.HostLoad, cluster, profiles_dir=None) -> float | None:
    """The device's cores (ops/index.yaml) minus what other processes used during the run;
    None for devices without a core count."""
    from autoplan.yaml_files import profiles_root
    from autoplan.cost.profiled import device_profile

    dev = device_profile(cluster.device.name, profiles_root(profiles_dir))
    if dev.cores is None:
        return None
    return max(0.1, dev.cores - load.external_cores)


# ---- fitting -------------------------------------------------------------------------------

def fit(runs: Sequence[RunRecord], raw: Sequence[Prediction], *, cluster: str) -> Calibration:
    """Factors for ``cluster`` from the runs and their raw predictions (module docstring)."""
    if not runs:
        raise ConfigError("no runs to calibrate from")
    factors = fit_time_factors([design_row(p.time) for p in raw],
                               [r.step_time_s for r in runs])
    factors["memory"] = fit_memory_factor([p.memory.total for p in raw],
                                          [r.peak_memory_bytes for r in runs])
    records = []
    for r, p in zip(runs, raw):
        records.append({
            "run": str(r.run_dir), "plan": r.label, "steps_timed": len(r.step_times_s),
            "measured_step_s": r.step_time_s,
            "measured_step_spread_s": [min(r.step_times_s), max(r.step_times_s)],
            "predicted_raw_step_s": p.step_time_s,
            "predicted_raw_terms_s": {k: round(v, 6) for k, v in p.time.to_dict().items()},
            "measured_peak_memory_bytes": r.peak_memory_bytes,
            "predicted_raw_memory_bytes": p.memory.total,
            "host_load": r.load.to_dict() if r.load else None})
    return Calibration(
        cluster=cluster, factors=factors,
        method="autoplan.calibrate: per-term factors by least squares on relative step-time "
               "errors (ridge 1e-3 towards 1); memory: geometric mean of measured/predicted",
        date=time.strftime("%Y-%m-%dT%H:%M:%S%z"), runs=tuple(records))


def calibrate(run_dirs: Sequence[str | Path], *, profiles_dir: str | Path | None = None,
              use_load: bool = True) -> tuple[Calibration, list[RunRecord], list[Prediction]]:
    """Load the runs (one cluster), re-estimate them raw, fit. Nothing is written."""
    from autoplan.fingerprints import cluster_fingerprint

    runs = [load_run(d) for d in run_dirs]
    clusters = {r.plan.cluster.get("name") for r in runs}
    if len(clusters) != 1:
        raise ConfigError(f"the runs are on different clusters {sorted(map(str, clusters))}; "
                          "calibrate one cluster at a time")
    specs = {cluster_fingerprint(r.plan): r for r in runs}
    if len(specs) != 1:
        a, b = list(specs.values())[:2]
        raise ConfigError(f"runs {a.run_dir} and {b.run_dir} name cluster "
                          f"{a.plan.cluster.get('name')!r} with different specifications "
                          f"(fingerprints {' and '.join(list(specs)[:2])}); calibrate one "
                          "cluster at a time")
    est = Reestimator(profiles_dir, use_load=use_load)
    raw = [est.predict(r) for r in runs]
    cal = fit(runs, raw, cluster=clusters.pop())
    check_physical(cal, runs, raw)
    return cal, runs, raw


def check_physical(cal: Calibration, runs: Sequence[RunRecord],
                   raw: Sequence[Prediction]) -> None:
    """Refuse factors that make a run's calibrated prediction impossible: every factor
    finite and positive; model FLOP utilisation at most 100% (PaLM appendix B's MFU: no
    device computes above its peak); per-device memory at least the parameters' own bytes
    (the breakdown's ``params`` term). ConfigError with the run and the reason."""
    import math

    for name, value in cal.factors.items():
        if not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
            raise ConfigError(f"fitted factor {name} = {value!r} is not a positive number; "
                              "nothing written")
    for r, p in zip(runs, raw):
        c = cal.apply(p)
        if c.mfu > 1.0:
            raise ConfigError(f"the fitted factors give run {r.run_dir} an MFU of "
                              f"{c.mfu:.1%} (> 100%: faster than the device's peak); its plan "
                              "is probably not the run's; nothing written")
        if c.memory.total < p.memory.params:
            raise ConfigError(f"the fitted memory factor x{cal.factor('memory'):.3f} gives run "
                              f"{r.run_dir} {c.memory.total / 1e6:.1f} MB per device, below its "
                              f"parameters' own {p.memory.params / 1e6:.1f} MB; nothing written")


# ---- command -------------------------------------------------------------------------------

def add_calibrate_command(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """``autoplan calibrate``; wire into autoplan/cli.py's subparsers."""
    p = subparsers.add_parser(
        "calibrate", help="fit the cost model's per-term factors to engine runs",
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("run_dirs", nargs="+", metavar="RUN_DIR",
                   help="run directories written by `autoplan run --out RUN_DIR`")
    p.add_argument("--out", type=Path, help="calibration file to write (default: "
                   "profiles/calibration/<cluster>.json)")
    p.add_argument("--profiles", type=Path, help="profiles folder (default: profiles/ or "
                   "$AUTOPLAN_PROFILES)")
    p.add_argument("--ignore-load", action="store_true",
                   help="predict every run for an idle machine even if it has host_load.json")
    p.add_argument("--force", action="store_true", help="replace an existing calibration "
                   "file at the default place (shipped or earlier; --out needs no --force)")
    p.add_argument("--dry-run", action="store_true", help="print the fit, write nothing")
    p.add_argument("--json", action="store_true", help="print the calibration as JSON")
    p.set_defaults(func=_run_command)
    return p


def _run_command(args: argparse.Namespace) -> int:
    from autoplan.yaml_files import profiles_root

    cal, runs, raw = calibrate(args.run_dirs, profiles_dir=args.profiles,
                               use_load=not args.ignore_load)
    if args.json:
        print(json.dumps(cal.to_dict(), indent=1))
    else:
        _print_table(cal, runs, raw)
    if not args.dry_run:
        if args.out is None:
            from autoplan.trust import check_file_stem

            check_file_stem(cal.cluster, "cluster name")
        out = args.out or calibration_path(cal.cluster, profiles_root(args.profiles))
        if args.out is None and out.exists() and not args.force:
            raise ConfigError(f"{out} exists (a shipped or earlier calibration); pass --force "
                              "to replace it, or --out FILE", field="--out")
        cal.save(out)
        print(f"written {out}", file=sys.stderr if args.json else sys.stdout)
    return 0


def _print_table(cal: Calibration, runs: list[RunRecord], raw: list[Prediction]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"calibration of {cal.cluster}: {len(runs)} runs", title_justify="left")
    for col in ("run", "plan", "measured s", "raw s", "calibrated s", "compute", "tp",
                "dp", "pp", "bubble", "mem meas. MB", "mem pred. MB", "other cores"):
        table.add_column(col, justify="left" if col in ("run", "plan") else "right")
    for r, p in zip(runs, raw):
        t = p.time
        calibrated = cal.apply(p)
        table.add_row(r.run_dir.name, r.label, f"{r.step_time_s:.3f}", f"{p.step_time_s:.3f}",
                      f"{calibrated.step_time_s:.3f}",
                      f"{t.compute + t.recompute + t.optimizer:.3f}", f"{t.tp_comm:.3f}",
                      f"{t.dp_comm:.3f}", f"{t.pp_comm:.3f}", f"{t.bubble:.3f}",
                      f"{r.peak_memory_bytes / 1e6:.1f}" if r.peak_memory_bytes else "-",
                      f"{calibrated.memory.total / 1e6:.1f}",
                      f"{r.load.external_cores:.2f}" if r.load else "-")
    console = Console(width=None if sys.stdout.isatty() else 160)
    console.print(table)
    console.print("factors: " + ", ".join(f"{k} x{cal.factor(k):.3f}" for k in TERMS))
    errs = [abs(cal.apply(p).step_time_s - r.step_time_s) / r.step_time_s
            for r, p in zip(runs, raw)]
    console.print(f"in-sample median |error| of step time after calibration: "
                  f"{statistics.median(errs):.1%} (not a held-out figure)")
