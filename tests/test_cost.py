"""Cost model: ZeRO memory, activations, pipeline in-flight counts, collectives, roofline."""

from __future__ import annotations

import dataclasses

import pytest

from autoplan.cluster import load_cluster, load_device
from autoplan.cost import (CommModel, ComputeModel, Efficiency, Group, activation_bytes,
                           default_efficiency, in_flight_micro_batches, model_state_bytes,
                           op_kind, recompute_peak_bytes)
from autoplan.cost.kernel_shape import gemm_factor
from autoplan.errors import UnknownNameError
from autoplan.graph import BatchSpec, Layer, LayerStats, OpGraph, OpNode, TensorMeta

GB = 1e9


# ---- model states (ZeRO paper, sec. 5: psi = 7.5B, N_d = 64) ------------------------------

@pytest.mark.parametrize("zero,expected_gb", [(0, 120), (1, 31.4), (2, 16.6), (3, 1.9)])
def test_zero_model_states_match_the_paper(zero, expected_gb):
    mem = model_state_bytes(7.5e9, dp=64, zero=zero)
    assert mem.total / GB == pytest.approx(expected_gb, rel=0.02)
    assert mem.activations == mem.other == 0


def test_zero_breakdown_and_sharding():
    m = model_state_bytes(1e9, dp=8, zero=2)
    assert (m.params, m.grads, m.optimizer) == (2e9, 2e9 / 8, 12e9 / 8)
    fp32 = model_state_bytes(1e9, dp=8, zero=1, precision="fp32")
    assert (fp32.params, fp32.grads, fp32.optimizer) == (4e9, 4e9, 1e9)
    tp = model_state_bytes(8e9, dp=4, zero=3, params_sharded_by=8)      # TP=8 first
    assert tp.total == pytest.approx(16 * 1e9 / 4)
    with pytest.raises(ValueError, match="zero must be"):
        model_state_bytes(1e9, dp=8, zero=4)
    with pytest.raises(ValueError, match="precision"):
        model_state_bytes(1e9, dp=8, zero=0, precision="fp8")


# ---- activations (Korthikanti et al. 2022, sec. 4) ---------------------------------------

S, B, H, A, T = 2048, 2, 4096, 32, 8
SBH = S * B * H


def gpt_layer_stats() -> LayerStats:
    attn = 5 * A * S / H
    return LayerStats(saved_bytes=int(SBH * (34 + attn)), saved_bytes_tp=int(SBH * (24 + attn)),
                      saved_bytes_attn=int(SBH * attn), input_bytes=2 * SBH,
                      output_bytes=2 * SBH)


def test_activations_no_parallelism():
    assert activation_bytes(gpt_layer_stats()) == pytest.approx(SBH * (34 + 5 * A * S / H))


def test_activations_tensor_parallel():
    got = activation_bytes(gpt_layer_stats(), tp=T)
    assert got == pytest.approx(SBH * (10 + 24 / T + 5 * A * S / (H * T)))


def test_activations_sequence_parallel():
    got = activation_bytes(gpt_layer_stats(), tp=T, sequence_parallel=True)
    assert got == pytest.approx(SBH * (34 + 5 * A * S / H) / T)


def test_activations_full_recomputation():
    stats = gpt_layer_stats()
    assert activation_bytes(stats, tp=T, checkpoint=True) == 2 * SBH
    assert activation_bytes(stats, tp=T, sequence_parallel=True, checkpoint=True) == 2 * SBH / T
    assert recompute_peak_bytes(stats, tp=T) == activation_bytes(stats, tp=T)


def test_activations_flash_attention_and_micro_batch_scale():
    stats = gpt_layer_stats()
    assert activation_bytes(stats, flash_attention=True) == pytest.approx(SBH * 34)
    assert activation_bytes(stats, tp=T, flash_attention=True) == pytest.approx(
        SBH * (10 + 24 / T))
    assert activation_bytes(stats, micro_batch_scale=4) == pytest.approx(
        4 * activation_bytes(stats))


# ---- pipeline in-flight micro-batches ----------------------------------------------------

def test_in_flight_gpipe_and_1f1b():
    assert in_flight_micro_batches("gpipe", 4, 0, 16) == 16
    assert in_flight_micro_batches("gpipe", 4, 3, 16) == 16
    assert [in_flight_micro_batches("1f1b", 4, r, 16) for r in range(4)] == [4, 3, 2, 1]
    assert in_flight_micro_batches("1f1b", 8, 0, 3) == 3                  # capped by m


def test_in_flight_interleaved():
    p, v, m = 4, 2, 16
    first = in_flight_micro_batches("interleaved_1f1b", p, 0, m, v)
    assert first == pytest.approx(p * (1 + (p - 1) / (p * v)))          # Korthikanti 4.2.3
    assert in_flight_micro_batches("interleaved_1f1b", p, p - 1, m, v) == pytest.approx(
        ((v - 1) * p + 1) / v)                                           # Megatron warm-up
    assert in_flight_micro_batches("interleaved_1f1b", p, 1, m, 1) == 3  # v = 1 is 1F1B
    assert in_flight_micro_batches("interleaved_1f1b", p, 0, 2, v) == 2  # capped by m
    with pytest.raises(ValueError, match="stage"):
        in_flight_micro_batches("1f1b", 4, 4, 16)
    with pytest.raises(ValueError, match="schedule"):
        in_flight_micro_batches("zigzag", 4, 0, 16)


# ---- communication -----------------------------------------------------------------------

@pytest.fixture(scope="module")
def selene() -> CommModel:
    return CommModel(load_cluster("dgx-a100", nodes=64))


def test_all_reduce_inside_a_dgx_a100(selene):
    t = selene.time("all_reduce", 1e9, Group(8, 8))
    assert t == pytest.approx(2 * 7 / 8 * 1e9 / 230e9, rel=0.01)
    # NCCL's smallest latency: ring LL, 3.6 us base + 2(n-1) x 0.47 us NVLink steps
    assert selene.alpha("all_reduce", Group(8, 8)) == pytest.approx((3.6 + 14 * 0.47) * 1e-6)


def test_cross_node_groups_share_the_nics(selene):
    one_per_node = Group(64, 1)                  # TP=8 in each node, DP across 64 nodes
    assert selene.bus_bandwidth(one_per_node) == pytest.approx(24e9)          # one HDR NIC
    whole_nodes = Group(64 * 8, 8)               # DP over whole nodes
    assert selene.bus_bandwidth(whole_nodes) == pytest.approx(192e9)          # published
    assert selene.bus_bandwidth(Group(32, 2)) == pytest.approx(48e9)          # 2 NICs' share
    assert selene.bus_bandwidth(Group(64, 1, concurrent=1)) == pytest.approx(24e9)  # own NIC
    t = selene.time("all_reduce", 1e9, one_per_node)
    # + NCCL's ring latency: 126 network steps of 9.6 us, x1.9 past the plateau (2.3 ms)
    assert t == pytest.approx(2 * 63 / 64 * 1e9 / 24e9 + (8.4 + 126 * 9.6) * 1.9e-6, rel=0.01)
    assert selene.time("send_recv", 1e8, Group(2, 1)) == pytest.approx(1e8 / 24e9 + 5e-6)


def test_alpha_dominates_tiny_messages(selene):
    g = Group(64, 1)
    t = selene.time("all_reduce", 8, g)
    assert selene.alpha("all_reduce", g) / t > 0.999
    # NCCL's tree LL: 4.4 us + 2 x log2(64) network steps of 5 us
    assert t == pytest.approx((4.4 + 2 * 6 * 5.0) * 1e-6, rel=0.01)
    assert selene.time("all_reduce", 0, g) == 0.0
    assert selene.time("all_reduce", 1e9, Group(1, 1)) == 0.0


def test_collectives_relative_times(selene):
    g, n = Group(8, 8), 1e9
    ar, ag, rs = (selene.time(c, n, g) for c in ("all_reduce", "all_gather", "reduce_scatter"))
    a2a, p2p = selene.time("all_to_all", n, g), selene.time("send_recv", n, Group(2, 2))
    assert ar == pytest.approx(ag + rs, rel=0.02)                # ring AR = RS + AG
    assert ag == pytest.approx(rs) and a2a == pytest.approx(ag, rel=0.01)
    assert p2p == pytest.approx(n / 230e9 + 1e-6)
    assert selene.time("all_reduce", n, Group(16, 8)) > ar       # crossing nodes is slower


def test_comm_fitted_table_and_errors():
    cluster = load_cluster("dgx-a100", nodes=2)
    fitted = CommModel(cluster, fitted={("all_reduce", "intra"): (20e-6, 1 / 200e9)})
    assert fitted.time("all_reduce", 1e9, Group(8, 8)) == pytest.approx(
        20e-6 + 2 * 7 / 8 * 1e9 / 200e9)
    assert fitted.time("all_gather", 1e9, Group(8, 8)) == pytest.approx(
        CommModel(cluster).time("all_gather", 1e9, Group(8, 8)))  # not fitted: default
    with pytest.raises(ValueError, match="unknown collective 'broadcastt'"):
        fitted.time("broadcastt", 1, Group(2, 2))
    with pytest.raises(ValueError, match="spans 3 nodes"):
        fitted.time("all_reduce", 1, Group(24, 8))
    with pytest.raises(ValueError, match="16 ranks per node"):
        fitted.time("all_reduce", 1, Group(16, 16))


def test_group_shapes_from_meshes():
    assert Group.for_mesh_axis((2, 4, 8), 2, 8) == Group(8, 8)          # tp inside a node
    assert Group.for_mesh_axis((2, 4, 8), 1, 8) == Group(4, 1)          # dp across nodes
    assert Group.for_mesh_axis((1, 4, 4), 1, 8) == Group(4, 2)          # ranks 0,4 | 8,12
    assert Group.of_ranks([0, 1, 8, 9], 8) == Group(4, 2)


# ---- compute -----------------------------------------------------------------------------

def node(op: str, *, flops: float = 0.0, nbytes: int = 0, role: str = "replicated",
         dtype: str = "bfloat16", name: str = "n") -> OpNode:
    return OpNode(name=name, op=op, inputs=[], input_meta=[TensorMeta((1,), dtype)],
                  output_meta=[TensorMeta((1,), dtype)], fwd_flops=flops, bwd_flops=2 * flops,
                  bytes_read=nbytes * 2 // 3, bytes_written=nbytes - nbytes * 2 // 3,
                  tp_role=role)  # type: ignore[arg-type]


def test_roofline_matmul_is_compute_bound():
    a100 = load_device("a100-80gb")
    cm = ComputeModel(a100, "bfloat16")
    eff = default_efficiency(a100)
    n = 4096
    mm = dataclasses.replace(node("aten.mm.default", flops=2 * n**3, nbytes=3 * n * n * 2),
                             output_meta=[TensorMeta((n, n), "bfloat16")])
    fwd, bwd = cm.op_time(mm)
    assert op_kind(mm) == "matmul"
    g = gemm_factor(1, n, n, n, eff.sms)          # square: forward and backward alike
    assert 0.9 < g < 0.95                         # 1024 tiles on 108 SMs, K = 4096
    assert fwd == pytest.approx(2 * n**3 / (312e12 * eff.matmul * g) + eff.kernel_overhead_s)
    assert 2 * n**3 / (312e12 * eff.matmul) > 3 * n * n * 2 / (2039e9 * eff.memory)
    assert bwd == pytest.approx(4 * n**3 / (312e12 * eff.matmul * g)
                                + 2 * eff.kernel_overhead_s)


def test_roofline_pointwise_is_memory_bound():
    a100 = load_device("a100-80gb")
    cm = ComputeModel(a100, "bfloat16")
    eff = default_efficiency(a100)
    numel = 64 * 2**20
    gelu = node("aten.gelu.default", nbytes=2 * numel * 2)       # read + write, bf16
    fwd, bwd = cm.op_time(gelu)
    assert op_kind(gelu) == "memory"
    expected = eff.fusion * (2 * numel * 2 / (2039e9 * eff.memory) + eff.kernel_overhead_s)
    assert fwd == pytest.approx(expected) and bwd == pytest.approx(expected)
    # the same op traced in float32 moves half the bytes in bfloat16
    fwd32, _ = cm.op_time(node("aten.gelu.default", nbytes=4 * numel * 2, dtype="float32"))
    assert fwd32 == pytest.approx(fwd)
    assert cm.op_time(node("aten.view.default", nbytes=10**9)) == (0.0, 0.0)


def test_op_time_sharding_measured_hook_and_dtypes():
    a100 = load_device("a100-80gb")
    exact = Efficiency(matmul=0.8, memory=0.8)                  # no overhead, no fusion
    cm = ComputeModel(a100, "bfloat16", exact)
    mm = node("aten.addmm.default", flops=1e12, nbytes=10**6)
    assert cm.op_time(mm, shard=4)[0] == pytest.approx(cm.op_time(mm)[0] / 4)
    hooked = ComputeModel(a100, "bfloat16", exact,
                          measured=lambda n, s: (1.0, 2.0) if n.op.endswith("addmm.default")
                          else None)
    assert hooked.op_time(mm) == (1.0, 2.0)
    assert hooked.op_time(node("aten.gelu.default", nbytes=10**6)) == cm.op_time(
        node("aten.gelu.default", nbytes=10**6))
    with pytest.raises(UnknownNameError, match="bfloat16"):
        ComputeModel(load_device("v100-32gb"), "bfloat16")
    assert ComputeModel(load_device("v100-32gb"), "float16").peak == 125e12
    with pytest.raises(ValueError, match="in \\(0, 1\\]"):
        Efficiency(matmul=1.5, memory=0.8)


def test_layer_time_shards_by_tp_role():
    a100 = load_device("a100-80gb")
    cm = ComputeModel(a100, "bfloat16", Efficiency(matmul=0.8, memory=0.8))
    ops = [node("aten.addmm.default", flops=4e12, nbytes=10**6, role="column", name="fc1"),
           node("aten.gelu.default", nbytes=4 * 10**9, role="sharded", name="gelu"),
           node("aten.addmm.default", flops=4e12, nbytes=10**6, role="row", name="fc2"),
           node("aten.native_layer_norm.default", nbytes=10**9, role="replicated", name="ln")]
    graph = OpGraph(model_name="toy", fingerprint="f", batch=BatchSpec(batch_size=1),
                    nodes={o.name: o for o in ops}, params={},
                    layers=[Layer(index=0, name="blocks.0", kind="Block#x",
                                  nodes=[o.name for o in ops])])
    layer = graph.layers[0]
    ln_f, ln_b = cm.op_time(ops[3])
    f1, b1 = cm.layer_time(layer, graph)
    f4, b4 = cm.layer_time(layer, graph, tp=4)
    assert f4 == pytest.approx((f1 - ln_f) / 4 + ln_f)          # replicated LN not sharded
    assert b4 == pytest.approx((b1 - ln_b) / 4 + ln_b)
    f4sp, b4sp = cm.layer_time(layer, graph, tp=4, sequence_parallel=True)
    assert (f4sp, b4sp) == (pytest.approx(f1 / 4), pytest.approx(b1 / 4))
    f2x, _ = cm.layer_time(layer, graph, micro_batch_scale=2)
    assert f2x == pytest.approx(2 * f1)
    assert cm.optimizer_time(1e9) == pytest.approx(28e9 / (2039e9 * 0.8))


# ---- pipeline boundaries on the critical path -------------------------------------------------

def test_each_chunk_pays_both_of_its_boundaries_once():
    """T_c = work + s(c) + s(c - 1) (autoplan.cost.step.path_times): the first chunk pays only
    its output's boundary, the last (no send of its own) its input's; the sum over chunks is
    each boundary twice, the schedule's four transfers per boundary in two full-duplex pairs."""
    from autoplan.cost.step import ChunkCost, path_times

    def chunk(fwd, send):
        return ChunkCost(fwd, 2 * fwd, 0.0, 0.0, send, 0.0, 0.0, False, (), 0.0, 0, 1)

    chunks = [chunk(1.0, 0.1), chunk(1.0, 0.2), chunk(1.5, 0.0)]
    assert [c.work for c in chunks] == [3.0, 3.0, 4.5]
    assert path_times(chunks) == pytest.approx([3.1, 3.3, 4.7])
    assert sum(path_times(chunks)) == pytest.approx(sum(c.work + 2 * c.send for c in chunks))


def test_the_last_stage_pays_its_input_boundary_in_the_step():
    """GPT-3 175B on 8 DGX A100 nodes at pp 8: the last stage (the LM head) is the slowest
    and the step charges it its input boundary, m s(pp - 2), as pp_comm."""
    from autoplan.api import prepare
    from autoplan.cluster import load_cluster
    from autoplan.models.registry import resolve
    from autoplan.planner.grid.estimate import ParallelConfig

    problem = prepare(resolve("gpt3-175b"), load_cluster("dgx-a100", nodes=8),
                      global_batch=64, seq_len=2048)
    est = problem.estimator()
    p = ParallelConfig(tp=8, pp=8, micro_batch=1, num_micro_batches=64, checkpoint="full")
    chunks = est.chunks(p)
    pred = est.predict(p)
    paths = [c.work + c.send + r for c, r in zip(chunks, [0.0] + [c.send for c in chunks])]
    assert max(range(8), key=paths.__getitem__) == 7 and chunks[-1].send == 0.0
    assert pred.time.pp_comm == pytest.approx(64 * chunks[-2].send) and chunks[-2].send > 0


# ---- the GPU runtime overhead (autoplan/cost/runtime.py) --------------------------------------

def test_runtime_overhead_is_its_own_term_on_uncalibrated_gpus_only():
    from autoplan.api import estimate
    from autoplan.cost.runtime import RUNTIME_OVERHEAD, runtime_factor, runtime_seconds

    assert runtime_seconds(10.0, gpu=True, calibrated=False) == pytest.approx(
        10.0 * RUNTIME_OVERHEAD)
    assert runtime_seconds(10.0, gpu=False, calibrated=False) == 0.0
    assert runtime_seconds(10.0, gpu=True, calibrated=True) == 0.0
    assert runtime_factor(gpu=True, calibrated=False) == 1 + RUNTIME_OVERHEAD
    assert runtime_factor(gpu=False, calibrated=False) == 1.0
    gpu = estimate("gpt-tiny", "dgx-a100", global_batch=16, dp=8)
    t = gpu.prediction.time
    modelled = t.total - t.runtime
    assert t.runtime == pytest.approx(RUNTIME_OVERHEAD * modelled)
    assert gpu.prediction.step_time_s == pytest.approx(t.total)
    assert gpu.to_dict()["prediction"]["time"]["runtime"] == pytest.approx(t.runtime)
    cpu = estimate("gpt-tiny", "local-cpu", global_batch=16, nodes=1, dp=4)
    assert cpu.prediction.time.runtime == 0.0


# ---- ZeRO-1/2: reduce-scatter the gradients, gather the updated parameters --------------------

def test_sharded_optimizer_reduce_scatters_and_gathers_behind_the_forward():
    """ZeRO-1 on 48 ranks one per node (the Megatron-Core 32B row's DP group): the gradients
    are reduce-scattered in fp32 behind the backward and the bf16 parameters all-gathered
    behind the next forward (the first unit's gather exposed), where ZeRO-0 all-reduces
    fp32 gradients behind the backward alone (autoplan.cost.step, module docstring)."""
    from autoplan.cost.comm import Group
    from autoplan.cost.overlap import bucketed_reduction
    from autoplan.cost.step import DDP_BUCKET_BYTES, REDUCE_BYTES, ChunkCost, ParamBucket
    from autoplan.api import prepare
    from autoplan.cluster import load_cluster
    from autoplan.models.registry import resolve

    est = prepare(resolve("gpt-tiny"), load_cluster("dgx-h100", nodes=48),
                  global_batch=48, seq_len=64).estimator()
    step = est.step
    group = Group(size=48, ranks_per_node=1)
    psi, units, fwd, bwd = 4e9, 49, 0.25, 0.5
    bucket = ParamBucket(("dp",), psi, group)

    def chunk(zero):
        return ChunkCost(fwd, bwd, 0.0, 0.0, 0.0, 0.0, 0.0, False, (bucket,), 0.0, zero, 8,
                         modules=units)

    comm = step.comm
    t_rs = comm.time("reduce_scatter", psi * REDUCE_BYTES, group)
    t_ag = comm.time("all_gather", psi * 2, group)
    t_ar = comm.time("all_reduce", psi * REDUCE_BYTES, group)
    assert t_rs + t_ag < t_ar            # half of the traffic in bf16
    reduce, gather, local = step._syncs([bucket], 1)
    assert (reduce, gather, local) == (pytest.approx(t_rs), pytest.approx(t_ag),
                                       pytest.approx(psi / 48))
    e1 = step._dp_exposed([chunk(1)], [bucket], 1, 1, reduce, t_gather=gather)
    last_rs = comm.time("reduce_scatter", DDP_BUCKET_BYTES, group)
    first_ag = comm.time("all_gather", psi / units * 2, group)
    assert e1 == pytest.approx(bucketed_reduction(t_rs, bwd, last_rs)
                               + bucketed_reduction(t_ag, fwd, first_ag))
    r0, g0, _ = step._syncs([bucket], 0)
    assert g0 == 0.0 and r0 == pytest.approx(t_ar)
    e0 = step._dp_exposed([chunk(0)], [bucket], 0, 1, r0)
    assert e0 == pytest.approx(bucketed_reduction(
        t_ar, bwd, comm.time("all_reduce", DDP_BUCKET_BYTES, group)))
    assert e1 < e0                       # the gather hides behind the forward
