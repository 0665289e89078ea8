"""Run a search plan: per-op placements through DTensor, stages on submeshes of any shape.

A plan written by the search (``planner.name == "auto"``, layout ``"uniform"`` or
``"stages"``) gives each stage its own logical mesh, placements per parameter and per op,
data axes and ZeRO stage (:mod:`autoplan.plan`). This runtime executes it as it is written;
the uniform planner's plans, and search plans the uniform layout expresses exactly
(:func:`runs_per_op`), keep the Megatron-style runtime of :mod:`engine.parallelize`.

Per stage (this rank runs one, or ``virtual_stages`` chunks under interleaved 1F1B):

1. **Mesh** — a ``DeviceMesh`` over the stage's ranks, shaped ``mesh_shape``, axes
   ``axis_names`` (:func:`engine.placements.build_stage_meshes`; every rank builds all).
2. **Parameters** — the chunk is built on meta (:func:`engine.model.build_chunk`), each
   parameter becomes a DTensor with its planned placements, further sharded at rest by the
   stage's ZeRO along its data axes (:mod:`engine.zero`); module outputs the search placed
   get a redistribution hook (:func:`engine.placements.activation_hooks`).
3. **Checkpointing** — ``checkpoint_wrapper`` on the stage's ``checkpoint_layers``.
4. **Materialise** — :func:`engine.model.materialize` (same initial values as any layout).
5. **Schedule** — micro-batch ``i`` of ``B = global_batch / num_micro_batches`` samples:
   the first stage takes its rows of the tokens as a DTensor sharded on the data axes, each
   stage runs forward on DTensors (``implicit_replication`` for tensors built inside the
   model), sends its output rows to the ranks of the next stage that need them
   (:mod:`engine.transfer`), and the last stage computes the mean loss. Backward runs in the
   order of the plan's schedule (:func:`schedule_actions`: GPipe, 1F1B or interleaved 1F1B),
   sending input gradients back the same way.
   Losses are scaled by ``1 / num_micro_batches``, so gradients are those of the mean loss;
   logits sharded along the vocabulary take a vocabulary-parallel cross-entropy
   (:func:`vocab_parallel_loss`). A stage whose weights are all replicated (plain data
   parallelism) computes on local tensors instead (:mod:`engine.zero`'s local mode).
6. **Step** — ZeRO's gradient reduction (:meth:`engine.zero.Zero.end_step`), AdamW on the
   at-rest parameters.

Interleaved 1F1B (``virtual_stages`` chunks per pipeline rank) runs Megatron-LM's order
(:func:`schedule_actions`). Not yet executed (refused with a message naming the field, and
avoided by the planner, :func:`autoplan.capability.per_op_gap`): Hugging Face models, tied embeddings, and
Llama-style weights sharded per op.
"""

from __future__ import annotations

import contextlib
import functools
import math
from typing import Callable

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.experimental import implicit_replication
from torch.distributed.tensor.parallel import loss_parallel

from autoplan.capability import per_op_gap, uniform_gap
from autoplan.errors import PlanError
from autoplan.plan import Plan
from autoplan.schedule import order as schedule_order
from engine import model as model_lib
from engine.data import local_batch
from engine.parallelize import apply_checkpointing
from engine.recompute import mode_of
from engine.placements import (StageMesh, activation_hooks, batch_rows, distribute_parameters,
                               register_cpu_attention)
from engine.transfer import Boundary, check_routes
from engine.train import Trainer
from engine.zero import Zero, at_rest


def runs_per_op(plan: Plan, spec=None) -> bool:
    """Whether ``plan`` needs this runtime rather than the uniform one
    (:mod:`engine.parallelize`): a search plan, unless it is one the uniform runtime
    expresses exactly — one mesh ``(pp, dp, tp)``, the batch split along ``dp`` only, every
    weight replicated along ``dp`` and placed along ``tp`` as a Megatron-LM style of
    :mod:`engine.tensor_parallel` — where FSDP2 and the tensor-parallel styles overlap their
    communication better. ``plan.runtime`` (``"per_op"``/``"uniform"``) forces it."""
    if plan.runtime is not None:
        return plan.runtime == "per_op"
    return plan.planner.name == "auto" and per_op_reason(plan, spec) is not None


def per_op_reason(plan: Plan, spec=None) -> str | None:
    """What in search plan ``plan`` the uniform runtime cannot run (None: nothing): what the
    plan's data says (:func:`autoplan.capability.uniform_gap`), then what the uniform
    runtime's checks on the real modules refuse."""
    why = uniform_gap(plan)
    if why is not None:
        return why
    from autoplan.models.registry import ModelSpec
    from engine.validate import check_engine_support

    try:
        check_engine_support(plan, spec or ModelSpec.from_dict(plan.model), "<plan>")
    except PlanError as exc:
        return str(exc).removeprefix("plan <plan>: ")
    return None


def check_staged_support(plan: Plan, spec, source: str) -> None:
    """What this runtime executes (module docstring); raises PlanError naming the field."""
    p = plan.parallel
    v = p.virtual_stages
    if v > 1 and p.num_micro_batches % p.pp:
        raise PlanError(f"plan {source}: field 'parallel.num_micro_batches': interleaved 1F1B "
                        f"needs a multiple of the {p.pp} pipeline ranks, got "
                        f"{p.num_micro_batches}")
    if len(plan.stages) != p.pp * v:
        raise PlanError(f"plan {source}: field 'stages': {len(plan.stages)} stages for pp="
                        f"{p.pp} x virtual_stages={v}")
    gap = per_op_gap(spec, plan)
    if gap:
        raise PlanError(f"plan {source}: field 'model': this plan places ops individually, "
                        f"and {gap}; plan it with --planner uniform")
    info = model_lib.model_info(spec)
    world = set()
    for st in plan.stages:
        if sorted(st.ranks) != list(st.ranks) or len(st.ranks) != _prod(st.mesh_shape):
            raise PlanError(f"plan {source}: field 'stages[{st.index}].ranks': "
                            f"{list(st.ranks)} must be {_prod(st.mesh_shape)} ascending ranks "
                            f"for mesh_shape {list(st.mesh_shape)}")
        same = plan.stages[st.index % p.pp]
        if st.index >= p.pp and tuple(st.ranks) != tuple(same.ranks):
            raise PlanError(f"plan {source}: field 'stages[{st.index}].ranks': chunk "
                            f"{st.index} runs on pipeline rank {st.index % p.pp}, ranks "
                            f"{list(same.ranks)}")
        if st.index < p.pp and world & set(st.ranks):
            raise PlanError(f"plan {source}: field 'stages[{st.index}].ranks': a rank runs two "
                            "pipeline positions")
        world |= set(st.ranks)
        if len(st.axis_names) != len(st.mesh_shape):
            raise PlanError(f"plan {source}: field 'stages[{st.index}].axis_names' does not "
                            f"match mesh_shape {list(st.mesh_shape)}")
    if world != set(range(plan.world_size)):
        raise PlanError(f"plan {source}: field 'stages': the stages' ranks do not cover the "
                        f"world 0..{plan.world_size - 1}")
    names = [n for st in plan.stages for n in st.layer_names]
    if names != info.layer_names():
        raise PlanError(f"plan {source}: field 'stages': layer_names must cover <pre>, "
                        f"blocks.0..blocks.{info.num_blocks - 1}, <post> in order")
    if plan.global_batch % p.num_micro_batches:
        raise PlanError(f"plan {source}: field 'global_batch' {plan.global_batch} is not a "
                        f"multiple of parallel.num_micro_batches {p.num_micro_batches}")
    micro = plan.global_batch // p.num_micro_batches
    for st in plan.stages:
        split = _prod(st.mesh_shape[st.axis_names.index(a)] for a in st.data_axes
                      if a in st.axis_names)
        if micro % split:
            raise PlanError(f"plan {source}: field 'stages[{st.index}].data_axes': a "
                            f"micro-batch of {micro} does not split into {split} pieces")


def _prod(xs) -> int:
    return math.prod(int(x) for x in xs)


class StagedPlace:
    """Where this rank is (what the trainer's logging, seeding and checkpoints need)."""

    #: the per-op runtime runs neither expert nor context parallelism
    #: (:func:`engine.runtime.check_all` sends those plans to the uniform runtime)
    ep = 1
    cp = 1

    def __init__(self, plan: Plan, stage_meshes: list[StageMesh], device: torch.device):
        self.rank = dist.get_rank()
        self.device = device
        self.num_stages = len(plan.stages)
        self.stages = tuple(sm.index for sm in stage_meshes if sm.contains(self.rank))
        self.stage = self.stages[0]
        sm = stage_meshes[self.stage]
        self.sm = sm
        self.pp_rank = self.stage
        self.dp_rank = sm.data_index(self.rank)
        coord = sm.mesh.get_coordinate()
        self.coord = dict(zip(sm.axis_names, coord))

    def describe(self) -> str:
        axes = " ".join(f"{a} {c}/{n}" for (a, c), n in zip(self.coord.items(),
                                                           self.sm.ranks.shape))
        stages = "/".join(map(str, self.stages))
        return (f"per-op runtime, rank {self.rank}: stage {stages} of {self.num_stages} on "
                f"{'x'.join(map(str, self.sm.ranks.shape))} ({axes}; data axes "
                f"{list(self.sm.data_axes) or 'none'}), {self.device}")


class StagedStage:
    """This rank's stage: its chunk, ZeRO, optimizer and links to its neighbours."""

    def __init__(self, plan: Plan, spec, place: StagedPlace, stage_meshes: list[StageMesh],
                 index: int, *, seed: int, autocast_dtype: torch.dtype | None,
                 op_modules: Callable[[], dict[str, tuple[str, int, int]]]):
        register_cpu_attention()
        self.plan, self.place, self.index = plan, place, index
        st = plan.stages[index]
        sm = stage_meshes[index]
        self.sm, self.st = sm, st
        zero = plan.parallel.zero if st.zero is None else st.zero
        chunk = model_lib.build_chunk(spec, st.layer_names)                     # 1-2
        compute = distribute_parameters(chunk, plan, st, sm, at_rest(sm, zero))
        # plain data parallelism (every weight replicated, ZeRO 0-2) skips DTensor
        self.local = zero != 3 and all(isinstance(p, Replicate)
                                       for pl in compute.values() for p in pl)
        # the op -> module map comes from a trace, taken only when a stage needs it
        self.hooks = 0 if self.local or not st.activation_placements else \
            activation_hooks(chunk, st, sm, op_modules())
        apply_checkpointing(chunk, st.checkpoint_layers, mode_of(plan))        # 3
        model_lib.materialize(chunk, model_lib.initializer(spec), place.device, seed)  # 4
        if autocast_dtype is not None:
            chunk.forward = torch.autocast(place.device.type,
                                           dtype=autocast_dtype)(chunk.forward)
        chunk.train()
        self.chunk = chunk
        self.zero = Zero.attach(chunk, zero, sm, compute, local=self.local)
        n = len(plan.stages)
        self.micro = plan.global_batch // plan.parallel.num_micro_batches
        self.rows = batch_rows(sm, place.rank, self.micro)
        self.first, self.last = index == 0, index == n - 1
        self.prev = None if self.first else Boundary(
            stage_meshes[index - 1], sm, self.micro, place.rank, link=index - 1)
        self.next = None if self.last else Boundary(
            sm, stage_meshes[index + 1], self.micro, place.rank, link=index)

    # ---- the actions of a schedule -------------------------------------------------------
    def forward(self, i: int, inputs: torch.Tensor, targets: torch.Tensor, state: dict,
                sends: list) -> torch.Tensor | None:
        """Forward of micro-batch ``i``; returns its loss on the last stage."""
        sm, pl = self.sm, self.sm.batch_placements()
        lo, hi = self.rows
        base = i * self.micro
        if self.first:
            local = inputs[base + lo:base + hi]
        else:
            local = self.prev.recv(i, self.place.device, backward=False)
            local.requires_grad_(True)
        parallel = False              # the loss took loss_parallel (vocab_parallel_loss)
        if self.local:
            out = self.chunk(local, targets[base + lo:base + hi]) if self.last else \
                self.chunk(local)
        else:
            x = DTensor.from_local(local, sm.mesh, pl, run_check=False)
            with implicit_replication():
                if self.last:
                    y = DTensor.from_local(targets[base + lo:base + hi], sm.mesh, pl,
                                           run_check=False)
                    logits = self.chunk(x)
                    axis = vocab_axis(logits)
                    parallel = axis is not None
                    out = vocab_parallel_loss(logits, y, axis)
                else:
                    out = self.chunk(x).redistribute(sm.mesh, pl).to_local()
        state[i] = (local, out, parallel)
        if self.last:
            return out.detach().full_tensor() if isinstance(out, DTensor) else out
        sends.extend(self.next.send(out.detach(), i, backward=False))
        return None

    def backward(self, i: int, state: dict, sends: list, scale: float) -> None:
        local, out, parallel = state.pop(i)
        # the vocabulary-parallel loss's backward needs its context, and only it: a loss
        # over replicated logits (a stage sharding some weights, not the head's vocabulary)
        # is plain cross-entropy, whose backward loss_parallel refuses
        lp = loss_parallel() if parallel else contextlib.nullcontext()
        with implicit_replication(), lp:
            if self.last:
                # local mode: the loss is this rank's rows' mean; the micro-batch's mean is
                # the average over the data pieces, which the gradient reduction sums
                (out * (scale / self.sm.data_size if self.local else scale)).backward()
            else:
                grad = self.next.recv(i, self.place.device, backward=True)
                torch.autograd.backward(out, grad)
        if not self.first:
            sends.extend(self.prev.send(local.grad, i, backward=True))


def vocab_axis(logits: DTensor) -> int | None:
    """The one mesh axis sharding ``logits`` along the vocabulary (its last dimension), or
    None: not sharded so, or on several axes (which ``loss_parallel`` does not take)."""
    cls = logits.ndim - 1
    axes = [k for k, p in enumerate(logits.placements)
            if isinstance(p, Shard) and p.dim in (cls, -1)]
    return axes[0] if len(axes) == 1 else None


def vocab_parallel_loss(logits: DTensor, targets: DTensor, axis: int | None) -> DTensor:
    """Mean token cross-entropy of ``logits`` (b, s, vocab) against ``targets`` (b, s), in
    fp32 (as :meth:`autoplan.models.gpt.GPT.loss`). Logits sharded along the vocabulary on
    one mesh axis (a vocabulary-parallel head) take ``loss_parallel``: each rank's softmax
    statistics are all-reduced instead of the logits being gathered (Megatron-LM's
    vocabulary-parallel cross-entropy); the sum is divided by the token count, since
    ``loss_parallel``'s mean is one-dimensional-mesh only."""
    import torch.nn.functional as F

    flat = logits.flatten(0, 1).float()
    tgt = targets.flatten(0, 1)
    if axis is None:                 # axis: vocab_axis(logits)
        return F.cross_entropy(flat, tgt)
    want = [Replicate() if k == axis else p for k, p in enumerate(flat.placements)]
    tgt = tgt.redistribute(flat.device_mesh, want)
    with loss_parallel():
        return F.cross_entropy(flat, tgt, reduction="sum") / tgt.numel()


def schedule_actions(schedule: str, position: int, pp: int, v: int, m: int
                     ) -> list[tuple[str, int, int]]:
    """The order of ``(kind, chunk, micro-batch)`` (kind ``"F"``/``"B"``, ``chunk`` the
    index among this pipeline rank's ``v`` chunks) on pipeline rank ``position`` of ``pp``:
    :func:`autoplan.schedule.order`, the one order the report and the memory model use too
    (GPipe, 1F1B, Megatron-LM's interleaved 1F1B; one stage alternates)."""
    return [tuple(a) for a in schedule_order(schedule, pp, v, m, position)]


def run_micro_batches(stages: list[StagedStage], inputs: torch.Tensor, targets: torch.Tensor
                      ) -> torch.Tensor | None:
    """One step's forwards and backwards of this rank's chunks (``stages``, in chunk order);
    the mean loss where the last stage is."""
    first = stages[0]
    p = first.plan.parallel
    m = p.num_micro_batches
    states: list[dict] = [{} for _ in stages]
    sends: list = []
    losses = []
    for st in stages:
        st.zero.begin_step()
    position = first.index % p.pp
    for kind, j, i in schedule_actions(p.schedule, position, p.pp, len(stages), m):
        st = stages[j]
        if kind == "F":
            loss = st.forward(i, inputs, targets, states[j], sends)
            if loss is not None:
                losses.append(loss.detach().float())
        else:
            st.backward(i, states[j], sends, 1.0 / m)
            st.zero.after_backward()
        sends = [w for w in sends if not w[0].is_completed()]
    for work, _ in sends:
        work.wait()
    for st in stages:
        st.zero.end_step()
    return torch.stack(losses).mean() if losses else None


def trace_op_modules(spec, seq_len: int, dtype: torch.dtype
                     ) -> dict[str, tuple[str, int, int]]:
    """Op name -> (leaf module FQN, the op's output rank, the module's output rank), for
    every op traced inside a leaf module, from the planner's own trace — so the plan's op
    names mean the same ops here (:func:`engine.placements.activation_hooks`)."""
    from autoplan.trace import trace

    graph = trace(spec, 1, seq_len, dtype=dtype)
    by_module: dict[str, list] = {}
    for name, node in graph.nodes.items():
        if node.module_path and node.output_meta:
            by_module.setdefault(node.module_path, []).append((name, node))
    leaves = {m for m in by_module
              if not any(o.startswith(m + ".") for o in by_module)}
    out = {}
    for module in leaves:
        ops = by_module[module]
        out_rank = len(ops[-1][1].output_meta[0].shape)
        for name, node in ops:
            out[name] = (module, len(node.output_meta[0].shape), out_rank)
    return out


class StagedTrainer(Trainer):
    """:class:`engine.train.Trainer` with this module's stages in place of the uniform
    runtime's chunks and schedule (same loop, metrics, checkpoints)."""

    def __init__(self, plan: Plan, spec, cfg, place: StagedPlace,
                 stage_meshes: list[StageMesh], *, source: str = "<plan>"):
        self.stage_meshes = stage_meshes
        super().__init__(plan, spec, cfg, place, source=source)

    def _build(self) -> None:
        prec = self.precision
        op_modules = functools.cache(
            lambda: trace_op_modules(self.spec, self.seq_len, prec.compute))
        self.staged = [StagedStage(self.plan, self.spec, self.pm, self.stage_meshes, c,
                                   seed=self.cfg.seed,
                                   autocast_dtype=prec.compute if prec.autocast else None,
                                   op_modules=op_modules)
                       for c in self.pm.stages]
        check_routes(self.stage_meshes, self.staged[0].micro)
        self.chunks = [st.chunk for st in self.staged]
        self.schedule = None
        self.has_loss = any(st.last for st in self.staged)

    def _forward_backward(self, step: int) -> torch.Tensor:
        inputs, targets = local_batch(self.data, step, dp=1, dp_rank=0,
                                      device=self.pm.device)
        loss = run_micro_batches(self.staged, inputs, targets)
        return loss if loss is not None else torch.zeros((), device=self.pm.device)
