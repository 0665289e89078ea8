"""Op profiler: time every distinct op signature of traced graphs on a local device.

    from autoplan.trace import trace
    from autoplan.profile.ops import profile_ops
    graph = trace(resolve("gpt-small"), 4, None, dtype=torch.float32)
    report = profile_ops(graph, "profiles/ops/cpu-amd-epyc.json", tp_degrees=(1, 2, 4))

or ``autoplan profile ops gpt-small --batch-size 1,2,4,8 --tp 1,2,4``.

For each :class:`~autoplan.graph.OpNode` and each TP degree ``t`` the signature one rank
runs is worked out (:func:`autoplan.profile.replay.sharded_call`), duplicates dropped, and
every signature not already in the output file is timed forward and backward
(:mod:`autoplan.profile.timing`) on random inputs built from its shapes. Results are merged
into the file every ``flush_every`` signatures (under the file lock, atomically), so an
interrupted run loses at most that many and a re-run skips what is done. Ops that cannot be
re-run from their signature are reported, not stored: the cost model uses its roofline for
them. Where the device has no kernel for an op (the CUDA attention kernels a GPU trace
records, on a CPU), the portable op computing the same is timed and named in ``timed_as``.

The device is an argument (``"cpu"``, ``"cuda"``, ``"cuda:1"``); nothing else differs.
On CPU the default is one thread per process, as torchrun sets ``OMP_NUM_THREADS=1`` for
the ranks whose ops these timings stand for.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable

import torch

from autoplan.graph import OpNode
from autoplan.profile.replay import (Call, ReplayError, count_flops, portable_call,
                                     sharded_call)
from autoplan.profile.signature import Signature
from autoplan.profile.store import (OpEntry, OpProfile, ProfileError, add_op_entries,
                                    device_slug, measured_provenance, source_id)
from autoplan.profile.timing import TimingConfig, cpu_threads, time_op


@dataclass
class ProfileReport:
    path: Path
    device: str
    signatures: int = 0            # distinct signatures in the input
    measured: int = 0              # timed in this run
    skipped: int = 0               # already in the file
    failed: dict[str, str] = field(default_factory=dict)    # signature key -> reason
    seconds: float = 0.0
    complete: bool = True          # False when stopped by max_new or an interrupt


def collect_signatures(nodes: Iterable[OpNode], tp_degrees: Iterable[int] = (1,)
                       ) -> tuple[dict[str, tuple[Signature, Call]], dict[str, str]]:
    """Distinct (sharded) signatures of ``nodes`` with their calls, and the ones that
    cannot be re-run (key -> reason)."""
    found: dict[str, tuple[Signature, Call]] = {}
    failed: dict[str, str] = {}
    seen: set[tuple[str, str, int]] = set()
    degrees = sorted(set(int(t) for t in tp_degrees))
    for node in nodes:
        sig = Signature.of(node)
        for t in degrees:
            memo = (sig.key, node.tp_role, t)
            if memo in seen:
                continue
            seen.add(memo)
            try:
                shard, call = sharded_call(sig, node.tp_role, t)
            except ReplayError as exc:
                failed[sig.key] = str(exc)
                continue
            found.setdefault(shard.key, (shard, call))
    return found, failed


def profile_ops(nodes: Iterable[OpNode], out: str | os.PathLike, *,
                tp_degrees: Iterable[int] = (1,), device: str = "cpu",
                timing: TimingConfig = TimingConfig(), threads: int | None = 1,
                flush_every: int = 16, max_new: int | None = None, progress: bool = True,
                device_name: str | None = None, seed: int = 0, redo: bool = False
                ) -> ProfileReport:
    """Time every signature of ``nodes`` (an OpGraph, or any OpNodes) not yet in ``out``.

    ``threads`` applies on CPU only (None: torch's default). ``max_new`` stops after that
    many new signatures (the rest is left for a later run). ``redo`` times every signature
    again, replacing what the file has (e.g. once the machine is quiet). Returns what was
    done.
    """
    t_start = time.perf_counter()
    dev = torch.device(device)
    name = device_name or device_slug(device)
    path = Path(out)
    sigs, failed = collect_signatures(nodes, tp_degrees)
    done: set[str] = set()
    if path.exists():
        existing = OpProfile.load(path)
        if existing.device != name:
            raise ProfileError(f"holds timings of device {existing.device!r}, not {name!r} "
                               "(write to another file)", source=str(path), field="device")
        done = set() if redo else set(existing.entries)
    todo = [(k, v) for k, v in sigs.items() if k not in done]
    report = ProfileReport(path=path, device=name, signatures=len(sigs), failed=dict(failed),
                           skipped=len(sigs) - len(todo))
    if max_new is not None and len(todo) > max_new:
        todo, report.complete = todo[:max_new], False
    n_threads = threads if dev.type == "cpu" else None
    prov = measured_provenance(device=name, device_type=dev.type,
                               threads=n_threads or torch.get_num_threads(),
                               warmup=timing.warmup, repeats=timing.repeats,
                               min_rep_s=timing.min_rep_s, statistic=timing.statistic)
    sid = source_id(prov)
    generator = torch.Generator().manual_seed(seed)
    pending: list[OpEntry] = []

    def flush() -> None:
        if pending:
            add_op_entries(path, name, pending, {sid: prov})
            pending.clear()

    try:
        with cpu_threads(n_threads), _Progress(progress, len(todo), name) as advance:
            for key, (sig, call) in todo:
                timed_as = None
                try:
                    try:
                        t = time_op(call, sig, dev, timing, generator)
                    except NotImplementedError:          # no kernel for this device
                        portable = portable_call(call, sig)
                        if portable is None:
                            raise
                        t = time_op(portable, sig, dev, timing, generator)
                        timed_as = str(portable.op)
                except (RuntimeError, ValueError, TypeError) as exc:
                    report.failed[key] = f"{type(exc).__name__}: {str(exc).splitlines()[0]}"
                    advance()
                    continue
                pending.append(OpEntry(op=sig.op, dtype=sig.dtype, inputs=sig.inputs,
                                       outputs=sig.outputs, fwd_s=t.fwd_s, bwd_s=t.bwd_s,
                                       repeats=t.repeats, flops=count_flops(call, sig),
                                       bytes=sig.bytes, source=sid, timed_as=timed_as))
                report.measured += 1
                if len(pending) >= flush_every:
                    flush()
                advance()
    except KeyboardInterrupt:
        report.complete = False
        raise
    finally:
        flush()
        report.seconds = time.perf_counter() - t_start
    return report


class _Progress:
    """A rich progress bar on stderr (or nothing); ``advance()`` steps it by one."""

    def __init__(self, enabled: bool, total: int, device: str):
        self.enabled, self.total, self.device = enabled, total, device
        self.bar = None

    def __enter__(self):
        if not self.enabled:
            return lambda: None
        from rich.console import Console
        from rich.progress import (BarColumn, MofNCompleteColumn, Progress, TimeElapsedColumn,
                                   TimeRemainingColumn)

        self.bar = Progress("[progress.description]{task.description}", BarColumn(),
                            MofNCompleteColumn(), TimeElapsedColumn(), TimeRemainingColumn(),
                            console=Console(stderr=True), transient=False)
        self.bar.__enter__()
        task = self.bar.add_task(f"timing ops on {self.device}", total=self.total)
        return lambda: self.bar.advance(task)

    def __exit__(self, *exc) -> None:
        if self.bar is not None:
            self.bar.__exit__(*exc)
