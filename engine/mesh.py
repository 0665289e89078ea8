"""The process group and the named DeviceMesh a plan runs on.

Layout (:mod:`autoplan.plan`): axes ``("pp", "dp", "tp")`` row-major over global ranks,
``rank = (p * dp + d) * tp + t`` — ``tp`` varies fastest (inside a node), ``pp`` slowest.
Pipeline stage ``s`` (of ``pp * virtual_stages``) runs on pipeline rank ``s % pp``.

One code path for CPU and GPU: the device type comes from the plan (``mesh.device_type``),
the device index from torchrun's ``LOCAL_RANK``. CPU runs use gloo; GPU runs use NCCL for the
mesh and ``cpu:gloo,cuda:nccl`` for the default group (checkpoint metadata is gathered on CPU).
Every group — the default one and each mesh axis — gets the run's collective timeout, so a
dead or hung rank fails the run after ``timeout_s`` instead of hanging it.

Expert and context parallelism (``parallel.ep`` / ``parallel.cp`` > 1) use a finer mesh over
the same ranks, ``("pp", "edp", "ep", "cp", "tp")`` with ``dp = edp · ep``, row-major as
the plan's ``(pp, dp, cp, tp)`` (:func:`autoplan.plan.stage_ranks`): data-parallel index
``d = e · ep + j``, so an expert-parallel group is ``ep`` consecutive data-parallel ranks
(GShard's, and Megatron-LM / torchtitan's folding of EP into DP), and the ranks holding the
same experts (*expert data parallel*) are those of equal ``j``: ``edp · cp`` of them. The
replicated weights' data-parallel mesh is then ``("edp", "ep", "cp")`` flattened — every
rank holding a replica, ``dp · cp`` of them — which FSDP2 shards or replicates over.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from autoplan.plan import Plan

AXES = ("pp", "dp", "tp")
EXPERT_AXES = ("pp", "edp", "ep", "cp", "tp")
_MESH_BACKEND = {"cpu": "gloo", "cuda": "nccl"}
_DEFAULT_BACKEND = {"cpu": "gloo", "cuda": "cpu:gloo,cuda:nccl"}


@dataclass(frozen=True, kw_only=True)
class ParallelMesh:
    """The world as the engine sees it; passed explicitly, never global."""

    mesh: DeviceMesh                   # 3-D, axes pp, dp, tp
    device: torch.device
    rank: int
    pp: int
    dp: int
    tp: int
    pp_rank: int
    dp_rank: int
    tp_rank: int
    stages: tuple[int, ...]            # plan stage indices this rank runs (>1: interleaved)
    num_stages: int
    ep: int = 1                        # expert parallelism (a split of dp)
    cp: int = 1                        # context parallelism (its own axis)
    cp_rank: int = 0
    replica_mesh: DeviceMesh | None = None    # the (edp, ep, cp) ranks, flattened (ep/cp > 1)

    @property
    def pp_mesh(self) -> DeviceMesh:
        return self.mesh["pp"]

    @property
    def dp_mesh(self) -> DeviceMesh:
        """The ranks holding replicas of a (non-expert) weight: ``dp`` of them, ``dp · cp``
        with context parallelism."""
        return self.replica_mesh if self.replica_mesh is not None else self.mesh["dp"]

    @property
    def ep_mesh(self) -> DeviceMesh:
        """This rank's expert-parallel group (``ep`` consecutive data-parallel ranks)."""
        return self.mesh["ep"]

    @property
    def cp_mesh(self) -> DeviceMesh:
        return self.mesh["cp"]

    @property
    def expert_replicas(self) -> int:
        """Ranks holding the same experts: ``dp · cp / ep``."""
        return self.dp * self.cp // self.ep

    def expert_replica_groups(self) -> list:
        """Process groups whose all-reduces, in turn, sum over the ranks holding this rank's
        experts (``edp`` then ``cp``; empty when there is one such rank)."""
        if self.replica_mesh is None:
            return []
        return [self.mesh[a].get_group() for a in ("edp", "cp") if self.mesh[a].size() > 1]

    @property
    def tp_mesh(self) -> DeviceMesh:
        return self.mesh["tp"]

    @property
    def is_last_stage_rank(self) -> bool:
        return self.pp_rank == self.pp - 1

    def describe(self) -> str:
        extra = (f" ep {self.dp_rank % self.ep}/{self.ep}" if self.ep > 1 else "") + \
            (f" cp {self.cp_rank}/{self.cp}" if self.cp > 1 else "")
        return (f"rank {self.rank}: pp {self.pp_rank}/{self.pp} dp {self.dp_rank}/{self.dp}"
                f"{extra} tp {self.tp_rank}/{self.tp}, stages {list(self.stages)}, "
                f"{self.device}")


def device_for(device_type: str) -> torch.device:
    """This process's device: ``cpu``, or ``cuda:LOCAL_RANK`` (made current)."""
    if device_type == "cpu":
        return torch.device("cpu")
    index = int(os.environ.get("LOCAL_RANK", "0"))
    module = torch.get_device_module(device_type)
    module.set_device(index)
    return torch.device(device_type, index)


def init_distributed(device_type: str, timeout_s: float) -> torch.device:
    """``init_process_group`` from torchrun's environment with the run's timeout."""
    device = device_for(device_type)
    if not dist.is_initialized():
        kwargs = {}
        if device.type != "cpu":
            kwargs["device_id"] = device
        dist.init_process_group(backend=_DEFAULT_BACKEND[device_type],
                                timeout=timedelta(seconds=timeout_s), **kwargs)
    return device


def _axis_options(device_type: str, timeout_s: float):
    backend = _MESH_BACKEND[device_type]
    if backend == "gloo":
        opts = dist.ProcessGroupGloo._Options()
    else:
        opts = dist.ProcessGroupNCCL.Options()
    opts._timeout = timedelta(seconds=timeout_s)
    return backend, opts


def build_mesh(plan: Plan, device: torch.device, timeout_s: float) -> ParallelMesh:
    """The plan's mesh over the initialised world (collective: every rank calls it)."""
    if plan.parallel.ep > 1 or plan.parallel.cp > 1:
        return _build_expert_mesh(plan, device, timeout_s)
    shape = dict(zip(plan.mesh.axis_names, plan.mesh.shape))
    dims = tuple(shape.get(a, 1) for a in AXES)
    override = {a: _axis_options(plan.mesh.device_type, timeout_s) for a in AXES}
    mesh = init_device_mesh(plan.mesh.device_type, dims, mesh_dim_names=AXES,
                            backend_override=override)
    rank = dist.get_rank()
    pp, dp, tp = dims
    pp_rank, rest = divmod(rank, dp * tp)
    dp_rank, tp_rank = divmod(rest, tp)
    coords = mesh.get_coordinate()
    assert tuple(coords) == (pp_rank, dp_rank, tp_rank), (coords, rank)
    stages = tuple(s.index for s in plan.stages if rank in s.ranks)
    return ParallelMesh(mesh=mesh, device=device, rank=rank, pp=pp, dp=dp, tp=tp,
                        pp_rank=pp_rank, dp_rank=dp_rank, tp_rank=tp_rank, stages=stages,
                        num_stages=len(plan.stages))


def _build_expert_mesh(plan: Plan, device: torch.device, timeout_s: float) -> ParallelMesh:
    """The ``("pp", "edp", "ep", "cp", "tp")`` mesh of an EP / CP plan (module docstring)."""
    p = plan.parallel
    dims = (p.pp, p.dp // p.ep, p.ep, p.cp, p.tp)
    override = {a: _axis_options(plan.mesh.device_type, timeout_s) for a in EXPERT_AXES}
    mesh = init_device_mesh(plan.mesh.device_type, dims, mesh_dim_names=EXPERT_AXES,
                            backend_override=override)
    replicas = mesh["edp", "ep", "cp"]._flatten("dp_cp")
    rank = dist.get_rank()
    pp_rank, e, j, cp_rank, tp_rank = mesh.get_coordinate()
    stages = tuple(s.index for s in plan.stages if rank in s.ranks)
    return ParallelMesh(mesh=mesh, device=device, rank=rank, pp=p.pp, dp=p.dp, tp=p.tp,
                        pp_rank=pp_rank, dp_rank=e * p.ep + j, tp_rank=tp_rank,
                        stages=stages, num_stages=len(plan.stages), ep=p.ep, cp=p.cp,
                        cp_rank=cp_rank, replica_mesh=replicas)
