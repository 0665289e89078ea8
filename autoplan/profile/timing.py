"""Timing one op, forward and backward, on a CPU or CUDA device — one code path.

Each repetition runs the op ``inner`` times back to back and reports the mean per call;
``inner`` is chosen after warm-up so that a repetition lasts at least ``min_rep_s`` (a
microsecond op timed once is all clock overhead). The result is the median over
repetitions, or with ``statistic="min"`` the fastest one: on a machine shared with other
work, contention only ever adds time, and the median of a 2-core machine at load 5 put a
(512, 64) x (64, 256) matmul at twice the time of one twice its size. On CUDA the clock is a pair of CUDA events around the repetition, read after
``synchronize``; on CPU it is ``time.perf_counter``.

Forward is timed as training runs it: grad mode on, floating inputs requiring grad (so the
autograd graph is recorded). Backward runs the op once, then times
``torch.autograd.grad(outputs, inputs, cotangents, retain_graph=True)`` with random
cotangents — the vector-Jacobian product of the op alone.
"""

from __future__ import annotations

import math
import statistics
import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import torch

from autoplan.profile.replay import Call, make_inputs, output_tensors
from autoplan.profile.signature import Signature

MAX_INNER = 1000


@dataclass(frozen=True)
class TimingConfig:
    warmup: int = 3
    repeats: int = 7
    min_rep_s: float = 2e-3
    statistic: str = "median"        # or "min" (module docstring)

    def __post_init__(self) -> None:
        if self.statistic not in ("median", "min"):
            raise ValueError(f"statistic must be 'median' or 'min', got {self.statistic!r}")
        if self.repeats < 1 or self.warmup < 0 or self.min_rep_s < 0:
            raise ValueError(f"bad timing config {self}")

    def summarise(self, times: list[float]) -> float:
        return min(times) if self.statistic == "min" else statistics.median(times)


@dataclass(frozen=True)
class OpTiming:
    fwd_s: float
    bwd_s: float | None          # 0.0: nothing to differentiate; None: backward failed
    repeats: int


def time_fn(fn: Callable[[], Any], device: torch.device, cfg: TimingConfig) -> list[float]:
    """Per-call seconds of ``fn`` for each of ``cfg.repeats`` repetitions."""
    once = math.inf
    for _ in range(max(1, cfg.warmup)):
        once = min(once, time_block(fn, device, 1))
    inner = int(min(MAX_INNER, max(1, math.ceil(cfg.min_rep_s / max(once, 1e-9)))))
    return [time_block(fn, device, inner) / inner for _ in range(cfg.repeats)]


def time_block(fn: Callable[[], Any], device: torch.device, inner: int) -> float:
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize(device)
        start.record()
        for _ in range(inner):
            fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3
    t0 = time.perf_counter()
    for _ in range(inner):
        fn()
    return time.perf_counter() - t0


def time_op(call: Call, sig: Signature, device: torch.device, cfg: TimingConfig,
            generator: torch.Generator | None = None) -> OpTiming:
    """Median forward and backward seconds of ``call`` on fresh random inputs."""
    try:
        inputs = make_inputs(sig, device, requires_grad=True, generator=generator)
        call(inputs, device)
    except NotImplementedError:   # no kernel on this device: the caller decides
        raise
    except RuntimeError:          # e.g. an in-place op on a leaf: time it without autograd
        inputs = make_inputs(sig, device, requires_grad=False, generator=generator)
        fwd = cfg.summarise(time_fn(lambda: call(inputs, device), device, cfg))
        return OpTiming(fwd, None, cfg.repeats)
    fwd = cfg.summarise(time_fn(lambda: call(inputs, device), device, cfg))
    wrt = [x for x in inputs if x.requires_grad]
    outs = [o for o in output_tensors(call(inputs, device)) if o.requires_grad]
    if not wrt or not outs:
        return OpTiming(fwd, 0.0, cfg.repeats)
    cots = [torch.randn(o.shape, generator=generator, dtype=torch.float32).to(o.dtype)
            .to(device) for o in outs]

    def backward() -> Any:
        return torch.autograd.grad(outs, wrt, cots, retain_graph=True, allow_unused=True)

    try:
        bwd = cfg.summarise(time_fn(backward, device, cfg))
    except RuntimeError:          # no derivative formula for this op
        return OpTiming(fwd, None, cfg.repeats)
    return OpTiming(fwd, bwd, cfg.repeats)


@contextmanager
def cpu_threads(n: int | None) -> Iterator[None]:
    """Run with ``torch.set_num_threads(n)`` (None: leave as is), restored afterwards."""
    if n is None:
        yield
        return
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)
