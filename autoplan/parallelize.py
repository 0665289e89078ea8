"""Apply a plan inside your own training script: ``autoplan.parallelize``.

Keep your model, data loading and training loop; the plan only decides how the model is
split (as DeepSpeed's ``initialize`` or Accelerate's ``prepare`` do). Launch the script
with torchrun, one process per device of the plan::

    torchrun --standalone --nproc_per_node=4 train.py

    # train.py
    import torch, autoplan

    model = MyModel()                                  # any nn.Module (real or meta weights)
    plan = autoplan.Plan.load("plan.json")             # e.g. autoplan.optimize(...).save(...)
    model, optimizer = autoplan.parallelize(
        model, plan, lambda params: torch.optim.AdamW(params, lr=1e-3),
        loss_fn=torch.nn.functional.cross_entropy,     # or a model returning the loss / .loss
        example_batch=(x0, y0))                        # one global batch; needed for pp > 1
    for x, y in loader:                                # the global batch, or this rank's rows
        loss = model.step((x, y))                      # forwards + backwards, all micro-batches
        optimizer.step()
        optimizer.zero_grad()

``model.step(batch)`` runs one optimiser step's forwards and backwards — the plan's
micro-batches in a plain accumulation loop, or its pipeline schedule (GPipe, 1F1B,
interleaved 1F1B) where the plan has stages — and returns the mean loss over the batch (the
same value on every rank). ``batch`` is a tuple of tensors whose dim 0 is the sample: the
global batch (``plan.global_batch`` rows, each data-parallel rank takes its share) or this
rank's rows already (``global_batch / dp``). With ``loss_fn`` the last ``num_targets``
tensors are targets: ``loss = loss_fn(model(*inputs), *targets)``; without it the model's
output is the loss, or has a ``.loss`` (Hugging Face models given labels).

The model runs on :mod:`engine.generic` (data parallel / ZeRO through FSDP2, tensor
parallel on DTensors from the plan's placements, pipeline stages cut at the plan's layer
boundaries by ``torch.distributed.pipelining``); what it cannot run for a plan is refused
before any collective (:func:`autoplan.capability.generic_gap`). Weights: the module's own
(every rank must hold the same values, e.g. built after the same ``torch.manual_seed``); a
meta-device module is materialised on the host with each submodule's
``reset_parameters()`` under ``torch.manual_seed(seed)``.
"""

from __future__ import annotations

import os
import sys
import types
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

import torch
import torch.nn as nn

from autoplan.capability import generic_gap
from autoplan.errors import PlanError
from autoplan.plan import Plan


class ParallelModel:
    """The user's model as this rank runs it (see the module docstring)."""

    def __init__(self, generic, pm, module: nn.Module):
        self._generic, self.mesh, self.module = generic, pm, module

    @property
    def parameters_owned(self) -> list[nn.Parameter]:
        """The parameters (shards) this rank updates."""
        return [p for m in self._generic.modules for p in m.parameters()]

    @property
    def stage_modules(self) -> list[nn.Module]:
        """This rank's pipeline stage modules (the whole model without stages)."""
        return list(self._generic.modules)

    def step(self, batch: Sequence[torch.Tensor]) -> float:
        """Forwards and backwards of one optimiser step; returns the batch's mean loss."""
        import torch.distributed as dist

        local = self._generic.step(tuple(batch))
        has = float(self._generic.has_loss)
        pair = torch.stack([local.float(), torch.tensor(has, device=local.device)])
        dist.all_reduce(pair)
        return (pair[0] / pair[1]).item()


def _materialize(model: nn.Module, seed: int) -> None:
    """Give a meta-device module host memory and its own initial values."""
    if not any(t.is_meta for t in (*model.parameters(), *model.buffers())):
        return
    model.to_empty(device="cpu")
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        for name, module in model.named_modules():
            own = list(module.parameters(recurse=False))
            if not own:
                continue
            reset = getattr(module, "reset_parameters", None)
            if reset is None:
                raise PlanError(f"module {name or type(model).__name__} has meta parameters "
                                "and no reset_parameters(); pass the model with its weights")
            reset()


def parallelize(model: nn.Module, plan: Plan | str | Path,
                optimizer_factory: Callable[[Iterable[nn.Parameter]], Any] | None = None, *,
                loss_fn: Callable[..., torch.Tensor] | None = None, num_targets: int = 1,
                example_batch: Sequence[torch.Tensor] | None = None, seed: int = 0,
                timeout_s: float = 300.0) -> tuple[ParallelModel, Any]:
    """Split ``model`` as ``plan`` says on this rank; returns ``(model, optimizer)`` (the
    optimizer over this rank's parameter shards, None without a factory). Collective: every
    rank of the torchrun launch calls it."""
    from engine.generic import GenericModel, LossModule
    from engine.mesh import build_mesh, init_distributed
    from engine.parallelize import resolve_precision
    from engine.validate import check_standard_mesh, check_world

    source = str(plan) if not isinstance(plan, Plan) else "<plan>"
    if not isinstance(plan, Plan):
        plan = Plan.load(plan)
    if "WORLD_SIZE" not in os.environ:
        raise PlanError(f"plan {source} needs {plan.world_size} ranks; launch the script with "
                        f"torchrun --nproc_per_node={plan.world_size}")
    check_world(plan, source, world_size=int(os.environ["WORLD_SIZE"]))
    gap = generic_gap(plan)
    if gap:
        raise PlanError(f"plan {source}: {gap}")
    check_standard_mesh(plan, source)
    _materialize(model, seed)
    n = sum(p.numel() for p in model.parameters())
    if plan.num_params and n != plan.num_params:
        raise PlanError(f"plan {source}: field 'num_params' is {plan.num_params} but the model "
                        f"has {n} parameters; plan this model")
    if plan.parallel.pp > 1 and example_batch is None:
        raise PlanError(f"plan {source} has {plan.parallel.pp} pipeline stages: pass "
                        "example_batch= (one global batch) so the model can be split")
    device = init_distributed(plan.mesh.device_type, timeout_s)
    pm = build_mesh(plan, device, timeout_s)
    precision, _ = resolve_precision(plan, device)
    wrapped = LossModule(model, loss_fn, num_targets)
    example = tuple(example_batch) if example_batch is not None else ()
    if plan.parallel.pp > 1 and len(example[0]) != plan.global_batch:
        raise PlanError(f"example_batch has {len(example[0])} rows; pass one global batch of "
                        f"{plan.global_batch} (plan field 'global_batch')")
    generic = GenericModel(wrapped, plan, pm, precision=precision, example=example,
                           prefix="module.")
    parallel = ParallelModel(generic, pm, model)
    optimizer = optimizer_factory(parallel.parameters_owned) if optimizer_factory else None
    return parallel, optimizer


class _CallableModule(types.ModuleType):
    """``autoplan.parallelize(...)`` calls :func:`parallelize` even once this module has
    been imported (importing a submodule binds its name on the package, over the lazy
    export of :mod:`autoplan`)."""

    def __call__(self, *args, **kwargs):
        return parallelize(*args, **kwargs)


sys.modules[__name__].__class__ = _CallableModule
