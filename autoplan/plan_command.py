"""The parser of a command that takes a plan file (``report``, ``export``, ``launch``)."""

from __future__ import annotations

import argparse


def add_plan_command(subparsers: argparse._SubParsersAction, name: str, help: str, doc: str
                     ) -> argparse.ArgumentParser:
    """Add the command ``name`` taking a plan file to ``subparsers``: its description is the
    first paragraph of its module docstring ``doc``, its epilog the rest."""
    p = subparsers.add_parser(name, help=help, description=doc.split("\n\n")[0],
                              epilog=doc.split("\n\n", 1)[1],
                              formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("plan", help="plan JSON file")
    return p
