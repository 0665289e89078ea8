"""The never-slower guard over the zoo's families (issue 15, item 5): the default planner's
plan is never predicted slower than the uniform grid's best — priced by the search's
evaluator where it can reprice the grid's configuration, else by the two planners' own
predictions. One small fp32 model per family, on 2 CPU ranks (``benchmarks/model_zoo.py``
checks every row at full size)."""

from __future__ import annotations

from dataclasses import replace

import pytest

pytest.importorskip("transformers", reason="the zoo's Hugging Face rows need 'transformers'")

from benchmarks.model_zoo import ZOO  # noqa: E402
from benchmarks.zoo_models import available  # noqa: E402

FAMILIES = ["gpt2", "bert", "t5", "vit", "nn_transformer", "tv_resnet18",
            "timm_convnext_tiny"]


@pytest.mark.slow
@pytest.mark.parametrize("name", FAMILIES)
def test_search_never_predicted_slower_than_the_grid(name):
    import autoplan
    from autoplan.cluster import load_cluster
    from autoplan.models.registry import resolve

    model, extra, small, package = ZOO[name]
    why = available(package) if package else None
    if why:
        pytest.skip(why)
    if model.startswith("module:"):
        model = "import:benchmarks.zoo_models:nn_transformer"
    spec = resolve(model, **{**extra, **small})
    cluster = replace(load_cluster("local-cpu"), devices_per_node=2)
    plan = autoplan.optimize(spec, cluster, global_batch=8, precision="fp32")
    if plan.planner["name"] == "uniform":     # the grid's best, returned by the guard (or the
        return                                # engine's fallback): equal to it by definition
    comparison = plan.comparison
    assert comparison.get("feasible"), comparison
    repriced = comparison.get("repriced_step_time_s")
    grid = repriced if repriced is not None else comparison["step_time_s"]
    assert plan.prediction.step_time_s <= grid * (1 + 1e-9)
