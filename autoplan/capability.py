"""Which runtime runs a plan, and what the generic runtime can run — decided from data.

Pure functions of the model spec and the plan (no ``engine``, no ``torch.distributed``), so
the planner, the report and the export can ask without building anything distributed.
The engine picks its runtime with :func:`runtime_for` (:mod:`engine.runtime`).

Runtimes:

* ``uniform`` — the Megatron-style runtime of :mod:`engine.parallelize`: the built-in GPT and
  the Hugging Face causal LMs with a stage adapter (:data:`ADAPTED_HF`); tensor and sequence
  parallelism, pipelines of any schedule, ZeRO 0-3; the only runtime for expert (``ep``) and
  context (``cp``) parallelism (:mod:`engine.expert_parallel`).
* ``per_op`` — :mod:`engine.staged`, for search plans of the built-in GPT whose placements
  the uniform layout cannot express (:func:`uniform_gap` names what; the engine adds the
  checks that need the real modules, :func:`engine.staged.runs_per_op`). What it does not
  run yet is :func:`per_op_gap`'s.
* ``generic`` — :mod:`engine.generic`, every other model: any Hugging Face architecture or
  task, ``import:`` modules, a user's module through :func:`autoplan.parallelize`.

What the generic runtime runs (:func:`generic_gap` gives the reason for what it does not):

==========================  =====================================================
data parallel, ZeRO 0-3     any model (``replicate`` / ``fully_shard`` per block)
tensor parallel             ``pp == 1``; every sharded weight's dim divisible by tp
                            (checked at launch on the real shapes); the forward runs
                            on DTensors, so any placement the plan writes is exact
sequence parallel           no: it needs a Megatron layout of the residual stream,
                            which only the adapted models declare
pipeline                    ``tp == 1``, stages that begin at a block, no
                            activation checkpointing inside stages, GPipe or 1F1B
                            (not interleaved: labels skip stages); the model must
                            export as one graph (``torch.export``, checked at launch)
per-op layouts              no: stage submeshes of their own shapes, batch split
                            along more than ``dp``
==========================  =====================================================
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from autoplan.placement import REPLICATE, REPLICATED, parse
from autoplan.precision import PLAN_KEYS as PRECISION_KEYS

if TYPE_CHECKING:                      # pragma: no cover
    from autoplan.models.registry import ModelSpec
    from autoplan.plan import Plan

#: Hugging Face model types with a stage adapter in :mod:`engine.hf_arch` (the keys of its
#: ``ARCHITECTURES``; ``tests/test_engine_generic.py`` checks they agree).
ADAPTED_HF = ("gpt2", "llama", "mistral", "qwen2", "mixtral", "qwen3_moe")
RUNTIMES = ("uniform", "per_op", "generic")
#: The dtypes every runtime computes, stores and reduces in (no float16: no loss scaling).
ENGINE_DTYPES = ("float32", "bfloat16")


def adapted(spec: "ModelSpec") -> bool:
    """Does a per-architecture runtime (the uniform / per-op ones) know this model?"""
    return (spec.source == "builtin" and spec.name == "gpt") or (
        spec.source == "hf" and spec.name in ADAPTED_HF)


def forced_runtime(plan: "Plan") -> str | None:
    """The runtime the plan names in its typed ``runtime`` field (validated at load), or
    None: the engine chooses."""
    return plan.runtime if plan.runtime in RUNTIMES else None


def runtime_for(spec: "ModelSpec", plan: "Plan") -> str:
    """``"generic"`` for a model no adapted runtime knows (or a plan forcing it); otherwise
    the runtime the plan forces, or ``"adapted"``: the engine then chooses ``uniform`` or
    ``per_op`` from the placements."""
    forced = forced_runtime(plan)
    if forced == "generic" or not adapted(spec):
        return "generic"
    return forced or "adapted"


def generic_gap(plan: "Plan") -> str | None:
    """Why the generic runtime cannot run ``plan`` (None: it can). The checks that need the
    real model (divisible shapes, an exportable graph) happen at launch."""
    p = plan.parallel
    if plan.layout != "uniform":
        return "field 'layout': the generic runtime runs the uniform (pp, dp, tp) layout only"
    for st in plan.stages:
        extra = sorted(set(st.data_axes) - {"dp"})
        if extra:
            return (f"field 'stages[{st.index}].data_axes': the generic runtime splits the "
                    f"batch along dp only, not {extra}")
    for fqn, axes in sorted(plan.param_placements.items()):
        if parse(axes.get("dp", REPLICATED)).kind != REPLICATE and p.zero != 3:
            return (f"field 'param_placements.{fqn}.dp': {axes['dp']} needs ZeRO-3 on the "
                    "generic runtime")
    if p.sequence_parallel and p.tp > 1:
        return ("field 'parallel.sequence_parallel': the generic runtime does not run "
                "sequence parallelism (it needs a declared Megatron layout of the residual "
                "stream)")
    if p.pp > 1 and p.tp > 1:
        return ("field 'parallel': the generic runtime does not combine tensor parallelism "
                "with pipeline stages (the stages run captured graph code, not modules)")
    if p.pp > 1:
        if any(st.checkpoint_layers for st in plan.stages):
            return ("field 'stages[].checkpoint_layers': the generic runtime does not "
                    "checkpoint activations inside pipeline stages")
        for st in plan.stages[1:]:
            if not st.layer_names or st.layer_names[0] in ("<pre>", "<post>"):
                return (f"field 'stages[{st.index}].layer_names': a pipeline stage must "
                        "begin with a block")
        if p.virtual_stages > 1 or p.schedule == "interleaved_1f1b":
            return ("field 'parallel.schedule': the generic runtime does not run interleaved "
                    "1F1B (the batch inputs the last stage reads, such as labels, skip the "
                    "stages between, which torch.distributed.pipelining's multi-stage "
                    "schedules refuse); use 1f1b or gpipe")
        if p.virtual_stages > 1 and p.num_micro_batches % p.pp:
            return ("field 'parallel.num_micro_batches': interleaved 1F1B needs a multiple "
                    f"of pp={p.pp}")
    if plan.global_batch % (p.dp * p.num_micro_batches):
        return (f"field 'global_batch': {plan.global_batch} does not split into dp={p.dp} x "
                f"{p.num_micro_batches} micro-batches")
    return precision_gap(plan.precision)


def precision_gap(precision: dict) -> str | None:
    """Why the engine cannot run a plan's ``precision`` dict (None: it can): the master,
    compute and reduce dtypes among :data:`ENGINE_DTYPES`, and ``matmul`` float8 (torchao's
    float8 linear layers, :mod:`engine.float8`) or absent. One check for the capability
    query and the engine's validation."""
    for key in precision:
        if key not in PRECISION_KEYS:
            return f"field 'precision.{key}': unknown key"
    for key in ("params", "compute", "reduce"):
        value = precision.get(key, "float32")
        if value not in ENGINE_DTYPES:
            return (f"field 'precision.{key}': the engine runs "
                    f"{' and '.join(ENGINE_DTYPES)}, got {value!r}")
    matmul = precision.get("matmul")
    if matmul is not None and matmul != "float8":
        return f"field 'precision.matmul': the engine runs float8 GEMMs or none, got {matmul!r}"
    return None


def per_op_gap(spec: "ModelSpec", plan: "Plan | None" = None) -> str | None:
    """Why the per-op runtime cannot run ``spec`` (or ``plan`` of it; None: it can). It runs
    the built-in GPT with untied embeddings (``tie_embeddings``, False unless the model's
    config says so) and shards Llama-style weights not yet (DTensor cannot reshape the
    head-sharded attention output after the rotary embedding)."""
    if spec.source != "builtin" or spec.name != "gpt":
        return f"the per-op runtime runs built-in GPT models, not {spec.source}:{spec.name}"
    if spec.config.get("tie_embeddings", False):
        return "the per-op runtime does not run tied embeddings yet"
    if plan is not None and spec.config.get("style") == "llama" and any(
            parse(v).kind != REPLICATE for axes in plan.param_placements.values()
            for v in axes.values()):
        return "the per-op runtime does not shard Llama-style weights yet"
    return None


def uniform_gap(plan: "Plan") -> str | None:
    """What in ``plan`` the uniform (pp, dp, tp) layout cannot express, read from the plan
    alone (None: nothing): stage submeshes of their own shapes, the batch split along more
    than ``dp``, a weight sharded along ``dp`` (ZeRO-3's at-rest shard is the runtime's, not
    the plan's). The engine adds what needs the model's modules (a placement its
    tensor-parallel styles cannot apply: :func:`engine.validate.check_engine_support`)."""
    if plan.layout == "stages":
        return "its stages sit on submeshes of their own shapes"
    for st in plan.stages:
        extra = sorted(set(st.data_axes) - {"dp"})
        if extra:
            return f"stage {st.index} splits the batch along {extra} too"
    for fqn, axes in sorted(plan.param_placements.items()):
        if parse(axes.get("dp", REPLICATED), f"param_placements.{fqn}.dp").kind != REPLICATE:
            return f"weight {fqn} is {axes['dp']} along the data-parallel axis"
    return None


def needs_per_op(plan: "Plan") -> bool:
    """Whether ``plan`` runs on the per-op runtime as far as the plan's data tells:
    ``plan.runtime`` when it names one, else a search plan with a :func:`uniform_gap`."""
    if plan.runtime is not None:
        return plan.runtime == "per_op"
    return plan.planner.name == "auto" and uniform_gap(plan) is not None


def generic_flags() -> dict[str, bool]:
    """What the generic runtime can run for any model, before the plan is known (the
    fields of :class:`autoplan.models.capabilities.ModelCapabilities`)."""
    return {"tensor_parallel": True, "sequence_parallel": False, "pipeline": True,
            "runs": True}
