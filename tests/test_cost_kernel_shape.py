"""GEMM and attention efficiency by shape (autoplan.cost.kernel_shape, cost.compute), and
fp16 mixed precision with loss scaling."""

import pytest

from autoplan.api import check_precision, estimate, prepare
from autoplan.cluster import load_cluster, load_device
from autoplan.cost import ComputeModel
from autoplan.cost.compute import (IN_STEP, LOSS_SCALE_BYTES_PER_PARAM, default_efficiency,
                                   gemm_dims)
from autoplan.cost.kernel_shape import (FA2_FWD_BWD_TFLOPS, GEMM_K0, SMS, TILE_ELEMENTS,
                                        attention_tflops, gemm_backward_factor, gemm_factor,
                                        wave_utilisation)
from autoplan.errors import ConfigError
from autoplan.graph import OpNode, TensorMeta


def mm(m: int, n: int, k: int, role: str = "replicated", op: str = "aten.mm.default",
       batch: int = 1) -> OpNode:
    out = (batch, m, n) if batch > 1 else (m, n)
    a = (batch, m, k) if batch > 1 else (m, k)
    b = (batch, k, n) if batch > 1 else (k, n)
    return OpNode(name="mm", op=op, inputs=[], input_meta=[TensorMeta(a, "bfloat16"),
                                                            TensorMeta(b, "bfloat16")],
                  output_meta=[TensorMeta(out, "bfloat16")], fwd_flops=2.0 * batch * m * n * k,
                  bwd_flops=4.0 * batch * m * n * k,
                  bytes_read=2 * batch * (m * k + k * n), bytes_written=2 * batch * m * n,
                  tp_role=role)  # type: ignore[arg-type]


def sdpa(b: int, heads: int, s: int, d: int, causal: bool) -> OpNode:
    q = TensorMeta((b, heads, s, d), "bfloat16")
    f = 4.0 * b * heads * s * s * d
    return OpNode(name="attn", op="aten._scaled_dot_product_flash_attention.default",
                  inputs=[], input_meta=[q, q, q], output_meta=[q], fwd_flops=f,
                  bwd_flops=2.5 * f, bytes_read=3 * q.nbytes, bytes_written=q.nbytes,
                  causal=causal)


# ---- the shape curve ------------------------------------------------------------------------
def test_wave_utilisation_is_monotone_and_bounded():
    sms = SMS["ampere"]
    values = [wave_utilisation(t, sms) for t in (1, 10, 54, 108, 500, 5000, 10**6)]
    assert values == sorted(values) and all(0 < v < 1 for v in values)
    assert wave_utilisation(sms / 2, sms) == pytest.approx(0.5)       # half the SMs busy
    assert values[-1] > 0.999
    assert wave_utilisation(10, 0) == 1.0                              # no model (CPU)


@pytest.mark.parametrize("family", ["ampere", "hopper", "volta"])
def test_gemm_factor_small_shards_slower_large_approach_one(family):
    sms = SMS[family]
    sizes = [256, 512, 1024, 2048, 4096, 8192, 16384, 32768]
    f = [gemm_factor(1, s, s, s, sms) for s in sizes]
    assert f == sorted(f)                                              # monotone in size
    assert f[0] < 0.25 and f[-1] > 0.99                                # small slow, large -> 1
    # K alone: the pipeline fill costs K0 of depth
    assert gemm_factor(1, 8192, 8192, GEMM_K0, sms) == pytest.approx(
        0.5 * wave_utilisation(8192 * 8192 / TILE_ELEMENTS, sms))
    # backward: harmonic mean of the data- and weight-gradient GEMMs
    d, w = gemm_factor(1, 4096, 1024, 512, sms), gemm_factor(1, 1024, 512, 4096, sms)
    assert gemm_backward_factor(1, 4096, 512, 1024, sms) == pytest.approx(2 / (1 / d + 1 / w))


def test_gemm_dims_follow_tp_role_and_micro_batch():
    assert gemm_dims(mm(2048, 6144, 2048)) == (1, 2048, 6144, 2048)
    assert gemm_dims(mm(2048, 6144, 2048, "column"), tp=4) == (1, 2048, 1536, 2048)
    assert gemm_dims(mm(2048, 2048, 6144, "row"), tp=4) == (1, 2048, 2048, 1536)
    assert gemm_dims(mm(2048, 6144, 2048, "column"), tp=2, batch_scale=4) == \
        (1, 8192, 3072, 2048)
    bmm = mm(2048, 2048, 128, "sharded", op="aten.bmm.default", batch=32)
    assert gemm_dims(bmm, tp=8, batch_scale=2) == (8, 2048, 2048, 128)


def test_compute_model_prices_the_shard_shape():
    a100 = load_device("a100-80gb")
    cm = ComputeModel(a100, "bfloat16")
    eff = default_efficiency(a100)
    big = mm(8192, 8192, 8192)
    fwd, bwd = cm.op_time(big)
    rate = 312e12 * eff.matmul * gemm_factor(1, 8192, 8192, 8192, SMS["ampere"])
    assert fwd == pytest.approx(big.fwd_flops / rate + eff.kernel_overhead_s)
    # achieved fraction of peak: large GEMMs near the asymptote, TP-8 shards of a small
    # layer at micro-batch 1 well below it
    achieved = big.fwd_flops / (fwd * 312e12)
    assert 0.9 * eff.matmul < achieved < eff.matmul
    small = mm(2048, 3 * 1024, 1024, "column")
    f8, _ = cm.op_time_at(small, None, tp=8)
    assert small.fwd_flops / 8 / (f8 * 312e12) < 0.6 * eff.matmul
    # the same FLOPs as one larger shard run faster than split eight ways
    f1, _ = cm.op_time(mm(2048, 384, 1024))
    assert f8 == pytest.approx(f1)
    assert cm.op_time(mm(4096, 384, 1024))[0] < 2 * f1


# ---- attention ------------------------------------------------------------------------------
def test_attention_table_matches_flashattention2_and_interpolates():
    a100 = FA2_FWD_BWD_TFLOPS["ampere"]
    assert attention_tflops("ampere", 2048, 128, True) == a100[(128, True)][2] == 155
    mid = attention_tflops("ampere", 2048 * 2**0.5, 128, True)
    assert 155 < mid < 173
    assert attention_tflops("ampere", 100, 64, False) == a100[(64, False)][0]
    assert attention_tflops("ampere", 10**6, 128, False) == a100[(128, False)][-1]
    assert attention_tflops("ampere", 4096, 96, True) == pytest.approx((156 + 173) / 2)
    assert attention_tflops("volta", 2048, 128, True) is None
    for family in FA2_FWD_BWD_TFLOPS:
        for row in FA2_FWD_BWD_TFLOPS[family].values():
            assert list(row) == sorted(row)                          # longer: faster


def test_causal_attention_does_half_the_traced_flops():
    h100 = load_device("h100-sxm")
    cm = ComputeModel(h100, "bfloat16")
    eff = default_efficiency(h100)
    full, causal = sdpa(1, 16, 8192, 128, False), sdpa(1, 16, 8192, 128, True)
    t_full, t_causal = sum(cm.op_time(full)), sum(cm.op_time(causal))
    # FA2, H100, non-causal, d 128, 8k; at the sustained clock, sharing the GPU as a GEMM does
    rate = 335e12 * eff.clock * IN_STEP
    assert t_full == pytest.approx(3.5 * full.fwd_flops / rate + 2 * eff.kernel_overhead_s,
                                   rel=1e-6)
    rate_c = 308e12 * eff.clock * IN_STEP
    assert t_causal == pytest.approx(3.5 * causal.fwd_flops / 2 / rate_c
                                     + 2 * eff.kernel_overhead_s, rel=1e-6)
    # a device family without a table keeps the documented constant on the traced FLOPs
    v100 = ComputeModel(load_device("v100-32gb"), "float16")
    fv, _ = v100.op_time(causal)
    e = default_efficiency(load_device("v100-32gb"))
    assert fv == pytest.approx(causal.fwd_flops / (125e12 * e.attention) + e.kernel_overhead_s)



def test_attention_on_a_lower_peak_part_of_the_family_scales_with_its_peak():
    """The table was measured on the SXM part; an H100 at a 500 W limit (the Grand Teton
    cluster file: 912 of 989 TFLOP/s) runs the same kernel 912/989 as fast; a part at the
    reference peak (H200: the same die) is unchanged."""
    from pathlib import Path

    from autoplan.cluster import load_cluster
    from autoplan.cost.kernel_shape import FA2_REFERENCE_PEAK_TFLOPS

    root = Path(__file__).resolve().parents[1]
    gt = load_cluster(root / "benchmarks/data/clusters/grand-teton-h100.yaml").device
    assert gt.peak_flops("bfloat16") == 912e12 and FA2_REFERENCE_PEAK_TFLOPS["hopper"] == 989
    causal = sdpa(1, 16, 8192, 128, True)
    eff = default_efficiency(gt)
    t_gt = sum(ComputeModel(gt, "bfloat16").op_time(causal)) - 2 * eff.kernel_overhead_s
    t_sxm = sum(ComputeModel(load_device("h100-sxm"), "bfloat16").op_time(causal)) \
        - 2 * eff.kernel_overhead_s
    assert t_gt == pytest.approx(t_sxm * 989 / 912, rel=1e-9)
    t_h200 = sum(ComputeModel(load_device("h200-sxm"), "bfloat16").op_time(causal)) \
        - 2 * eff.kernel_overhead_s
    assert t_h200 == pytest.approx(t_sxm, rel=1e-9)

# ---- fp16 mixed precision -------------------------------------------------------------------
def test_fp16_is_the_v100_default_and_bf16_is_refused_there():
    v100 = load_cluster("dgx-v100")
    assert check_precision(None, v100) == "mixed-fp16"
    assert check_precision(None, load_cluster("dgx-a100")) == "mixed"
    assert check_precision("mixed-fp16", load_cluster("dgx-a100")) == "mixed-fp16"
    with pytest.raises(ConfigError, match="precision.*bfloat16.*mixed-fp16"):
        check_precision("mixed", v100)
    with pytest.raises(ConfigError, match="precision.*GPUs"):
        check_precision("mixed-fp16", load_cluster("local-cpu"))
    with pytest.raises(ConfigError, match="precision"):
        check_precision("bf16", v100)


def test_fp16_prices_loss_scaling_and_fp32_master_weights():
    problem = prepare("gpt-1.7b", "dgx-v100", global_batch=16)
    plan = estimate(None, None, global_batch=16, problem=problem, tp=1, pp=1, dp=8,
                    micro_batch=2, checkpoint="full")
    assert plan.precision == {"params": "float32", "compute": "float16", "reduce": "float32"}
    v100 = load_device("v100-32gb")
    fp16 = ComputeModel(v100, "float16")
    assert fp16.peak == 125e12
    n = 1e9
    plain = n * 28.0 / (v100.memory_bandwidth * fp16.efficiency.memory)
    assert fp16.optimizer_time(n) == pytest.approx(
        plain * (28.0 + LOSS_SCALE_BYTES_PER_PARAM) / 28.0)
    assert ComputeModel(load_device("a100-80gb"), "bfloat16").optimizer_time(n) == \
        pytest.approx(n * 28.0 / (load_device("a100-80gb").memory_bandwidth * 0.8))
    mem = plan.prediction.memory           # fp16 weights and grads, fp32 master + Adam: 2/2/12
    assert mem.grads == pytest.approx(mem.params)
    assert mem.optimizer == pytest.approx(6 * mem.params)


def test_trace_records_causal_attention():
    import torch

    from autoplan.models import resolve
    from autoplan.trace import trace

    graph = trace(resolve("gpt-tiny", attention="sdpa"), batch_size=1, seq_len=64,
                  dtype=torch.bfloat16)
    attn = [n for n in graph.nodes.values() if "attention" in n.op]
    assert attn and all(n.causal for n in attn)
    assert not any(n.causal for n in graph.nodes.values() if "attention" not in n.op)


def test_fused_swiglu_does_not_keep_the_silu_output():
    import torch

    from autoplan.cost.fused import fuse_saved_activations
    from autoplan.models import resolve
    from autoplan.trace import trace

    spec = resolve("llama3-8b", layers=2, hidden=256, heads=8, kv_heads=2, ffn_hidden=832,
                   vocab_size=512)
    graph = trace(spec, batch_size=1, seq_len=64, dtype=torch.bfloat16)
    fused = fuse_saved_activations(graph)
    silu = [n for n in graph.nodes.values() if n.op.startswith("aten.silu")]
    assert silu and all(n.saved_bytes == 64 * 832 * 2 for n in silu)     # traced: kept
    assert all(fused.nodes[n.name].saved_bytes == 0 for n in silu)        # fused: recomputed
    block = graph.layers[1]
    dropped = graph.layers[1].stats.saved_bytes - fused.layers[1].stats.saved_bytes
    kept = sum(fused.nodes[n].saved_bytes for n in block.nodes)
    assert fused.layers[1].stats.saved_bytes == kept
    assert dropped >= 64 * 832 * 2


# ---- widths: float32 upcasts and the loss ---------------------------------------------------
def _elementwise(op: str, dtype_in: str, dtype_out: str, numel: int) -> OpNode:
    width = {"bfloat16": 2, "float32": 4}
    return OpNode(name=op, op=op, inputs=[], input_meta=[TensorMeta((numel,), dtype_in)],
                  output_meta=[TensorMeta((numel,), dtype_out)], fwd_flops=0.0, bwd_flops=0.0,
                  bytes_read=numel * width[dtype_in], bytes_written=numel * width[dtype_out])


def test_float32_upcasts_of_a_bf16_trace_and_the_loss_run_at_float32_width():
    h100 = load_device("h100-sxm")
    cm = ComputeModel(h100, "bfloat16")
    eff = default_efficiency(h100)
    bw = h100.memory_bandwidth * eff.memory
    n = 4096 * 131072                                    # one sequence's logits, 128k vocabulary
    upcast = _elementwise("aten._to_copy.default", "bfloat16", "float32", n)
    # traced in bf16 for a bf16 run: the upcast's float32 output is real float32 traffic
    f, _ = cm.op_time(upcast, traced_dtype="bfloat16")
    assert f == pytest.approx(eff.fusion * (6 * n / bw + eff.kernel_overhead_s))
    # traced in float32 for a bf16 run: every tensor shrinks to the compute width
    f32 = _elementwise("aten._to_copy.default", "float32", "float32", n)
    f, _ = cm.op_time(f32, traced_dtype="float32")
    assert f == pytest.approx(eff.fusion * (4 * n / bw + eff.kernel_overhead_s))
    # the loss runs in float32 whatever the trace, and no fusion removes its passes
    for traced in ("float32", "bfloat16"):
        loss = _elementwise("aten._log_softmax.default", traced, traced, n)
        f, b = cm.op_time(loss, traced_dtype=traced)
        assert f == pytest.approx(8 * n / bw + eff.kernel_overhead_s)
        assert b == pytest.approx(f)
