"""``autoplan run plan.json [--steps N] [--out DIR] [-- ENGINE ARGS]``: a plan on this
machine under torchrun (:func:`engine.launch.run_local`), its host load recorded beside the
run's metrics.

``run``'s own options may come before or after the plan; the engine's own arguments follow
``--``. (argparse hands everything after the positional plan to the engine's remainder and
drops a ``--`` that starts it, so the split is made before parsing, :func:`split_engine_args`,
and ``run``'s options are taken back from the rest, :func:`run_options`.)
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Sequence


def split_engine_args(argv: Sequence[str]) -> tuple[list[str], list[str] | None]:
    """(the arguments argparse parses, the engine's after ``--`` or None) of ``argv``."""
    argv = list(argv)
    if argv[:1] == ["run"] and "--" in argv:
        cut = argv.index("--")
        return argv[:cut], argv[cut + 1:]
    return argv, None


def run_options(args: argparse.Namespace) -> list[str]:
    """The engine's arguments of ``autoplan run``, after taking back ``run``'s own options
    written after the plan (``autoplan run plan.json --steps 5 --out d``: argparse hands
    everything after the positional plan to the engine's remainder; the engine's own
    arguments follow ``--``)."""
    rest = list(args.engine_args)
    cut = rest.index("--") if "--" in rest else len(rest)
    own = argparse.ArgumentParser(prog="autoplan run", add_help=False)
    own.add_argument("--steps", type=int)
    own.add_argument("--out")
    known, unknown = own.parse_known_args(rest[:cut])
    if known.steps is not None:
        args.steps = known.steps
    if known.out is not None:
        args.out = known.out
    return unknown + rest[cut + 1:]


def cmd_run(args: argparse.Namespace) -> int:
    from autoplan import hostload
    from engine.launch import run_local

    extra = run_options(args)
    out = Path(args.out) if args.out else Path("runs") / Path(args.plan).stem
    status, load = hostload.measured_run(out, lambda: run_local(
        args.plan, steps=args.steps, out_dir=out, extra_args=extra))
    if status == 0:
        ranks = None
        if (out / "summary.json").is_file():
            ranks = json.loads((out / "summary.json").read_text()).get("world_size")
        print(hostload.describe(load, ranks), flush=True)
        print(f"run directory: {out} (metrics.jsonl, summary.json, {hostload.FILE})", flush=True)
    return status


