"""What each runtime can run, decided from the plan and the model spec as data
(autoplan.capability): the per-op runtime's gaps and what the uniform layout cannot express,
asked by the planner, the export and the engine alike."""

import dataclasses

import pytest

from autoplan.capability import needs_per_op, per_op_gap, runtime_for, uniform_gap
from autoplan.models.registry import ModelSpec
from autoplan.placement import PlacementError
from engine_helpers import make_plan

GPT = ModelSpec("builtin", "gpt", {"layers": 2, "hidden": 64, "heads": 4})


def test_per_op_gap_from_the_spec():
    assert per_op_gap(GPT) is None
    assert "built-in GPT" in per_op_gap(ModelSpec("hf", "llama", {}))
    assert "tied embeddings" in per_op_gap(ModelSpec("builtin", "gpt", {"tie_embeddings": True}))
    llama = ModelSpec("builtin", "gpt", {"style": "llama"})
    plan = make_plan(tp=2)
    assert per_op_gap(llama) is None                       # replicated weights: it runs
    assert "Llama-style" in per_op_gap(llama, plan)        # sharded weights: not yet
    assert per_op_gap(GPT, plan) is None


def test_uniform_gap_names_what_the_uniform_layout_cannot_express():
    plan = dataclasses.replace(make_plan(dp=2), planner={"name": "auto"})
    assert uniform_gap(plan) is None and not needs_per_op(plan)
    split = dataclasses.replace(plan, stages=[dataclasses.replace(st, data_axes=("dp", "tp"))
                                              for st in plan.stages])
    assert "['tp']" in uniform_gap(split) and needs_per_op(split)
    fqn = next(iter(plan.param_placements))
    sharded = dataclasses.replace(plan, param_placements={
        **plan.param_placements, fqn: {"dp": "Shard(0)", "tp": "Replicate()"}})
    assert fqn in uniform_gap(sharded)
    assert needs_per_op(dataclasses.replace(plan, runtime="per_op"))
    assert not needs_per_op(dataclasses.replace(split, runtime="uniform"))   # forced
    assert not needs_per_op(dataclasses.replace(split, planner={"name": "uniform"}))


def test_uniform_gap_refuses_garbage_placements_naming_the_field():
    plan = make_plan(dp=2)
    bad = dataclasses.replace(plan, param_placements={"w": {"dp": "Shard(x)"}})
    with pytest.raises(PlacementError, match="param_placements.w.dp"):
        uniform_gap(bad)


def test_engine_agrees_where_the_data_decides():
    """The engine's choice (engine.staged.runs_per_op) adds module-level checks to
    uniform_gap; where the plan's data already decides, both say the same."""
    from engine.staged import per_op_reason, runs_per_op

    plan = dataclasses.replace(make_plan(dp=2), planner={"name": "auto"})
    split = dataclasses.replace(plan, stages=[dataclasses.replace(st, data_axes=("dp", "tp"))
                                              for st in plan.stages])
    for p in (plan, split, dataclasses.replace(plan, runtime="per_op")):
        assert runs_per_op(p) == needs_per_op(p)
    assert per_op_reason(split) == uniform_gap(split)


def test_the_runtime_a_plan_forces_is_its_typed_field():
    plan = make_plan(dp=2)
    assert runtime_for(GPT, plan) == "adapted"
    assert runtime_for(GPT, dataclasses.replace(plan, runtime="per_op")) == "per_op"
    assert runtime_for(ModelSpec("builtin", "mlp", {}), plan) == "generic"
