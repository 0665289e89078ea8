"""Moving a micro-batch's activations (and their gradients) between two stages' submeshes.

Two consecutive stages may sit on submeshes of different sizes and shapes, and split the
batch differently. On both sides the boundary tensor is held batch-major: rank ``r`` of a
stage holds rows ``[lo_r, hi_r)`` of the micro-batch (:func:`engine.placements.batch_rows`),
replicated over the stage's non-data axes. :func:`routes` matches every row range a rank
needs with the ranks that hold it — one message per overlapping (holder, needer) pair, a
holder chosen among the replicas round-robin over the needers, so replicas share
the sending — and the same function routes gradients back (holders and needers
swapped: every replica that computed an output needs its gradient).

Messages are point-to-point (``isend``/``irecv``; gloo on CPU, NCCL on GPUs) with a small
header (the piece's shape and dtype), so the receiver needs no prior knowledge of shapes.
Tags keep the boundaries, micro-batches and the two directions apart.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist

from engine.placements import StageMesh, batch_rows

_DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.float64,
           torch.int32]
_HEADER = 8                            # ndim, up to 6 dims, dtype code


@dataclass(frozen=True)
class Message:
    src: int
    dst: int
    lo: int                            # rows [lo, hi) of the micro-batch
    hi: int


def _holders(sm: StageMesh, micro_batch: int) -> list[tuple[int, int, list[int]]]:
    """``(lo, hi, replicas)`` per data piece of the stage."""
    pieces: dict[tuple[int, int], list[int]] = {}
    for r in sm.ranks.flatten().tolist():
        pieces.setdefault(batch_rows(sm, r, micro_batch), []).append(r)
    return [(lo, hi, sorted(rs)) for (lo, hi), rs in sorted(pieces.items())]


def routes(src: StageMesh, dst: StageMesh, micro_batch: int) -> list[Message]:
    """Every message that gives each rank of ``dst`` its rows, from the ranks of ``src``."""
    held = _holders(src, micro_batch)
    out = []
    j = 0                              # the needer's index over all of dst: spreads senders
    for lo, hi, needers in _holders(dst, micro_batch):
        for r in needers:
            for slo, shi, replicas in held:
                a, b = max(lo, slo), min(hi, shi)
                if a < b:
                    out.append(Message(src=replicas[j % len(replicas)], dst=r, lo=a, hi=b))
            j += 1
    return out


def _tag(link: int, micro_batch_index: int, backward: bool) -> int:
    """Distinct per boundary (``link``: stage ``link`` -> ``link + 1``; two boundaries join
    the same ranks under interleaving), micro-batch and direction."""
    return (link * 1_000_000 + micro_batch_index) * 2 + int(backward)


class Boundary:
    """The link between stage ``a`` and stage ``a + 1`` as this rank sees it."""

    def __init__(self, src: StageMesh, dst: StageMesh, micro_batch: int, rank: int, *,
                 link: int = 0):
        self.rank, self.link = rank, link
        fwd = routes(src, dst, micro_batch)
        bwd = routes(dst, src, micro_batch)
        self.src_rows = batch_rows(src, rank, micro_batch) if src.contains(rank) else None
        self.dst_rows = batch_rows(dst, rank, micro_batch) if dst.contains(rank) else None
        self.fwd_send = [m for m in fwd if m.src == rank]
        self.fwd_recv = [m for m in fwd if m.dst == rank]
        self.bwd_send = [m for m in bwd if m.src == rank]
        self.bwd_recv = [m for m in bwd if m.dst == rank]

    # the sender of a direction holds `rows` (its own range); pieces are slices of them
    def send(self, local: torch.Tensor, index: int, *, backward: bool) -> list:
        msgs, (lo, _) = (self.bwd_send, self.dst_rows) if backward else \
            (self.fwd_send, self.src_rows)
        works = []
        for m in msgs:
            piece = local[m.lo - lo:m.hi - lo].contiguous()
            header = torch.zeros(_HEADER, dtype=torch.int64)
            header[0] = piece.dim()
            header[1:1 + piece.dim()] = torch.tensor(piece.shape)
            header[-1] = _DTYPES.index(piece.dtype)
            tag = _tag(self.link, index, backward)
            works.append((dist.isend(header.to(piece.device) if piece.is_cuda else header,
                                     m.dst, tag=tag), header))
            works.append((dist.isend(piece, m.dst, tag=tag), piece))
        return works

    def recv(self, index: int, device: torch.device, *, backward: bool) -> torch.Tensor:
        msgs, (lo, hi) = (self.bwd_recv, self.src_rows) if backward else \
            (self.fwd_recv, self.dst_rows)
        pieces = []
        tag = _tag(self.link, index, backward)
        for m in sorted(msgs, key=lambda m: m.lo):
            header = torch.zeros(_HEADER, dtype=torch.int64,
                                 device=device if device.type == "cuda" else "cpu")
            dist.recv(header, m.src, tag=tag)
            h = header.cpu().tolist()
            shape = tuple(h[1:1 + h[0]])
            piece = torch.empty(shape, dtype=_DTYPES[h[-1]], device=device)
            dist.recv(piece, m.src, tag=tag)
            pieces.append(piece)
        out = torch.cat(pieces) if len(pieces) > 1 else pieces[0]
        if out.shape[0] != hi - lo:
            raise RuntimeError(f"rank {self.rank}: received {out.shape[0]} rows of micro-batch "
                               f"{index}, expected {hi - lo}")
        return out


def check_routes(stage_meshes: list[StageMesh], micro_batch: int) -> None:
    """Every rank of every stage after the first receives exactly its rows (a self-check
    of :func:`routes`, cheap, run once)."""
    for a, b in zip(stage_meshes, stage_meshes[1:]):
        for direction in (routes(a, b, micro_batch), routes(b, a, micro_batch)):
            got: dict[int, list[tuple[int, int]]] = {}
            for m in direction:
                got.setdefault(m.dst, []).append((m.lo, m.hi))
            for r, ranges in got.items():
                ranges.sort()
                side = b if b.contains(r) else a
                lo, hi = batch_rows(side, r, micro_batch)
                joined = np.concatenate([np.arange(x, y) for x, y in ranges])
                assert joined.tolist() == list(range(lo, hi)), (r, ranges, lo, hi)
