"""The runtimes behind one small protocol, chosen from the plan.

The engine's common core — the process group and mesh (:mod:`engine.mesh`), data
(:mod:`engine.data`), the training loop with metrics and checkpoints (:mod:`engine.train`,
:mod:`engine.metrics`, :mod:`engine.checkpoint`) — is shared; what differs is how a plan
becomes this rank's model. A :class:`Runtime` does two things:

* ``check(plan, spec, source)`` — every check that needs no process group (raises
  :class:`autoplan.errors.PlanError` naming the plan file and field);
* ``trainer(plan, spec, cfg, device, source)`` — builds this rank's meshes and model
  (collective) and returns the trainer whose ``run()`` trains.

:func:`select` picks one: :func:`autoplan.capability.runtime_for` (data only) says whether
an adapted runtime knows the model; among those, :func:`engine.staged.runs_per_op` picks
the per-op runtime for search placements the uniform layout cannot express.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch

from autoplan.capability import generic_gap, runtime_for
from autoplan.errors import PlanError
from autoplan.models.registry import ModelSpec
from autoplan.plan import Plan
from engine.config import RunConfig


class Runtime(Protocol):
    name: str

    def check(self, plan: Plan, spec: ModelSpec, source: str) -> None: ...

    def trainer(self, plan: Plan, spec: ModelSpec, cfg: RunConfig, device: torch.device, *,
                source: str) -> Any: ...


class Uniform:
    """Megatron-style: one ``(pp, dp, tp)`` mesh, TP styles, FSDP2, pipelining schedules
    (:mod:`engine.parallelize`)."""

    name = "uniform"

    def check(self, plan, spec, source):
        from engine.validate import check_engine_support

        check_engine_support(plan, spec, source)

    def trainer(self, plan, spec, cfg, device, *, source):
        from engine.mesh import build_mesh
        from engine.train import Trainer

        return Trainer(plan, spec, cfg, build_mesh(plan, device, cfg.timeout_s), source=source)


class PerOp:
    """Per-op DTensor placements on stage submeshes of any shape (:mod:`engine.staged`)."""

    name = "per_op"

    def check(self, plan, spec, source):
        from engine.staged import check_staged_support

        check_staged_support(plan, spec, source)

    def trainer(self, plan, spec, cfg, device, *, source):
        from engine.placements import build_stage_meshes
        from engine.staged import StagedPlace, StagedTrainer

        meshes = build_stage_meshes(plan, device.type)
        return StagedTrainer(plan, spec, cfg, StagedPlace(plan, meshes, device), meshes,
                             source=source)


class Generic:
    """Any traced model from the plan's placements (:mod:`engine.generic`)."""

    name = "generic"

    def check(self, plan, spec, source):
        from engine.validate import check_standard_mesh

        gap = generic_gap(plan)
        if gap:
            raise PlanError(f"plan {source}: {gap}")
        check_standard_mesh(plan, source)

    def trainer(self, plan, spec, cfg, device, *, source):
        from engine.generic_train import GenericTrainer
        from engine.mesh import build_mesh

        return GenericTrainer(plan, spec, cfg, build_mesh(plan, device, cfg.timeout_s),
                              source=source)


RUNTIMES: dict[str, Runtime] = {r.name: r for r in (Uniform(), PerOp(), Generic())}


def select(plan: Plan, spec: ModelSpec) -> Runtime:
    """The runtime that runs ``plan`` of ``spec`` (module docstring)."""
    kind = runtime_for(spec, plan)
    if kind == "generic":
        return RUNTIMES["generic"]
    from engine.staged import runs_per_op

    return RUNTIMES["per_op" if runs_per_op(plan, spec) else "uniform"]


def make_trainer(plan: Plan, spec: ModelSpec, cfg: RunConfig, device: torch.device, *,
                 source: str):
    """The trainer of ``plan`` on this rank (collective: builds the meshes)."""
    return select(plan, spec).trainer(plan, spec, cfg, device, source=source)


def check_all(plan: Plan, source: str, *, world_size: int,
              local_world_size: int | None = None) -> ModelSpec:
    """Every pre-collective check, cheapest first."""
    if plan.parallel.tp_comm_overlap:
        raise PlanError(f"plan {source}: field 'parallel.tp_comm_overlap': the engine does "
                        "not overlap tensor-parallel collectives with their GEMMs (Megatron-LM "
                        "--tp-comm-overlap needs Transformer Engine userbuffers, torchtitan's "
                        "async TP torch.compile on CUDA); export it to Megatron-LM or "
                        "torchtitan, or plan without it (its prediction assumes the overlap)")
    from engine.validate import check_device, check_model, check_world

    check_world(plan, source, world_size=world_size, local_world_size=local_world_size)
    check_device(plan, source, local_world_size=local_world_size)
    spec = check_model(plan, source)
    runtime = select(plan, spec)
    p = plan.parallel
    if (p.ep > 1 or p.cp > 1) and runtime.name != "uniform":
        raise PlanError(f"plan {source}: field 'parallel' asks for expert (ep = {p.ep}) or "
                        f"context (cp = {p.cp}) parallelism, which the engine runs in its "
                        f"uniform runtime only, not the {runtime.name} one this plan needs "
                        "(plan it with --planner uniform)")
    runtime.check(plan, spec, source)
    return spec
