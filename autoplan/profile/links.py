"""Collective benchmark, nccl-tests style, under torchrun; results into a link profile.

    # this machine, gloo over loopback (about a minute each):
    torchrun --standalone --nproc_per_node=2 -m autoplan.profile.links --out profiles/links/local-cpu.json
    torchrun --standalone --nproc_per_node=4 -m autoplan.profile.links --out profiles/links/local-cpu.json --group-sizes 4
    # a GPU cluster (NCCL), 2 nodes of 8:
    torchrun --nnodes=2 --nproc_per_node=8 --rdzv-endpoint=HOST:29500 -m autoplan.profile.links \\
        --out profiles/links/mycluster.json --max-bytes 512M

or ``autoplan profile links --nproc 4``. The same code runs gloo on CPU and NCCL on CUDA
(``--device``; default CUDA when present).

What is measured: all-reduce, all-gather, reduce-scatter, all-to-all and send/recv (each
rank sends to the next in its group and receives from the previous one at the same time),
for message sizes from ``--min-bytes`` to ``--max-bytes`` (×``--step``), for groups of each
size at each link level:

* ``intra``: the first ``n`` ranks of the first node (``n`` up to the ranks per node);
* ``inter``: one rank per node for ``n`` up to the number of nodes, whole nodes beyond.

Nodes are told apart by hostname and torchrun's ``GROUP_RANK``; on one machine only the
intra level exists, and the file says so. Sizes follow nccl-tests: ``bytes`` is the whole
buffer (all-gather: the gathered output; reduce-scatter: the input; all-to-all: one rank's
buffer). Each point is the median over ``--repeats`` repetitions of the per-call time, each
repetition the slowest rank's (``all_reduce(MAX)``), after warm-up, the repetitions of all
sizes interleaved; algbw = bytes / time, busbw = algbw · factor (:mod:`autoplan.profile.fit`).
``--statistic min`` takes the fastest repetition instead: on a machine shared with other
work, contention only ever adds time, so the minimum is the reproducible figure of the link
itself (the median of a loaded 2-core machine moved by 2x between runs; the minimum by
~20%). Both are stored with every point.
``--time-budget`` bounds the whole run: each (group, collective) gets an equal share and
drops the sizes that would overrun it.

The allocator on CPU: gloo allocates a temporary buffer of the full message for every
all-gather / reduce-scatter call, and glibc serves large allocations with a fresh ``mmap``
(above a threshold that adapts between 128 KiB and 32 MiB) and returns freed heap tops to
the kernel, so such calls page-fault their buffers in again and again: measured here, a
2-rank all-gather of 32 MiB took 1.35 ms/MB against 0.45 ms/MB at 4-16 MiB. That cliff is
the process's allocator, not the link, and no alpha-beta model follows it. So on CPU the
benchmark first sets glibc's mmap and trim thresholds to 1 GiB (``mallopt``; recorded in
the provenance as ``malloc``), after which 32 MiB costs 0.52-0.56 ms/MB; ``--keep-malloc``
leaves them alone. A training job on CPU can do the same (or set ``MALLOC_MMAP_THRESHOLD_``
and ``MALLOC_TRIM_THRESHOLD_`` in its environment).

Rank 0 merges the points into ``--out`` (replacing earlier points of the same collective,
level and group size), refits alpha-beta for every (collective, level) and group size, and
writes the file atomically under its lock.
"""

from __future__ import annotations

import argparse
import ctypes
import math
import os
import socket
import statistics
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist

from autoplan.profile.fit import bus_factor
from autoplan.profile.store import (COLLECTIVES, LinkPoint, LinkProfile, ProfileError,
                                    fit_link_points, measured_provenance, source_id,
                                    update_link_profile)
from autoplan.profile.timing import time_block

KiB, MiB = 1 << 10, 1 << 20
CPU_MAX_BYTES = 32 * MiB
#: glibc mallopt parameters (malloc.h) and the value the CPU benchmark sets them to.
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
MALLOC_THRESHOLD = 1 << 30


@dataclass(frozen=True, kw_only=True)
class BenchConfig:
    out: Path
    cluster: str
    collectives: tuple[str, ...] = COLLECTIVES
    min_bytes: int = 8
    max_bytes: int = 32 * MiB
    step: int = 2
    time_budget_s: float = 90.0
    group_sizes: tuple[int, ...] | None = None     # None: powers of two up to what fits
    levels: tuple[str, ...] = ("intra", "inter")
    dtype: str = "float32"
    device: str = "cpu"
    warmup: int = 2
    repeats: int = 9
    min_rep_s: float = 5e-3
    statistic: str = "median"                       # or "min" (module docstring)
    malloc: str = "default"                         # what tune_malloc() did


@dataclass(frozen=True)
class Group:
    level: str
    ranks: tuple[int, ...]
    handle: Any              # the ProcessGroup (None on ranks outside it)


def message_sizes(cfg: BenchConfig) -> list[int]:
    """min_bytes, min_bytes·step, ... up to max_bytes."""
    if cfg.min_bytes < 1 or cfg.max_bytes < cfg.min_bytes or cfg.step < 2:
        raise ProfileError(f"need 1 <= min_bytes <= max_bytes and step >= 2, got "
                           f"{cfg.min_bytes}, {cfg.max_bytes}, {cfg.step}", field="--min-bytes")
    out, size = [], cfg.min_bytes
    while size <= cfg.max_bytes:
        out.append(size)
        size *= cfg.step
    return out


def node_of_ranks() -> list[int]:
    """Node index of every rank, from (hostname, GROUP_RANK), numbered by first rank."""
    mine = (socket.gethostname(), os.environ.get("GROUP_RANK", "0"))
    every: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    ids: dict[Any, int] = {}
    return [ids.setdefault(tuple(e), len(ids)) for e in every]


def plan_groups(nodes: list[int], cfg: BenchConfig) -> list[tuple[str, tuple[int, ...]]]:
    """(level, ranks) of every group to benchmark (module docstring)."""
    by_node: dict[int, list[int]] = {}
    for rank, node in enumerate(nodes):
        by_node.setdefault(node, []).append(rank)
    first = by_node[0]
    world = len(nodes)
    n_nodes = len(by_node)
    pow2 = [1 << k for k in range(1, int(math.log2(world)) + 1)] if world > 1 else []
    wanted = cfg.group_sizes or tuple(pow2)
    out: list[tuple[str, tuple[int, ...]]] = []
    if "intra" in cfg.levels:
        out += [("intra", tuple(first[:n])) for n in wanted if 2 <= n <= len(first)]
    if "inter" in cfg.levels and n_nodes > 1:
        per_node = min(len(r) for r in by_node.values())
        for n in wanted:
            if 2 <= n <= n_nodes:
                out.append(("inter", tuple(by_node[i][0] for i in range(n))))
            elif n > n_nodes and n % n_nodes == 0 and n // n_nodes <= per_node:
                k = n // n_nodes
                out.append(("inter", tuple(r for i in range(n_nodes) for r in by_node[i][:k])))
    return out


def run(cfg: BenchConfig) -> list[dict[str, Any]]:
    """Benchmark on an initialised process group; every rank returns rank 0's points."""
    device = torch.device(cfg.device)
    load_start = [round(x, 2) for x in os.getloadavg()]
    nodes = node_of_ranks()
    groups = [Group(level, ranks, dist.new_group(list(ranks)))
              for level, ranks in plan_groups(nodes, cfg)]
    sizes = message_sizes(cfg)
    blocks = [(g, c) for g in groups for c in cfg.collectives]
    share = cfg.time_budget_s / max(1, len(blocks))
    rank = dist.get_rank()
    points: list[dict[str, Any]] = []
    for group, collective in blocks:
        if rank in group.ranks:
            points += _bench_block(group, collective, sizes, share, cfg, device)
        dist.barrier()
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, points)
    merged = [p for part in gathered for p in part]
    levels = ["inter", "intra"] if len(set(nodes)) > 1 else ["intra"]
    return [{"levels": levels, "nodes": len(set(nodes)), "load_avg_start": load_start}] + merged


def _bench_block(group: Group, collective: str, sizes: list[int], share: float,
                 cfg: BenchConfig, device: torch.device) -> list[dict[str, Any]]:
    """All sizes of one collective on one group, within about ``share`` seconds.

    Pass 1 warms each size up (ascending) and estimates its cost; sizes are kept while the
    estimated total fits ``share``. Pass 2 times ``cfg.repeats`` rounds over the kept sizes,
    interleaved, so a burst of load from other processes spoils one repetition of several
    sizes rather than every repetition of one. All decisions use values all-reduced with
    MAX, so every member of the group takes the same ones.
    """
    n = len(group.ranks)
    plan: list[tuple[Callable[[], Any], int, int]] = []     # (fn, bytes, inner)
    spent = 0.0
    for size in sizes:
        fn, nbytes = _collective(collective, size, group, cfg, device)
        once = math.inf
        for _ in range(max(1, cfg.warmup)):
            once = min(once, time_block(fn, device, 1))
        once = _agree(once, group, device)
        inner = int(min(1000, max(1, math.ceil(cfg.min_rep_s / max(once, 1e-9)))))
        cost = once * (cfg.warmup + cfg.repeats * inner)
        if len(plan) >= 2 and spent + cost > share:
            break
        spent += cost
        plan.append((fn, nbytes, inner))
    times: list[list[float]] = [[] for _ in plan]
    for _ in range(cfg.repeats):
        for i, (fn, _nbytes, inner) in enumerate(plan):
            dist.barrier(group=group.handle)
            times[i].append(_agree(time_block(fn, device, inner) / inner, group, device))
    out = []
    if dist.get_rank() == group.ranks[0]:
        for (_fn, nbytes, _inner), ts in zip(plan, times):
            median, fastest = statistics.median(ts), min(ts)
            t = fastest if cfg.statistic == "min" else median
            algbw = nbytes / t / 1e9
            out.append({"collective": collective, "group_size": n, "level": group.level,
                        "bytes": nbytes, "time_s": t, "algbw_gbps": algbw,
                        "busbw_gbps": algbw * bus_factor(collective, n),
                        "time_median_s": median, "time_min_s": fastest})
    return out


def _collective(collective: str, size: int, group: Group, cfg: BenchConfig,
                device: torch.device) -> tuple[Callable[[], Any], int]:
    """A no-argument function running ``collective`` once, and its nccl-tests byte count."""
    dtype = getattr(torch, cfg.dtype)
    elt = torch.tensor([], dtype=dtype).element_size()
    n, pg = len(group.ranks), group.handle
    per = max(1, size // (elt * n))          # elements per rank's chunk
    if collective == "all_reduce":
        buf = torch.ones(max(1, size // elt), dtype=dtype, device=device)
        return (lambda: dist.all_reduce(buf, group=pg)), buf.numel() * elt
    if collective == "all_gather":
        src = torch.ones(per, dtype=dtype, device=device)
        dst = torch.empty(per * n, dtype=dtype, device=device)
        gather = getattr(dist, "all_gather_single", dist.all_gather_into_tensor)
        return (lambda: gather(dst, src, group=pg)), dst.numel() * elt
    if collective == "reduce_scatter":
        src = torch.ones(per * n, dtype=dtype, device=device)
        dst = torch.empty(per, dtype=dtype, device=device)
        scatter = getattr(dist, "reduce_scatter_single", dist.reduce_scatter_tensor)
        return (lambda: scatter(dst, src, group=pg)), src.numel() * elt
    if collective == "all_to_all":
        src = torch.ones(per * n, dtype=dtype, device=device)
        dst = torch.empty(per * n, dtype=dtype, device=device)
        return (lambda: dist.all_to_all_single(dst, src, group=pg)), src.numel() * elt
    if collective == "send_recv":
        me = group.ranks.index(dist.get_rank())
        nxt, prv = group.ranks[(me + 1) % n], group.ranks[(me - 1) % n]
        src = torch.ones(max(1, size // elt), dtype=dtype, device=device)
        dst = torch.empty_like(src)

        def exchange() -> None:
            ops = [dist.P2POp(dist.isend, src, nxt, pg), dist.P2POp(dist.irecv, dst, prv, pg)]
            for req in dist.batch_isend_irecv(ops):
                req.wait()

        return exchange, src.numel() * elt
    raise ProfileError(f"unknown collective {collective!r}; known: {list(COLLECTIVES)}",
                       field="--collectives")


def _agree(value: float, group: Group, device: torch.device) -> float:
    t = torch.tensor([value], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group.handle)
    return float(t.item())


def save(cfg: BenchConfig, result: list[dict[str, Any]], backend: str) -> LinkProfile:
    """Merge the points into ``cfg.out`` and refit (rank 0 only)."""
    info, raw = result[0], result[1:]
    prov = measured_provenance(backend=backend, device=cfg.device, dtype=cfg.dtype,
                               world_size=dist.get_world_size(), nodes=info["nodes"],
                               warmup=cfg.warmup, repeats=cfg.repeats,
                               statistic=cfg.statistic, load_avg_start=info["load_avg_start"],
                               malloc=cfg.malloc,
                               time_budget_s=cfg.time_budget_s)
    sid = source_id(prov)
    new = [LinkPoint(**p, source=sid) for p in raw]
    measured = {(p.collective, p.level, p.group_size) for p in new}

    def change(current: LinkProfile | None) -> LinkProfile:
        if current is not None and current.backend != backend:
            raise ProfileError(f"holds {current.backend} timings; this run used {backend} "
                               "(write to another file)", source=str(cfg.out), field="backend")
        keep = [p for p in (current.points if current else [])
                if (p.collective, p.level, p.group_size) not in measured]
        points = keep + new
        sources = {k: v for k, v in (current.sources if current else {}).items()
                   if k in {p.source for p in keep}}
        sources[sid] = prov
        fit_prov = {"kind": "measured", "method": "weighted least squares, autoplan.profile.fit",
                    "from_sources": sorted({p.source for p in points})}
        fit_sid = source_id(fit_prov)
        sources[fit_sid] = fit_prov
        levels = sorted(set(info["levels"]) | set(current.levels_present if current else ()))
        note = ("measured on one node: only the intra-node level exists here; no inter-node "
                "link was measured" if levels == ["intra"] else
                "measured across nodes: intra and inter levels")
        stats = sorted({sources[p.source].get("statistic", "median") for p in points})
        note += (f". Point times are the {' / '.join(stats)} of each source's repetitions "
                 "(load averages in 'sources'); fits per group size are the accurate ones, "
                 "pooled fits (group_size null) share one alpha across group sizes")
        fits, problems = fit_link_points(points, fit_sid)
        for problem in problems:
            print(f"warning: not fitted: {problem}", file=sys.stderr)
        return LinkProfile(cluster=cfg.cluster, backend=backend, levels_present=levels,
                           note=note, points=points, fits=fits,
                           published=list(current.published if current else []),
                           sources=sources)

    return update_link_profile(cfg.out, change)


def parse_bytes(text: str) -> int:
    """``4096``, ``64K``, ``32M``, ``1G`` (binary multiples)."""
    text = text.strip().upper().removesuffix("B").removesuffix("I")
    mult = {"K": KiB, "M": MiB, "G": 1 << 30}.get(text[-1:], 1)
    try:
        return int(float(text[:-1] if mult > 1 else text) * mult)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a byte count: {text!r}") from None


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m autoplan.profile.links",
                                description="nccl-tests style collective benchmark "
                                            "(run under torchrun)")
    p.add_argument("--out", required=True, type=Path, help="link profile to merge into")
    p.add_argument("--cluster", help="cluster name in the file (default: the file's stem)")
    p.add_argument("--collectives", default=",".join(COLLECTIVES))
    p.add_argument("--min-bytes", type=parse_bytes, default=8)
    p.add_argument("--max-bytes", type=parse_bytes,
                   help="largest message (default 32M on CPU, 512M on CUDA)")
    p.add_argument("--step", type=int, default=2, help="factor between sizes")
    p.add_argument("--time-budget", type=float, default=90.0, help="seconds for the run")
    p.add_argument("--group-sizes", help="comma list (default: powers of two that fit)")
    p.add_argument("--levels", default="intra,inter")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--device", choices=("cpu", "cuda"),
                   help="default: cuda when available (NCCL), else cpu (gloo)")
    p.add_argument("--keep-malloc", action="store_true",
                   help="on CPU, do not raise glibc's mmap/trim thresholds (module docstring)")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--statistic", choices=("median", "min"), default="median",
                   help="which repetition statistic is a point's time (min: on a shared "
                        "machine)")
    p.add_argument("--repeats", type=int, default=9, help="timed repetitions per point "
                                                          "(median)")
    return p


def config_from_args(args: argparse.Namespace) -> BenchConfig:
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    collectives = tuple(c.strip() for c in args.collectives.split(",") if c.strip())
    for c in collectives:
        if c not in COLLECTIVES:
            raise ProfileError(f"unknown collective {c!r}; known: {list(COLLECTIVES)}",
                               field="--collectives")
    return BenchConfig(
        out=args.out, cluster=args.cluster or args.out.stem, collectives=collectives,
        min_bytes=args.min_bytes,
        max_bytes=args.max_bytes or (512 * MiB if device == "cuda" else CPU_MAX_BYTES),
        step=args.step, time_budget_s=args.time_budget,
        group_sizes=tuple(int(x) for x in args.group_sizes.split(",")) if args.group_sizes
        else None,
        levels=tuple(x.strip() for x in args.levels.split(",")), dtype=args.dtype,
        device=device, warmup=args.warmup, repeats=args.repeats, statistic=args.statistic,
        min_rep_s=1e-3 if device == "cuda" else 5e-3)


def tune_malloc() -> str:
    """Raise glibc's mmap and trim thresholds to 1 GiB (module docstring); returns what was
    done, for the provenance."""
    try:
        libc = ctypes.CDLL("libc.so.6")
        ok = (libc.mallopt(M_MMAP_THRESHOLD, MALLOC_THRESHOLD) == 1 and
              libc.mallopt(M_TRIM_THRESHOLD, MALLOC_THRESHOLD) == 1)
    except (OSError, AttributeError):
        ok = False
    return ("glibc mallopt M_MMAP_THRESHOLD = M_TRIM_THRESHOLD = 1 GiB" if ok
            else "default (mallopt unavailable)")


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from autoplan.errors import AutoplanError

    try:
        cfg = config_from_args(args)
    except AutoplanError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if "RANK" not in os.environ:
        print("error: run under torchrun, e.g. torchrun --standalone --nproc_per_node=2 "
              "-m autoplan.profile.links --out profiles/links/local-cpu.json", file=sys.stderr)
        return 2
    backend = "nccl" if cfg.device == "cuda" else "gloo"
    if cfg.device == "cpu" and not args.keep_malloc:
        cfg = replace(cfg, malloc=tune_malloc())
    if cfg.device == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        cfg = replace(cfg, device=f"cuda:{torch.cuda.current_device()}")
    dist.init_process_group(backend)
    try:
        t0 = time.perf_counter()
        result = run(cfg)
        if dist.get_rank() == 0:
            try:
                prof = save(cfg, result, backend)
            except AutoplanError as exc:
                print(f"error: {exc}", file=sys.stderr)
                return 2
            _print_summary(prof, len(result) - 1, time.perf_counter() - t0, cfg.out)
    finally:
        dist.destroy_process_group()
    return 0


def _print_summary(prof: LinkProfile, n_points: int, seconds: float, path: Path) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"{path}: {n_points} points in {seconds:.0f} s; fits "
                        "t = alpha + bytes·factor/busbw", title_justify="left")
    for col in ("collective", "level", "n", "points", "alpha (us)", "busbw (GB/s)",
                "err >=1MB", "segments", "seg. err"):
        table.add_column(col, justify="left" if col in ("collective", "level") else "right")

    def pct(x: float | None) -> str:
        return "-" if x is None else f"{100 * x:.0f}%"

    for f in prof.fits:
        table.add_row(f.collective, f.level, str(f.group_size or "all"), str(f.points),
                      f"{f.alpha_s * 1e6:.0f}", f"{f.busbw_gbps:.3f}",
                      pct(f.max_rel_err_ge_1mb), str(len(f.segments) or 1),
                      pct(f.segments_max_rel_err_ge_1mb))
    Console(width=None if sys.stdout.isatty() else 120).print(table)


if __name__ == "__main__":
    sys.exit(main())
