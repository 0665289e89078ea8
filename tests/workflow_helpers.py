"""Run the workflow commands (report, export, launch) as the ``autoplan`` CLI does: a parser
with :func:`autoplan.workflow_cli.add_workflow_commands`, ``error: ...`` and status 2 for an
AutoplanError."""

from __future__ import annotations

import argparse
import sys

from autoplan.errors import AutoplanError
from autoplan.workflow_cli import add_workflow_commands


def run_cli(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="autoplan")
    add_workflow_commands(parser.add_subparsers())
    args = parser.parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except AutoplanError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
