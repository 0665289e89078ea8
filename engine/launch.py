"""Start the engine on this machine: what ``autoplan run PLAN`` calls.

:func:`run_local` checks everything first, no process started (:mod:`engine.preflight`:
the run options, the output directory — creatable, writable, free space for a checkpoint,
not in use by another run — and the plan against the launch: world size, device type, model
fingerprint, engine support), so a mistake is one ``error:`` line instead of torchrun's
failure report, then runs::

    python -m torch.distributed.run --standalone --nproc_per_node=N -m engine.run PLAN ...

and returns its exit status. When the run fails, the first failing rank's own error
(:mod:`engine.rank_errors`) is the last line printed. Multi-node runs use torchrun directly
(see :mod:`engine.run`).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Sequence

from autoplan.errors import AutoplanError
from autoplan.plan import Plan

_REPO = Path(__file__).resolve().parent.parent


def torchrun_command(plan_path: str | os.PathLike, *, nproc: int,
                     steps: int | None = None, out_dir: str | os.PathLike | None = None,
                     extra_args: Sequence[str] = ()) -> list[str]:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc_per_node={nproc}", "-m", "engine.run", str(plan_path)]
    if steps is not None:
        cmd += ["--steps", str(steps)]
    if out_dir is not None:
        cmd += ["--out", str(out_dir)]
    return cmd + list(extra_args)


def run_local(plan_path: str | os.PathLike, *, nproc: int | None = None,
              steps: int | None = None, out_dir: str | os.PathLike | None = None,
              extra_args: Sequence[str] = (), env: dict[str, str] | None = None) -> int:
    """Run ``plan_path`` with ``nproc`` local ranks (default: the plan's world size).

    Returns the exit status: 0 on success, 2 when the plan does not fit this launch (the
    reason printed as ``error: ...``), torchrun's status otherwise.
    """
    import tempfile

    from engine.preflight import preflight, pricing_gaps
    from engine.rank_errors import ENV, earliest

    try:
        cfg = _run_config(steps, out_dir, extra_args)
        plan = Plan.load(plan_path)
        nproc = plan.world_size if nproc is None else nproc
        preflight(plan, str(plan_path), cfg, world_size=nproc)
    except AutoplanError as exc:
        print(f"error: {exc}", file=sys.stderr, flush=True)
        return 2
    for gap in pricing_gaps(plan):
        print(f"note: {gap}: expect the measured step to differ from the prediction",
              flush=True)
    run_env = dict(os.environ if env is None else env)
    # a fresh rendezvous store per attempt (engine.run's docstring; pytorch/pytorch#135712)
    run_env.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    run_env["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(_REPO), run_env.get("PYTHONPATH", "")) if p)
    cmd = torchrun_command(plan_path, nproc=nproc, steps=steps, out_dir=out_dir,
                           extra_args=extra_args)
    with tempfile.TemporaryDirectory(prefix="autoplan-rank-errors-") as errors:
        run_env[ENV] = errors
        code = subprocess.run(cmd, env=run_env).returncode
        first = earliest(Path(errors)) if code else None
    if first is not None:
        print(f"error: rank {first['rank']} failed first: {first['message']}",
              file=sys.stderr, flush=True)
    return code


def _run_config(steps: int | None, out_dir: str | os.PathLike | None,
                extra_args: Sequence[str]):
    """The RunConfig the ranks will parse from this command line (so its options are
    checked here, before torchrun starts)."""
    from engine.config import RunConfig
    from engine.run import build_parser

    from autoplan.trust import take_trust_flag

    argv = ["<plan>"] + (["--steps", str(steps)] if steps is not None else []) \
        + (["--out", str(out_dir)] if out_dir is not None else []) \
        + take_trust_flag(extra_args)[0]
    try:
        args = vars(build_parser().parse_args(argv))
    except SystemExit:
        raise AutoplanError(f"engine options {list(extra_args)} are not valid (see "
                            "python -m engine.run --help)") from None
    args.pop("plan")
    return RunConfig.from_dict(args)
