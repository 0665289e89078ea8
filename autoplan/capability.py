"""Which runtime runs a plan, and what the generic runtime can run — decided from data.

Pure functions of the model spec and the plan (no ``engine``, no ``torch.distributed``), so
the planner, the report and the export can ask without building anything distributed.
The engine picks its runtime with :func:`runtime_for` (:mod:`engine.runtime`).

Runtimes:

* ``uniform`` — the Megatron-style runtime of :mod:`engine.parallelize`: the built-in GPT and
  the Hugging Face causal LMs with a stage adapter (:data:`ADAPTED_HF`); tensor and sequence
  parallelism, pipelines of any schedule, ZeRO 0-3.
* ``per_op`` — :mod:`engine.staged`, for search plans of the built-in GPT whose placements
  the uniform layout cannot express (chosen by the engine, :func:`engine.staged.runs_per_op`).
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

if TYPE_CHECKING:                      # pragma: no cover
    from autoplan.models.registry import ModelSpec
    from autoplan.plan import Plan

#: Hugging Face model types with a stage adapter in :mod:`engine.hf_arch` (the keys of its
#: ``ARCHITECTURES``; ``tests/test_engine_generic.py`` checks they agree).
ADAPTED_HF = ("gpt2", "llama", "mistral", "qwen2")
RUNTIMES = ("uniform", "per_op", "generic")


def adapted(spec: "ModelSpec") -> bool:
    """Does a per-architecture runtime (the uniform / per-op ones) know this model?"""
    return (spec.source == "builtin" and spec.name == "gpt") or (
        spec.source == "hf" and spec.name in ADAPTED_HF)


def forced_runtime(plan: "Plan") -> str | None:
    """``planner["runtime"]`` when the plan names one of :data:`RUNTIMES`."""
    forced = plan.planner.get("runtime") if isinstance(plan.planner, dict) else None
    return forced if forced in RUNTIMES else None


def runtime_for(spec: "ModelSpec", plan: "Plan") -> str:
    """``"generic"`` for a model no adapted runtime knows (or a plan forcing it); otherwise
    ``"adapted"``: the engine then chooses ``uniform`` or ``per_op`` from the placements."""
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
        if axes.get("dp", "Replicate()") != "Replicate()" and p.zero != 3:
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
    for key in ("params", "compute", "reduce"):
        if plan.precision.get(key, "float32") not in ("float32", "bfloat16"):
            return f"field 'precision.{key}': the engine runs float32 and bfloat16"
    return None


def generic_flags() -> dict[str, bool]:
    """What the generic runtime can run for any model, before the plan is known (the
    fields of :class:`autoplan.models.capabilities.ModelCapabilities`)."""
    return {"tensor_parallel": True, "sequence_parallel": False, "pipeline": True,
            "runs": True}
