"""The uniform grid's fast paths give exactly what the direct computations give (issue #18).

:meth:`Estimator._layers` adds each layer's terms, computed once per configuration
(:meth:`Estimator._layer_terms`); checked bit for bit against the loop computing every
term in place (the grid before issue #18's last pass), for every range of a small GPT, a
mixture of experts (expert all-to-alls) and a long-sequence model (context parallelism's
key/value exchange). Planning only: no engine runs.
"""

from __future__ import annotations

import itertools

from autoplan.api import prepare
from autoplan.cost.memory import activation_bytes, selective_peak_bytes
from autoplan.cost.parallel_dims import context_parallel_extra_activation, context_parallel_time
from autoplan.models import resolve
from autoplan.planner.grid.estimate import Estimator, _is_block

GPT_SMALL = dict(vocab_size=8192, hidden=1024, layers=4, heads=16, seq_len=1024)
MOE = dict(vocab_size=512, seq_len=256, hidden=128, layers=4, heads=4, kv_heads=2,
           style="llama", experts=8, top_k=2)
LONG = dict(vocab_size=512, seq_len=8192, hidden=128, layers=4, heads=4, kv_heads=2,
            style="llama")


def _loop_layers(est: Estimator, start: int, end: int, tp: int, sp: bool, micro_batch: int,
                 recompute: str, ep: int = 1, cp: int = 1) -> tuple:
    """``Estimator._layers`` as one loop computing every layer's terms in place."""
    scale = micro_batch / est.b0
    tok = scale / cp
    fwd = bwd = tp_f = tp_b = act = peak = gathered = core = gemm_f = gemm_b = 0.0
    params = params_sp = experts = 0.0
    group = est._axis_group(tp, 1)
    cp_group = est._axis_group(cp, tp)
    ep_group = est._axis_group(ep, cp * tp)
    for i in range(start, end):
        layer = est.graph.layers[i]
        st = layer.stats
        sp_l = est._sequence_sharded(i, sp)
        f, b, core_f, g_f, g_b, _, core_b = est._kind_time(i, tp, sp_l, micro_batch)
        fwd += f / cp
        bwd += b / cp
        gemm_f += g_f / cp
        gemm_b += g_b / cp
        sliced = est._slices_input(i, start, sp)
        if tp > 1:
            cf, cb = est._tp_comm(st, tok, sp_l, group,
                                  est._slice_reads(i)[1] * tok if sliced else 0.0)
            tp_f += cf
            tp_b += cb
        if ep > 1 and st.moe_a2a_bytes:
            one = est.comm.time("all_to_all", st.moe_a2a_bytes * tok, ep_group)
            tp_f += 2 * one
            tp_b += 2 * one
        kv_extra = 0.0
        if cp > 1 and st.kv_bytes:
            kv = st.kv_bytes * scale / tp
            cf, cb = context_parallel_time(est.comm, cp_group, kv, attention_fwd=core_f / cp,
                                           attention_bwd=core_b / cp, method=est.cp_comm)
            tp_f += cf
            tp_b += cb
            kv_extra = context_parallel_extra_activation(kv, cp, est.cp_comm)
        e_tp = st.expert_params_tp
        expert = (e_tp / tp + st.expert_params - e_tp) / ep
        local = (st.params_tp - e_tp) / tp + (st.params - st.params_tp
                                              - st.expert_params + e_tp)
        synced_tp = est._replicated_params[i] if sp_l else 0.0
        params += local - synced_tp
        params_sp += synced_tp
        experts += expert
        gathered = max(gathered, (local + expert) * est.param_bytes)
        block = _is_block(layer.name)
        ckpt = recompute == "full" and block
        selective = recompute == "selective" and block
        grown, fixed = est._stats[i]
        full = activation_bytes(grown, tp=tp, sequence_parallel=sp_l, checkpoint=False,
                                micro_batch_scale=tok,
                                flash_attention=est.flash_attention) + fixed + kv_extra
        if selective:
            core += core_f / cp
            act += activation_bytes(grown, tp=tp, sequence_parallel=sp_l,
                                    micro_batch_scale=tok, selective=True,
                                    flash_attention=est.flash_attention) + fixed + kv_extra
            peak = max(peak, selective_peak_bytes(grown, tp=tp, micro_batch_scale=tok,
                                                  flash_attention=est.flash_attention))
        elif ckpt:
            act += activation_bytes(grown, tp=tp, sequence_parallel=sp_l and not sliced,
                                    checkpoint=True, micro_batch_scale=tok,
                                    flash_attention=est.flash_attention)
            peak = max(peak, full)
        else:
            act += full
    cpu_f, cpu_b = est._shared_tp(start, end, tp, sp, scale, group)
    return (fwd, bwd, tp_f, tp_b, params, params_sp, act, peak, gathered, cpu_f, cpu_b,
            experts, core, gemm_f, gemm_b)


def _check_every_range(problem, configs) -> int:
    est = problem.estimator()
    n = len(problem.graph.layers)
    checked = 0
    # ranges in an order that reuses layer terms across ranges (as the grid does)
    for tp, sp, mb, rec, ep, cp in configs:
        for start, end in itertools.combinations(range(n + 1), 2):
            got = est._layers(start, end, tp, sp, mb, rec, ep, cp)
            want = _loop_layers(est, start, end, tp, sp, mb, rec, ep, cp)
            assert got == want, (start, end, tp, sp, mb, rec, ep, cp)
            checked += 1
    return checked


def test_layer_sums_equal_the_loop_over_layers_gpt():
    problem = prepare(resolve("gpt", **GPT_SMALL), "dgx-a100", global_batch=64, nodes=2)
    configs = [(tp, sp, mb, rec, 1, 1) for tp in (1, 2, 8) for sp in (False, True)
               for mb in (1, 4) for rec in ("none", "full", "selective") if tp > 1 or not sp]
    assert _check_every_range(problem, configs) == len(configs) * 21


def test_layer_sums_equal_the_loop_over_layers_experts_and_context():
    moe = prepare(resolve("gpt", **MOE), "dgx-h100", global_batch=64, nodes=2)
    assert any(l.stats.moe_a2a_bytes for l in moe.graph.layers)
    configs = [(tp, False, 2, rec, ep, 1) for tp in (1, 2) for ep in (1, 2, 4)
               for rec in ("none", "full")]
    assert _check_every_range(moe, configs) == len(configs) * 21
    long = prepare(resolve("gpt", **LONG), "dgx-h100", global_batch=16, nodes=2)
    assert any(l.stats.kv_bytes for l in long.graph.layers)
    configs = [(tp, sp, 1, rec, 1, cp) for tp in (1, 2) for sp in (False, True)
               for cp in (1, 2, 4) for rec in ("none", "selective") if tp > 1 or not sp]
    assert _check_every_range(long, configs) == len(configs) * 21
    ring = prepare(resolve("gpt", **LONG), "dgx-h100", global_batch=16, nodes=2,
                   cp_comm="ring")
    assert _check_every_range(ring, configs) == len(configs) * 21


def test_the_grid_finds_what_it_found_before_on_a_small_gpt():
    """End to end: the grid's ranking equals one priced with the direct loop."""
    from autoplan.planner.grid.uniform import search_uniform

    problem = prepare(resolve("gpt", **GPT_SMALL), "dgx-a100", global_batch=64, nodes=2)
    fast = search_uniform(problem.graph, problem.cluster, 64, precision=problem.precision,
                          estimator=problem.estimator(), keep=8)
    slow_est = problem.estimator()
    slow_est._layers = lambda *a: _loop_layers(slow_est, *a)       # the loop, uncached
    slow = search_uniform(problem.graph, problem.cluster, 64, precision=problem.precision,
                          estimator=slow_est, keep=8)
    assert [c.parallel for c in fast.ranked] == [c.parallel for c in slow.ranked]
    assert [c.prediction.step_time_s for c in fast.ranked] == \
        [c.prediction.step_time_s for c in slow.ranked]
