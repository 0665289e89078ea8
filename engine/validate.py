"""Checks that run before any collective: does this plan fit this launch and this engine?

:func:`engine.runtime.check_all` runs the launch checks here, then the chosen runtime's
own.

Every failure is a :class:`PlanError` whose message names the plan file and says what to do,
e.g. ``plan plans/x.json was made for 4 ranks (mesh pp=1 dp=2 tp=2) but torchrun started 2;
relaunch with --nproc_per_node=4``. They need no process group, so a mismatched launch fails
at once on every rank instead of hanging in the first collective.
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import Shard

from autoplan.errors import ConfigError, PlanError
from autoplan.schedule import runs_micro_batches
from autoplan.capability import ENGINE_DTYPES, precision_gap
from autoplan.models.capabilities import capabilities
from autoplan.models.registry import ModelSpec
from autoplan.placement import REPLICATED
from autoplan.plan import Plan, stage_ranks
from engine import model as model_lib
from engine.tensor_parallel import parse_placement, tp_plan

SUPPORTED_DTYPES = ENGINE_DTYPES


def mesh_label(plan: Plan) -> str:
    return " ".join(f"{a}={s}" for a, s in zip(plan.mesh.axis_names, plan.mesh.shape))


def check_world(plan: Plan, source: str, *, world_size: int,
                local_world_size: int | None = None) -> None:
    """The launch started exactly the plan's number of ranks."""
    want = plan.world_size
    if world_size == want:
        return
    launched = "torchrun started" if local_world_size is not None else "the launch asks for"
    hint = f"relaunch with --nproc_per_node={want}"
    if local_world_size is not None and local_world_size != world_size:
        hint = (f"relaunch with --nnodes and --nproc_per_node whose product is {want}")
    raise PlanError(f"plan {source} was made for {want} ranks (mesh {mesh_label(plan)}) but "
                    f"{launched} {world_size}; {hint}")


def check_device(plan: Plan, source: str, *, local_world_size: int | None = None) -> None:
    """The plan's device type exists here, with a device per local rank."""
    dtype = plan.mesh.device_type
    if dtype == "cpu":
        return
    module = getattr(torch, dtype, None)
    if module is None or not module.is_available():
        raise PlanError(f"plan {source} runs on '{dtype}' devices (field 'mesh.device_type') "
                        "but none is available here; plan for this machine's cluster or run "
                        "where the devices are")
    count = module.device_count()
    if local_world_size is not None and local_world_size > count:
        raise PlanError(f"plan {source}: {local_world_size} ranks on this node but only "
                        f"{count} {dtype} device(s)")


def check_model(plan: Plan, source: str) -> ModelSpec:
    """The plan's model section is the model it was planned for, and the engine can run it."""
    try:
        spec = ModelSpec.from_dict(plan.model, source_file=source)
    except ConfigError as exc:
        raise PlanError(str(exc)) from None
    got = spec.fingerprint()
    if got != plan.model_fingerprint:
        raise PlanError(f"plan {source}: field 'model' hashes to fingerprint {got} but the plan "
                        f"was made for {plan.model_fingerprint} (was the model section edited?); "
                        "re-plan for this model")
    from autoplan.models.registry import build_model

    built = sum(p.numel() for p in build_model(spec, device="meta").parameters())
    if built != plan.num_params:
        raise PlanError(f"plan {source}: field 'num_params' is {plan.num_params} but this "
                        f"autoplan builds the model with {built} parameters; re-plan")
    return spec


def check_standard_mesh(plan: Plan, source: str) -> None:
    """The plan's mesh is the standard ``(pp, dp, tp)`` one — ``(pp, dp, cp, tp)`` with
    context parallelism — and every stage sits on its pipeline rank's submesh
    (:mod:`engine.mesh`)."""
    p = plan.parallel
    axes, shape = ("pp", "dp", "tp"), (p.pp, p.dp, p.tp)
    if p.cp > 1:
        axes, shape = ("pp", "dp", "cp", "tp"), (p.pp, p.dp, p.cp, p.tp)
    if tuple(plan.mesh.axis_names) != axes:
        raise PlanError(f"plan {source}: field 'mesh.axis_names' must be {list(axes)}, "
                        f"got {list(plan.mesh.axis_names)}")
    if tuple(plan.mesh.shape) != shape:
        raise PlanError(f"plan {source}: field 'mesh.shape' {list(plan.mesh.shape)} != "
                        f"{list(axes)} = {list(shape)}")
    for st in plan.stages:
        pr = st.index % p.pp
        want = stage_ranks(p, pr)
        if tuple(st.ranks) != want:
            raise PlanError(f"plan {source}: field 'stages[{st.index}].ranks' is "
                            f"{list(st.ranks)}; the engine runs stage {st.index} on pipeline "
                            f"rank {pr} = ranks {list(want)}")
        if tuple(st.mesh_shape) != shape[1:]:
            raise PlanError(f"plan {source}: field 'stages[{st.index}].mesh_shape' is "
                            f"{list(st.mesh_shape)}; the engine needs every stage on a "
                            f"{tuple(axes[1:])} = {list(shape[1:])} submesh")


def check_expert_context(plan: Plan, spec: ModelSpec, source: str) -> None:
    """What the engine runs of expert and context parallelism (:mod:`engine.expert_parallel`):
    EP over a model's mixture-of-experts layers whose expert counts it divides, without
    tensor parallelism; CP for the models whose capabilities allow it (the built-in GPT,
    the adapted Hugging Face decoders), at a sequence length
    ``2 · cp`` divides
    (load-balanced chunks, :mod:`autoplan.models.context_parallel`)."""
    p = plan.parallel
    if p.ep > 1:
        from autoplan.models.moe import expert_layers
        from autoplan.models.registry import build_model

        counts = sorted({layer.experts for layer in
                         expert_layers(build_model(spec, device="meta"))})
        if not counts:
            raise PlanError(f"plan {source}: field 'parallel.ep' is {p.ep} but model "
                            f"{spec.name!r} has no mixture-of-experts layers")
        bad = [e for e in counts if e % p.ep]
        if bad:
            raise PlanError(f"plan {source}: field 'parallel.ep': {p.ep} does not divide the "
                            f"model's {bad[0]} experts")
        if p.tp > 1:
            raise PlanError(f"plan {source}: field 'parallel.tp': the engine runs expert "
                            f"parallelism (ep = {p.ep}) with tp = 1, got tp = {p.tp}")
    if p.cp > 1:
        from autoplan.models.capabilities import capabilities

        caps = capabilities(spec)
        if not caps.context_parallel:
            raise PlanError(f"plan {source}: field 'parallel.cp': {caps.cp_reason}")
        seq = plan.seq_len or model_lib.model_info(spec).max_seq_len
        if seq % (2 * p.cp):
            raise PlanError(f"plan {source}: field 'seq_len': context parallelism cuts each "
                            f"sequence into 2 x cp = {2 * p.cp} equal chunks; {seq} does "
                            "not divide")


def check_engine_support(plan: Plan, spec: ModelSpec, source: str) -> None:
    """What the uniform runtime can execute: uniform stage submeshes on the standard layout,
    shardable sizes, placements it can apply, supported precisions."""
    p = plan.parallel
    model_lib.check_supported(spec)
    check_standard_mesh(plan, source)
    check_expert_context(plan, spec, source)
    names = [n for st in plan.stages for n in st.layer_names]
    if len(names) != len(set(names)):
        raise PlanError(f"plan {source}: field 'stages': a layer appears in two stages")
    info = model_lib.model_info(spec)
    every = info.layer_names()
    if names != every:
        missing = sorted(set(every) - set(names))
        raise PlanError(f"plan {source}: field 'stages': the stages' layer_names must be "
                        f"<pre>, {every[1]}..{every[-2]}, <post> in order"
                        + (f"; missing {missing}" if missing else ""))
    caps = capabilities(spec)
    for wanted, allowed, what in ((p.tp > 1, caps.tensor_parallel, f"tp={p.tp}"),
                                  (p.sequence_parallel and p.tp > 1, caps.sequence_parallel,
                                   "sequence_parallel"),
                                  (p.pp > 1, caps.pipeline, f"pp={p.pp}")):
        if wanted and not allowed:
            raise PlanError(f"plan {source}: field 'parallel' asks for {what}, which the "
                            f"engine cannot run for model {spec.name!r}: {caps.reason}")
    if not runs_micro_batches(p.schedule, p.pp, p.num_micro_batches):
        # torch.distributed.pipelining.Schedule1F1B refuses fewer micro-batches than stages
        raise PlanError(f"plan {source}: field 'parallel.num_micro_batches': 1F1B needs at "
                        f"least pp={p.pp} micro-batches, got {p.num_micro_batches} (with "
                        f"fewer, 1F1B is GPipe: use schedule 'gpipe')")
    gap = precision_gap(plan.precision)
    if gap:
        raise PlanError(f"plan {source}: {gap}")
    for fqn, axes in plan.param_placements.items():
        dp_place = parse_placement(axes.get("dp", REPLICATED), f"{fqn}.dp")
        if isinstance(dp_place, Shard):
            if dp_place.dim != 0 or p.zero != 3:
                raise PlanError(f"plan {source}: field 'param_placements.{fqn}.dp': "
                                f"{axes['dp']} needs ZeRO-3 and dim 0 (FSDP shards dim 0); "
                                f"the plan has zero={p.zero}")
    seq = plan.seq_len or info.max_seq_len
    if seq > info.max_seq_len:
        raise PlanError(f"plan {source}: field 'seq_len' {seq} exceeds the model's "
                        f"{info.max_seq_len}")
    if p.tp > 1:
        for what, n in caps.tp_divisors:
            if n % p.tp:
                raise PlanError(f"plan {source}: tp={p.tp} does not divide the model's "
                                f"{what} ({n})")
        if p.sequence_parallel and seq % p.tp:
            raise PlanError(f"plan {source}: sequence parallelism needs tp={p.tp} to divide "
                            f"seq_len ({seq})")
    for st in plan.stages:
        chunk = model_lib.build_chunk(spec, st.layer_names)
        tp_plan(chunk, plan.param_placements, sequence_parallel=p.sequence_parallel)
