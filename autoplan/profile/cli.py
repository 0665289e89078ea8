"""``autoplan profile ...``: the profilers on the command line.

    autoplan profile ops gpt-small --batch-size 1,2,4,8 --tp 1,2,4          # -> profiles/ops/<device>.json
    autoplan profile ops gpt-7.5b --seq-len 2048 --device cuda --dtype bfloat16 --tp 1,2,4,8
    autoplan profile links --nproc 4 --out profiles/links/local-cpu.json --group-sizes 4
    autoplan profile ops gpt-tiny --batch-size 1,2,4,8 --tp 1,2,4 --statistic min --repeats 15

``add_profile_commands(subparsers)`` registers them on the main parser's subparsers; each
sets ``func(args) -> int``. ``links`` starts torchrun for this machine
(``python -m torch.distributed.run --standalone --nproc_per_node=N -m autoplan.profile.links``);
on a multi-node cluster run :mod:`autoplan.profile.links` under your own torchrun.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

from autoplan.errors import ConfigError


def add_profile_commands(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Add ``profile ops`` and ``profile links`` to ``subparsers``; returns ``profile``."""
    p = subparsers.add_parser("profile", help="measure op times and collective timings "
                                              "into profiles/",
                              description=__doc__.split("\n\n")[1],
                              formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(title="what to profile", metavar="KIND")
    p.set_defaults(func=lambda args: _usage(p))

    ops = sub.add_parser("ops", help="time every op of a model forward and backward")
    ops.add_argument("model", help="built-in model or preset (see `autoplan models`), "
                                   "hf:<type>, import:<pkg.module:factory>")
    ops.add_argument("--batch-size", default="1", type=_int_list,
                     help="micro-batch sizes to trace, comma list (default 1)")
    ops.add_argument("--seq-len", type=int, help="sequence length (default: the model's)")
    ops.add_argument("--tp", default="1", type=_int_list,
                     help="tensor-parallel degrees whose shards to time, e.g. 1,2,4")
    ops.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N")
    ops.add_argument("--dtype", default="float32", help="dtype to trace and time in")
    ops.add_argument("--out", type=Path,
                     help="profile file (default profiles/ops/<device name>.json)")
    ops.add_argument("--threads", type=int, default=1,
                     help="CPU threads (default 1, as torchrun gives each rank; 0: torch's "
                          "default)")
    ops.add_argument("--warmup", type=int, default=3)
    ops.add_argument("--repeats", type=int, default=7)
    ops.add_argument("--statistic", choices=("median", "min"), default="median",
                     help="of the repetitions (min: on a machine shared with other work)")
    ops.add_argument("--flush-every", type=int, default=16,
                     help="write to the file after this many signatures (resume point)")
    ops.add_argument("--limit", type=int, help="time at most this many new signatures")
    ops.add_argument("--redo", action="store_true",
                     help="time every signature again, replacing the file's entries")
    ops.add_argument("--force", action="store_true",
                     help="with --redo and no --out: replace entries of the default profile")
    ops.add_argument("--json", action="store_true", help="print the report as JSON")
    ops.set_defaults(func=cmd_profile_ops)

    links = sub.add_parser("links", help="benchmark collectives on this machine (torchrun)")
    links.add_argument("--nproc", type=int, default=2, help="processes (ranks) to start")
    links.add_argument("--out", type=Path,
                       help="link profile (default profiles/links/local-<cpu|cuda>.json)")
    links.add_argument("--device", choices=("cpu", "cuda"))
    links.add_argument("--max-bytes", help="largest message, e.g. 32M (default 32M CPU, "
                                           "512M CUDA)")
    links.add_argument("--time-budget", type=float, help="seconds for the run (default 90)")
    links.add_argument("--group-sizes", help="comma list (default: powers of two that fit)")
    links.add_argument("--collectives", help="comma list (default: all five)")
    links.add_argument("--repeats", type=int, help="repetitions per point (default 9)")
    links.add_argument("--statistic", choices=("median", "min"),
                       help="of the repetitions (default median; min on a shared machine)")
    links.add_argument("--force", action="store_true",
                       help="replace the default profile when it exists (no --out)")
    links.set_defaults(func=cmd_profile_links)
    return p


def _usage(p: argparse.ArgumentParser) -> int:
    p.print_help()
    return 2


def _int_list(text: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a comma list of integers, got {text!r}")
    if not values or any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return values


def _profiles_root() -> Path:
    from autoplan.yaml_files import profiles_root

    return profiles_root()


def cmd_profile_ops(args: argparse.Namespace) -> int:
    import itertools

    import torch

    from autoplan.models.registry import resolve
    from autoplan.profile.ops import profile_ops
    from autoplan.profile.store import device_slug
    from autoplan.profile.timing import TimingConfig
    from autoplan.trace.replicate import trace_replicated as trace

    dtype = getattr(torch, args.dtype, None)
    if not isinstance(dtype, torch.dtype):
        raise ConfigError(f"unknown dtype {args.dtype!r}", field="--dtype")
    try:
        device = torch.device(args.device)
    except RuntimeError:
        raise ConfigError(f"not a device: {args.device!r}", field="--device") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError("CUDA is not available on this machine", field="--device")
    spec = resolve(args.model)
    out = args.out or _profiles_root() / "ops" / f"{device_slug(args.device)}.json"
    if args.redo and args.out is None:
        refuse_overwrite(out, force=args.force)
    graphs = [trace(spec, b, args.seq_len, dtype=dtype) for b in args.batch_size]
    report = profile_ops(itertools.chain.from_iterable(graphs), out, tp_degrees=args.tp,
                         device=args.device,
                         timing=TimingConfig(warmup=args.warmup, repeats=args.repeats,
                                             statistic=args.statistic),
                         threads=args.threads or None, flush_every=args.flush_every,
                         max_new=args.limit, progress=not args.json, redo=args.redo)
    summary = {"file": str(report.path), "device": report.device,
               "signatures": report.signatures, "measured": report.measured,
               "already_there": report.skipped, "failed": report.failed,
               "seconds": round(report.seconds, 1), "complete": report.complete}
    if args.json:
        print(json.dumps(summary, indent=2, sort_keys=True))
        return 0
    print(f"{report.path}: {report.signatures} signatures, {report.measured} timed now, "
          f"{report.skipped} already there, {len(report.failed)} not timeable "
          f"({report.seconds:.0f} s){'' if report.complete else '; incomplete: run again'}")
    for key, why in report.failed.items():
        print(f"  not timed: {key}: {why}")
    return 0


def links_command(args: argparse.Namespace) -> list[str]:
    """The torchrun command line ``profile links`` runs."""
    device = args.device or ("cuda" if _cuda_available() else "cpu")
    out = args.out or _profiles_root() / "links" / f"local-{device}.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc_per_node={args.nproc}", "-m", "autoplan.profile.links",
           "--out", str(out), "--device", device]
    for flag, value in (("--max-bytes", args.max_bytes), ("--time-budget", args.time_budget),
                        ("--group-sizes", args.group_sizes),
                        ("--collectives", args.collectives), ("--repeats", args.repeats),
                        ("--statistic", args.statistic)):
        if value is not None:
            cmd += [flag, str(value)]
    return cmd


def refuse_overwrite(path: Path, *, force: bool) -> None:
    """A profile at its default place (shipped with autoplan, or measured before) is replaced
    only when the user says so: ``--force``, or ``--out`` naming a file."""
    if path.exists() and not force:
        raise ConfigError(f"{path} exists (a shipped or earlier profile); pass --force to "
                          "replace it, or --out FILE to write elsewhere", field="--out")


def cmd_profile_links(args: argparse.Namespace) -> int:
    if args.nproc < 2:
        raise ConfigError(f"need at least 2 processes, got {args.nproc}", field="--nproc")
    if args.out is None:
        device = args.device or ("cuda" if _cuda_available() else "cpu")
        refuse_overwrite(_profiles_root() / "links" / f"local-{device}.json",
                         force=getattr(args, "force", False))
    cmd = links_command(args)
    print("running: " + " ".join(cmd), file=sys.stderr)
    return subprocess.call(cmd)


def _cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()
