"""Pipeline schedules: the order of forwards and backwards on each pipeline rank.

One generator for everyone who needs the order: the engine runs it
(:mod:`engine.staged`), the report simulates it (:mod:`autoplan.report.schedule`) and the
memory model counts what it keeps alive (:func:`peak_in_flight`). Torch-free.

A pipeline has ``pp`` ranks, each running ``v`` model chunks (``v > 1`` only for
interleaved 1F1B), and ``m`` micro-batches. An action is ``(kind, chunk, micro_batch)`` with
``kind`` ``"F"`` or ``"B"`` and ``chunk`` the index among the rank's own ``v`` chunks (the
global chunk is ``chunk * pp + rank``, Narayanan et al. 2021, sec. 2.2).

* one stage (``pp * v == 1``): forward and backward alternate, whatever the schedule's
  name: nothing can overlap, so nothing is kept longer than one micro-batch (gradient
  accumulation).
* ``gpipe`` (Huang et al. 2019): all forwards, then all backwards.
* ``1f1b`` (PipeDream-Flush, Narayanan et al. 2021 sec. 2.2.1): ``min(pp - r - 1, m)``
  warm-up forwards on rank ``r``, then one forward and one backward in turn, then the
  remaining backwards.
* ``interleaved_1f1b`` (Narayanan et al. 2021 sec. 2.2.2, Megatron-LM's order; also
  torch.distributed.pipelining's ``ScheduleInterleaved1F1B``): forwards visit the rank's
  chunks round-robin in rounds of ``g`` micro-batches (``g = pp`` when ``pp`` divides
  ``m``, :func:`round_size`), backwards visit them in reverse;
  ``2 (pp - r - 1) + (v - 1) g`` warm-up forwards, then 1F1B.
"""

from __future__ import annotations

from functools import lru_cache
from typing import NamedTuple

SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b")


def runs_micro_batches(schedule: str, pp: int, m: int) -> bool:
    """Can ``schedule`` run ``m`` micro-batches over ``pp`` stages? GPipe runs any m (every
    stage then holds all m in flight); 1F1B and interleaved 1F1B need m >= pp (torch's
    ``Schedule1F1B`` refuses fewer)."""
    return pp <= 1 or schedule == "gpipe" or m >= pp
FORWARD, BACKWARD = "F", "B"


class Action(NamedTuple):
    kind: str            # "F" or "B"
    chunk: int           # index among this rank's chunks, 0 .. v-1
    micro_batch: int


def _check(schedule: str, pp: int, v: int, m: int, rank: int) -> None:
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule must be one of {SCHEDULES}, got {schedule!r}")
    for name, x in (("pp", pp), ("v", v), ("m", m)):
        if isinstance(x, bool) or not isinstance(x, int) or x < 1:
            raise ValueError(f"{name} must be a positive integer, got {x!r}")
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < pp:
        raise ValueError(f"rank must be in [0, {pp}), got {rank!r}")
    if v > 1 and schedule != "interleaved_1f1b":
        raise ValueError(f"{v} chunks per rank need the interleaved_1f1b schedule")


def round_size(pp: int, m: int) -> int:
    """Micro-batches per round of the interleaved schedule: ``m / max(1, m // pp)`` (``pp``
    when ``m`` is a multiple of it, torch.distributed.pipelining's rule), rounded up when
    the rounds do not divide ``m`` evenly."""
    rounds = max(1, m // pp)
    return -(-m // rounds)


def _sequence(pp: int, v: int, m: int, kind: str) -> list[Action]:
    """All of one direction's actions of a rank, in Megatron-LM's chunk order."""
    out = []
    g = round_size(pp, m)
    chunks = range(v) if kind == FORWARD else range(v - 1, -1, -1)
    for first in range(0, m, g):
        group = range(first, min(first + g, m))
        for j in chunks:
            out.extend(Action(kind, j, i) for i in group)
    return out


def warmup(schedule: str, pp: int, v: int, m: int, rank: int, extra: int = 0) -> int:
    """Forwards rank ``rank`` runs before its first backward (see the module docstring);
    ``extra`` adds warm-up forwards (the report's simulation uses it for interleaved rounds
    that do not divide ``m``)."""
    _check(schedule, pp, v, m, rank)
    if pp * v == 1:
        return min(1, m)
    if schedule == "gpipe":
        return m
    if v == 1:
        return min(pp - rank - 1 + extra, m)
    return min(2 * (pp - rank - 1) + (v - 1) * round_size(pp, m) + extra, m * v)


def order(schedule: str, pp: int, v: int, m: int, rank: int, extra_warmup: int = 0
          ) -> list[Action]:
    """The actions rank ``rank`` runs in one training step, in order."""
    _check(schedule, pp, v, m, rank)
    fwd, bwd = _sequence(pp, v, m, FORWARD), _sequence(pp, v, m, BACKWARD)
    if pp * v == 1:
        return [a for i in range(m) for a in (fwd[i], bwd[i])]
    if schedule == "gpipe":
        return fwd + bwd
    w = warmup(schedule, pp, v, m, rank, extra_warmup)
    out = fwd[:w]
    for k in range(len(fwd) - w):
        out += [fwd[w + k], bwd[k]]
    return out + bwd[len(fwd) - w:]


def peak_in_flight(schedule: str, pp: int, rank: int, m: int, v: int = 1) -> float:
    """Micro-batches of *whole-stage* activations rank ``rank`` holds at its peak: the
    largest number of chunk forwards whose backward has not yet run, in :func:`order`,
    divided by ``v`` (each chunk is ``1/v`` of the rank's layers).

    Closed forms this reproduces (tests check them): GPipe ``m`` (one stage: 1);
    1F1B ``min(pp - r, m)``; interleaved ``min(w + 1, m v) / v`` with
    ``w = 2 (pp - r - 1) + (v - 1) pp``, which on the first rank is
    ``pp (1 + (pp - 1) / (pp v))`` (Korthikanti et al. 2022, sec. 4.2.3)."""
    live = peak = 0
    for a in order(schedule, pp, v, m, rank):
        live += 1 if a.kind == FORWARD else -1
        peak = max(peak, live)
    return peak / v


@lru_cache(maxsize=4096)
def live_chunks(schedule: str, pp: int, rank: int, m: int, v: int = 1
                ) -> tuple[tuple[int, ...], ...]:
    """The per-chunk counts of forwards whose backward has not yet run on rank ``rank``,
    after each forward of :func:`order`, keeping only the vectors no other one exceeds in
    every chunk: the peak of ``sum_c live_c * a_c`` for any chunk activations ``a_c >= 0``
    is reached at one of them. Under interleaving the rank's chunks are not held equally
    often: on the first rank of ``pp = 16``, ``v = 8``, ``m = 32`` (Megatron's rounds of
    16) the warm-up ends holding chunk 0 for 31 micro-batches and chunks 1-7 for 16 each,
    and as backwards retire the last chunks first the set shifts to the first ones (chunks
    0-2 for all 32 micro-batches, chunks 6-7 for none); all hold 143 chunk forwards. So a
    first chunk holding only the embedding (Llama 3, Dubey et al. 2024, sec. 3.3.2) keeps
    112 layers' activations there, not the 125 of 143 equal chunks of a stage's 7 layers."""
    live = [0] * v
    rows: set[tuple[int, ...]] = set()
    for a in order(schedule, pp, v, m, rank):
        live[a.chunk] += 1 if a.kind == FORWARD else -1
        if a.kind == FORWARD:
            rows.add(tuple(live))
    top = sorted(rows, key=sum, reverse=True)
    kept: list[tuple[int, ...]] = []
    for row in top:
        if not any(all(k >= r for k, r in zip(other, row)) for other in kept):
            kept.append(row)
    return tuple(kept)

