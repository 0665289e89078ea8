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
import sys
import time
from pathlib import Path
from typing import Any, Callable

RESULTS = Path(__file__).resolve().parent / "results"


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
           "command": "python " + " ".join([f"benchmarks/{name}.py", *sys.argv[1:]]),
           "measurements": measurements, "targets": targets, **(extra or {})}
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
