"""``autoplan report PLAN``: the plan as an HTML page and/or PNG figures.

    autoplan report plan.json                       # -> report.html
    autoplan report plan.json -o out/plan.html --png out/figures
    autoplan report plan.json --png figures --json  # PNGs only

Figures: ``mesh.png`` (devices coloured by stage), ``timeline.png`` (one step of the
pipeline schedule), ``memory.png`` (per-stage memory against the device limit), ``time.png``
(compute vs communication per stage), ``alternatives.png`` (when the plan has some).
"""

from __future__ import annotations

import argparse
import json
import sys

from autoplan.errors import ConfigError
from autoplan.plan_command import add_plan_command


def add_report_command(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Add ``report`` to ``subparsers``; returns its parser."""
    p = add_plan_command(subparsers, "report", "an HTML report (and PNG figures) of a plan",
                         __doc__)
    p.add_argument("-o", "--output",
                   help="HTML file, self-contained with the images embedded (default "
                        "report.html, unless only --png is given)")
    p.add_argument("--png", metavar="DIR", help="write each figure as DIR/NAME.png")
    p.add_argument("--top-k", type=int, default=8, help="alternatives to show (default 8)")
    p.add_argument("--json", action="store_true", help="print what was written as JSON")
    p.set_defaults(func=cmd_report)
    return p


def cmd_report(args: argparse.Namespace) -> int:
    from autoplan.plan import Plan
    from autoplan.report import build_report, write_report

    if args.top_k < 0:
        raise ConfigError(f"must be >= 0, got {args.top_k}", field="--top-k")
    plan = Plan.load(args.plan)
    report = build_report(plan, top_k=args.top_k)
    html_path = args.output or (None if args.png else "report.html")
    written = write_report(report, html_path=html_path, png_dir=args.png)
    summary = {**written, "sections": [s.id for s in report.sections],
               "figures": sorted(report.figures), "timing": report.timing.source,
               "simulated_step_s": report.step.step_s,
               "predicted_step_s": plan.prediction.step_time_s if plan.prediction else None,
               "note": report.timing.note}
    if args.json:
        print(json.dumps(summary, indent=2, sort_keys=True))
        return 0
    if written["html"]:
        print(f"report written to {written['html']}")
    for path in written["pngs"]:
        print(f"figure written to {path}")
    if report.timing.source not in ("plan", "estimator"):
        print(f"note: {report.timing.note}", file=sys.stderr)
    return 0
