"""The Python entry points: ``optimize``, ``estimate``, ``trace_model``.

    import autoplan
    plan = autoplan.optimize("gpt-7.5b", "dgx-a100", nodes=16, global_batch=512)
    plan.save("plan.json")
    print(plan.prediction.step_time_s, plan.parallel.label())

    # what does my current setup cost, and what would autoplan do instead?
    mine = autoplan.estimate("gpt-7.5b", "dgx-a100", nodes=16, global_batch=512,
                             tp=4, pp=1, micro_batch=2, checkpoint="full")

``optimize`` runs the Alpa-style search by default (``planner="auto"``,
:mod:`autoplan.planner.search.search`) with the uniform grid beside it, whose best configuration the
plan keeps as ``comparison`` (the search's plan is never predicted slower). The engine runs
search plans (:mod:`engine.staged`); for a model whose search plans it cannot run yet (a
Hugging Face model, tied embeddings, Llama-style weights sharded per op) ``optimize`` does
not search (:func:`search_gap`, decided first) and returns the grid's best, saying why in
``plan.planner["note"]``. ``planner="uniform"`` runs the grid alone. Before tracing,
``optimize`` (and ``autoplan plan``) rejects a model whose states alone cannot fit
(:mod:`autoplan.planner.bounds`).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
import sys
from typing import TYPE_CHECKING, Any, Callable

if TYPE_CHECKING:      # torch is imported to trace, not to resolve a name or reject a problem
    import torch.nn as nn

from autoplan.cluster import Cluster, load_cluster
from autoplan.cost.memory import DEFAULT_HEADROOM
from autoplan.errors import ConfigError, PlanError
from autoplan.graph import OpGraph
from autoplan.models.registry import ModelSpec, default_seq_len, resolve
from autoplan.plan import ParallelConfig, Plan
from autoplan.planner.build import build_plan
from autoplan.planner.grid.estimate import Estimator, fits
from autoplan.planner.grid.uniform import SearchResult, SearchSpace, search_uniform
from autoplan.precision import default_for
from autoplan.pricing import Pricing
from autoplan.schedule import runs_micro_batches
from autoplan.precision import precision as precision_named

ModelLike = str | ModelSpec
ClusterLike = str | Cluster

#: The largest global batch (samples) planned: the planners enumerate the divisors of the
#: batch per data-parallel rank, and an absurd batch (10**30) would keep them busy for hours.
#: The CLI's ``--global-batch`` has the same bound.
MAX_GLOBAL_BATCH = 2 ** 31
#: The longest sequence planned (as a model config's sizes, autoplan.models.registry.MAX_SIZE).
MAX_SEQ_LEN = 2 ** 24


def _count(value: Any, name: str, *, low: int = 1, high: int | None = None) -> int:
    """``value`` as an argument ``name`` that must be an integer in [low, high]: a
    ConfigError naming it otherwise (never a ZeroDivisionError or an endless search later)."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"must be an integer, got {value!r}"[:200], field=name)
    if value < low or (high is not None and value > high):
        bound = f">= {low}" if high is None else f"in [{low}, {high}]"
        raise ConfigError(f"must be an integer {bound}, got {value}", field=name)
    return value


@dataclass
class Problem:
    """A model traced for a cluster: what optimize and estimate share."""

    spec: ModelSpec
    graph: OpGraph
    cluster: Cluster
    global_batch: int
    seq_len: int | None
    precision: str                 # a name of autoplan.precision: "mixed", "mixed-fp16", "fp32"
    memory_headroom: float = DEFAULT_HEADROOM   # fraction of device memory left free
    fused: bool = True             # the runtime fuses element-wise ops (False: eager PyTorch)
    fused_loss: bool | None = None  # ... and the loss's backward (None: as fused)
    float8_recipe: str = "torchao"  # whose float8 casts mixed-fp8 pays (autoplan.cost.float8)
    attention_kernel: str = "flash2"  # which fused attention runs (autoplan.cost.kernel_shape)
    cp_comm: str = "all-gather"     # how CP ranks exchange keys/values (cost.parallel_dims)

    @property
    def precision_dict(self) -> dict[str, str]:
        return precision_named(self.precision).plan_dict()

    @property
    def pricing(self) -> Pricing:
        """The runtime assumptions this problem's plans are priced under (the plan records them)."""
        return Pricing(self.fused, self.fused_loss, self.float8_recipe, self.attention_kernel,
                       self.cp_comm)

    def estimator(self) -> Estimator:
        return Estimator(self.graph, self.cluster, precision=self.precision,
                         memory_headroom=self.memory_headroom, fused=self.fused,
                         fused_loss=self.fused_loss, float8_recipe=self.float8_recipe,
                         attention_kernel=self.attention_kernel, cp_comm=self.cp_comm)


def check_precision(name: str | None, cluster: Cluster) -> str:
    """The precision name to plan ``cluster`` in: ``name``, or by default fp32 on CPU, bf16
    mixed precision on GPUs with bfloat16 and fp16 mixed precision (loss scaling) on GPUs
    without (V100). Refuses bf16 where the device has no bf16 peak, and fp16 on CPU ranks
    (gloo and CPU kernels do not train in fp16 with loss scaling)."""
    device = cluster.device
    on_cpu = device.name.lower().startswith("cpu")
    has_bf16 = "bfloat16" in device.peak_tflops
    if name is None:
        return default_for(device.name, bf16=has_bf16).name
    try:
        prec = precision_named(name)
    except ValueError as exc:
        raise ConfigError(str(exc).split(": ", 1)[-1], field="precision") from None
    if prec.loss_scaling and on_cpu:
        raise ConfigError(f"{name!r} (fp16 with loss scaling) is for GPUs; the CPU engine "
                          f"(gloo) trains in fp32 or bf16 only", field="precision")
    if prec.matmul is not None and prec.matmul not in device.peak_tflops and not on_cpu:
        raise ConfigError(f"{name!r} runs its linear layers' GEMMs in {prec.matmul}, which "
                          f"device {device.name!r} has no tensor cores for (float8 needs "
                          f"Hopper or later; use 'mixed')", field="precision")
    if prec.compute not in device.peak_tflops:
        hint = " (use 'mixed-fp16': fp16 with loss scaling)" if prec.compute == "bfloat16" \
            and "float16" in device.peak_tflops else ""
        raise ConfigError(f"{name!r} computes in {prec.compute}, which device "
                          f"{device.name!r} has no peak for{hint}", field="precision")
    return prec.name


def _is_module(obj: Any) -> bool:
    """``isinstance(obj, torch.nn.Module)`` without importing torch (an object can only be a
    module once torch is imported)."""
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(obj, torch.nn.Module)


def prepare(model: ModelLike | nn.Module, cluster: ClusterLike, *, global_batch: int,
            nodes: int | None = None, seq_len: int | None = None,
            precision: str | None = None, check_fits: bool = False,
            memory_headroom: float = DEFAULT_HEADROOM, example_inputs: Any = None,
            fused: bool = True, fused_loss: bool | None = None,
            float8_recipe: str = "torchao", attention_kernel: str = "flash2",
            cp_comm: str = "all-gather") -> Problem:
    """Resolve the model and cluster and trace the model on the meta device, at micro-batch
    1 or, for a model whose BatchNorm refuses one sample per channel in training, the
    smallest batch it accepts. ``model`` may be an ``nn.Module`` (meta or real) with its
    ``example_inputs`` (``model(*example_inputs)`` returns the loss): see
    :func:`autoplan.models.registry.module_spec`. ``check_fits`` (for planning): first raise
    InfeasibleError when the model states alone cannot fit in the cluster's memory
    (:mod:`autoplan.planner.bounds`), without tracing. ``fused=False``: the runtime runs
    element-wise ops unfused, as traced (eager PyTorch, torchtitan without torch.compile);
    by default as a fusing runtime does (Megatron-LM's fused kernels, torch.compile:
    :mod:`autoplan.cost.compute`, phi). ``fused_loss``: whether the loss's backward is fused
    (a fused cross-entropy kernel, torch.compile, Megatron-LM's in-place one) or holds
    eager PyTorch's two fp32 gradients (:func:`autoplan.cost.memory.loss_temporaries_bytes`);
    None: as ``fused``. ``float8_recipe``: whose float8 casts a ``mixed-fp8`` step pays,
    ``"torchao"`` (autoplan's engine, torchtitan) or ``"transformer-engine"`` (Megatron-LM,
    NeMo: :mod:`autoplan.cost.float8`). ``attention_kernel``: which fused attention the
    runtime runs, ``"flash2"`` (torch's SDPA flash backend: autoplan's engine, torchtitan) or
    ``"cudnn"`` (Transformer Engine on Hopper: Megatron-Core, NeMo;
    :mod:`autoplan.cost.kernel_shape`). ``cp_comm``: how context-parallel ranks exchange
    keys and values, ``"all-gather"`` (autoplan's engine) or ``"ring"`` (Transformer
    Engine's point-to-point ring: Megatron-Core, NeMo; torch's ring attention:
    :mod:`autoplan.cost.parallel_dims`)."""
    from autoplan.models.registry import module_spec

    if _is_module(model):
        if example_inputs is None:
            raise ConfigError("an nn.Module needs its example_inputs (a tensor or a tuple of "
                              "tensors: model(*example_inputs) returns the loss)",
                              field="example_inputs")
        model = module_spec(model, example_inputs)
    elif example_inputs is not None:
        raise ConfigError("example_inputs is for an nn.Module; a named model makes its own",
                          field="example_inputs")
    _count(global_batch, "global_batch", high=MAX_GLOBAL_BATCH)
    if seq_len is not None:
        _count(seq_len, "seq_len", high=MAX_SEQ_LEN)
    if nodes is not None:
        _count(nodes, "nodes")
    if isinstance(memory_headroom, bool) or not isinstance(memory_headroom, (int, float)) \
            or not 0 <= memory_headroom < 1:
        raise ConfigError(f"must be a fraction in [0, 1), got {memory_headroom!r}"[:200],
                          field="memory_headroom")
    bad = Pricing.first_error(dict(fused=fused, fused_loss=fused_loss, cp_comm=cp_comm,
                                   float8_recipe=float8_recipe,
                                   attention_kernel=attention_kernel))
    if bad is not None:
        raise ConfigError(bad[1], field=bad[0])
    spec = resolve(model) if isinstance(model, str) else model
    clus = load_cluster(cluster, nodes=nodes) if isinstance(cluster, str) else (
        cluster.with_nodes(nodes) if nodes else cluster)
    precision = check_precision(precision, clus)
    if check_fits:
        from autoplan.planner.bounds import check_states_fit

        check_states_fit(spec, clus, precision)
    seq = seq_len or default_seq_len(spec)
    import torch

    dtype = getattr(torch, precision_named(precision).compute)
    graph = _trace_smallest_batch(spec, seq, dtype)
    if not clus.device.name.lower().startswith("cpu"):
        # GPU training runs fused norm and attention kernels: their saved activations
        from autoplan.cost.fused import fuse_saved_activations

        graph = fuse_saved_activations(graph)
    return Problem(spec, graph, clus, global_batch, seq, precision, float(memory_headroom),
                   fused, fused_loss, float8_recipe, attention_kernel, cp_comm)


def _trace_smallest_batch(spec: ModelSpec, seq_len: int | None, dtype) -> OpGraph:
    """The trace at micro-batch 1, or 2, 4, ... up to 16 while BatchNorm refuses the batch
    (training-mode BatchNorm needs more than one value per channel: a 1x1 feature map at
    batch 1); the planners scale from the traced batch ``b0``. A deep stack of equal blocks
    is traced with three and replicated (:mod:`autoplan.trace.replicate`)."""
    from autoplan.errors import TraceError
    from autoplan.trace.replicate import trace_replicated

    batch = 1
    while True:
        try:
            return trace_replicated(spec, batch, seq_len, dtype=dtype)
        except (TraceError, ValueError) as exc:
            if "more than 1 value per channel" not in str(exc) or batch >= 16:
                raise
            batch *= 2


def head_counts(spec: ModelSpec) -> tuple[int, ...]:
    """Sizes a TP degree must divide: attention heads and KV heads from the model config,
    plus what the engine requires (:func:`autoplan.models.capabilities.capabilities`)."""
    from autoplan.models.capabilities import capabilities

    cfg = spec.config
    keys = ("heads", "kv_heads", "n_head", "num_attention_heads", "num_key_value_heads")
    out = [int(cfg[k]) for k in keys if cfg.get(k)]
    out += [n for _, n in capabilities(spec).tp_divisors]
    return tuple(sorted(set(out)))


def runnable_space(spec: ModelSpec, space: SearchSpace,
                   graph: OpGraph | None = None) -> SearchSpace:
    """Restrict ``space`` to what the engine can run for this model (no TP for a fused-QKV
    GPT-2, no pipeline with tied embeddings, no TP of a ``graph`` with convolutions on the
    generic runtime, ...), so plans are never paper."""
    from dataclasses import replace

    from autoplan.models.capabilities import capabilities

    from autoplan.capability import adapted

    caps = capabilities(spec)
    allowed = {"tp": caps.tensor_parallel, "sequence_parallel": caps.sequence_parallel,
               "pp": caps.pipeline, "cp": caps.context_parallel}
    changes: dict = {key: (False,) if key == "sequence_parallel" else (1,)
                     for key, ok in allowed.items() if not ok}

    if not adapted(spec):   # the generic runtime: no TP or recomputation with pipelines, no
        changes.update(tp_with_pp=False, checkpoint_with_pp=False)     # interleaved schedule
        changes["schedules"] = tuple(s for s in space.schedules if s != "interleaved_1f1b")
        if graph is not None and any(n.op.startswith("aten.convolution")
                                     for n in graph.nodes.values()):
            # DTensor's convolution handles spatially sharded inputs only: its backward
            # asserts the input is a DTensor (torch/distributed/tensor/_tp_conv.py)
            changes["tp"] = (1,)
    return replace(space, **changes)


PLANNERS = ("auto", "uniform")


def plan_problem(problem: Problem, *, space: SearchSpace = SearchSpace(), top_k: int = 10,
                 progress: Callable[[int], None] | None = None, planner: str = "uniform",
                 options=None) -> tuple[Plan, Any]:
    """Plan ``problem`` with ``planner``: ``"uniform"`` (the grid; returns its
    :class:`SearchResult`) or ``"auto"`` (the Alpa-style search, with the grid's best kept
    as the plan's ``comparison``; returns the search's result)."""
    if planner not in PLANNERS:
        raise ConfigError(f"must be one of {', '.join(PLANNERS)}, got {planner!r}",
                          field="planner")
    if planner == "auto":
        plan, result = _plan_auto(problem, space=space, top_k=top_k, options=options)
    else:
        plan, result = _plan_uniform(problem, space=space, top_k=top_k, progress=progress)
    plan.pricing = problem.pricing
    return plan, result


def _plan_uniform(problem: Problem, *, space: SearchSpace, top_k: int,
                  progress: Callable[[int], None] | None) -> tuple[Plan, SearchResult]:
    result = search_uniform(problem.graph, problem.cluster, problem.global_batch,
                            space=runnable_space(problem.spec, space, problem.graph),
                            precision=problem.precision,
                            divides=head_counts(problem.spec), progress=progress,
                            estimator=problem.estimator(), keep=top_k + 1)
    best = result.best
    plan = build_plan(problem.graph, problem.spec, problem.cluster, best.parallel,
                      global_batch=problem.global_batch, seq_len=problem.seq_len,
                      precision=problem.precision_dict, prediction=best.prediction,
                      alternatives=[c.summary() for c in result.ranked[1:top_k + 1]],
                      planner={"name": "uniform", "evaluated": result.evaluated,
                               "feasible": result.feasible})
    return plan, result


def _plan_auto(problem: Problem, *, space: SearchSpace, top_k: int,
               options=None) -> tuple[Plan, Any]:
    """The search, the uniform grid beside it for the comparison, the plan."""
    from dataclasses import replace

    from autoplan.display import prediction_dict
    from autoplan.errors import InfeasibleError
    from autoplan.models.capabilities import capabilities
    from autoplan.planner.search.megatron import uniform_choice
    from autoplan.planner.search.search import Candidate, SearchOptions, search
    from autoplan.planner.search.to_plan import build_search_plan

    gap = search_gap(problem.spec)
    uniform = uniform_plan = None
    uniform_error = None
    try:
        uniform_plan, uniform = _plan_uniform(problem, space=space, top_k=top_k, progress=None)
    except InfeasibleError as exc:
        uniform_error = str(exc)
    if gap is not None and uniform_plan is not None:
        # decided before searching: the search's plan would give way to the grid's
        note = f"{gap}, so the search did not run; this is the uniform grid's best"
        return replace(uniform_plan, planner={**uniform_plan.planner, "note": note}), uniform
    options = options or SearchOptions()
    if "op" in space.checkpoint and "op" not in options.checkpoint:   # asked of the grid
        options = replace(options, checkpoint=(*options.checkpoint, "op"))
    if not capabilities(problem.spec).pipeline:      # what the engine can run for the model
        options = replace(options, max_stages=1)
    from autoplan.capability import adapted

    if not adapted(problem.spec):      # the generic runtime: no interleaving, and stages
        options = replace(options, virtual_stages=(), split_at_blocks=True)   # at blocks
    try:
        result = search(problem.spec, problem.graph, problem.cluster,
                        global_batch=problem.global_batch, precision=problem.precision,
                        options=options, memory_headroom=problem.memory_headroom,
                        fused=problem.fused, fused_loss=problem.fused_loss,
                        float8_recipe=problem.float8_recipe,
                        attention_kernel=problem.attention_kernel)
    except InfeasibleError as exc:
        if uniform_error is not None:
            raise InfeasibleError(f"{uniform_error} (the search found no plan either: "
                                  f"{exc})") from None
        raise
    except PlanError as exc:
        if uniform_plan is None:
            raise
        # the search cannot model this graph (e.g. its op sequence at the probe batch does
        # not line up with the trace, planner/record.py): the grid's best, saying why
        note = (f"the search could not run ({' '.join(str(exc).split())[:300]}); this is "
                "the uniform grid's best")
        return replace(uniform_plan, planner={**uniform_plan.planner, "note": note}), uniform
    comparison: dict[str, Any] = {"planner": "uniform"}
    if uniform is None:
        comparison.update(feasible=False, message=uniform_error)
    else:
        best = uniform.best
        reprice_error = None
        try:                       # the same configuration, priced by the search's evaluator
            mine = uniform_choice(result.evaluator, best.parallel)
            repriced = result.evaluator.predict(mine)
        except (InfeasibleError, ValueError) as exc:   # not expressible with DTensor's placements
            mine = repriced = None
            reprice_error = " ".join(str(exc).split())[:300] or type(exc).__name__
        if reprice_error is not None:
            comparison["repriced_error"] = reprice_error
        comparison.update(
            feasible=True, parallel=best.parallel.label(), config=asdict(best.parallel),
            evaluated=uniform.evaluated, step_time_s=best.prediction.step_time_s,
            repriced_step_time_s=repriced.step_time_s if repriced else None,
            prediction=prediction_dict(best.prediction),
            speedup=best.prediction.step_time_s / result.prediction.step_time_s)
        if repriced is not None and repriced.step_time_s < result.prediction.step_time_s and \
                repriced.memory.total <= repriced.memory_limit_bytes:
            # never worse than the baseline: its layout, priced by the search's evaluator
            result.ranked.insert(0, Candidate(mine, repriced.step_time_s, "uniform baseline",
                                              repriced))
            result.best, result.prediction = mine, repriced
            comparison["speedup"] = best.prediction.step_time_s / repriced.step_time_s
    plan = build_search_plan(result, problem.spec, problem.cluster,
                             global_batch=problem.global_batch, seq_len=problem.seq_len,
                             precision=problem.precision_dict, top_k=top_k,
                             comparison=comparison)
    if uniform is not None and comparison.get("repriced_step_time_s") is None and \
            uniform.best.prediction.step_time_s < plan.prediction.step_time_s:
        # the grid's best could not be priced by the search's evaluator: the two planners'
        # own predictions, compared directly, keep the never-slower promise
        note = (f"the search's plan ({plan.planner.get('label')}, "
                f"{plan.prediction.step_time_s:.4g} s per step) is predicted slower than the "
                f"uniform grid's best ({uniform.best.prediction.step_time_s:.4g} s), which "
                f"the search's evaluator could not reprice ({comparison.get('repriced_error')}"
                "); this is the grid's best")
        return replace(uniform_plan, planner={**uniform_plan.planner, "note": note,
                                              "search": plan.planner.get("label"),
                                              "search_step_time_s":
                                                  plan.prediction.step_time_s}), result
    gap = _engine_gap(problem.spec, plan)
    if gap and uniform_plan is not None:
        # a plan the engine could not run is worth less than the grid's best, which it runs
        note = (f"the engine cannot run the search's plan ({plan.planner.get('label')}, "
                f"{plan.prediction.step_time_s:.4g} s per step): {gap}; this is the uniform "
                "grid's best")
        return replace(uniform_plan, planner={**uniform_plan.planner, "note": note,
                                              "search": plan.planner.get("label")}), result
    return plan, result


def search_gap(spec: ModelSpec) -> str | None:
    """Why the engine would run none of the search's plans of ``spec`` that place ops
    individually (None: it may run them, or it runs no plan of this model at all and a plan
    is paper either way). Such a plan would be replaced by the grid's best after the search
    (:func:`_engine_gap`), so the search is not run. A plan sharding some weight stands for
    the search's plans: the search shards weights whenever it pays (the only plans it
    would keep are those the uniform runtime also expresses, which the grid finds).
    Decided from the model spec as data (:mod:`autoplan.capability`)."""
    from types import SimpleNamespace

    from autoplan.capability import adapted, per_op_gap
    from autoplan.placement import shard_text

    if not adapted(spec):
        return None
    sharded = SimpleNamespace(param_placements={"<any weight>": {"tp": shard_text(0)}})
    return per_op_gap(spec) or per_op_gap(spec, sharded)


def _engine_gap(spec: ModelSpec, plan: Plan) -> str | None:
    """Why the engine cannot run ``plan`` of a model it runs otherwise (None: it can), from
    the plan and the spec as data: the generic runtime's limits, or an adapted runtime's."""
    from autoplan.capability import adapted, generic_gap, needs_per_op, per_op_gap

    if not adapted(spec):
        return generic_gap(plan)
    gap = per_op_gap(spec, plan)
    return gap if gap and needs_per_op(plan) else None


def optimize(model: ModelLike | nn.Module, cluster: ClusterLike, *, global_batch: int,
             nodes: int | None = None, seq_len: int | None = None,
             precision: str | None = None, space: SearchSpace = SearchSpace(),
             top_k: int = 10, planner: str = "auto", options=None,
             example_inputs: Any = None) -> Plan:
    """Plan ``model`` on ``cluster``: the fastest predicted configuration that fits.

    ``model``: a built-in name or preset ("gpt-7.5b", "llama3-70b"), ``hf:<type or
    config.json>``, ``import:pkg.module:factory``, a ModelSpec, or an ``nn.Module`` instance
    (meta or real; never modified) with ``example_inputs`` such that
    ``model(*example_inputs)`` returns the training loss. ``cluster``: a preset
    name ("dgx-a100"), a YAML path, or a Cluster; ``nodes`` overrides its node count.
    ``planner``: ``"auto"`` (default: the Alpa-style search, with the grid's best as its
    comparison and floor; ``options`` is its :class:`~autoplan.planner.search.search.SearchOptions`)
    or ``"uniform"`` (the grid of uniform configurations alone, restricted by ``space``).
    Raises InfeasibleError (with the memory it would need) if nothing fits.
    """
    _count(top_k, "top_k", low=0)
    if planner not in PLANNERS:
        raise ConfigError(f"must be one of {', '.join(PLANNERS)}, got {planner!r}"[:200],
                          field="planner")
    problem = prepare(model, cluster, global_batch=global_batch, nodes=nodes, seq_len=seq_len,
                      precision=precision, check_fits=True, example_inputs=example_inputs)
    plan, _ = plan_problem(problem, space=space, top_k=top_k, planner=planner,
                           options=options)
    return plan


def estimate(model: ModelLike, cluster: ClusterLike, *, global_batch: int,
             nodes: int | None = None, seq_len: int | None = None,
             precision: str | None = None, tp: int = 1, pp: int = 1, dp: int | None = None,
             zero: int = 0, micro_batch: int = 1, checkpoint: str = "none",
             schedule: str = "1f1b", virtual_stages: int = 1,
             sequence_parallel: bool = False, ep: int = 1, cp: int = 1,
             tp_comm_overlap: bool | str = False, problem: Problem | None = None) -> Plan:
    """The prediction for one configuration the user gives, as a Plan (check ``fits(plan)``).

    ``dp`` defaults to world / (tp·pp·cp); the number of micro-batches follows from the
    global batch: ``m = global_batch / (dp · micro_batch)``. ``ep``: expert parallelism (a
    divisor of dp splitting the experts); ``cp``: context parallelism (ranks per sequence);
    ``checkpoint``: 'none', 'selective' (the attention core), 'op' (torchtitan's op-level
    policy, :mod:`autoplan.cost.recompute`) or 'full' recomputation;
    ``tp_comm_overlap``: TP collectives overlapped with their GEMMs (needs sequence
    parallelism), or ``"backward"``: only the input gradients' collectives beside the
    weight-gradient GEMMs, as Megatron-LM runs by default (:mod:`autoplan.cost.tp_overlap`).
    A degree or size that is not a positive
    integer, or degrees that do not multiply to the cluster's devices, raise ConfigError
    naming the argument (before the model is traced).
    """
    from autoplan.plan import SCHEDULES
    from autoplan.plan_parts import RECOMPUTE_MODES

    for name, value in (("tp", tp), ("pp", pp), ("micro_batch", micro_batch),
                        ("virtual_stages", virtual_stages), ("ep", ep), ("cp", cp)):
        _count(value, name)
    if dp is not None:
        _count(dp, "dp")
    if isinstance(zero, bool) or zero not in (0, 1, 2, 3):
        raise ConfigError(f"must be 0, 1, 2 or 3, got {zero!r}"[:200], field="zero")
    if not isinstance(sequence_parallel, bool):
        raise ConfigError(f"must be True or False, got {sequence_parallel!r}"[:200],
                          field="sequence_parallel")
    if checkpoint not in RECOMPUTE_MODES:
        raise ConfigError(f"must be 'none', 'selective', 'op' or 'full', got {checkpoint!r}"[:200],
                          field="checkpoint")
    if not isinstance(tp_comm_overlap, bool) and tp_comm_overlap != "backward":
        raise ConfigError(f"must be True, False or 'backward', got {tp_comm_overlap!r}"[:200],
                          field="tp_comm_overlap")
    if tp_comm_overlap is True and not (sequence_parallel and tp > 1 and ep == 1 and cp == 1):
        raise ConfigError("needs tp > 1 with sequence parallelism, ep = 1 and cp = 1",
                          field="tp_comm_overlap")
    if tp_comm_overlap == "backward" and not (tp > 1 and ep == 1 and cp == 1):
        raise ConfigError("'backward' needs tp > 1, ep = 1 and cp = 1",
                          field="tp_comm_overlap")
    if schedule not in SCHEDULES:
        raise ConfigError(f"must be one of {', '.join(SCHEDULES)}, got {schedule!r}"[:200],
                          field="schedule")
    if problem is None:
        problem = prepare(model, cluster, global_batch=global_batch, nodes=nodes,
                          seq_len=seq_len, precision=precision)
    world = problem.cluster.world_size
    if dp is None:
        if world % (tp * pp * cp):
            what = "tp*pp*cp" if cp > 1 else "tp*pp"
            raise ConfigError(f"{what} = {tp * pp * cp} does not divide the {world} devices of "
                              f"{problem.cluster.name}", field="tp")
        dp = world // (tp * pp * cp)
    if dp * cp * tp * pp != world:
        what, parts = ("dp*cp*tp*pp", (dp, cp, tp, pp)) if cp > 1 else ("dp*tp*pp", (dp, tp, pp))
        raise ConfigError(f"{what} = {'*'.join(map(str, parts))} = {dp * cp * tp * pp} but "
                          f"the cluster has {world} devices", field="dp")
    if dp % ep:
        raise ConfigError(f"ep = {ep} must divide dp = {dp} (expert parallelism folds into "
                          "data parallelism)", field="ep")
    experts = problem.graph.experts
    if ep > 1 and (not experts or experts % ep):
        raise ConfigError(f"ep = {ep} needs a mixture of experts whose expert count it "
                          f"divides; {problem.spec.name} has {experts or 'no'} experts",
                          field="ep")
    seq = problem.graph.batch.seq_len
    if cp > 1 and (not seq or seq % (2 * cp) or any(
            layer.stats.kv_bytes == 0 for layer in problem.graph.blocks())):
        raise ConfigError(f"cp = {cp} needs scaled-dot-product attention in every block and "
                          f"a sequence length divisible by 2 x cp (got {seq})", field="cp")
    per_rank, rem = divmod(problem.global_batch, dp * micro_batch)
    if rem or per_rank < 1:
        raise ConfigError(f"global batch {problem.global_batch} is not divisible by dp * "
                          f"micro_batch = {dp} * {micro_batch} = {dp * micro_batch}",
                          field="micro_batch")
    parallel = ParallelConfig(dp=dp, tp=tp, pp=pp, zero=zero, sequence_parallel=sequence_parallel,
                              micro_batch=micro_batch, num_micro_batches=per_rank,
                              schedule=schedule, virtual_stages=virtual_stages,
                              checkpoint=checkpoint, ep=ep, cp=cp,
                              tp_comm_overlap=tp_comm_overlap)
    _check_shardable(problem, parallel)
    prediction = problem.estimator().predict(parallel)
    plan = build_plan(problem.graph, problem.spec, problem.cluster, parallel,
                      global_batch=problem.global_batch, seq_len=problem.seq_len,
                      precision=problem.precision_dict, prediction=prediction,
                      planner={"name": "estimate"})
    plan.pricing = problem.pricing
    return plan


def plan_fits(plan: Plan) -> bool:
    return plan.prediction is not None and fits(plan.prediction)


def _check_shardable(problem: Problem, p: ParallelConfig) -> None:
    from autoplan.models.capabilities import capabilities

    caps = capabilities(problem.spec)
    if (p.tp > 1 and not caps.tensor_parallel) or (p.pp > 1 and not caps.pipeline) or (
            p.sequence_parallel and not caps.sequence_parallel):
        raise ConfigError(f"the engine cannot run this for {problem.spec.name}: {caps.reason}",
                          field="tp" if p.tp > 1 else "pp")
    if p.cp > 1 and not caps.context_parallel:
        raise ConfigError(caps.cp_reason, field="cp")
    blocks = len(problem.graph.blocks())
    if p.pp > max(blocks, 1) or p.pp * p.virtual_stages > max(blocks, 1):
        raise ConfigError(f"pp * virtual_stages = {p.pp * p.virtual_stages} exceeds the model's "
                          f"{blocks} blocks", field="pp")
    if p.tp > problem.cluster.devices_per_node:
        raise ConfigError(f"tp = {p.tp} exceeds the {problem.cluster.devices_per_node} devices "
                          "of a node (tensor parallelism stays inside a node)", field="tp")
    for name, info in problem.graph.params.items():
        if info.tp_dim is not None and info.shape[info.tp_dim] % p.tp:
            raise ConfigError(f"tp = {p.tp} does not divide dim {info.tp_dim} of {name} "
                              f"{list(info.shape)}", field="tp")
    for k in head_counts(problem.spec):
        if k % p.tp:
            raise ConfigError(f"tp = {p.tp} does not divide the head count {k}", field="tp")
    if not runs_micro_batches(p.schedule, p.pp, p.num_micro_batches):
        raise ConfigError(f"{p.num_micro_batches} micro-batches for {p.pp} pipeline stages; "
                          f"{p.schedule} needs at least as many micro-batches as stages "
                          "(GPipe does not)", field="micro_batch")
