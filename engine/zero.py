"""ZeRO over a stage's data axes, for DTensor parameters (search plans, :mod:`engine.staged`).

Rajbhandari et al. 2020 (arXiv 1910.02054). A parameter computed with placements ``C`` on
the stage mesh is kept *at rest* with placements ``S``: ``C`` with ``Shard(0)`` on the first
data axis it is replicated on (ZeRO >= 1, when dim 0 has at least that axis's size), else
``S = C``. The optimizer (AdamW, built by the caller) holds the at-rest parameters, so its
states are sharded whenever ``S`` is — ZeRO-1's saving. Per ZeRO stage, one training step:

=====  ====================================================  ==============================
zero   forward / backward                                    after the last micro-batch
=====  ====================================================  ==============================
0      computes with ``p`` (``S = C``); gradients accumulate  partial sums all-reduced
       as DTensor partial sums
1      ``full = gather(p)`` once per step (all-gather),       reduce-scatter into ``p.grad``
       computes with ``full``
2      as 1, and after each micro-batch's backward its        --
       gradients are reduce-scattered into ``p.grad`` and
       the full ones freed
3      each forward of its block gathers ``p`` inside         what DTensor left partial is
       autograd, so backward reduce-scatters its gradient    reduced
       into ``p.grad``
=====  ====================================================  ==============================

**Local mode.** A stage whose every parameter is computed replicated is plain data
parallelism: it runs on plain tensors (each rank its rows of the micro-batch, the loss the
mean of its rows divided by the number of data pieces), and its gradients are treated as the
partial sums they are — skipping DTensor's per-op dispatch, which on a CPU costs ~10-25% of
a step (``benchmarks/search_measured.py``).

Collectives are **bucketed** as FSDP's are: one all-gather, one reduce-scatter and one
all-reduce per mesh axis for all of a stage's parameters (padded to equal shards, DTensor's
``torch.chunk`` split), not one per parameter — on a high-latency link (gloo over loopback,
~0.1-1 ms per collective) per-parameter collectives cost more than the step's compute.
ZeRO-3's gathers are per block (FSDP's unit; embeddings, final norm and head with the
chunk), inside autograd, so a recomputed block gathers again.

The gathered tensor is swapped into the owning module's ``_parameters`` for the computation
and the at-rest parameter put back afterwards, so ``state_dict``, checkpoints and the
optimizer only ever see the at-rest DTensors (as FSDP2 does). Unlike FSDP2 the gathers are
not prefetched or overlapped with compute; ZeRO-3 keeps a gathered weight until its backward.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor, Partial, Placement, Replicate, Shard
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from engine.placements import StageMesh


def at_rest(sm: StageMesh, zero: int):
    """The function ``(fqn, param, compute) -> at-rest placements`` for this stage."""

    def rest(fqn: str, param: torch.Tensor, compute: tuple[Placement, ...]):
        if zero == 0 or param.dim() == 0:
            return compute
        for a in sm.data_axes:
            k = sm.axis_names.index(a)
            if isinstance(compute[k], Replicate) and param.shape[0] >= sm.ranks.shape[k] \
                    and not any(isinstance(p, Shard) and p.dim % param.dim() == 0
                                for p in compute[k + 1:]):
                out = list(compute)
                out[k] = Shard(0)
                return tuple(out)
        return compute

    return rest


@dataclass
class _Slot:
    module: nn.Module
    name: str
    param: nn.Parameter                # the at-rest DTensor (what the optimizer updates)
    compute: tuple[Placement, ...]
    axis: int | None = None            # the mesh dim ZeRO shards it along (None: not sharded)
    full: torch.Tensor | None = None   # the gathered copy during a step (ZeRO-1/2, local mode)

    def __post_init__(self) -> None:
        self.axis = next((k for k, (a, b) in enumerate(zip(self.param.placements,
                                                           self.compute)) if a != b), None)

    def as_dtensor(self, local: torch.Tensor, placements) -> DTensor:
        """``local`` as this parameter's (or its gradient's) DTensor with ``placements``."""
        return DTensor.from_local(local, self.param.device_mesh, placements, run_check=False,
                                  shape=self.param.shape, stride=self.param.stride())


def _by_axis(slots: list[_Slot]) -> list[tuple[int | None, list[_Slot]]]:
    """``slots`` grouped by ZeRO axis, unsharded (None) first: one bucket each."""
    groups: dict[int | None, list[_Slot]] = {}
    for s in slots:
        groups.setdefault(s.axis, []).append(s)
    return sorted(groups.items(), key=lambda kv: -1 if kv[0] is None else kv[0])


def _chunk_sizes(n: int, parts: int) -> list[int]:
    """Dim-0 sizes of ``torch.chunk(x, parts)`` padded to ``parts`` pieces (DTensor's)."""
    q = math.ceil(n / parts) if n else 0
    return [max(0, min(q, n - j * q)) for j in range(parts)]


def _local_shape(t: DTensor, placements) -> tuple[int, ...]:
    shape, _ = compute_local_shape_and_global_offset(t.shape, t.device_mesh, list(placements))
    return tuple(shape)


def _unit(chunk: nn.Module, fqn: str) -> nn.Module:
    """The module whose forward gathers ``fqn`` under ZeRO-3: its block (inside a
    checkpoint wrapper, so a recomputed forward gathers again), else the chunk (embeddings,
    final norm, head) — FSDP's units."""
    prefix = getattr(chunk, "block_prefix", "blocks") + "."
    if fqn.startswith(prefix):
        key = fqn[len(prefix):].split(".", 1)[0]
        block = chunk.blocks[key]
        return getattr(block, "_checkpoint_wrapped_module", block)
    return chunk


class _GatherBucket(torch.autograd.Function):
    """Forward: the at-rest shards of a unit's weights (one ZeRO axis) -> their compute
    placements, by one all-gather; backward: their gradients -> the at-rest placements, by
    one reduce-scatter (and all-reduces of other partial axes)."""

    @staticmethod
    def forward(ctx, zero: "Zero", k: int, slots: list, *shards: DTensor):
        ctx.zero, ctx.slots = zero, slots
        return tuple(s.as_dtensor(local, s.compute)
                     for s, local in zip(slots, zero._all_gather(slots, k)))

    @staticmethod
    def backward(ctx, *grads):
        zero, slots = ctx.zero, ctx.slots
        have = [i for i, g in enumerate(grads) if g is not None]
        reduced = zero._reduce([grads[i] for i in have],
                               [tuple(slots[i].param.placements) for i in have],
                               [slots[i].axis for i in have]) if have else []
        out: list = [None] * len(slots)
        for i, g in zip(have, reduced):
            out[i] = g
        return (None, None, None, *out)


@dataclass
class Zero:
    """The ZeRO bookkeeping of one stage's chunk (module docstring)."""

    zero: int
    sm: StageMesh
    local: bool = False                # compute on plain tensors (:meth:`begin_step`)
    slots: list[_Slot] = field(default_factory=list)

    @classmethod
    def attach(cls, chunk: nn.Module, zero: int, sm: StageMesh,
               compute: dict[str, tuple[Placement, ...]], *, local: bool = False) -> "Zero":
        if local and zero == 3:
            raise ValueError("local mode gathers once per step; ZeRO-3 gathers per module")
        z = cls(zero=zero, sm=sm, local=local)
        fqns: list[str] = []
        for mod_name, module in chunk.named_modules():
            for name, param in module.named_parameters(recurse=False):
                fqn = f"{mod_name}.{name}" if mod_name else name
                fqn = fqn.replace("_checkpoint_wrapped_module.", "")
                z.slots.append(_Slot(module=module, name=name, param=param,
                                     compute=compute[fqn]))
                fqns.append(fqn)
        if zero == 3:
            units: dict[int, tuple[nn.Module, list[_Slot]]] = {}
            for fqn, s in zip(fqns, z.slots):
                if s.axis is not None:
                    unit = _unit(chunk, fqn)
                    units.setdefault(id(unit), (unit, []))[1].append(s)
            for unit, slots in units.values():
                unit.register_forward_pre_hook(
                    lambda _m, _a, slots=slots: z._gather_in_autograd(slots))
                unit.register_forward_hook(
                    lambda _m, _a, _o, slots=slots: z._put_back(slots))
        return z

    # ---- swapping ------------------------------------------------------------------------
    @staticmethod
    def _swap_in(s: _Slot, tensor: torch.Tensor) -> None:
        s.module._parameters[s.name] = tensor      # noqa: SLF001 - FSDP2 swaps the same way

    def _gather_in_autograd(self, slots: list[_Slot]) -> None:
        """ZeRO-3: one bucketed all-gather per shard axis for a unit's weights, whose
        backward is one bucketed reduce-scatter (:class:`_GatherBucket`)."""
        for k, group in _by_axis(slots):
            fulls = _GatherBucket.apply(self, k, group, *[s.param for s in group])
            for s, full in zip(group, fulls):
                self._swap_in(s, full)

    def _put_back(self, slots: list[_Slot]) -> None:
        for s in slots:
            self._swap_in(s, s.param)

    # ---- bucketed collectives -----------------------------------------------------------
    def _group(self, k: int):
        return self.sm.mesh.get_group(self.sm.axis_names[k])

    @torch.no_grad()
    def _all_gather(self, slots: list[_Slot], k: int) -> list[torch.Tensor]:
        """The compute-placement local tensors of ``slots`` (all sharded along dim ``k``)."""
        n = self.sm.mesh.size(k)
        shapes = [_local_shape(s.param, s.compute) for s in slots]
        rows = [math.prod(sh[1:]) for sh in shapes]
        sizes = [_chunk_sizes(sh[0], n) for sh in shapes]
        widths = [max(sz) * r for sz, r in zip(sizes, rows)]
        total = sum(widths)
        ref = slots[0].param.to_local()
        buf = torch.zeros(total, dtype=ref.dtype, device=ref.device)
        off = 0
        for s, w in zip(slots, widths):
            local = s.param.to_local().reshape(-1)
            buf[off:off + local.numel()] = local
            off += w
        out = torch.empty(n * total, dtype=buf.dtype, device=buf.device)
        dist.all_gather_single(out, buf, group=self._group(k))
        out = out.view(n, total)
        result, off = [], 0
        for sh, r, sz, w in zip(shapes, rows, sizes, widths):
            pieces = [out[j, off:off + sz[j] * r].view(sz[j], *sh[1:]) for j in range(n)]
            result.append(torch.cat(pieces))
            off += w
        return result

    @torch.no_grad()
    def _reduce(self, grads: list[DTensor], targets: list[tuple[Placement, ...]],
                zero_axes: list[int | None]) -> list[DTensor]:
        """``grads`` (partial sums where the batch was split) reduced to ``targets``: one
        reduce-scatter per axis sharded by ZeRO (``zero_axes``), one all-reduce per axis left
        replicated; any other change goes through DTensor's ``redistribute``."""
        locals_ = [g.to_local() for g in grads]
        placements = [list(g.placements) for g in grads]
        mesh = grads[0].device_mesh
        for k in range(mesh.ndim):
            scatter = [i for i, (p, t) in enumerate(zip(placements, targets))
                       if isinstance(p[k], Partial) and zero_axes[i] == k]
            if scatter:
                n = mesh.size(k)
                me = mesh.get_local_rank(k)
                shapes = [tuple(locals_[i].shape) for i in scatter]
                rows = [math.prod(sh[1:]) for sh in shapes]
                sizes = [_chunk_sizes(sh[0], n) for sh in shapes]
                widths = [max(sz) * r for sz, r in zip(sizes, rows)]
                total = sum(widths)
                buf = torch.zeros(n, total, dtype=locals_[scatter[0]].dtype,
                                  device=locals_[scatter[0]].device)
                off = 0
                for i, r, sz, w in zip(scatter, rows, sizes, widths):
                    flat = locals_[i].reshape(-1)
                    start = 0
                    for j in range(n):
                        buf[j, off:off + sz[j] * r] = flat[start:start + sz[j] * r]
                        start += sz[j] * r
                    off += w
                out = torch.empty(total, dtype=buf.dtype, device=buf.device)
                dist.reduce_scatter_single(out, buf.view(-1), group=self._group(k))
                off = 0
                for i, sh, r, sz, w in zip(scatter, shapes, rows, sizes, widths):
                    locals_[i] = out[off:off + sz[me] * r].view(sz[me], *sh[1:]).clone()
                    placements[i][k] = targets[i][k]
                    off += w
            reduce = [i for i, (p, t) in enumerate(zip(placements, targets))
                      if isinstance(p[k], Partial) and isinstance(t[k], Replicate)]
            if reduce:
                flat = torch.cat([locals_[i].reshape(-1) for i in reduce])
                dist.all_reduce(flat, group=self._group(k))
                off = 0
                for i in reduce:
                    m = locals_[i].numel()
                    locals_[i] = flat[off:off + m].view(locals_[i].shape)
                    placements[i][k] = Replicate()
                    off += m
        out = []
        for g, local, p, t in zip(grads, locals_, placements, targets):
            d = DTensor.from_local(local, mesh, p, run_check=False, shape=g.shape,
                                   stride=g.stride())
            if tuple(p) != tuple(t):           # anything unusual: DTensor's general path
                d = d.redistribute(mesh, t)
            out.append(d)
        return out

    # ---- the step ----------------------------------------------------------------------
    def begin_step(self) -> None:
        """ZeRO-1/2: gather every sharded parameter once for this step's micro-batches. In
        local mode (every parameter computed replicated: plain data parallelism), every
        parameter is swapped for a plain tensor, so the stage computes without DTensor."""
        if self.zero not in (1, 2) and not self.local:
            return
        for k, slots in _by_axis([s for s in self.slots if s.axis is not None or self.local]):
            gathered = self._all_gather(slots, k) if k is not None else \
                [s.param.to_local() for s in slots]
            for s, local in zip(slots, gathered):
                full = local.detach() if self.local else s.as_dtensor(local, s.compute)
                full.requires_grad_(s.param.requires_grad)
                s.full = full
                self._swap_in(s, full)

    def after_backward(self) -> None:
        """ZeRO-2: after a micro-batch's backward, reduce-scatter its gradients."""
        if self.zero == 2:
            self._reduce_full_grads()

    def _reduce_full_grads(self) -> None:
        slots = [s for s in self.slots if s.full is not None and s.full.grad is not None]
        if not slots:
            return
        # a local-mode gradient is what it is: partial sums over the data axes
        partial = [Partial() if a in self.sm.data_axes else Replicate()
                   for a in self.sm.axis_names]
        grads = [s.as_dtensor(s.full.grad, partial) if self.local else s.full.grad
                 for s in slots]
        reduced = self._reduce(grads, [tuple(s.param.placements) for s in slots],
                               [s.axis for s in slots])
        for s, g in zip(slots, reduced):
            s.param.grad = g if s.param.grad is None else s.param.grad + g
            s.full.grad = None

    @torch.no_grad()
    def end_step(self) -> None:
        """Reduce what is left of the gradients to the at-rest placements; put the at-rest
        parameters back."""
        self._reduce_full_grads()
        for s in self.slots:
            if s.full is not None:
                self._swap_in(s, s.param)
                s.full = None
        pending = [s for s in self.slots if isinstance(s.param.grad, DTensor)
                   and tuple(s.param.grad.placements) != tuple(s.param.placements)]
        if pending:
            reduced = self._reduce([s.param.grad for s in pending],
                                   [tuple(s.param.placements) for s in pending],
                                   [s.axis for s in pending])
            for s, g in zip(pending, reduced):
                s.param.grad = g
