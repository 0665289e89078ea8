"""The torchrun command each node of a plan's cluster runs.

Every node starts ``nproc_per_node = devices_per_node`` ranks of ``-m engine.run PLAN``:

* rendezvous ``c10d`` (default; torchrun's elastic rendezvous, hosted on the head node)::

      torchrun --nnodes=N --nproc_per_node=G --rdzv-backend=c10d \\
          --rdzv-endpoint=HEAD:29500 --rdzv-id=ID -m engine.run PLAN

  the same command on every node; torchrun numbers the nodes as they join. The plan's
  layout only needs each node's ranks to be consecutive (tensor parallelism stays inside a
  node), which torchrun guarantees.
* rendezvous ``static``: ``--node_rank=i --master_addr=HEAD --master_port=29500``, one
  command per node, node 0 on the head.

The plan must be readable at the same path on every node (a shared file system), and the
commands run from the autoplan checkout (``engine`` importable).
"""

from __future__ import annotations

import os
import shlex
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from autoplan.errors import AutoplanError, ConfigError
from autoplan.plan import Plan

DEFAULT_PORT = 29500
HEAD_PLACEHOLDER = "${MASTER_ADDR:?set MASTER_ADDR to the head node address}"
RENDEZVOUS = ("c10d", "static")


class LaunchError(AutoplanError):
    """The plan cannot be launched as asked (hosts, cluster shape); the message says why."""


@dataclass(frozen=True)
class NodeCommand:
    node_rank: int
    host: str | None                   # from the nodes file, if any
    argv: tuple[str, ...]              # torchrun and its arguments
    cwd: str                           # where to run it

    @property
    def shell(self) -> str:
        """One line to paste into a shell on the node."""
        return f"cd {shlex.quote(self.cwd)} && " + " ".join(shell_word(a) for a in self.argv)


def shell_word(arg: str) -> str:
    """``arg`` quoted for a POSIX shell; double quotes when it expands a variable."""
    return f'"{arg}"' if "${" in arg else shlex.quote(arg)


def repo_root() -> Path:
    """The checkout holding the ``engine`` package (where ``-m engine.run`` resolves)."""
    import engine

    return Path(engine.__file__).resolve().parent.parent


def cluster_shape(plan: Plan) -> tuple[int, int]:
    """(nodes, devices per node) of the plan's cluster; LaunchError if the plan's world size
    is not all of it."""
    nodes = int(plan.cluster.get("nodes", 1))
    per_node = int(plan.cluster.get("devices_per_node", plan.world_size))
    if nodes * per_node != plan.world_size:
        raise LaunchError(f"the plan uses {plan.world_size} ranks but its cluster has {nodes} "
                          f"x {per_node} = {nodes * per_node} devices; launch needs whole nodes")
    return nodes, per_node


def read_hosts(path: str | os.PathLike, nodes: int) -> tuple[list[str], list[str]]:
    """(the first ``nodes`` hosts of a nodes file, notes). One host per line; blank lines and
    '#' comments are skipped; LaunchError if there are fewer than ``nodes``."""
    try:
        text = Path(path).read_text()
    except OSError as exc:
        raise LaunchError(f"{path}: cannot read nodes file ({exc.strerror})") from None
    hosts = [line.split("#", 1)[0].strip() for line in text.splitlines()]
    hosts = [h for h in hosts if h]
    bad = [h for h in hosts if any(c.isspace() for c in h)]
    if bad:
        raise LaunchError(f"{path}: one host per line, got {bad[0]!r}")
    if len(hosts) < nodes:
        raise LaunchError(f"{path}: {len(hosts)} host(s) for a plan of {nodes} nodes")
    notes = []
    if len(hosts) > nodes:
        notes.append(f"{path} lists {len(hosts)} hosts; using the first {nodes}")
    return hosts[:nodes], notes


def engine_args(plan_path: str, steps: int | None, out_dir: str | None,
                extra: Sequence[str] = ()) -> list[str]:
    args = ["-m", "engine.run", plan_path]
    if steps is not None:
        args += ["--steps", str(steps)]
    if out_dir is not None:
        args += ["--out", out_dir]
    return args + list(extra)


def node_commands(plan: Plan, plan_path: str | os.PathLike, *,
                  hosts: Sequence[str] | None = None, master_addr: str | None = None,
                  port: int = DEFAULT_PORT, rdzv: str = "c10d", rdzv_id: str | None = None,
                  steps: int | None = None, out_dir: str | None = None,
                  workdir: str | os.PathLike | None = None,
                  extra: Sequence[str] = ()) -> list[NodeCommand]:
    """One torchrun command per node (see the module docstring)."""
    if rdzv not in RENDEZVOUS:
        raise ConfigError(f"must be one of {RENDEZVOUS}, got {rdzv!r}", field="--rdzv")
    if not 0 < port < 65536:
        raise ConfigError(f"must be a TCP port (1-65535), got {port}", field="--port")
    nodes, per_node = cluster_shape(plan)
    if hosts is not None and len(hosts) != nodes:
        raise LaunchError(f"{len(hosts)} host(s) for a plan of {nodes} nodes")
    head = hosts[0] if hosts else (master_addr or HEAD_PLACEHOLDER)
    rid = rdzv_id or f"autoplan-{plan.model_fingerprint[:8]}"
    tail = engine_args(str(Path(plan_path).resolve()), steps, out_dir, extra)
    cwd = str(Path(workdir).resolve() if workdir else repo_root())
    out = []
    for i in range(nodes):
        argv = ["torchrun", f"--nnodes={nodes}", f"--nproc_per_node={per_node}"]
        if rdzv == "c10d":
            argv += ["--rdzv-backend=c10d", f"--rdzv-endpoint={head}:{port}",
                     f"--rdzv-id={rid}"]
        else:
            argv += [f"--node_rank={i}", f"--master_addr={head}", f"--master_port={port}"]
        out.append(NodeCommand(i, hosts[i] if hosts else None, tuple(argv + tail), cwd))
    return out
