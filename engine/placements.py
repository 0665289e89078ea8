"""A search plan's placements as DTensor objects, on a stage's own submesh.

A search plan (``planner.name == "auto"``, :mod:`autoplan.planner.search.to_plan`) says, per stage:
the ranks and the shape of its logical mesh (``mesh_shape``, ``axis_names``), the placement
each parameter is computed with on every axis (``param_placements[fqn][axis]``), the axes
the batch is split along (``data_axes``), and the placement the search chose for the output
of some ops (``activation_placements``). The engine runs such a stage as one SPMD program
over DTensors (:mod:`engine.staged`):

* every parameter is a DTensor on the stage mesh with its planned placements (ZeRO shards
  it further at rest, :mod:`engine.zero`);
* the stage's input is a DTensor with ``Shard(0)`` (the batch) on each data axis, in axis
  order, and ``Replicate()`` on the others — so rank ``c`` of the mesh holds rows
  ``[i B/n, (i+1) B/n)`` of the micro-batch, with ``i`` its row-major index over the data
  axes and ``n`` their size product (:func:`batch_rows`);
* every op between runs through DTensor's sharding propagation, which redistributes an
  input where the op's strategy needs another placement; the outputs of the modules whose
  op the search placed are redistributed to that placement (:func:`enforce_activations`).

Plain tensors created inside ``forward`` (a position index) count as replicated
(``implicit_replication``). DTensor has no sharding rule for the CPU flash-attention kernel
that ``scaled_dot_product_attention`` runs on CPU; :func:`register_cpu_attention` adds one
(the batch and head dimensions shard, as in DTensor's rule for the CUDA kernel).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import (DTensor, Partial, Placement, Replicate, Shard,
                                      distribute_tensor)

from autoplan.errors import PlanError
from autoplan.placement import REPLICATED, PlacementError, parse
from autoplan.placement_dtensor import to_dtensor
from autoplan.plan import Plan, Stage
from engine.tensor_parallel import parse_placement


def parse_activation(text: str, where: str) -> Placement | None:
    """``"Shard(1)"`` -> ``Shard(1)`` (:mod:`autoplan.placement` parses it); None for
    ``_StridedShard(d)`` (a flattened dimension sharded along its inner factor: its rows are
    not a contiguous block, so the engine lets DTensor choose rather than force it);
    ``where`` names the plan field in errors."""
    try:
        p = parse(text, f"field '{where}'")
    except PlacementError as exc:
        raise PlanError(str(exc)) from None
    return None if p.strided else to_dtensor(p)


@dataclass(frozen=True)
class StageMesh:
    """One stage's logical mesh over its global ranks, and this rank's place in it."""

    index: int
    mesh: DeviceMesh
    ranks: np.ndarray                  # global ranks, shaped like the mesh
    axis_names: tuple[str, ...]
    data_axes: tuple[str, ...]

    @property
    def data_size(self) -> int:
        """How many pieces the batch is split into (the product of the data axes)."""
        return math.prod(self.ranks.shape[self.axis_names.index(a)] for a in self.data_axes)

    def data_index(self, rank: int) -> int:
        """``rank``'s row-major index over the data axes (which batch piece it holds)."""
        coord = np.argwhere(self.ranks == rank)[0]
        index = 0
        for a in self.data_axes:
            k = self.axis_names.index(a)
            index = index * self.ranks.shape[k] + int(coord[k])
        return index

    def batch_placements(self) -> tuple[Placement, ...]:
        """The placement of a batch-major tensor held by data piece: ``Shard(0)`` on each
        data axis (left to right = row-major), ``Replicate()`` elsewhere."""
        return tuple(Shard(0) if a in self.data_axes else Replicate()
                     for a in self.axis_names)

    def contains(self, rank: int) -> bool:
        return bool((self.ranks == rank).any())


def build_stage_meshes(plan: Plan, device_type: str) -> list[StageMesh]:
    """One :class:`StageMesh` per plan stage (collective: every rank builds every stage's
    mesh, since creating a process group involves the whole world)."""
    out = []
    for st in plan.stages:
        ranks = np.asarray(st.ranks, dtype=np.int64).reshape(tuple(st.mesh_shape))
        names = tuple(st.axis_names)
        unknown = set(st.data_axes) - set(names)
        if unknown:
            raise PlanError(f"field 'stages[{st.index}].data_axes': {sorted(unknown)} are not "
                            f"axes of the stage ({list(names)})")
        data = tuple(a for a in names if a in st.data_axes)
        mesh = DeviceMesh(device_type, torch.as_tensor(ranks), mesh_dim_names=names)
        out.append(StageMesh(index=st.index, mesh=mesh, ranks=ranks, axis_names=names,
                             data_axes=data))
    return out


def batch_rows(sm: StageMesh, rank: int, micro_batch: int) -> tuple[int, int]:
    """Rows ``[lo, hi)`` of a micro-batch of ``micro_batch`` samples that ``rank`` holds."""
    n = sm.data_size
    if micro_batch % n:
        raise PlanError(f"stage {sm.index}: a micro-batch of {micro_batch} samples does not "
                        f"split over its data axes {list(sm.data_axes)} ({n} pieces)")
    per = micro_batch // n
    i = sm.data_index(rank)
    return i * per, (i + 1) * per


def param_placements(plan: Plan, st: Stage, fqn: str) -> tuple[Placement, ...]:
    """The placements ``fqn`` is computed with on ``st``'s axes (absent: replicated)."""
    axes = plan.param_placements.get(fqn, {})
    return tuple(parse_placement(axes.get(a, REPLICATED), f"{fqn}.{a}")
                 for a in st.axis_names)


def distribute_parameters(chunk: nn.Module, plan: Plan, st: Stage, sm: StageMesh,
                          at_rest) -> dict[str, tuple[Placement, ...]]:
    """Replace every parameter of ``chunk`` (on meta) by a DTensor on the stage mesh, with
    the placements ``at_rest(fqn, compute)`` returns (ZeRO's); returns the compute
    placements per FQN. Sizes are checked: a sharded dim must be at least the axis size."""
    compute: dict[str, tuple[Placement, ...]] = {}
    for mod_name, module in chunk.named_modules():
        for name, param in list(module.named_parameters(recurse=False)):
            fqn = f"{mod_name}.{name}" if mod_name else name
            if isinstance(param, DTensor):
                raise PlanError(f"parameter {fqn} is shared with another module (tied "
                                "weights): a search plan cannot place it yet")
            pl = param_placements(plan, st, fqn)
            for a, p in zip(st.axis_names, pl):
                if isinstance(p, Shard):
                    dim = p.dim % param.dim() if param.dim() else None
                    size = sm.ranks.shape[st.axis_names.index(a)]
                    if dim is None or param.shape[dim] < size:
                        raise PlanError(f"field 'param_placements.{fqn}.{a}': {p} of shape "
                                        f"{tuple(param.shape)} over {size} ranks")
            compute[fqn] = pl
            dt = distribute_tensor(param.detach(), sm.mesh, list(at_rest(fqn, param, pl)),
                                   src_data_rank=None)          # on meta: no data moves
            module.register_parameter(name, nn.Parameter(dt, requires_grad=param.requires_grad))
    return compute


def activation_hooks(chunk: nn.Module, st: Stage, sm: StageMesh,
                     op_modules: dict[str, tuple[str, int, int]]) -> int:
    """Redistribute the output of each leaf module holding an op the plan placed to that
    placement (``op_modules``: op -> (module, op rank, module output rank), from the trace;
    the last placed op of a module wins). A linear layer's 2-D matmul placement maps onto
    its 3-D output: ``Shard(0)`` (tokens) -> the batch, ``Shard(1)`` -> the features.
    Returns how many modules got a hook."""
    wanted: dict[str, tuple[Placement, ...]] = {}
    for op, axes in st.activation_placements.items():
        if op not in op_modules:
            continue
        fqn, op_rank, out_rank = op_modules[op]
        pl = tuple(parse_activation(axes.get(a, REPLICATED),
                                    f"stages[{st.index}].activation_placements.{op}.{a}")
                   for a in st.axis_names)
        if None in pl:
            continue
        if op_rank != out_rank:
            if (op_rank, out_rank) != (2, 3):
                continue
            pl = tuple(Shard(2) if isinstance(p, Shard) and p.dim % 2 == 1 else p
                       for p in pl)
        if any(isinstance(p, Partial) for p in pl):
            continue                   # pending sums: DTensor produces them where needed
        wanted[fqn] = pl
    modules = dict(chunk.named_modules())
    count = 0
    for fqn, pl in wanted.items():
        module = modules.get(fqn)
        if module is None:
            continue

        def hook(_mod, _args, out, pl=pl):
            if isinstance(out, DTensor) and tuple(out.placements) != pl \
                    and _divisible(out, pl, sm):
                return out.redistribute(sm.mesh, pl)
            return out

        module.register_forward_hook(hook)
        count += 1
    return count


def _divisible(t: DTensor, pl: tuple[Placement, ...], sm: StageMesh) -> bool:
    """Whether ``pl`` shards ``t`` into equal pieces (otherwise let DTensor choose)."""
    shape = list(t.shape)
    for k, p in enumerate(pl):
        if isinstance(p, Shard):
            d = p.dim % len(shape)
            n = sm.ranks.shape[k]
            if shape[d] % n:
                return False
            shape[d] //= n
    return True


_REGISTERED = False


def register_cpu_attention() -> None:
    """Sharding rules for the CPU flash-attention kernels (forward and backward): the batch
    (dim 0) or the heads (dim 1) of q, k, v, the output and the log-sum-exp shard alike;
    otherwise everything is replicated. Idempotent."""
    global _REGISTERED
    if _REGISTERED:
        return
    from torch.distributed.tensor.experimental import register_sharding

    aten = torch.ops.aten
    choices = (Replicate(), Shard(0), Shard(1))

    @register_sharding(aten._scaled_dot_product_flash_attention_for_cpu.default)
    def _forward(query, key, value, dropout_p=0.0, is_causal=False, attn_mask=None,
                 scale=None):
        return [([p, p], [p, p, p, None, None, None if attn_mask is None else p, None])
                for p in choices]

    @register_sharding(aten._scaled_dot_product_flash_attention_for_cpu_backward.default)
    def _backward(grad_out, query, key, value, out, logsumexp, dropout_p, is_causal,
                  attn_mask=None, scale=None):
        return [([p, p, p], [p, p, p, p, p, p, None, None,
                             None if attn_mask is None else p, None])
                for p in choices]

    _REGISTERED = True
