"""Shared plumbing of the benchmark scripts: machine info, result files, tables.

Each benchmark writes ``benchmarks/results/NAME.json`` with the machine and versions it ran
on, its raw measurements, and a ``targets`` list of ``{name, target, value, met}``, and
prints a table (DESIGN.md, "Benchmarks").
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable

ROOT = Path(__file__).resolve().parents[1]
#: Where results go: benchmarks/results, or ``$AUTOPLAN_BENCHMARK_RESULTS`` (the tests that
#: run each benchmark's ``--quick`` mode write to a temporary folder).
RESULTS = Path(os.environ.get("AUTOPLAN_BENCHMARK_RESULTS")
               or Path(__file__).resolve().parent / "results")


def machine() -> dict[str, Any]:
    import torch

    import autoplan

    return {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "cpus": os.cpu_count(),
        "torch": torch.__version__,
        "autoplan": autoplan.__version__,
        "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
    }


def target(name: str, target: str, value: Any, met: bool) -> dict[str, Any]:
    return {"name": name, "target": target, "value": value, "met": bool(met)}


def write_results(name: str, measurements: Any, targets: list[dict[str, Any]],
                  extra: dict[str, Any] | None = None) -> Path:
    """Write results/NAME.json atomically and print the targets table."""
    from autoplan.plan import atomic_write_text

    doc = {"benchmark": name, "machine": machine(),
           "date": time.strftime("%Y-%m-%d", time.gmtime()),
           "command": "python " + " ".join([f"benchmarks/{Path(sys.argv[0]).name}",
                                            *sys.argv[1:]]),
           "measurements": measurements, "targets": targets, **(extra or {})}
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = atomic_write_text(RESULTS / f"{name}.json",
                             json.dumps(doc, indent=2, sort_keys=False, default=str) + "\n")
    print_table(f"{name}: targets", ["target", "wanted", "value", "met"],
                [[t["name"], t["target"], _fmt(t["value"]), "yes" if t["met"] else "NO"]
                 for t in targets])
    print(f"results written to {path.relative_to(Path.cwd()) if path.is_relative_to(Path.cwd()) else path}")
    return path


def print_table(title: str, columns: list[str], rows: list[list[Any]]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=title, title_justify="left")
    for col in columns:
        table.add_column(col)
    for row in rows:
        table.add_row(*[_fmt(v) for v in row])
    Console(width=160).print(table)


def run_torchrun(script: str | Path, nproc: int, args: list[str]) -> int:
    """Run ``script`` with ``args`` under ``torchrun --standalone`` on ``nproc`` local ranks,
    from the repository root (on PYTHONPATH; one OpenMP thread per rank); prints the tail of
    its output where it fails. Returns its exit status."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p), OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc_per_node={nproc}", str(Path(script).resolve()), *args]
    proc = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True)
    if proc.returncode:
        print(proc.stdout[-3000:], proc.stderr[-6000:], file=sys.stderr)
    return proc.returncode


def alternating_blocks(steps: dict[str, Callable[[int], Any]], rounds: int, block: int, *,
                       one_count: bool = False
                       ) -> tuple[dict[str, list[float]], dict[str, dict[int, Any]]]:
    """Time the sides' step functions side by side, under torch.distributed (every rank
    calls it): ``rounds`` + 1 rounds, each running every side in turn for ``block`` steps,
    a barrier before each step; round 0 warms them up and is not timed. Each side's steps
    are numbered from 1, or with ``one_count`` by one count across all the sides.

    Returns (on every rank) each side's step times, a step as slow as its slowest rank, and
    what each side's steps returned, by step number."""
    import torch.distributed as dist

    times: dict[str, list[float]] = {side: [] for side in steps}
    results: dict[str, dict[int, Any]] = {side: {} for side in steps}
    count, total = dict.fromkeys(steps, 0), 0
    for r in range(rounds + 1):
        for side, step_fn in steps.items():
            for _ in range(block):
                count[side] += 1
                total += 1
                step = total if one_count else count[side]
                dist.barrier()
                t0 = time.perf_counter()
                results[side][step] = step_fn(step)
                dt = time.perf_counter() - t0
                if r:                                   # round 0 warms every side up
                    times[side].append(dt)
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, times)
    slowest = {side: [max(g[side][i] for g in gathered) for i in range(len(times[side]))]
               for side in times}
    return slowest, results


def median_time(fn: Callable[[], Any], repeats: int = 5) -> tuple[float, list[float]]:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times), times


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    return str(v)
