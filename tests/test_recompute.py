"""Selective recomputation and TP-communication overlap: formulas, pricing, plan, export,
engine.

Tiers: unit tests of the formulas (Korthikanti et al. 2022's published reductions), of the
pricing on traced models (selective memory between none and full; overlap only lowers TP
time), of the plan field and the exporters; single-process checks of the engine's selective
policy (the attention core recomputed, nothing else; gradients bit-equal); and a
multi-process gloo loss-parity run against one process (``multiproc``).
"""

from __future__ import annotations

import json

import pytest
import torch

from autoplan.api import estimate, prepare
from autoplan.cost.memory import activation_bytes, selective_peak_bytes
from autoplan.cost.recompute import attention_core, core_fwd_flops, korthikanti_layer_bytes
from autoplan.cost.tp_overlap import (BACKWARD_SHARE, EFFICIENCY, WGRAD_SHARE, paid,
                                      paid_backward)
from autoplan.errors import ConfigError, PlanError
from autoplan.export.common import NotExpressibleError
from autoplan.export.deepspeed import deepspeed_config
from autoplan.export.megatron import megatron_args
from autoplan.export.torchtitan import to_torchtitan
from autoplan.models import resolve
from autoplan.plan import ParallelConfig, Plan
from autoplan.planner.grid.uniform import SearchSpace, enumerate_configs
from engine_helpers import (TINY, losses, make_plan, max_rel_diff,
                            recompute_backward_ops, run_plans)

EAGER = dict(vocab_size=2048, hidden=512, layers=8, heads=8, seq_len=256, attention="eager")
# (seq_len != hidden: the tracer tells an attention matrix by its (..., s, s) shape)


@pytest.fixture(scope="module")
def eager():
    return prepare(resolve("gpt", **EAGER), "dgx-a100", global_batch=16, precision="mixed")


@pytest.fixture(scope="module")
def sdpa():
    return prepare(resolve("gpt", **dict(EAGER, attention="sdpa")), "dgx-a100",
                   global_batch=16, precision="mixed")


def _estimate(problem, **kw):
    return estimate(None, None, global_batch=16, problem=problem, **kw).prediction


# ---- the formulas ------------------------------------------------------------------------
@pytest.mark.parametrize("name, a, s, h, reduction", [
    ("GPT-3 175B", 96, 2048, 12288, 0.70),        # sec. 5: 5as/h = 80, 70% less
    ("MT-NLG 530B", 128, 2048, 20480, 0.65),      # sec. 5: 5as/h = 64, 65% less
])
def test_selective_reduction_matches_korthikanti(name, a, s, h, reduction):
    """Korthikanti et al. 2022 sec. 5: selective recomputation cuts the activation memory of
    GPT-3 by 70% and of MT-NLG by 65% (tensor + sequence parallelism, t = 8)."""
    none = korthikanti_layer_bytes("none", s=s, b=1, h=h, a=a, t=8)
    sel = korthikanti_layer_bytes("selective", s=s, b=1, h=h, a=a, t=8)
    full = korthikanti_layer_bytes("full", s=s, b=1, h=h, a=a, t=8)
    assert round(1 - sel / none, 2) == reduction, name
    assert sel == 34 * s * h / 8 and full == 2 * s * h / 8
    assert full < sel < none
    # Table 2, tensor parallelism without SP: s b h (10 + 24 / t [+ 5 a s / (h t)])
    assert korthikanti_layer_bytes("selective", s=s, b=1, h=h, a=a, t=8,
                                   sequence_parallel=False) == s * h * (10 + 24 / 8)


def test_tp_overlap_price():
    """paid(C, W, n): no overlap at n = 1; never more than C; of the (n - 1) / n that can
    hide, EFFICIENCY hides when the GEMMs are long enough, at 0.1 of its time; with no GEMM
    time all of C."""
    e = EFFICIENCY
    assert paid(1.0, 5.0, 1) == 1.0
    assert paid(1.0, 0.0, 4) == pytest.approx(1.0)
    assert paid(1.0, 5.0, 4) == pytest.approx(1 - 0.9 * e * 0.75)
    assert paid(1.0, 0.3, 4) == pytest.approx(1 - 0.9 * 0.3)
    assert paid(1.0, 5.0, 4, efficiency=1.0) == pytest.approx(0.25 + 0.1 * 0.75)
    for c, w, n in ((2.0, 0.5, 2), (0.1, 3.0, 8), (1.0, 1.0, 4)):
        assert 0 < paid(c, w, n) <= c
    with pytest.raises(ValueError):
        paid(1.0, 1.0, 0)


def test_backward_only_overlap_price():
    """paid_bwd(C_b, W_b, c): the share c of the backward collectives (the column-parallel
    input gradients: half of them under SP, all without) hides behind the column-parallel
    weight gradients (WGRAD_SHARE of the TP GEMMs' backward), at 0.1 of its time."""
    assert BACKWARD_SHARE == {True: 0.5, False: 1.0}
    assert paid_backward(1.0, 10.0, 0.5) == pytest.approx(1 - 0.9 * 0.5)
    assert paid_backward(1.0, 10.0, 1.0) == pytest.approx(0.1)
    assert paid_backward(1.0, 1.0, 1.0) == pytest.approx(1 - 0.9 * WGRAD_SHARE)
    assert paid_backward(1.0, 0.0, 0.5) == 1.0 and paid_backward(0.0, 1.0, 0.5) == 0.0
    # per layer (forward and backward C each) the decomposition hides more in all, though
    # less of the backward alone: it loses (1 - EFFICIENCY) to the decomposition itself
    assert 2 * paid(1.0, 10.0, 8) < 1.0 + paid_backward(1.0, 10.0, 0.5)
    with pytest.raises(ValueError, match="share"):
        paid_backward(1.0, 1.0, 1.5)


# ---- pricing on traced models ------------------------------------------------------------
def test_attention_core_of_eager_and_fused_attention(eager, sdpa):
    g = eager.graph
    ops = {g.nodes[n].op.split(".")[1] for n in attention_core(g)}
    assert {"bmm", "_softmax", "masked_fill"} <= ops and "mm" not in ops and "addmm" not in ops
    fused = {sdpa.graph.nodes[n].op for n in attention_core(sdpa.graph)}
    assert fused and all("scaled_dot_product" in op for op in fused)
    # Q K^T and P V: 4 b s^2 h forward FLOPs per block (b = 1, the traced micro-batch)
    s, h, blocks = EAGER["seq_len"], EAGER["hidden"], EAGER["layers"]
    assert core_fwd_flops(g) >= 4 * s * s * h * blocks
    assert core_fwd_flops(g) < 0.5 * sum(l.stats.fwd_flops for l in g.blocks())


def test_selective_keeps_all_but_the_attention_matrices(eager):
    for layer in eager.graph.blocks():
        st = layer.stats
        assert st.saved_bytes_attn > 0
        for tp, sp in ((1, False), (4, False), (4, True)):
            none = activation_bytes(st, tp=tp, sequence_parallel=sp)
            sel = activation_bytes(st, tp=tp, sequence_parallel=sp, selective=True)
            full = activation_bytes(st, tp=tp, sequence_parallel=sp, checkpoint=True)
            assert sel == pytest.approx(none - st.saved_bytes_attn / tp)
            assert full < sel < none
            assert selective_peak_bytes(st, tp=tp) == pytest.approx(st.saved_bytes_attn / tp)


@pytest.mark.parametrize("tp, sp", [(1, False), (4, True)])
def test_selective_memory_and_time_lie_between_none_and_full(eager, tp, sp):
    """The memory model: activations none > selective > full; the step's recomputation:
    0 < selective < full, the other terms unchanged."""
    pred = {ck: _estimate(eager, tp=tp, sequence_parallel=sp, checkpoint=ck, micro_batch=2)
            for ck in ("none", "selective", "full")}
    act = {k: p.memory.activations for k, p in pred.items()}
    assert act["full"] < act["selective"] < act["none"]
    rec = {k: p.time.recompute for k, p in pred.items()}
    assert rec["none"] == 0 < rec["selective"] < rec["full"]
    assert pred["selective"].time.compute == pred["none"].time.compute
    assert pred["none"].step_time_s < pred["selective"].step_time_s < pred["full"].step_time_s
    # hardware FLOPs count the recomputed attention core
    assert pred["none"].hardware_tflops_per_device < \
        pred["selective"].hardware_tflops_per_device * pred["selective"].step_time_s / \
        pred["none"].step_time_s


def test_fused_attention_gains_nothing_from_selective(sdpa):
    """With scaled_dot_product_attention there is no attention matrix: selective keeps the
    same bytes and only costs time, so the grid does not enumerate it."""
    none = _estimate(sdpa, tp=2, sequence_parallel=True)
    sel = _estimate(sdpa, tp=2, sequence_parallel=True, checkpoint="selective")
    assert sel.memory.activations == pytest.approx(none.memory.activations)
    assert sel.step_time_s > none.step_time_s
    configs = list(enumerate_configs(sdpa.graph, sdpa.cluster, 16))
    assert {p.checkpoint for p in configs} == {"none", "full"}


def test_tp_overlap_lowers_only_tp_time(eager):
    base = _estimate(eager, tp=8, sequence_parallel=True)
    over = _estimate(eager, tp=8, sequence_parallel=True, tp_comm_overlap=True)
    assert 0 < over.time.tp_comm < base.time.tp_comm
    for k in ("compute", "recompute", "dp_comm", "pp_comm", "optimizer"):
        assert getattr(over.time, k) == getattr(base.time, k), k
    assert over.memory.total == base.memory.total
    assert over.step_time_s < base.step_time_s


def test_backward_only_overlap_lowers_only_the_backward_tp_time(eager):
    """tp_comm_overlap "backward" (Megatron-LM's asynchronous input-gradient collectives):
    with and without SP, the step pays less TP time than without overlap and, under SP, more
    than the decomposed overlap; nothing else moves; the label says which."""
    for sp in (True, False):
        base = _estimate(eager, tp=8, sequence_parallel=sp)
        bwd = _estimate(eager, tp=8, sequence_parallel=sp, tp_comm_overlap="backward")
        assert 0 < bwd.time.tp_comm < base.time.tp_comm
        for k in ("compute", "recompute", "dp_comm", "pp_comm", "optimizer"):
            assert getattr(bwd.time, k) == getattr(base.time, k), k
        assert bwd.memory.total == base.memory.total
    full = _estimate(eager, tp=8, sequence_parallel=True, tp_comm_overlap=True)
    half = _estimate(eager, tp=8, sequence_parallel=True, tp_comm_overlap="backward")
    assert full.time.tp_comm < half.time.tp_comm
    label = ParallelConfig(tp=2, tp_comm_overlap="backward").label()
    assert "tpoverlap-bwd" in label
    with pytest.raises(PlanError, match="tp_comm_overlap.*backward"):
        ParallelConfig(tp=1, tp_comm_overlap="backward")
    with pytest.raises(PlanError, match="true, false or 'backward'"):
        ParallelConfig(tp=2, tp_comm_overlap="forward")
    with pytest.raises(ConfigError, match="'backward' needs tp > 1"):
        _estimate(eager, tp=1, tp_comm_overlap="backward")


def test_grid_enumerates_the_new_options_where_they_apply(eager):
    """Selective where blocks keep attention matrices; TP-communication overlap only when
    asked (plans for the exporters: the engine does not run it), on GPUs, tp > 1 with SP."""
    configs = list(enumerate_configs(eager.graph, eager.cluster, 16))
    assert {p.checkpoint for p in configs} == {"none", "selective", "full"}
    assert not any(p.tp_comm_overlap for p in configs)
    both = SearchSpace(tp_comm_overlap=(False, True))
    over = [p for p in enumerate_configs(eager.graph, eager.cluster, 16, both)
            if p.tp_comm_overlap]
    assert over and all(p.tp > 1 and p.sequence_parallel for p in over)
    cpu = prepare(resolve("gpt", **EAGER), "local-cpu", global_batch=16, precision="fp32")
    assert not any(p.tp_comm_overlap
                   for p in enumerate_configs(cpu.graph, cpu.cluster, 16, both))


def test_search_recomputes_selectively_per_stage():
    """The search prices selective stages (the attention core's forward again, its matrices
    dropped) and writes them as a 'selective' plan."""
    from autoplan.planner.search.search import SearchOptions, search
    from autoplan.planner.search.to_plan import build_search_plan

    problem = prepare(resolve("gpt", **dict(EAGER, layers=4, hidden=256, heads=4)),
                      "dgx-a100", global_batch=16, precision="mixed")
    res = search(problem.spec, problem.graph, problem.cluster, global_batch=16,
                 options=SearchOptions(checkpoint=("selective",), micro_batches=(1, 2)))
    best = res.ranked[0]
    assert all(st.selective and not st.checkpoint for st in best.choice.stages)
    assert best.prediction.time.recompute > 0
    plan = build_search_plan(res, problem.spec, problem.cluster, global_batch=16,
                             seq_len=problem.seq_len, precision=problem.precision_dict,
                             top_k=0)
    assert plan.parallel.checkpoint == "selective"
    assert all(st.checkpoint_layers for st in plan.stages if any(
        n.startswith("blocks.") for n in st.layer_names))


# ---- the plan ----------------------------------------------------------------------------
def test_plan_fields_validate_with_clear_errors():
    with pytest.raises(PlanError, match="parallel.checkpoint.*'selective'"):
        ParallelConfig(checkpoint="attention")
    with pytest.raises(PlanError, match="parallel.tp_comm_overlap.*sequence parallelism"):
        ParallelConfig(tp=2, tp_comm_overlap=True)
    with pytest.raises(PlanError, match="parallel.tp_comm_overlap.*true, false or .backward."):
        ParallelConfig(tp=2, sequence_parallel=True, tp_comm_overlap="yes")
    with pytest.raises(ConfigError):
        estimate("gpt-tiny", "local-cpu", global_batch=4, tp_comm_overlap=True)
    p = ParallelConfig(tp=2, sequence_parallel=True, checkpoint="selective",
                       tp_comm_overlap=True)
    assert "sel-ckpt" in p.label() and "tpoverlap" in p.label()


def test_plan_round_trip_and_older_plans(tmp_path):
    plan = make_plan(tp=2, sp=True, checkpoint="selective", device_type="cuda")
    assert plan.parallel.checkpoint == "selective"
    assert all(n in plan.stages[0].checkpoint_layers
               for n in plan.stages[0].layer_names if n.startswith("blocks."))
    back = Plan.load(plan.save(tmp_path / "p.json"))
    assert back.parallel == plan.parallel
    d = json.loads((tmp_path / "p.json").read_text())
    del d["parallel"]["tp_comm_overlap"]               # a plan written before the field
    (tmp_path / "old.json").write_text(json.dumps(d))
    assert Plan.load(tmp_path / "old.json").parallel.tp_comm_overlap is False
    d["parallel"]["checkpoint"] = "partial"
    (tmp_path / "bad.json").write_text(json.dumps(d))
    with pytest.raises(PlanError, match="parallel.checkpoint"):
        Plan.load(tmp_path / "bad.json")


# ---- export ------------------------------------------------------------------------------
def _cuda_plan(**kw):
    return make_plan(device_type="cuda", precision={"params": "float32",
                                                    "compute": "bfloat16",
                                                    "reduce": "float32"}, **kw)


def test_export_maps_selective_and_overlap():
    plan = _cuda_plan(tp=2, sp=True, checkpoint="selective")
    plan = Plan.from_dict({**plan.to_dict(), "parallel": {**plan.to_dict()["parallel"],
                                                          "tp_comm_overlap": True}})
    args, _ = megatron_args(plan)
    flat = [" ".join(a) for a in args]
    assert "--recompute-granularity selective" in flat and "--tp-comm-overlap" in flat
    assert not any("--recompute-method" in a for a in flat)
    tt = to_torchtitan(plan)
    assert 'mode = "selective"' in tt.text and 'selective_ac_option = "op"' in tt.text
    assert "enable_async_tensor_parallel = true" in tt.text
    assert any("Korthikanti" in n for n in tt.notes)      # the op policy differs: said so
    with pytest.raises(NotExpressibleError, match="selective recomputation"):
        deepspeed_config(_cuda_plan(dp=2, checkpoint="selective"))
    full, _ = megatron_args(_cuda_plan(tp=2, sp=True, checkpoint=True))
    assert ("--recompute-granularity", "full") in full
    # the backward-only overlap is Megatron-LM's default: no flag, a note; torchtitan has
    # none, so it does not enable async TP and says the prediction is optimistic there
    bwd = Plan.from_dict({**plan.to_dict(), "parallel": {**plan.to_dict()["parallel"],
                                                         "tp_comm_overlap": "backward"}})
    args, notes = megatron_args(bwd)
    assert not any("--tp-comm-overlap" in " ".join(a) for a in args)
    assert any("CUDA_DEVICE_MAX_CONNECTIONS=1" in n for n in notes)
    tt = to_torchtitan(bwd)
    assert "enable_async_tensor_parallel = false" in tt.text
    assert any("optimistic" in n for n in tt.notes)


# ---- the engine --------------------------------------------------------------------------
def test_engine_refuses_tp_overlap(tmp_path):
    from engine.runtime import check_all

    plan = make_plan(tp=2, sp=True)
    plan = Plan.from_dict({**plan.to_dict(), "parallel": {**plan.to_dict()["parallel"],
                                                          "tp_comm_overlap": True}})
    with pytest.raises(PlanError, match="parallel.tp_comm_overlap.*export"):
        check_all(plan, "p.json", world_size=2)
    bwd = Plan.from_dict({**plan.to_dict(), "parallel": {**plan.to_dict()["parallel"],
                                                         "tp_comm_overlap": "backward"}})
    with pytest.raises(PlanError, match="parallel.tp_comm_overlap"):
        check_all(bwd, "p.json", world_size=2)


@pytest.mark.parametrize("attention", ["eager", "sdpa"])
def test_selective_policy_recomputes_the_attention_core_only(attention):
    """One process: the wrapped blocks give bit-equal gradients; the forward ops that run
    again during backward are the attention core's under selective recomputation (softmax /
    the fused kernel, no linear layer's addmm, no norm), and everything under full."""
    grads, counts = recompute_backward_ops(dict(TINY, attention=attention),
                                           (None, "selective", "full"))
    in_backward = {mode: set(c) for mode, c in counts.items()}
    for mode in ("selective", "full"):
        assert all(torch.equal(a, b) for a, b in zip(grads[None], grads[mode])), mode
    core = "_softmax" if attention == "eager" else "_scaled_dot_product_flash_attention_for_cpu"
    assert core not in in_backward[None] and "addmm" not in in_backward[None]
    assert core in in_backward["selective"]
    assert not in_backward["selective"] & {"addmm", "native_layer_norm", "gelu"}
    assert {core, "addmm", "native_layer_norm"} <= in_backward["full"]


# ---- multi-process parity ----------------------------------------------------------------
STEPS = 10
OPTIONS = ["--lr", "0.003", "--warmup-steps", "1", "--log-every", "10"]
EAGER_TINY = dict(TINY, attention="eager")
PARITY = {
    "dp2_selective": dict(dp=2, checkpoint="selective", model=EAGER_TINY),
    "tp2_sp_selective": dict(tp=2, sp=True, checkpoint="selective", model=EAGER_TINY),
    "dp2_zero3_selective_sdpa": dict(dp=2, zero=3, checkpoint="selective"),
}


@pytest.mark.multiproc
def test_selective_loss_parity_two_ranks(tmp_path):
    """Two gloo ranks with selective recomputation train like one process without any
    recomputation: per-step fp32 losses within 1e-5 (relative)."""
    singles = {"ref_eager": make_plan(model=EAGER_TINY), "ref_sdpa": make_plan()}
    done = run_plans(1, tmp_path, singles, steps=STEPS, extra=OPTIONS)   # one launch
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-8000:]
    refs = {name[4:]: losses(tmp_path / name) for name in singles}
    for ref in refs.values():
        assert ref[STEPS] < ref[1] - 0.1                      # it learns
    proc = run_plans(2, tmp_path, {k: make_plan(**kw) for k, kw in PARITY.items()},
                     steps=STEPS, extra=OPTIONS)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-8000:]
    for name in PARITY:
        ref = refs["sdpa" if name.endswith("sdpa") else "eager"]
        diff = max_rel_diff(losses(tmp_path / name), ref)
        print(f"parity {name}: max relative loss difference {diff:.2e}")
        assert diff <= 1e-5, name
