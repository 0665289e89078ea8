"""``autoplan export PLAN --to torchtitan|megatron|deepspeed``: the plan in another runtime's
configuration format.

    autoplan export plan.json --to torchtitan -o job.toml
    autoplan export plan.json --to megatron                 # bash array of arguments
    autoplan export plan.json --to deepspeed -o ds_config.json
    autoplan export plan.json --to megatron --json          # {"target", "text", "notes", ...}

A plan the target cannot express (ZeRO-2/3 in Megatron-LM, ZeRO-1/2 in torchtitan, TP/PP in
DeepSpeed's JSON, per-stage meshes anywhere, ...) is refused with one ``error:`` line naming
what, and exit status 2.
"""

from __future__ import annotations

import argparse
import json
import sys

from autoplan.export import TARGETS
from autoplan.plan_command import add_plan_command


def add_export_command(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Add ``export`` to ``subparsers``; returns its parser."""
    p = add_plan_command(subparsers, "export", "write a plan as a torchtitan, Megatron-LM or "
                                               "DeepSpeed configuration", __doc__)
    p.add_argument("--to", required=True, choices=TARGETS, dest="target",
                   help="the runtime whose configuration to write")
    p.add_argument("-o", "--output", help="file to write (default: print it)")
    p.add_argument("--steps", type=int, help="training steps (torchtitan [training] steps)")
    p.add_argument("--json", action="store_true",
                   help="print {target, text, notes, file} as JSON")
    p.set_defaults(func=cmd_export)
    return p


def cmd_export(args: argparse.Namespace) -> int:
    from autoplan.errors import ConfigError
    from autoplan.export import export_plan
    from autoplan.plan import Plan, atomic_write_text

    if args.steps is not None and args.steps < 1:
        raise ConfigError(f"must be >= 1, got {args.steps}", field="--steps")
    plan = Plan.load(args.plan)
    try:
        result = export_plan(plan, args.target, steps=args.steps)
    except ConfigError as exc:          # a value of the plan's model: name the plan file
        if exc.source is not None:
            raise
        raise ConfigError(str(exc), source=args.plan) from None
    path = str(atomic_write_text(args.output, result.text)) if args.output else None
    if args.json:
        print(json.dumps({"target": args.target, "text": result.text,
                          "notes": list(result.notes), "file": path}, indent=2,
                         sort_keys=True))
        return 0
    if path:
        print(f"{result.target} configuration written to {path}")
    else:
        sys.stdout.write(result.text)
    for note in result.notes:
        print(f"note: {note}", file=sys.stderr)
    return 0
