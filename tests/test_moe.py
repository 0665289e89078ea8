"""Mixture of experts: capacity dispatch (autoplan.models.moe), the built-in MoE GPT, the
Hugging Face MoE architectures through it, presets, and traced FLOPs."""

import math

import pytest
import torch

from autoplan.models.moe import (MoE, active_params, capacity, capacity_forward,
                                 dispatch_slots)
from autoplan.models.registry import build_model, resolve

transformers = pytest.importorskip("transformers")


def test_capacity_formula():
    # GShard / Switch: ceil(cf * k * T / E), within [1, T]
    assert capacity(4096, 8, 2, 1.0) == 1024
    assert capacity(4096, 8, 2, 1.25) == 1280
    assert capacity(10, 8, 2, 1.0) == 3
    assert capacity(3, 8, 1, 100.0) == 3 and capacity(1, 64, 1, 0.01) == 1


def test_dispatch_ranks_pairs_within_their_expert_and_drops_beyond_capacity():
    idx = torch.tensor([[0, 1], [0, 2], [0, 1]])        # expert 0 chosen 3 times
    slot, kept = dispatch_slots(idx, experts=3, cap=2)
    assert kept.tolist() == [True, True, True, True, False, True]
    assert slot.tolist() == [0, 2, 1, 4, 6, 3]          # dropped pair -> spare slot E*C


def test_dropped_tokens_contribute_nothing():
    torch.manual_seed(0)
    moe = MoE(8, 16, experts=2, top_k=1, capacity_factor=0.5)
    for p in moe.parameters():
        torch.nn.init.normal_(p, std=0.1)
    x = torch.randn(1, 8, 8)
    w = torch.ones(8, 1)
    idx = torch.zeros(8, 1, dtype=torch.long)            # all to expert 0, capacity 2
    y = capacity_forward(x[0], idx, w, experts=2, capacity_factor=0.5, up=moe.gate_up,
                         down=moe.down, apply_gate=moe._gate)
    assert y[:2].abs().sum() > 0 and torch.all(y[2:] == 0)


def _equal_to_eager(cls, cfg_cls, **kw):
    from autoplan.models.moe import HF_IMPLEMENTATION, register_hf_experts

    assert register_hf_experts()
    torch.manual_seed(0)
    model = cls(cfg_cls(**kw)).float()
    tokens = torch.randint(0, kw["vocab_size"], (2, 12))
    results = {}
    for impl in ("eager", HF_IMPLEMENTATION):
        for m in model.modules():
            if hasattr(m, "config"):
                m.config._experts_implementation = impl
                m.config.autoplan_capacity_factor = 64.0    # no token can be dropped
        model.zero_grad()
        loss = model(input_ids=tokens, labels=tokens).loss
        loss.backward()
        results[impl] = (loss.item(), [p.grad.clone() for p in model.parameters()
                                       if p.grad is not None])
    (la, ga), (lb, gb) = results.values()
    assert la == pytest.approx(lb, rel=1e-6)
    assert len(ga) == len(gb) and max((a - b).abs().max().item() for a, b in zip(ga, gb)) < 1e-6


SMALL = dict(vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2)


def test_hf_mixtral_capacity_equals_eager():
    _equal_to_eager(transformers.MixtralForCausalLM, transformers.MixtralConfig,
                    num_local_experts=4, num_experts_per_tok=2, **SMALL)


def test_hf_qwen_moe_capacity_equals_eager():
    _equal_to_eager(transformers.Qwen3MoeForCausalLM, transformers.Qwen3MoeConfig,
                    num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
                    head_dim=8, **SMALL)
    _equal_to_eager(transformers.Qwen2MoeForCausalLM, transformers.Qwen2MoeConfig,
                    num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
                    shared_expert_intermediate_size=24, **SMALL)


def test_hf_moe_configs_under_other_names_route_through_the_capacity_experts():
    # Aria names its experts moe_num_experts / moe_topk and stores them transposed; ERNIE
    # 4.5 says moe_k; Kimi and Bailing num_experts_per_token
    from autoplan.models.moe import hf_routing

    cfg = transformers.AriaTextConfig(moe_num_experts=4, moe_topk=2, **SMALL)
    assert hf_routing(cfg) == (4, 2)
    assert hf_routing(transformers.Ernie4_5_MoeConfig(moe_num_experts=8, moe_k=3)) == (8, 3)
    assert hf_routing(transformers.MixtralConfig(num_local_experts=1)) is None   # one expert
    assert hf_routing(transformers.LlamaConfig()) is None
    _equal_to_eager(transformers.AriaTextForCausalLM, transformers.AriaTextConfig,
                    moe_num_experts=4, moe_topk=2, moe_num_shared_experts=1, **SMALL)


def test_builtin_moe_gpt_counts_and_trains():
    from autoplan.models.gpt_config import GPTConfig
    from autoplan.models.registry import example_batch

    spec = resolve("gpt", vocab_size=128, seq_len=32, hidden=32, layers=2, heads=4,
                   style="llama", experts=4, top_k=2, shared_experts=1, capacity_factor=2.0)
    cfg = GPTConfig.from_dict(spec.config)
    model = build_model(spec, device="cpu")
    assert sum(p.numel() for p in model.parameters()) == cfg.num_params()
    assert active_params(model) == cfg.num_params(active=True) < cfg.num_params()
    x, y = example_batch(spec, 2, 16, device="cpu")
    loss = model(x, y)
    loss.backward()
    assert math.isfinite(loss.item()) and model.blocks["0"].mlp.gate_up.grad.abs().sum() > 0


@pytest.mark.parametrize("bad", [dict(top_k=5), dict(capacity_factor=0.0),
                                 dict(capacity_factor=float("nan")), dict(experts=-1)])
def test_builtin_moe_config_errors_name_the_field(bad):
    from autoplan.errors import ConfigError

    with pytest.raises(ConfigError, match="model."):
        build_model(resolve("gpt", **{"hidden": 32, "heads": 4, "layers": 1, "experts": 4,
                                      **bad}))


# (total, active) in billions, as published (see autoplan/models/presets.py)
PUBLISHED = {"mixtral-8x7b": (46.7, 12.9), "mixtral-8x22b": (141, 39),
             "qwen3-30b-a3b": (30.5, 3.3), "deepseek-v3": (671, 37)}


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_moe_presets_match_published_parameter_counts(name):
    model = build_model(resolve(name), device="meta")
    total, active = PUBLISHED[name]
    assert sum(p.numel() for p in model.parameters()) / 1e9 == pytest.approx(total, rel=0.01)
    assert active_params(model) / 1e9 == pytest.approx(active, rel=0.03)


def test_traced_mixtral_flops_are_the_active_experts():
    """Mixtral-8x7B's widths with 2 layers: traced FLOPs within 10% of
    6 N_active T + attention (12 L T^2 h for forward and backward of non-causal SDPA)."""
    from autoplan.trace import trace

    spec = resolve("mixtral-8x7b", num_hidden_layers=2, vocab_size=4096)
    t = 512
    graph = trace(spec, 1, t, dtype=torch.bfloat16)
    model = build_model(spec, device="meta")
    n_active = active_params(model)
    expected = 6 * n_active * t + 12 * 2 * t * t * 4096
    assert (graph.fwd_flops + graph.bwd_flops) / expected == pytest.approx(1.0, abs=0.10)
    # and the routed experts are counted k/E, not E/E: far below 6 N_total T
    assert graph.fwd_flops + graph.bwd_flops < 0.5 * 6 * graph.num_params * t
