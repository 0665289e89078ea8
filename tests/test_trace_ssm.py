"""Mamba-style selective scans and RWKV's WKV traced as the one fused kernel a GPU runs
(:mod:`autoplan.trace.ssm`): the ops compute what transformers' loops compute, values and
gradients; Mamba, Falcon-Mamba, Jamba and RWKV trace with one op per layer instead of a
Python loop over the sequence; the patch is the tracing thread's alone and undone."""

from __future__ import annotations

import threading

import pytest
import torch

from autoplan.models import resolve
from autoplan.trace import trace
from autoplan.trace.cuda_semantics import CudaSemantics
from autoplan.trace.ssm import WKV_FLOPS, selective_scan, wkv

mm = pytest.importorskip("transformers.models.mamba.modeling_mamba")

SMALL = dict(num_hidden_layers=2, hidden_size=64, state_size=8, vocab_size=256)


@pytest.mark.parametrize("extras", [True, False])
def test_the_op_computes_transformers_scan_values_and_gradients(extras):
    g = torch.Generator().manual_seed(0)
    b, d, length, n = 2, 6, 7, 4

    def r(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g) * scale).requires_grad_()

    u, dt, B, C = r(b, d, length), r(b, d, length), r(b, n, length), r(b, n, length)
    A = (-torch.rand(d, n, generator=g)).requires_grad_()
    kw = dict(D=r(d), z=r(b, d, length), delta_bias=r(d), delta_softplus=True) if extras \
        else {}
    want = mm.mamba_selective_scan(u, dt, A, B, C, **kw)
    got = selective_scan(u, dt, A, B, C, **kw)
    assert torch.allclose(got, want, rtol=1e-6, atol=1e-6)
    leaves = [u, dt, A, B, C] + ([kw["D"], kw["z"], kw["delta_bias"]] if extras else [])
    grad = torch.randn(want.shape, generator=g)
    for a, b_ in zip(torch.autograd.grad(want, leaves, grad),
                     torch.autograd.grad(got, leaves, grad)):
        assert torch.allclose(a, b_, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name, extra", [
    ("hf:mamba", {}),
    ("hf:falcon_mamba", {}),
    ("hf:jamba", dict(num_experts=2, num_experts_per_tok=1, expert_layer_period=2,
                      attn_layer_period=2, attn_layer_offset=1, intermediate_size=128,
                      num_attention_heads=4, num_key_value_heads=2,
                      mamba_d_state=8)),
])
def test_mamba_style_models_trace_one_scan_per_layer(name, extra):
    """A loop over 256 positions was a dozen ops each; now one fused op per Mamba layer,
    priced from the kernel's FLOP count (9 b d l n plus the skip and the gate) and
    charged three times that in backward."""
    kw = dict(SMALL, **extra)
    if name == "hf:jamba":
        kw = {k: v for k, v in kw.items() if k != "state_size"}
    seq = 256
    graph = trace(resolve(name, **kw), 1, seq)
    scans = [n for n in graph.nodes.values() if n.op.startswith("autoplan.selective_scan")]
    mixers = sum(1 for layer in graph.blocks()
                 if any(graph.nodes[n].op.startswith("autoplan.selective_scan")
                        for n in layer.nodes))
    assert scans and len(scans) == mixers
    assert max(len(layer.nodes) for layer in graph.layers) < 400
    scan = scans[0]
    b, d, length = scan.input_meta[0].shape
    n = scan.input_meta[2].shape[-1]
    assert length == seq
    assert scan.fwd_flops == (9 * n + 2) * b * d * length
    assert scan.bwd_flops == 3 * scan.fwd_flops


def test_the_scan_patch_is_the_tracing_threads_alone_and_undone():
    own = mm.mamba_selective_scan
    seen = {}
    args = [torch.randn(1, 2, 3), torch.randn(1, 2, 3), -torch.rand(2, 2),
            torch.randn(1, 2, 3), torch.randn(1, 2, 3)]

    def other_thread():
        seen["fn"] = mm.mamba_selective_scan
        seen["out"] = mm.mamba_selective_scan(*args)

    with CudaSemantics():
        with CudaSemantics():
            assert mm.mamba_selective_scan is not own
            worker = threading.Thread(target=other_thread)
            worker.start()
            worker.join()
        assert mm.mamba_selective_scan.__wrapped__ is own
    assert mm.mamba_selective_scan is own
    assert torch.allclose(seen["out"], own(*args))
    with pytest.raises(RuntimeError):
        with CudaSemantics():
            raise RuntimeError("a trace that fails")
    assert mm.mamba_selective_scan is own


def test_wkv_computes_transformers_recurrence_and_rwkv_traces_one_op_per_layer():
    mr = pytest.importorskip("transformers.models.rwkv.modeling_rwkv")
    g = torch.Generator().manual_seed(1)
    td, tf = (torch.randn(4, generator=g).requires_grad_() for _ in range(2))
    k, v = (torch.randn(2, 5, 4, generator=g).requires_grad_() for _ in range(2))
    want, _ = mr.rwkv_linear_attention_cpu(td, tf, k, v)
    got, _ = wkv(td, tf, k, v)
    assert torch.allclose(got, want, rtol=1e-6, atol=1e-6)
    grad = torch.randn(want.shape, generator=g)
    for a, b_ in zip(torch.autograd.grad(want, [td, tf, k, v], grad),
                     torch.autograd.grad(got, [td, tf, k, v], grad)):
        assert torch.allclose(a, b_, rtol=1e-5, atol=1e-5)
    graph = trace(resolve("hf:rwkv", num_hidden_layers=2, hidden_size=64, vocab_size=256,
                          attention_hidden_size=64, intermediate_size=128), 1, 256)
    ops = [n for n in graph.nodes.values() if n.op.startswith("autoplan.wkv")]
    assert len(ops) == 2 and max(len(layer.nodes) for layer in graph.layers) < 200
    assert ops[0].fwd_flops == WKV_FLOPS * 256 * 64
    assert ops[0].bwd_flops == 3 * ops[0].fwd_flops


def test_the_fused_ops_are_priced_as_one_kernel_from_their_bytes():
    """The scan is already one kernel: none of the element-wise fusion factor a GPU
    framework's unfused chains get (the same node under another op name costs phi of it)."""
    from dataclasses import replace

    from autoplan.cluster import load_cluster
    from autoplan.cost.compute import FUSED_KERNEL_OPS, ComputeModel, op_base_name

    graph = trace(resolve("hf:mamba", **SMALL), 1, 256)
    scan = next(n for n in graph.nodes.values() if n.op.startswith("autoplan.selective_scan"))
    assert op_base_name(scan.op) in FUSED_KERNEL_OPS
    cm = ComputeModel(load_cluster("dgx-h100").device)
    phi = cm.efficiency.fusion
    assert phi < 1
    other = replace(scan, op="aten.some_elementwise_chain.default")
    for mine, chain in zip(cm.op_time(scan, shard=1.0), cm.op_time(other, shard=1.0)):
        assert chain == pytest.approx(phi * mine)
