"""A SLURM batch script that runs a plan on its cluster's nodes.

One task per node (``--ntasks-per-node=1``); each task is a torchrun that starts the node's
ranks, meeting at a c10d rendezvous on the job's first node (from ``scontrol show
hostnames``), with the job id as rendezvous id::

    sbatch job.sbatch        # written by: autoplan launch plan.json --slurm -o job.sbatch
"""

from __future__ import annotations

import os
import re
import shlex
from pathlib import Path
from typing import Sequence

from autoplan.errors import ConfigError
from autoplan.models.names import describe
from autoplan.multinode.torchrun import DEFAULT_PORT, cluster_shape, engine_args, repo_root
from autoplan.plan import Plan


#: ``#SBATCH`` values are read by sbatch, not a shell: quoting does not protect them, so
#: they are limited to the characters their values need (SLURM's documented forms).
_JOB_NAME = re.compile(r"^[A-Za-z0-9_.+@=-]{1,128}$")
_TIME = re.compile(r"^[0-9]+([-:][0-9]+){0,3}$")             # days-hours:minutes:seconds forms
_PARTITION = re.compile(r"^[A-Za-z0-9_.-]+(,[A-Za-z0-9_.-]+)*$")
_UNSAFE = re.compile(r"[^A-Za-z0-9_.+@=-]")
_UNPRINTABLE = re.compile(r"[^\x20-\x7e]")


def _sbatch_value(value: str, option: str, pattern: re.Pattern) -> str:
    if not isinstance(value, str) or not pattern.match(value):
        raise ConfigError(f"{value!r} is not a valid value here (an #SBATCH line: "
                          f"{pattern.pattern})", field=option)
    return value


def sbatch_script(plan: Plan, plan_path: str | os.PathLike, *, port: int = DEFAULT_PORT,
                  job_name: str | None = None, time: str | None = None,
                  partition: str | None = None, steps: int | None = None,
                  out_dir: str | None = None, workdir: str | os.PathLike | None = None,
                  extra: Sequence[str] = ()) -> str:
    """The script's text."""
    nodes, per_node = cluster_shape(plan)
    if not 0 < port < 65536:
        raise ConfigError(f"must be a TCP port (1-65535), got {port}", field="--port")
    if job_name is None:
        name = _UNSAFE.sub("-", f"autoplan-{describe(plan.model).split(' ')[0]}")[:128]
    else:
        name = _sbatch_value(job_name, "--job-name", _JOB_NAME)
    if time:
        _sbatch_value(time, "--time", _TIME)
    if partition:
        _sbatch_value(partition, "--partition", _PARTITION)
    cwd = str(Path(workdir).resolve() if workdir else repo_root())
    about = _UNPRINTABLE.sub("?", f"{describe(plan.model)}, {plan.parallel.label()}")
    lines = ["#!/bin/bash",
             f"# SLURM batch script written by `autoplan launch --slurm`: {about}",
             f"#SBATCH --job-name={name}",
             f"#SBATCH --nodes={nodes}",
             "#SBATCH --ntasks-per-node=1"]
    if plan.mesh.device_type == "cuda":
        lines.append(f"#SBATCH --gpus-per-node={per_node}")
    if time:
        lines.append(f"#SBATCH --time={time}")
    if partition:
        lines.append(f"#SBATCH --partition={partition}")
    lines += ["#SBATCH --output=%x-%j.out",
              "",
              "set -euo pipefail",
              f"cd {shlex.quote(cwd)}",
              f'if [ "$SLURM_JOB_NUM_NODES" -ne {nodes} ]; then',
              f'    echo "error: the plan needs {nodes} nodes, the job has '
              '$SLURM_JOB_NUM_NODES" >&2',
              "    exit 2",
              "fi",
              'head_node=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)',
              "# a fresh rendezvous store per torchrun attempt (pytorch/pytorch#135712)",
              "export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1",
              "",
              "srun torchrun \\",
              f"    --nnodes={nodes} \\",
              f"    --nproc_per_node={per_node} \\",
              '    --rdzv-id="$SLURM_JOB_ID" \\',
              "    --rdzv-backend=c10d \\",
              f'    --rdzv-endpoint="$head_node:{port}" \\']
    tail = engine_args(str(Path(plan_path).resolve()), steps, out_dir, extra)
    lines.append("    " + " ".join(shlex.quote(a) for a in tail))
    return "\n".join(lines) + "\n"
