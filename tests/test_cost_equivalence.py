"""One configuration priced once: the grid and the search agree on every uniform configuration.

The grid (:class:`~autoplan.planner.grid.estimate.Estimator`) prices a
:class:`~autoplan.plan.ParallelConfig` from per-layer statistics; the search
(:class:`~autoplan.planner.search.evaluate.Evaluator`) prices the same configuration expressed
as per-op placements (:func:`~autoplan.planner.search.megatron.uniform_choice`: Megatron's
layout chosen by the intra-op ILP restricted to it). Both hand their chunks to the one composition,
:class:`autoplan.cost.step.StepModel`; this checks that the chunks agree too: step time, its
breakdown, memory per device and per-stage times equal within 1e-9 (relative), over a seeded
random sample of each cluster's whole uniform space (DP/TP/PP, sequence parallelism, ZeRO 0-3,
recomputation none / selective / full, TP-communication overlap, GPipe / 1F1B / interleaved
1F1B): a GPU cluster of two nodes (cross-node groups and pipeline sends) in mixed precision
-- once with fused attention, once with eager attention, whose attention matrices make
selective recomputation worth enumerating -- and the 4-rank CPU cluster whose ranks share
cores (measured op and link profiles, the shared-core composition, calibration) in fp32.

Small models, traced once per module; planning only (no engine runs).
"""

from __future__ import annotations

import random

import pytest

from autoplan.api import prepare
from autoplan.models import resolve
from autoplan.planner.search.compose import analyse
from autoplan.planner.search.costs import CostModel
from autoplan.planner.grid.estimate import Estimator
from autoplan.planner.search.evaluate import Evaluator
from autoplan.planner.search.megatron import uniform_choice
from autoplan.planner.grid.uniform import SearchSpace, enumerate_configs

REL = 1e-9
SAMPLES = {"gpu": 130, "gpu_eager": 80, "cpu": 90}        # 300 configurations in all


def _setup(spec, cluster, global_batch, precision, nodes=None):
    problem = prepare(spec, cluster, global_batch=global_batch, precision=precision,
                      nodes=nodes)
    ev = Evaluator(CostModel(problem.graph, problem.cluster, precision=precision),
                   analyse(problem.spec, problem.graph))
    est = Estimator(problem.graph, problem.cluster, precision=precision)
    configs = list(enumerate_configs(problem.graph, problem.cluster, global_batch,
                                     SearchSpace(tp_comm_overlap=(False, True))))
    return problem, ev, est, configs


@pytest.fixture(scope="module")
def gpu():
    spec = resolve("gpt", vocab_size=2048, hidden=512, layers=8, heads=8, seq_len=256)
    return _setup(spec, "dgx-a100", 64, "mixed", nodes=2)


@pytest.fixture(scope="module")
def gpu_eager():
    spec = resolve("gpt", vocab_size=2048, hidden=512, layers=8, heads=8, seq_len=256,
                   attention="eager")
    return _setup(spec, "dgx-a100", 64, "mixed", nodes=2)


@pytest.fixture(scope="module")
def cpu():
    return _setup("gpt-small", "local-cpu", 16, "fp32")


def _close(a: float, b: float) -> bool:
    return abs(a - b) <= REL * max(abs(a), abs(b)) + 1e-15


def _differences(grid, search) -> list[str]:
    out = []
    for name in ("step_time_s", "tokens_per_s", "mfu", "hardware_tflops_per_device"):
        if not _close(getattr(grid, name), getattr(search, name)):
            out.append(f"{name}: grid {getattr(grid, name)!r} search {getattr(search, name)!r}")
    for section in ("time", "memory"):
        g, s = getattr(grid, section).to_dict(), getattr(search, section).to_dict()
        out += [f"{section}.{k}: grid {g[k]!r} search {s[k]!r}" for k in g
                if not _close(g[k], s[k])]
    for i, (g, s) in enumerate(zip(grid.memory_per_stage, search.memory_per_stage)):
        if not _close(g.total, s.total):
            out.append(f"memory_per_stage[{i}]: grid {g.total!r} search {s.total!r}")
    for i, (g, s) in enumerate(zip(grid.stage_times, search.stage_times)):
        gd, sd = g.to_dict(), s.to_dict()
        # a chunk's forward / backward split of in-layer communication differs where the
        # grid books a collective and its dual together (sums checked)
        for k in ("forward", "backward", "recompute", "send"):
            if not _close(gd[k], sd[k]):
                out.append(f"stage_times[{i}].{k}: grid {gd[k]!r} search {sd[k]!r}")
        if not _close(gd["tp_forward"] + gd["tp_backward"], sd["tp_forward"] + sd["tp_backward"]):
            out.append(f"stage_times[{i}].tp: grid {gd!r} search {sd!r}")
    if len(grid.stage_times) != len(search.stage_times):
        out.append("stage_times: different numbers of stages")
    return out


@pytest.mark.parametrize("cluster", ["gpu", "gpu_eager", "cpu"])
def test_grid_and_search_price_every_uniform_configuration_the_same(cluster, request):
    problem, ev, est, configs = request.getfixturevalue(cluster)
    rng = random.Random(12)
    sample = rng.sample(configs, min(SAMPLES[cluster], len(configs)))
    assert len(sample) == SAMPLES[cluster]
    # the sample covers every dimension the issue names
    assert {p.schedule for p in sample} == {"gpipe", "1f1b", "interleaved_1f1b"}
    assert {p.zero for p in sample} == {0, 1, 2, 3}
    # selective recomputation where blocks keep attention matrices (eager attention);
    # TP-communication overlap on GPU clusters only
    assert {p.checkpoint for p in sample} == (
        {"none", "selective", "full"} if cluster == "gpu_eager" else {"none", "full"})
    assert any(p.tp_comm_overlap for p in sample) == (cluster != "cpu")
    assert any(p.sequence_parallel for p in sample)
    for axis in ("dp", "tp", "pp"):
        assert any(getattr(p, axis) > 1 for p in sample) and \
            any(getattr(p, axis) == 1 for p in sample), axis
    three_d = [p for p in configs if p.dp > 1 and p.tp > 1 and p.pp > 1]
    assert bool(three_d) == (cluster != "cpu")        # (4 CPU ranks cannot be 2 x 2 x 2)
    assert not three_d or any(p in three_d for p in sample)
    failures = {}
    for p in sample:
        diff = _differences(est.predict(p), ev.predict(uniform_choice(ev, p)))
        if diff:
            failures[p.label()] = diff
    assert not failures, f"{len(failures)} of {len(sample)} differ: " + \
        "; ".join(f"{k}: {v[:3]}" for k, v in list(failures.items())[:5])


def test_grid_and_search_price_op_level_recomputation_the_same(gpu):
    """Op-level recomputation (torchtitan's per-op policy) as the search's stages price it
    -- the matmuls and element-wise ops run again, their collectives but the
    reduce-scatters, the kept outputs sharded as the layouts place them -- equals the
    grid's price of the same uniform configuration."""
    problem, ev, _, _ = gpu
    est = Estimator(problem.graph, problem.cluster, precision="mixed")
    configs = list(enumerate_configs(problem.graph, problem.cluster, 64,
                                     SearchSpace(checkpoint=("op",),
                                                 tp_comm_overlap=(False, True))))
    sample = random.Random(3).sample(configs, 30)
    assert {p.checkpoint for p in sample} == {"op"}
    assert any(p.sequence_parallel for p in sample) and any(
        p.tp > 1 and not p.sequence_parallel for p in sample)
    failures = {}
    for p in sample:
        mine = ev.predict(uniform_choice(ev, p))
        assert mine.time.recompute > 0
        diff = _differences(est.predict(p), mine)
        if diff:
            failures[p.label()] = diff
    assert not failures, f"{len(failures)} of {len(sample)} differ: " + \
        "; ".join(f"{k}: {v[:3]}" for k, v in list(failures.items())[:5])
