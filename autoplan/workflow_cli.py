"""The workflow commands around a plan: ``report``, ``export`` and ``launch``.

    autoplan report plan.json -o report.html --png figures/
    autoplan export plan.json --to torchtitan|megatron|deepspeed -o FILE
    autoplan launch plan.json --master-addr HOST | --nodes-file hosts.txt | --slurm -o job.sbatch

:func:`add_workflow_commands` registers them on the main parser's subparsers (each sets
``func(args) -> int``; errors a user can cause are AutoplanError subclasses).
"""

from __future__ import annotations

import argparse


def add_workflow_commands(subparsers: argparse._SubParsersAction) -> None:
    """Add ``report``, ``export`` and ``launch`` to ``subparsers``."""
    from autoplan.export.cli import add_export_command
    from autoplan.multinode.cli import add_launch_command
    from autoplan.report.cli import add_report_command

    add_report_command(subparsers)
    add_export_command(subparsers)
    add_launch_command(subparsers)


def add_plan_command(subparsers: argparse._SubParsersAction, name: str, help: str, doc: str
                     ) -> argparse.ArgumentParser:
    """Add the command ``name`` taking a plan file to ``subparsers``: its description is the
    first paragraph of its module docstring ``doc``, its epilog the rest."""
    p = subparsers.add_parser(name, help=help, description=doc.split("\n\n")[0],
                              epilog=doc.split("\n\n", 1)[1],
                              formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("plan", help="plan JSON file")
    return p
