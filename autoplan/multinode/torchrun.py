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
from autoplan.trust import check_host
from autoplan.user_files import read_text

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
    #: indices of ``argv`` words holding :data:`HEAD_PLACEHOLDER` (no head node given):
    #: the one place the shell line expands a variable
    expands: frozenset[int] = frozenset()

    @property
    def shell(self) -> str:
        """One line to paste into a shell on the node: every word ``shlex.quote``-d, the
        placeholder (only where this module put it) a fixed double-quoted word."""
        return f"cd {shlex.quote(self.cwd)} && " + " ".join(
            shell_word(a, placeholder=i in self.expands) for i, a in enumerate(self.argv))


def shell_word(arg: str, *, placeholder: bool = False) -> str:
    """``arg`` quoted for a POSIX shell (``shlex.quote``: nothing in it expands). With
    ``placeholder``, the :data:`HEAD_PLACEHOLDER` inside it is left to expand, as the fixed
    word ``"${MASTER_ADDR:?...}"``, and the rest is quoted around it."""
    if not placeholder:
        return shlex.quote(arg)
    before, found, after = arg.partition(HEAD_PLACEHOLDER)
    assert found, "placeholder expected"
    if not any(c in before + after for c in '"$`\\!\n'):   # a word of constants: one quote
        return f'"{arg}"'
    return "".join(p for p in (shlex.quote(before) if before else "", f'"{HEAD_PLACEHOLDER}"',
                               shlex.quote(after) if after else ""))


def repo_root() -> Path:
    """The checkout holding the ``engine`` package (where ``-m engine.run`` resolves): found,
    not imported (the launcher writes commands; it runs none of the engine)."""
    import importlib.util

    found = importlib.util.find_spec("engine")
    if found is None or found.origin is None:
        raise LaunchError("the engine package is not importable from here (install autoplan "
                          "with `pip install -e .` in its checkout)")
    return Path(found.origin).resolve().parent.parent


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
        text = read_text(path)
    except OSError as exc:
        raise LaunchError(f"{path}: cannot read nodes file ({exc.strerror})") from None
    hosts = [line.split("#", 1)[0].strip() for line in text.splitlines()]
    hosts = [h for h in hosts if h]
    bad = [h for h in hosts if any(c.isspace() for c in h)]
    if bad:
        raise LaunchError(f"{path}: one host per line, got {bad[0]!r}")
    for h in hosts:
        try:
            check_host(h, "host")
        except ConfigError:
            raise LaunchError(f"{path}: not a host name or address: {h!r}") from None
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
    for h in hosts or ():
        check_host(h, "host")
    if master_addr is not None:
        check_host(master_addr, "--master-addr")
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
        words = tuple(argv + tail)
        expands = frozenset(j for j in range(len(argv)) if head == HEAD_PLACEHOLDER
                            and HEAD_PLACEHOLDER in argv[j])
        out.append(NodeCommand(i, hosts[i] if hosts else None, words, cwd, expands))
    return out
