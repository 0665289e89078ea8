"""The generic runtime: any traced model, parallelised from the plan's placements alone.

A model runs here when its forward takes one training batch and returns the loss — every
model :func:`autoplan.models.registry.build_model` builds (Hugging Face models of any
architecture and task, ``import:`` modules with an ``example_batch``), or a user's own
module through :func:`autoplan.parallelize.parallelize` (a ``loss_fn`` or an output's
``.loss`` supply the loss, :class:`LossModule`). Nothing here names an architecture: what a
placement needs comes from the plan, which the planner derived from the trace
(:mod:`autoplan.trace.roles` for column/row roles, :mod:`autoplan.trace.layers` for where
blocks start). Applied in one fixed order, on the uniform ``(pp, dp, tp)`` mesh
(:mod:`engine.mesh`):

1. **Initial values** — the model is built once on the host under ``torch.manual_seed(seed)``
   with its own initialisation (a user module keeps the weights it has), so every layout
   starts from bit-identical weights; each rank then keeps only its shards. Cost: one full
   copy of the model in host memory per rank while parallelising (the meta-device
   initialisation of :mod:`engine.model` needs a per-architecture rule, which is what this
   runtime avoids).
2. **Pipeline stages** (``pp > 1``) — ``torch.distributed.pipelining.pipeline`` captures the
   forward with ``torch.export`` (non-strict, on one micro-batch) and splits the graph at the
   trace's layer boundaries: ``SplitPoint.BEGINNING`` at the first block of every stage after
   the first. It is the one splitter that handles any module graph — skip connections such
   as an encoder output or labels read by a later stage are routed by the graph, which a
   module-sequence split (``nn.Sequential``-style) cannot do — and it runs on CPU with torch
   2.13. A model that does not export as one graph (data-dependent control flow) cannot be
   pipelined; the error says so. The stage modules execute graph code, not their blocks'
   ``forward``, so data parallelism wraps each stage as one unit and activation
   checkpointing and tensor parallelism are not applied to stages
   (:func:`autoplan.capability.generic_gap`).
3. **Tensor parallelism** (``tp > 1``, ``pp == 1``) — each parameter becomes a DTensor on the
   ``tp`` mesh with its planned placement (``Shard(0)`` column, ``Shard(1)`` row, as
   :mod:`autoplan.trace.roles` derived them; Megatron-LM, Shoeybi et al. 2019) and the
   forward runs on DTensors (``implicit_replication`` for the batch and tensors the model
   builds). DTensor's sharding propagation keeps every op's result equal to the unsharded
   one whatever the model hard-codes (``view(b, s, num_heads, head_dim)`` with global head
   counts, relative position biases), inserting the collectives the placements imply: the
   all-reduce after a row-parallel projection, a gather where an op needs the full tensor.
4. **Activation checkpointing** — ``checkpoint_wrapper`` on the stage's checkpointed blocks.
5. **Data parallelism / ZeRO** — :func:`engine.data_parallel.apply_dp` on the ``dp`` mesh
   (``replicate`` for ZeRO-0, ``fully_shard`` for 1-3), per block then the root, or per
   pipeline stage; over TP DTensors FSDP2 shards on ``dp`` as well (2-D).

The loss of step ``t`` is the mean of the micro-batch losses the model returns; with the
gradients averaged over data-parallel ranks and scaled by ``1 / num_micro_batches`` this is
the full batch's mean loss whenever every micro-batch holds the same number of loss terms
(no padding), so a one-process run of the same plan is the parity reference.
"""

from __future__ import annotations

import contextlib
import hashlib
from typing import Any, Callable, Sequence

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor, Replicate, distribute_tensor
from torch.distributed.tensor.experimental import implicit_replication

from autoplan.errors import PlanError
from autoplan.plan import Plan
from engine.data_parallel import apply_dp, mp_policy_for, set_microbatch
from engine.float8 import convert_float8
from engine.mesh import ParallelMesh
from engine.parallelize import Precision
from engine.recompute import mode_of, wrap
from engine.tensor_parallel import tp_placement

PRE, POST = "<pre>", "<post>"


def seed_for(*parts: Any) -> int:
    """A 63-bit seed from ``parts`` (sha256), the same on every rank."""
    digest = hashlib.sha256(":".join(map(str, parts)).encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


class LossModule(nn.Module):
    """``forward(*batch) -> scalar loss`` around a model whose output is the loss, has a
    ``.loss``, or goes through ``loss_fn(output, *targets)`` (the last ``num_targets``
    batch tensors are the targets). Its one child is named ``module``, so FQNs gain the
    prefix ``module.`` (:meth:`GenericModel.fqn`)."""

    def __init__(self, module: nn.Module, loss_fn: Callable[..., torch.Tensor] | None = None,
                 num_targets: int = 1):
        super().__init__()
        self.module = module
        self.loss_fn = loss_fn
        self.num_targets = num_targets if loss_fn is not None else 0

    def forward(self, *batch: torch.Tensor) -> torch.Tensor:
        k = self.num_targets
        inputs, targets = (batch[:-k], batch[-k:]) if k else (batch, ())
        out = self.module(*inputs)
        if self.loss_fn is not None:
            return self.loss_fn(out, *targets)
        if isinstance(out, torch.Tensor):
            if out.numel() != 1:
                raise PlanError(f"the model returned a tensor of shape {tuple(out.shape)}, not "
                                "a scalar loss; pass loss_fn to parallelize()")
            return out.reshape(())
        loss = getattr(out, "loss", None)
        if loss is None and isinstance(out, dict):
            loss = out.get("loss")
        if loss is None:
            raise PlanError(f"the model returned {type(out).__name__} without a loss; pass "
                            "loss_fn to parallelize() (or labels the model computes it from)")
        return loss


def split_points(plan: Plan, prefix: str = "") -> list[str]:
    """The module FQN at which each pipeline stage after the first begins."""
    points = []
    for st in plan.stages[1:]:
        first = st.layer_names[0] if st.layer_names else POST
        if first in (PRE, POST):
            raise PlanError(f"field 'stages[{st.index}].layer_names': a pipeline stage must "
                            f"begin with a block to be split there, got {first!r}")
        points.append(prefix + first)
    return points


def _set_param(root: nn.Module, fqn: str, value: nn.Parameter) -> None:
    owner, _, attr = fqn.rpartition(".")
    setattr(root.get_submodule(owner) if owner else root, attr, value)


def distribute_tp(model: nn.Module, plan: Plan, pm: ParallelMesh, prefix: str = "") -> int:
    """Every parameter a DTensor on the ``tp`` mesh with its planned placement (tied
    parameters stay one); returns how many are sharded."""
    sharded = 0
    done: dict[int, nn.Parameter] = {}
    for fqn, param in list(model.named_parameters(remove_duplicate=False)):
        if id(param) in done:
            _set_param(model, fqn, done[id(param)])
            continue
        name = fqn.removeprefix(prefix)
        place = tp_placement(plan.param_placements, name)
        if not isinstance(place, Replicate):
            # an uneven split (a dim smaller than tp) is a valid DTensor: its shards differ
            if param.dim() <= place.dim:
                raise PlanError(f"field 'param_placements.{name}.tp': {place} of a "
                                f"{param.dim()}-d parameter")
            sharded += 1
        new = nn.Parameter(distribute_tensor(param.detach(), pm.tp_mesh, [place],
                                             src_data_rank=None),
                           requires_grad=param.requires_grad)
        done[id(param)] = new
        _set_param(model, fqn, new)
    for fqn, buf in list(model.named_buffers()):
        owner, _, attr = fqn.rpartition(".")
        module = model.get_submodule(owner) if owner else model
        module.register_buffer(attr, distribute_tensor(buf, pm.tp_mesh, [Replicate()],
                                                       src_data_rank=None),
                               persistent=attr not in module._non_persistent_buffers_set)
    return sharded


class _DTensorForward(nn.Module):
    """Run ``module`` on DTensor parameters: plain inputs and tensors built inside count as
    replicated; the loss comes back as a plain tensor (its full value)."""

    def __init__(self, module: nn.Module):
        super().__init__()
        self.module = module

    def forward(self, *batch):
        with implicit_replication():
            loss = self.module(*batch)
        return loss.full_tensor() if isinstance(loss, DTensor) else loss


def _grads_like_params(model: nn.Module) -> None:
    """Give every DTensor gradient its parameter's placements (the optimizer updates in
    place, which DTensor allows only between tensors placed alike); DTensor may return a
    gradient placed otherwise, e.g. for a parameter split unevenly."""
    for param in model.parameters():
        grad = param.grad
        if isinstance(grad, DTensor) and isinstance(param, DTensor) \
                and grad.placements != param.placements:
            param.grad = grad.redistribute(param.device_mesh, param.placements)


def _check_tied_across_stages(model: nn.Module, pipe) -> None:
    """A weight shared by two stages (a tied LM head and input embedding) would become two
    copies trained apart: refuse it."""
    groups: dict[int, list[str]] = {}
    for fqn, param in model.named_parameters(remove_duplicate=False):
        groups.setdefault(id(param), []).append(fqn)
    where: dict[str, set[int]] = {}
    for i in range(pipe.num_stages):
        for fqn, _ in pipe.get_stage_module(i).named_parameters(remove_duplicate=False):
            where.setdefault(fqn.removeprefix("module."), set()).add(i)
    for names in groups.values():
        stages = set().union(*(where.get(n, set()) for n in names))
        if len(names) > 1 and len(stages) > 1:
            raise PlanError(f"field 'stages': the tied weights {names} fall in pipeline "
                            f"stages {sorted(stages)}; untie them (tie_word_embeddings=False) "
                            "or keep their layers in one stage")


def _contiguous_inputs(_module, args, kwargs):
    """Before a split point: what crosses to the next stage is sent by gloo, which takes
    contiguous tensors only, into buffers strided like the captured values."""
    fix = lambda v: v.contiguous() if isinstance(v, torch.Tensor) else v  # noqa: E731
    return tuple(map(fix, args)), {k: fix(v) for k, v in kwargs.items()}


def _contiguous_outputs(_module, _args, out):
    if isinstance(out, torch.Tensor):
        return out.contiguous()
    if isinstance(out, (tuple, list)):
        return type(out)(o.contiguous() if isinstance(o, torch.Tensor) else o for o in out)
    return out


class _ContiguousGrad(torch.autograd.Function):
    """Identity whose backward makes the gradient contiguous."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad.contiguous()


def _contiguous_input_grads(_module, args):
    return tuple(_ContiguousGrad.apply(a) if isinstance(a, torch.Tensor) and a.requires_grad
                 else a for a in args)


class _FirstStageInputs(nn.Module):
    """The model as the pipeline tracer sees it: every batch tensor goes through the first
    stage (a schedule hands the batch to the first stage only, so inputs read later — the
    labels of a loss in the last stage — must leave it as outputs; the copies are ops
    before the first split point), and the loss comes back as a (1,) tensor (a schedule
    concatenates the last stage's outputs over micro-batches)."""

    def __init__(self, module: nn.Module):
        super().__init__()
        self.module = module

    def forward(self, *batch):
        return self.module(*(t.clone() for t in batch)).reshape(1)


def _checkpoint(root: nn.Module, fqns: Sequence[str], mode: str = "full") -> None:
    for fqn in fqns:
        owner, _, attr = fqn.rpartition(".")
        parent = root.get_submodule(owner) if owner else root
        setattr(parent, attr, wrap(getattr(parent, attr), mode))


def rows(batch: Sequence[torch.Tensor], start: int, stop: int, total: int
         ) -> tuple[torch.Tensor, ...]:
    """Rows ``[start, stop)`` of every batch tensor whose dim 0 is the batch (``total``)."""
    return tuple(t[start:stop] if t.dim() and t.shape[0] == total else t for t in batch)


class GenericModel:
    """A model parallelised by the plan on this rank (module docstring): ``step(batch)``
    runs one optimiser step's forwards and backwards over this data-parallel rank's rows
    and returns this rank's mean loss (zero where it computes none); ``modules`` are the
    parameter holders an optimizer takes."""

    def __init__(self, model: nn.Module, plan: Plan, pm: ParallelMesh, *,
                 precision: Precision, example: Sequence[torch.Tensor], prefix: str = ""):
        self.plan, self.pm, self.prefix = plan, pm, prefix
        p = plan.parallel
        self.micro = plan.global_batch // (p.dp * p.num_micro_batches)
        mp = mp_policy_for(precision.params, precision.compute, precision.reduce)
        model = model.to(device=pm.device, dtype=precision.params)
        model.train()
        self.autocast = precision.compute if precision.compute != precision.params else None
        blocks = [prefix + n for st in plan.stages for n in st.layer_names
                  if n not in (PRE, POST)]
        if precision.float8:
            convert_float8(model, blocks)
        self.schedule = None
        self.sharded = 0                   # parameters sharded on the tp mesh
        if p.pp > 1:
            if p.tp > 1:
                raise PlanError("field 'parallel': the generic runtime does not combine "
                                "tensor parallelism with pipeline stages")
            self.modules, self.schedule = self._pipeline(model, example, mp)
            return
        ckpt = [prefix + n for n in plan.stages[0].checkpoint_layers if n not in (PRE, POST)]
        if p.tp > 1:
            from engine.placements import register_cpu_attention

            register_cpu_attention()
            self.sharded = distribute_tp(model, plan, pm, prefix)
        _checkpoint(model, ckpt, mode_of(plan))
        if p.dp > 1:
            apply_dp(model, pm.dp_mesh, zero=p.zero, pipelined=False, mp_policy=mp,
                     blocks=[model.get_submodule(b) for b in blocks])
        self.root = model
        self.run = _DTensorForward(model) if p.tp > 1 else model
        self.modules = [model]

    def _pipeline(self, model: nn.Module, example: Sequence[torch.Tensor], mp):
        from torch.distributed.pipelining import SplitPoint, pipeline

        from engine.pipeline import SCHEDULES

        plan, pm, p = self.plan, self.pm, self.plan.parallel
        if any(st.checkpoint_layers for st in plan.stages):
            raise PlanError("field 'stages[].checkpoint_layers': the generic runtime does not "
                            "checkpoint activations inside pipeline stages")
        spec = {name: SplitPoint.BEGINNING
                for name in split_points(plan, self.prefix + "module.")}
        wrapped = _FirstStageInputs(model)
        hooks = [wrapped.get_submodule(name).register_forward_pre_hook(
            _contiguous_inputs, with_kwargs=True) for name in spec]
        mb = rows(example, 0, self.micro, len(example[0]))
        try:
            pipe = pipeline(wrapped, mb_args=tuple(mb), split_spec=spec)
        except Exception as exc:   # noqa: BLE001 - torch.export's many failure types
            raise PlanError(f"the model cannot be split into pipeline stages: torch.export "
                            f"could not capture it as one graph ({type(exc).__name__}: "
                            f"{str(exc).splitlines()[0][:200]}); plan it with pp=1") from exc
        finally:
            for hook in hooks:
                hook.remove()
        _check_tied_across_stages(model, pipe)
        if pipe.num_stages != len(plan.stages):
            raise PlanError(f"field 'stages': split into {pipe.num_stages} stages, the plan has "
                            f"{len(plan.stages)}")
        group = pm.pp_mesh.get_group()
        stages, modules = [], []
        for index in pm.stages:
            sub = pipe.get_stage_module(index)
            # gloo sends contiguous tensors only: activations forward, gradients backward
            sub.register_forward_hook(_contiguous_outputs)
            sub.register_forward_pre_hook(_contiguous_input_grads)
            if p.dp > 1:
                apply_dp(sub, pm.dp_mesh, zero=p.zero, pipelined=True, mp_policy=mp)
            modules.append(sub)
            stages.append(pipe.build_stage(index, pm.device, group))
        cls = SCHEDULES[p.schedule]

        def loss_fn(out, _target):          # the last stage's output is the loss
            return out.sum()

        kwargs = dict(n_microbatches=p.num_micro_batches, loss_fn=loss_fn)
        schedule = cls(stages, **kwargs) if p.schedule == "interleaved_1f1b" else \
            cls(stages[0], **kwargs)
        return modules, schedule

    @contextlib.contextmanager
    def _tp_errors(self):
        """A forward DTensor cannot run (an op without a sharding rule, a view it cannot
        express on the placements) is a plan the runtime cannot execute: say so."""
        if self.plan.parallel.tp == 1:
            yield
            return
        try:
            yield
        except (RuntimeError, NotImplementedError, AssertionError) as exc:
            # (DTensor's convolution backward raises a bare AssertionError)
            raise PlanError(f"field 'parallel.tp': tensor parallelism on DTensors cannot run "
                            f"this model's forward or backward ({type(exc).__name__}: "
                            f"{str(exc).splitlines()[0][:200]}); plan it with tp=1") from exc

    def backward_context(self):
        """Backward of a DTensor forward sees the plain tensors it saved (the targets):
        they count as replicated there too."""
        return implicit_replication() if self.plan.parallel.tp > 1 else \
            contextlib.nullcontext()

    @property
    def has_loss(self) -> bool:
        return self.schedule is None or self.pm.num_stages - 1 in self.pm.stages

    def step(self, batch: Sequence[torch.Tensor]) -> torch.Tensor:
        """Forward and backward of this data-parallel rank's rows of ``batch`` (the global
        batch when its dim 0 is ``global_batch``, else already this rank's rows)."""
        p, pm = self.plan.parallel, self.pm
        total = len(batch[0])
        if total == self.plan.global_batch and p.dp > 1:
            per = total // p.dp
            batch = rows(batch, pm.dp_rank * per, (pm.dp_rank + 1) * per, total)
        batch = tuple(t.to(pm.device) for t in batch)
        autocast = torch.autocast(pm.device.type, dtype=self.autocast,
                                  enabled=self.autocast is not None)
        if self.schedule is not None:
            losses: list[torch.Tensor] = []
            # the last stage's output is the loss; the schedule still splits a target
            target = torch.zeros(len(batch[0]), device=pm.device) if self.has_loss else None
            args = batch if 0 in pm.stages else ()
            with autocast:
                self.schedule.step(*args, target=target, losses=losses)
            if not self.has_loss:
                return torch.zeros((), device=pm.device)
            return torch.stack([l.detach().float() for l in losses]).mean()
        n = p.num_micro_batches
        per = len(batch[0]) // n
        local = torch.zeros((), device=pm.device)
        for i in range(n):
            set_microbatch(self.root, zero=p.zero, last=i == n - 1)
            with autocast, self._tp_errors():
                loss = self.run(*rows(batch, i * per, (i + 1) * per, len(batch[0])))
            with self.backward_context(), self._tp_errors():
                (loss / n).backward()
            local += loss.detach().float() / n
        if p.tp > 1:
            _grads_like_params(self.root)
        return local

