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

Before any collective every rank checks the options (:mod:`engine.preflight`) and the plan
against the launch — world size, device type, model fingerprint, what the engine supports
(:mod:`engine.validate`) — and exits with status 2 and one ``error:`` line if they disagree.
Global rank 0 then locks ``--out`` for the run (:mod:`engine.rundir`) and copies the plan
into it as ``plan.json``. A rank that fails
later records its error first (:mod:`engine.rank_errors`): the first failing rank prints
``error: rank R: ...`` once, and the collective failures it causes elsewhere stay quiet. A
collective that fails (a dead rank, or one stuck past ``--timeout-s``) ends the run with
status 3. A plan whose model is ``import:`` code needs ``--trust-model-code`` (or
``AUTOPLAN_TRUST_MODEL_CODE=1``, which ``autoplan run --trust-model-code`` passes on): plans
are data. Outputs in ``--out``: ``metrics.jsonl`` (per step), ``summary.json`` and a printed
table (measured vs predicted), ``checkpoints/``.
"""

from __future__ import annotations

import argparse
import gc
import os
import socket
import sys
import time
import traceback
from dataclasses import MISSING, fields
from typing import Any, Callable, NoReturn, Sequence

from autoplan.errors import AutoplanError
from autoplan.plan import Plan
from engine.config import RunConfig


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m engine.run",
                                     description="Run an autoplan plan under torchrun.")
    parser.add_argument("plan", help="plan JSON file (--trust-model-code, anywhere: let its "
                                     "import: model be imported; plans are data)")
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


#: seconds a rank other than local rank 0 waits before exiting on an error every rank finds
#: before the ranks have started together (:func:`_report`)
QUIET_RANK_GRACE_S = 20.0


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


class _Phase:
    """Whether the ranks have started together (errors after it are per rank)."""
    started = False


def execute(plan: Plan, source: str, cfg: RunConfig, phase: _Phase | None = None
            ) -> dict[str, Any] | None:
    """Check, build the mesh, lock ``--out``, train; the process group is created if needed
    (and kept, so one launch may run several plans of the same world size in turn)."""
    import torch.distributed as dist

    from engine.mesh import init_distributed
    from engine.preflight import check_plan_common, check_run_options
    from engine.runtime import check_all

    check_run_options(cfg)
    spec = check_all(plan, source, world_size=int(os.environ["WORLD_SIZE"]),
                     local_world_size=int(os.environ.get("LOCAL_WORLD_SIZE",
                                                         os.environ["WORLD_SIZE"])))
    check_plan_common(plan, spec, source)
    device = init_distributed(plan.mesh.device_type, cfg.timeout_s)
    if phase is not None:
        phase.started = True
    lock = _lock_out_dir(cfg, plan, dist)
    try:
        return make_trainer(plan, spec, cfg, device, source=source).run()
    finally:
        if lock is not None:
            lock.close()


def _lock_out_dir(cfg: RunConfig, plan: Plan, dist):
    """Global rank 0 checks and locks ``--out``; every rank gets its verdict (one
    broadcast), so a refused run fails on every rank with the same message."""
    from engine.preflight import SPARE_BYTES, check_out_dir, checkpoint_bytes
    from engine.rundir import hold

    lock, verdict = None, [None]
    if dist.get_rank() == 0:
        try:
            need = SPARE_BYTES + (checkpoint_bytes(plan.num_params)
                                  if cfg.checkpoint_every else 0)
            out = check_out_dir(cfg.out_dir, need_bytes=need)
            lock = hold(out)
            # the run directory holds its own copy of the plan it ran (autoplan.calibrate)
            plan.save(out / "plan.json")
        except AutoplanError as exc:
            verdict[0] = str(exc)
    if dist.get_world_size() > 1:
        dist.broadcast_object_list(verdict, src=0)
    if verdict[0] is not None:
        raise AutoplanError(verdict[0])
    return lock


def _is_collective_failure(exc: BaseException) -> bool:
    import torch.distributed as dist

    if isinstance(exc, dist.DistError):
        return True
    text = str(exc)
    return isinstance(exc, RuntimeError) and any(
        marker in text for marker in ("gloo", "NCCL", "Connection closed by peer",
                                      "Timed out", "timed out"))


#: The caching allocator's settings a rank runs with unless the user set their own:
#: expandable segments grow one mapping in place instead of cutting fixed cudaMalloc
#: segments, so freed activation blocks merge with their neighbours (torch.cuda memory
#: management notes, "expandable_segments"; torchtitan's launcher sets the same). The
#: allocator reserve the cost model adds (:data:`autoplan.cost.memory.FRAGMENTATION`)
#: assumes it. Read by the allocator on first CUDA use, so set before anything touches it.
ALLOCATOR_SETTINGS = "expandable_segments:True"


def _allocator_settings() -> None:
    if not any(k in os.environ for k in ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF")):
        os.environ["PYTORCH_ALLOC_CONF"] = ALLOCATOR_SETTINGS


def main(argv: Sequence[str] | None = None) -> int:
    from autoplan.trust import take_trust_flag, trusting

    _allocator_settings()

    argv, trust = take_trust_flag(sys.argv[1:] if argv is None else argv)
    args = vars(build_parser().parse_args(argv))
    with trusting(trust):
        return _main(args)


def _report(cfg: RunConfig | None, phase: _Phase, message: str, *, collective: bool) -> None:
    """Print ``message`` once for the run (module docstring; engine.rank_errors)."""
    from engine.rank_errors import errors_dir, record

    rank = os.environ.get("RANK", "0")
    if not phase.started or cfg is None:      # the same on every rank: local rank 0 says it
        if _local_rank0():
            print(f"error: {message}", file=sys.stderr, flush=True)
        else:
            # ... so the others give it time to: torchrun ends every rank once one exits,
            # and a rank that failed the same check first (rank 0 starting later, on a
            # loaded machine) had local rank 0 killed before it printed (the user saw only
            # torchrun's summary). torchrun ends this wait as soon as local rank 0 exits.
            time.sleep(QUIET_RANK_GRACE_S)
        return
    if record(errors_dir(cfg.out_dir), int(rank), message, collective=collective):
        print(f"error: rank {rank}: {message}", file=sys.stderr, flush=True)


def _main(args: dict[str, Any]) -> int:
    source = args.pop("plan")
    import torch.distributed as dist

    cfg, phase = None, _Phase()
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
        execute(plan, source, cfg, phase)
        return 0
    except AutoplanError as exc:
        _report(cfg, phase, str(exc), collective=False)
        return 2
    except Exception as exc:       # noqa: BLE001 - only collective failures are reworded
        if not _is_collective_failure(exc):
            if phase.started and cfg is not None:     # recorded as this rank's own failure
                from engine.rank_errors import errors_dir, record

                record(errors_dir(cfg.out_dir), int(os.environ.get("RANK", "0")),
                       f"{type(exc).__name__}: {exc}"[:1000], collective=False)
            raise
        _report(cfg, phase, f"a collective failed ({type(exc).__name__}: "
                f"{(str(exc).splitlines() or [''])[0][:300]}); another rank died or stalled "
                "past the timeout (--timeout-s)", collective=True)
        return 3
    finally:
        if dist.is_available() and dist.is_initialized():
            gc.collect()         # drop module/DTensor cycles that still hold the groups' work
            dist.destroy_process_group()


def run_and_exit(run: Callable[[], int]) -> NoReturn:
    """Run ``run`` and end the process with its status, skipping interpreter finalization.

    Everything the run writes is closed and renamed into place before ``main`` returns
    (``engine.io.atomic_write_text``, the checkpointer), and the process groups are
    destroyed in ``_main``. What is left at that point are C++ static and thread-pool
    destructors (gloo's transport threads among them) that can race the interpreter's
    teardown and abort a finished rank with SIGABRT ("terminate called without an active
    exception"; pytorch/pytorch#179291 and #190489 discuss the class). torchrun then kills
    its peers and the whole run reads as failed. ``os._exit`` after flushing skips that
    teardown; the exit status and the output are the same.
    """
    try:
        code = run()
    except SystemExit as exc:             # argparse: --help (0), a usage error (2)
        code = exc.code if isinstance(exc.code, int) else (exc.code is not None)
        if isinstance(exc.code, str):
            print(exc.code, file=sys.stderr)
    except BaseException:                 # noqa: BLE001 - reported as the interpreter would
        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(int(code))


if __name__ == "__main__":
    run_and_exit(main)
