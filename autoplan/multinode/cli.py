"""``autoplan launch PLAN``: how to start a plan on its cluster's nodes.

    autoplan launch plan.json --master-addr node001 --steps 100     # a command per node
    autoplan launch plan.json --nodes-file hosts.txt --rdzv static  # node i: --node_rank=i
    autoplan launch plan.json --slurm -o job.sbatch --time 02:00:00 # then: sbatch job.sbatch
    autoplan launch plan.json --json                                # commands as data

Prints (or, with -o, writes as a shell script) the torchrun command each node runs:
``--nnodes`` = the plan's nodes, ``--nproc_per_node`` = devices per node, a c10d rendezvous
on the head node (the first host of --nodes-file, or --master-addr, or $MASTER_ADDR), and
``-m engine.run PLAN``. The plan must be at the same path on every node.
"""

from __future__ import annotations

import argparse
import json
import sys

from autoplan.multinode.torchrun import DEFAULT_PORT, RENDEZVOUS
from autoplan.plan_command import add_plan_command


def add_launch_command(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Add ``launch`` to ``subparsers``; returns its parser."""
    p = add_plan_command(subparsers, "launch", "torchrun commands (or a SLURM script) to run "
                                               "a plan on several nodes", __doc__)
    head = p.add_mutually_exclusive_group()
    head.add_argument("--nodes-file", help="hosts, one per line; the first is the head node")
    head.add_argument("--master-addr", help="the head node's address (rendezvous host)")
    p.add_argument("--port", type=int, default=DEFAULT_PORT,
                   help=f"rendezvous port on the head node (default {DEFAULT_PORT})")
    p.add_argument("--rdzv", choices=RENDEZVOUS, default="c10d",
                   help="c10d (default): the same command on every node; static: "
                        "--node_rank per node")
    p.add_argument("--rdzv-id", help="rendezvous id (default autoplan-<model fingerprint>)")
    p.add_argument("--slurm", action="store_true", help="a SLURM batch script instead")
    p.add_argument("--job-name", help="SLURM job name (default autoplan-<model>)")
    p.add_argument("--time", help="SLURM time limit, e.g. 02:00:00")
    p.add_argument("--partition", help="SLURM partition")
    p.add_argument("--steps", type=int, help="training steps (engine --steps)")
    p.add_argument("--out", help="run directory on the shared file system (engine --out)")
    p.add_argument("--workdir", help="the autoplan checkout on the nodes (default: this one)")
    p.add_argument("-o", "--output", help="write the script here instead of printing it")
    p.add_argument("--json", action="store_true", help="print the commands / script as JSON")
    p.set_defaults(func=cmd_launch)
    return p


def cmd_launch(args: argparse.Namespace) -> int:
    from autoplan.errors import ConfigError
    from autoplan.multinode import node_commands, read_hosts, sbatch_script
    from autoplan.multinode.torchrun import cluster_shape
    from autoplan.plan import Plan

    if args.steps is not None and args.steps < 1:
        raise ConfigError(f"must be >= 1, got {args.steps}", field="--steps")
    plan = Plan.load(args.plan)
    if args.slurm:
        if args.nodes_file or args.master_addr or args.rdzv != "c10d":
            raise ConfigError("SLURM picks the nodes and the head node itself; drop "
                              "--nodes-file / --master-addr / --rdzv", field="--slurm")
        text = sbatch_script(plan, args.plan, port=args.port, job_name=args.job_name,
                             time=args.time, partition=args.partition, steps=args.steps,
                             out_dir=args.out, workdir=args.workdir)
        return _emit(args, text, {"slurm": text})
    nodes, _ = cluster_shape(plan)
    hosts, notes = (read_hosts(args.nodes_file, nodes) if args.nodes_file else (None, []))
    commands = node_commands(plan, args.plan, hosts=hosts, master_addr=args.master_addr,
                             port=args.port, rdzv=args.rdzv, rdzv_id=args.rdzv_id,
                             steps=args.steps, out_dir=args.out, workdir=args.workdir)
    lines = ["#!/bin/bash",
             f"# {plan.parallel.label()}: {len(commands)} node(s); run each command on its "
             "node (the plan must be at the same path on every node)"]
    for c in commands:
        where = f" ({c.host})" if c.host else ""
        lines += [f"# node {c.node_rank}{where}", c.shell]
    for note in notes:
        print(f"note: {note}", file=sys.stderr)
    data = {"nodes": [{"node_rank": c.node_rank, "host": c.host, "argv": list(c.argv),
                       "cwd": c.cwd, "command": c.shell} for c in commands], "notes": notes}
    return _emit(args, "\n".join(lines) + "\n", data)


def _emit(args: argparse.Namespace, text: str, data: dict) -> int:
    from autoplan.plan import atomic_write_text

    path = str(atomic_write_text(args.output, text)) if args.output else None
    if args.json:
        print(json.dumps({**data, "file": path}, indent=2, sort_keys=True))
    elif path:
        print(f"written to {path}")
    else:
        sys.stdout.write(text)
    return 0
