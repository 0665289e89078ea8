"""Planning with expert and context parallelism: the trace's MoE/attention metadata, the
grid's pricing of ep and cp, the plan's mesh, and the errors for impossible degrees."""

import pytest

from autoplan.api import estimate, prepare
from autoplan.errors import ConfigError
from autoplan.plan import Plan
from autoplan.planner.grid.uniform import context_degrees, enumerate_configs, expert_degrees

MOE = dict(vocab_size=512, seq_len=256, hidden=128, layers=4, heads=4, kv_heads=2,
           style="llama", experts=8, top_k=2)
LONG = dict(vocab_size=512, seq_len=32768, hidden=128, layers=4, heads=4, kv_heads=2,
            style="llama")


@pytest.fixture(scope="module")
def moe():
    from autoplan.models.registry import resolve

    return prepare(resolve("gpt", **MOE), "dgx-h100", nodes=2, global_batch=64)


@pytest.fixture(scope="module")
def long():
    from autoplan.models.registry import resolve

    return prepare(resolve("gpt", **LONG), "dgx-h100", nodes=2, global_batch=16)


def test_trace_records_experts_and_keys(moe, long):
    g = moe.graph
    assert g.experts == 8
    block = g.blocks()[0].stats
    assert block.expert_params == 8 * 3 * 128 * 512            # gate_up + down, Llama ffn 512
    # one all-to-all: capacity (2 x 256 / 8 = 64 slots) x 8 experts x 128 wide, bf16
    assert block.moe_a2a_bytes == 64 * 8 * 128 * 2
    assert g.active_params < g.num_params
    # keys and values before grouped-query expansion: 2 x 32768 tokens x 2 heads x 32, bf16
    assert long.graph.blocks()[0].stats.kv_bytes == 2 * 32768 * 64 * 2


def test_expert_parallelism_splits_expert_weights_and_adds_all_to_alls(moe):
    base = estimate(None, None, global_batch=64, problem=moe, zero=1).prediction
    ep = estimate(None, None, global_batch=64, problem=moe, zero=1, ep=8).prediction
    assert ep.memory.params < base.memory.params
    assert ep.time.tp_comm > base.time.tp_comm == 0        # dispatch + combine
    assert ep.time.dp_comm < base.time.dp_comm             # expert grads: dp / ep ranks


def test_context_parallelism_divides_the_work_and_exchanges_keys(long):
    one = estimate(None, None, global_batch=16, problem=long, tp=1).prediction
    plan = estimate(None, None, global_batch=16, problem=long, tp=1, cp=2)
    two = plan.prediction
    assert two.time.compute == pytest.approx(one.time.compute, rel=1e-9)   # per step: same
    assert two.time.tp_comm > 0 == one.time.tp_comm
    assert two.memory.activations < one.memory.activations
    assert plan.parallel.label().startswith("dp8 cp2")
    assert plan.mesh.axis_names == ("pp", "dp", "cp", "tp") and plan.mesh.shape == (1, 8, 2, 1)


def test_plan_with_ep_and_cp_round_trips(tmp_path, moe):
    plan = estimate(None, None, global_batch=64, problem=moe, zero=1, ep=4)
    plan.save(tmp_path / "p.json")
    again = Plan.load(tmp_path / "p.json")
    assert again.parallel.ep == 4 and again.parallel.cp == 1


@pytest.mark.parametrize("kwargs, field", [(dict(ep=3), "ep"), (dict(ep=16, tp=2), "ep")])
def test_impossible_degrees_name_the_argument(moe, kwargs, field):
    with pytest.raises(ConfigError, match=f"'{field}'"):
        estimate(None, None, global_batch=64, problem=moe, **kwargs)


def test_context_parallelism_needs_sdpa_attention():
    from autoplan.models.registry import resolve

    eager = prepare(resolve("gpt", **{**LONG, "seq_len": 512, "attention": "eager"}),
                    "dgx-h100", nodes=2, global_batch=16)
    with pytest.raises(ConfigError, match="'cp'.*scaled-dot-product"):
        estimate(None, None, global_batch=16, problem=eager, cp=2)


def test_grid_offers_ep_for_experts_and_cp_for_long_sequences(moe, long):
    assert expert_degrees(moe.graph, 16) == [1, 2, 4, 8]
    assert expert_degrees(long.graph, 16) == [1]
    assert context_degrees(moe.graph, 16) == [1]                  # 256 tokens: too short
    assert context_degrees(long.graph, 16) == [1, 2, 4]           # >= 8192 tokens a rank
    eps = {c.ep for c in enumerate_configs(moe.graph, moe.cluster, 64)}
    cps = {c.cp for c in enumerate_configs(long.graph, long.cluster, 16)}
    assert eps == {1, 2, 4, 8} and cps == {1, 2, 4}


def test_exports_express_ep_and_cp_where_the_target_can(long):
    from autoplan.export.common import NotExpressibleError
    from autoplan.export.deepspeed import to_deepspeed
    from autoplan.export.megatron import to_megatron
    from autoplan.export.torchtitan import to_torchtitan
    from autoplan.models.registry import resolve

    problem = prepare(resolve("gpt", **{**LONG, "experts": 8, "top_k": 2}), "dgx-h100",
                      nodes=2, global_batch=16)
    z1 = estimate(None, None, global_batch=16, problem=problem, tp=1, cp=2, ep=4, zero=1)
    text = to_megatron(z1).text
    for flag in ("--context-parallel-size 2", "--expert-model-parallel-size 4",
                 "--num-experts 8", "--moe-router-topk 2", "(tp 1 x pp 1 x cp 2)"):
        assert flag in text
    z3 = estimate(None, None, global_batch=16, problem=problem, tp=1, cp=2, ep=4, zero=3)
    toml = to_torchtitan(z3).text
    assert "context_parallel_degree = 2" in toml and "expert_parallel_degree = 4" in toml
    with pytest.raises(NotExpressibleError, match="ep = 4, cp = 2"):
        to_deepspeed(z3)


def _prelaunch(plan: Plan, source: str, monkeypatch, local_world_size: int) -> None:
    """Every check ``engine.run`` makes before its first collective, except that the plan's
    devices exist here (a GPU plan checked on a CPU machine)."""
    import engine.validate
    from engine.preflight import check_plan_common
    from engine.runtime import check_all

    monkeypatch.setattr(engine.validate, "check_device", lambda *a, **k: None)
    spec = check_all(plan, source, world_size=plan.world_size,
                     local_world_size=local_world_size)
    check_plan_common(plan, spec, source)


@pytest.mark.slow
def test_mixtral_8x7b_on_64_h100_gets_expert_parallelism_the_engine_accepts(
        tmp_path, monkeypatch):
    """``autoplan plan`` (the default planner) of Mixtral-8x7B on 8 DGX H100 nodes: expert
    parallelism, and a plan that passes the engine's pre-launch checks."""
    from autoplan.cli import main

    out = tmp_path / "mixtral.json"
    assert main(["plan", "mixtral-8x7b", "--cluster", "dgx-h100", "--nodes", "8",
                 "--global-batch", "512", "-o", str(out)]) == 0
    plan = Plan.load(out)
    assert plan.world_size == 64 and plan.parallel.ep > 1 and plan.parallel.tp == 1
    _prelaunch(plan, str(out), monkeypatch, local_world_size=8)


def test_default_planner_keeps_the_grids_expert_parallel_plan(tmp_path, monkeypatch):
    """The search runs (a GPT-style MoE: the per-op runtime's model) but does not express
    EP; its never-slower guard keeps the grid's faster EP plan, which the engine runs
    (tests/test_engine_moe.py runs such plans)."""
    from autoplan.api import optimize
    from autoplan.models.registry import resolve

    spec = resolve("gpt", vocab_size=256, seq_len=64, hidden=64, layers=2, heads=4,
                   experts=4, top_k=2, capacity_factor=2.0)
    plan = optimize(spec, "local-cpu", global_batch=8)
    assert plan.parallel.ep > 1
    assert "search" in plan.planner and plan.planner["name"] == "uniform"
    assert plan.prediction.step_time_s < plan.planner["search_step_time_s"]
    path = plan.save(tmp_path / "moe.json")
    _prelaunch(plan, str(path), monkeypatch, local_world_size=4)
