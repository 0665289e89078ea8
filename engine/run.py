"""Run a plan: ``python -m engine.run PLAN`` under torchrun, one process per device.

Launch commands::

    # one node, N ranks (N = the plan's world size; CPU plans: gloo, GPU plans: one rank
    # per GPU with NCCL)
    torchrun --standalone --nproc_per_node=N -m engine.run plans/x.json --steps 50 --out runs/x

    # M nodes of N ranks: the same command on every node, with torchrun's rendezvous
    torchrun --nnodes=M --nproc_per_node=N --rdzv-backend=c10d \\
        --rdzv-endpoint=HOST:29500 --rdzv-id=JOB -m engine.run plans/x.json --out /shared/runs/x

    # from Python or the CLI (this machine): checks the plan first, then starts torchrun
    autoplan run plans/x.json --steps 50 --out runs/x          # engine.launch.run_local

    # resume the newest checkpoint in --out (checkpoints every K steps with --checkpoint-every)
    torchrun --standalone --nproc_per_node=N -m engine.run plans/x.json --out runs/x --resume

    # relaunch dead ranks and resume: each attempt needs a fresh rendezvous store (since
    # torch 2.5 the agent reuses one across attempts, and a relaunched rank can read its dead
    # predecessor's address: pytorch/pytorch#135712)
    TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 torchrun --standalone --nproc_per_node=N \
        --max-restarts=1 -m engine.run plans/x.json --out runs/x --checkpoint-every 5 --resume

    # a world-size-1 plan also runs without torchrun: python -m engine.run plans/one.json

Options are the fields of :class:`engine.config.RunConfig` (``--steps``, ``--lr``,
``--data PATH``, ``--checkpoint-every K``, ``--timeout-s``, ...; ``--help`` lists them).
``--fault``/``--fault-step``/``--fault-rank`` and ``--kill-after-step`` inject faults for the
tests only. With ``torchrun --max-restarts=R ... --resume`` a run whose rank dies is relaunched
and goes on from the newest complete checkpoint (a fresh start when there is none).

Before any collective every rank checks the plan against the launch — world size, device
type, model fingerprint, what the engine supports (:mod:`engine.validate`) — and exits with
status 2 and one ``error:`` line if they disagree. A collective that fails (a dead rank, or
one stuck past ``--timeout-s``) ends the run with status 3. Outputs in ``--out``:
``metrics.jsonl`` (per step), ``summary.json`` and a printed table (measured vs predicted),
``checkpoints/``.
"""

from __future__ import annotations

import argparse
import os
import socket
import sys
from dataclasses import MISSING, fields
from typing import Any, Sequence

from autoplan.errors import AutoplanError
from autoplan.plan import Plan
from engine.config import RunConfig


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m engine.run",
                                     description="Run an autoplan plan under torchrun.")
    parser.add_argument("plan", help="plan JSON file")
    for f in fields(RunConfig):
        flag = "--" + f.name.replace("_", "-")
        names = [flag, "--out"] if f.name == "out_dir" else [flag]
        default = f.default if f.default is not MISSING else None
        if isinstance(default, bool):
            parser.add_argument(*names, dest=f.name, action="store_true",
                                help=f"(default: {default})")
        else:
            parser.add_argument(*names, dest=f.name, type=type(default), default=default,
                                help=f"(default: {default})")
    return parser


def _local_rank0() -> bool:
    return os.environ.get("LOCAL_RANK", "0") == "0"


def _single_process_env() -> None:
    """Let a 1-rank plan run without torchrun (``python -m engine.run``)."""
    if "WORLD_SIZE" in os.environ:
        return
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1",
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))


def make_trainer(plan: Plan, spec, cfg: RunConfig, device, *, source: str):
    """The trainer for ``plan`` on this rank (collective: builds the meshes), from the
    runtime :func:`engine.runtime.select` picks."""
    from engine.runtime import make_trainer as runtime_trainer

    return runtime_trainer(plan, spec, cfg, device, source=source)


def execute(plan: Plan, source: str, cfg: RunConfig) -> dict[str, Any] | None:
    """Check, build the mesh, train; the process group is created if needed (and kept, so
    one launch may run several plans of the same world size in turn)."""
    from engine.mesh import init_distributed
    from engine.validate import check_all

    spec = check_all(plan, source, world_size=int(os.environ["WORLD_SIZE"]),
                     local_world_size=int(os.environ.get("LOCAL_WORLD_SIZE",
                                                         os.environ["WORLD_SIZE"])))
    device = init_distributed(plan.mesh.device_type, cfg.timeout_s)
    return make_trainer(plan, spec, cfg, device, source=source).run()


def _is_collective_failure(exc: BaseException) -> bool:
    import torch.distributed as dist

    if isinstance(exc, dist.DistError):
        return True
    text = str(exc)
    return isinstance(exc, RuntimeError) and any(
        marker in text for marker in ("gloo", "NCCL", "Connection closed by peer",
                                      "Timed out", "timed out"))


def main(argv: Sequence[str] | None = None) -> int:
    args = vars(build_parser().parse_args(argv))
    source = args.pop("plan")
    import torch.distributed as dist

    try:
        cfg = RunConfig.from_dict(args)
        plan = Plan.load(source)
        if plan.world_size == 1:
            _single_process_env()
        if "WORLD_SIZE" not in os.environ:
            from engine.validate import mesh_label

            raise AutoplanError(f"plan {source} needs {plan.world_size} ranks (mesh "
                                f"{mesh_label(plan)}); launch with torchrun --standalone "
                                f"--nproc_per_node={plan.world_size} -m engine.run {source}")
        execute(plan, source, cfg)
        return 0
    except AutoplanError as exc:
        if _local_rank0():
            print(f"error: {exc}", file=sys.stderr, flush=True)
        return 2
    except Exception as exc:       # noqa: BLE001 - only collective failures are reworded
        if not _is_collective_failure(exc):
            raise
        rank = os.environ.get("RANK", "?")
        print(f"error: rank {rank}: a collective failed ({type(exc).__name__}: "
              f"{str(exc).splitlines()[0][:300]}); another rank died or stalled past the "
              "timeout (--timeout-s)", file=sys.stderr, flush=True)
        return 3
    finally:
        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
