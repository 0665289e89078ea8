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
