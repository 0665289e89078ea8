"""Exact shortcuts of the planners (issue #18): each one gives what the long way gives.

* the uniform grid's branch and bound (:func:`autoplan.planner.grid.uniform.search_uniform` with
  ``keep``) ranks the same first ``keep`` configurations as pricing all, and its bound
  (:meth:`~autoplan.planner.grid.estimate.Estimator.step_lower_bound`) never exceeds a step time;
* :func:`autoplan.planner.search.tables.fastest_fitting` equals the argmin over the full
  (positions x rows x ranges) array it replaces, ties (broken by the least memory, then
  the first row) and no-fit columns included.
"""

from __future__ import annotations

import numpy as np
import pytest

from autoplan.api import head_counts, prepare, runnable_space
from autoplan.cost.runtime import RUNTIME_OVERHEAD
from autoplan.planner.search.tables import INF, fastest_fitting, last_fitting
from autoplan.planner.grid.uniform import SearchSpace, search_uniform


@pytest.fixture(scope="module")
def problem():
    return prepare("gpt-tiny", "dgx-a100", nodes=2, global_batch=64)


def _grid(problem, **kw):
    return search_uniform(problem.graph, problem.cluster, problem.global_batch,
                          space=runnable_space(problem.spec, SearchSpace()),
                          precision=problem.precision, divides=head_counts(problem.spec),
                          estimator=problem.estimator(), **kw)


def test_branch_and_bound_ranks_the_same_first_configurations(problem):
    full = _grid(problem)
    keep = 6
    bounded = _grid(problem, keep=keep)
    assert bounded.evaluated == full.evaluated
    assert keep <= bounded.priced < full.evaluated        # it prices fewer, not too few
    top = lambda r: [(c.parallel, c.prediction.step_time_s) for c in r.ranked[:keep]]  # noqa: E731
    assert top(bounded) == top(full)


def test_step_lower_bound_bounds_every_step_time(problem):
    est = problem.estimator()
    assert est.exact_pipeline_bound
    full = _grid(problem)
    for cand in full.ranked:
        bound = est.step_lower_bound(cand.parallel)
        assert 0 < bound <= cand.prediction.step_time_s
        # the bound is the pipeline term of the composed step (compute, TP, sends, bubble)
        # times 1 + the GPU runtime overhead the step adds (autoplan/cost/runtime.py)
        t = cand.prediction.time
        assert bound == pytest.approx((t.compute + t.recompute + t.tp_comm + t.pp_comm
                                       + t.bubble) * (1 + RUNTIME_OVERHEAD), rel=1e-9)
        assert t.runtime == pytest.approx(RUNTIME_OVERHEAD * (t.total - t.runtime), rel=1e-9)


def test_fastest_fitting_is_the_full_argmin():
    rng = np.random.default_rng(0)
    for _ in range(300):
        r, p, s1 = rng.integers(1, 12), rng.integers(1, 20), rng.integers(1, 34)
        lat = rng.choice([0.5, 1.0, 1.5, 2.0, INF], size=(r, p))        # ties and INF
        states = rng.choice([0.0, 1.0, 2.0, 3.0], size=(r, p))
        act = rng.choice([0.0, 0.1, 0.3, 1 / 3], size=(r, p))           # rounding edges
        fixed = rng.choice([0.0, 0.7, 1.1], size=(r, p))
        memory = float(rng.choice([2.0, 3.0, 5.0, 10.0]))
        mem = states[None] + np.arange(s1)[:, None, None] * act[None] + fixed[None]
        cand = np.where(mem <= memory, lat[None], INF)
        # the least latency; of equal ones the least tie key (states + act + fixed), then
        # the first row
        key = np.broadcast_to((states + act + fixed)[None], cand.shape)
        k = np.lexsort((key, cand), axis=1)[:, 0, :]
        val = np.take_along_axis(cand, k[:, None, :], axis=1)[:, 0, :]
        got_val, got_row = fastest_fitting(lat, states, act, fixed, memory, s1)
        assert np.array_equal(got_val, val)
        finite = np.isfinite(val)
        assert np.array_equal(got_row[finite], k[finite])
        last = last_fitting(states, act, fixed, memory, s1)
        assert np.array_equal(last, (mem <= memory).sum(axis=0) - 1)


def _difflib_align(recorded, traced):
    """:func:`autoplan.planner.search.record.align`'s rule over the whole sequences (no trimming)."""
    import difflib

    out, through = {}, set()
    sm = difflib.SequenceMatcher(a=recorded, b=traced, autojunk=False)
    for tag, i1, i2, j1, j2 in sm.get_opcodes():
        if tag == "equal":
            out.update({i1 + k: j1 + k for k in range(i2 - i1)})
        elif tag == "replace" and j2 - j1 == 1 and i2 - i1 > 1:
            out[i2 - 1] = j1
            through.update(range(i1, i2 - 1))
    return out, through


def test_align_trims_the_common_ends_as_difflib_would_match_them():
    from autoplan.planner.search.record import align

    block = ["aten.addmm.default", "aten.view.default", "aten.gelu.default"] * 40
    traced = ["aten.embedding.default"] + block + ["aten.view.default", "aten.mm.default"]
    recorded = (["aten.embedding.default"] + block
                + ["aten.clone.default", "aten._unsafe_view.default", "aten.mm.default"])
    got = align(recorded, traced)
    assert got == _difflib_align(recorded, traced)
    out, through = got
    assert out[len(recorded) - 2] == len(traced) - 2 and through == {len(recorded) - 3}
    assert align(traced, traced) == ({k: k for k in range(len(traced))}, set())


def test_equally_fast_stages_keep_the_one_with_less_memory():
    """GPT-1.7B on 32 A100s at batch 512 (benchmarks/solver_scaling.py): one stage at one
    micro-batch is as fast at ZeRO-1 as at ZeRO-2 in the tables; the first of the two
    (ZeRO-1) does not fit the exact memory check, the other does and is the uniform grid's
    plan. With ties broken by memory (tables.tie_key) the search finds it."""
    from autoplan.api import plan_problem
    from autoplan.planner.search.search import search

    p = prepare("gpt-1.7b", "dgx-a100", nodes=4, global_batch=512)
    _, uniform = plan_problem(p, top_k=0)
    result = search(p.spec, p.graph, p.cluster, global_batch=512)
    assert result.prediction.step_time_s <= uniform.best.prediction.step_time_s * (1 + 1e-9)
    assert result.prediction.memory.total <= result.prediction.memory_limit_bytes
    assert [st.zero for st in result.best.stages] == [uniform.best.parallel.zero]
