"""Simulate one training step of a pipeline schedule: when each forward / backward runs.

The pipeline has ``pp`` ranks and ``pp * v`` model chunks; chunk ``c`` runs on rank
``c % pp`` (Narayanan et al. 2021, interleaved 1F1B; ``v = 1`` for GPipe and 1F1B). Each rank
runs its operations in a fixed order (:func:`op_order`); an operation starts when its rank
is free and its input is ready:

* ``F(c, i)`` (forward of chunk c on micro-batch i) needs ``F(c - 1, i)``;
* ``B(c, i)`` needs ``B(c + 1, i)``, or, on the last chunk, ``F(c, i)``.

Block durations already include the stage-to-stage send (as :mod:`autoplan.planner.grid.estimate`
charges it), so a dependency's end time is when the next block may start.

Orders per rank ``d``:

* ``gpipe`` (Huang et al. 2019): all forwards, then all backwards.
* ``1f1b`` (PipeDream-Flush, Narayanan et al. 2021): ``min(pp - d - 1, m)`` warm-up forwards,
  then one forward and one backward in turn, then the remaining backwards.
* ``interleaved_1f1b`` (Megatron-LM; torch.distributed.pipelining's
  ``ScheduleInterleaved1F1B``): forwards visit the rank's chunks round-robin in rounds of
  ``g`` micro-batches (``g = pp`` when pp divides m, see :func:`autoplan.schedule.round_size`);
  ``2 (pp - d - 1) + (v - 1) g`` warm-up forwards, then 1F1B; backwards visit the chunks
  in reverse.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from autoplan.schedule import BACKWARD, FORWARD, order



@dataclass(frozen=True)
class Block:
    """One operation on one pipeline rank, with its simulated start and end (seconds)."""

    rank: int
    chunk: int
    micro_batch: int
    kind: str                 # "F" or "B"
    start: float
    end: float


def op_order(schedule: str, pp: int, v: int, m: int, rank: int,
             extra_warmup: int = 0) -> list[tuple[str, int, int]]:
    """The (kind, chunk, micro-batch) operations rank ``rank`` runs, in order, with global
    chunk numbers: :func:`autoplan.schedule.order`, the order the engine runs.
    ``extra_warmup`` adds warm-up forwards (1F1B schedules), for the interleaved cases whose
    rounds do not divide ``m`` (see :func:`simulate`)."""
    return [(a.kind, a.chunk * pp + rank, a.micro_batch)
            for a in order(schedule, pp, v, m, rank, extra_warmup)]


def simulate(schedule: str, pp: int, v: int, m: int, forward: Sequence[float],
             backward: Sequence[float]) -> list[Block]:
    """Blocks of one step, given per-chunk forward and backward seconds per micro-batch.

    ``forward[c]`` and ``backward[c]`` are chunk ``c``'s times (``len == pp * v``).
    The interleaved order of a last, smaller round of micro-batches (``m`` not a multiple of
    the round size: torch.distributed.pipelining refuses such a plan) can deadlock; warm-up
    is then lengthened one forward at a time until it does not.
    """
    n = pp * v
    if len(forward) != n or len(backward) != n:
        raise ValueError(f"need {n} chunk times, got {len(forward)} forward and "
                         f"{len(backward)} backward")
    for extra in range(m * v + 1):
        orders = [op_order(schedule, pp, v, m, d, extra) for d in range(pp)]
        blocks = _run(orders, n, forward, backward)
        if blocks is not None:
            return blocks
    raise ValueError(f"{schedule} with pp={pp}, v={v}, m={m} deadlocks")


def _run(orders: list[list[tuple[str, int, int]]], n: int, forward: Sequence[float],
         backward: Sequence[float]) -> list[Block] | None:
    """Execute each rank's order in turn; None if no rank can proceed (a deadlock)."""
    pp = len(orders)
    pos = [0] * pp
    free = [0.0] * pp
    done: dict[tuple[str, int, int], float] = {}
    blocks: list[Block] = []
    remaining = sum(len(o) for o in orders)
    while remaining:
        progressed = False
        for d in range(pp):
            while pos[d] < len(orders[d]):
                kind, c, i = orders[d][pos[d]]
                if kind == FORWARD:
                    dep = (FORWARD, c - 1, i) if c > 0 else None
                else:
                    dep = (BACKWARD, c + 1, i) if c < n - 1 else (FORWARD, c, i)
                if dep is not None and dep not in done:
                    break
                start = max(free[d], done[dep] if dep else 0.0)
                end = start + (forward[c] if kind == FORWARD else backward[c])
                done[(kind, c, i)] = end
                blocks.append(Block(d, c, i, kind, start, end))
                free[d] = end
                pos[d] += 1
                remaining -= 1
                progressed = True
        if not progressed:
            return None
    return blocks


def makespan(blocks: Sequence[Block]) -> float:
    """When the last block ends."""
    return max((b.end for b in blocks), default=0.0)
