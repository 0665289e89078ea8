"""What the user says about the runtime reaches every pricer: an eager runtime (element-wise
ops unfused, ``prepare(fused=False)`` / ``--eager``) and the memory headroom, in the grid's
estimator and in the search alike."""

from __future__ import annotations

import pytest

from autoplan.api import estimate, plan_problem, prepare
from autoplan.cost.memory import usable_bytes
from autoplan.models import resolve
from autoplan.planner.search.search import search

SMALL = dict(layers=4, hidden=512, heads=8, vocab_size=8192, seq_len=512)


@pytest.fixture(scope="module")
def spec():
    return resolve("gpt", **SMALL)


def test_an_eager_runtime_pays_the_unfused_element_wise_ops(spec):
    """phi = 1 instead of the fused 0.5: the same configuration is slower, by no more than
    its element-wise share; GEMMs and communication are unchanged. A cluster with measured
    op times (the CPU ranks here) prices what ran, fused or not."""
    fused = prepare(spec, "dgx-a100", nodes=1, global_batch=16)
    eager = prepare(spec, "dgx-a100", nodes=1, global_batch=16, fused=False)
    a = estimate(None, None, global_batch=16, problem=fused, tp=2).prediction
    b = estimate(None, None, global_batch=16, problem=eager, tp=2).prediction
    assert a.step_time_s < b.step_time_s < 2 * a.step_time_s
    assert a.time.tp_comm == pytest.approx(b.time.tp_comm)
    cpu = [estimate(None, None, global_batch=8, tp=2, problem=prepare(
        "gpt-tiny", "local-cpu", global_batch=8, fused=f)).prediction.step_time_s
        for f in (True, False)]
    assert cpu[0] == pytest.approx(cpu[1])
    with pytest.raises(Exception, match="fused"):
        prepare(spec, "dgx-a100", global_batch=16, fused="no")


def test_the_search_keeps_the_users_memory_headroom_and_runtime(spec):
    """The search sizes its plans to the problem's headroom (it used the default before)
    and prices the problem's runtime; the planner's plan carries that limit."""
    problem = prepare(spec, "dgx-a100", nodes=1, global_batch=16, memory_headroom=0.5,
                      fused=False)
    limit = usable_bytes(problem.cluster.device.memory_bytes, 0.5)
    result = search(problem.spec, problem.graph, problem.cluster, global_batch=16,
                    memory_headroom=0.5, fused=False)
    assert result.prediction.memory_limit_bytes == pytest.approx(limit)
    default = search(problem.spec, problem.graph, problem.cluster, global_batch=16)
    assert default.prediction.memory_limit_bytes > limit
    assert result.prediction.step_time_s > default.prediction.step_time_s   # eager: slower
    plan, _ = plan_problem(problem, top_k=0)
    assert plan.prediction.memory_limit_bytes == pytest.approx(limit)


def test_an_eager_loss_holds_two_float32_gradients(spec):
    """The last stage of an eager run keeps one more fp32 logits-sized tensor at the loss's
    backward (autoplan.cost.memory.loss_temporaries_bytes), in the grid and in the search."""
    fused = prepare(spec, "dgx-a100", nodes=1, global_batch=16)
    eager = prepare(spec, "dgx-a100", nodes=1, global_batch=16, fused=False)
    a = estimate(None, None, global_batch=16, problem=fused).prediction.memory
    b = estimate(None, None, global_batch=16, problem=eager).prediction.memory
    logits = SMALL["seq_len"] * SMALL["vocab_size"]          # estimate's micro-batch: 1
    assert b.other - a.other == pytest.approx(4 * logits * 1.05, rel=0.02)
    assert b.activations == a.activations


def test_a_fused_loss_in_an_eager_runtime(spec):
    """llm-foundry's MPT: element-wise ops eager, the loss a fused cross-entropy kernel:
    the eager time, the fused loss's memory."""
    eager = prepare(spec, "dgx-a100", nodes=1, global_batch=16, fused=False)
    mixed = prepare(spec, "dgx-a100", nodes=1, global_batch=16, fused=False, fused_loss=True)
    fused = prepare(spec, "dgx-a100", nodes=1, global_batch=16)
    e, m, f = (estimate(None, None, global_batch=16, problem=p).prediction
               for p in (eager, mixed, fused))
    assert m.step_time_s == pytest.approx(e.step_time_s) and m.step_time_s > f.step_time_s
    assert m.memory.total == pytest.approx(f.memory.total)
    assert m.memory.total < e.memory.total
    with pytest.raises(Exception, match="fused_loss"):
        prepare(spec, "dgx-a100", global_batch=16, fused_loss="yes")
