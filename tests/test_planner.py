"""Uniform planner and estimator: planning tests (no real devices; fake process group for
mesh checks at large world sizes)."""

from __future__ import annotations

import json
import pathlib

import pytest

import autoplan
from autoplan.api import estimate, plan_problem, prepare
from autoplan.errors import ConfigError, InfeasibleError, UnknownNameError
from autoplan.plan import Plan
from autoplan.planner.grid.uniform import SearchSpace, enumerate_configs


@pytest.fixture(scope="module")
def problem_1p7b():
    """GPT-1.7B (Megatron SC'21) on 4 DGX A100 nodes, global batch 512."""
    return prepare("gpt-1.7b", "dgx-a100", nodes=4, global_batch=512)


def test_plan_is_best_feasible_and_sorted(problem_1p7b):
    plan, result = plan_problem(problem_1p7b, top_k=5)
    times = [c.prediction.step_time_s for c in result.ranked]
    assert times == sorted(times)
    assert plan.prediction.step_time_s == times[0]
    assert plan.prediction.memory.total <= plan.prediction.memory_limit_bytes
    # the grid prices in the order of a step-time lower bound and stops once no other
    # configuration can enter the top k + 1: feasible counts the priced ones
    assert result.evaluated > result.priced >= result.feasible == len(times) >= 5
    assert len(plan.alternatives) == 5
    assert plan.world_size == 32
    # every enumerated configuration uses the whole cluster and the whole batch
    for cfg in enumerate_configs(problem_1p7b.graph, problem_1p7b.cluster, 512):
        assert cfg.world_size == 32 and cfg.global_batch() == 512
        assert cfg.tp <= 8


def test_search_respects_space(problem_1p7b):
    space = SearchSpace(tp=(2,), pp=(1,), zero=(1,), checkpoint=("full",))
    plan, _ = plan_problem(problem_1p7b, space=space)
    p = plan.parallel
    assert (p.tp, p.pp, p.zero, p.checkpoint, p.dp) == (2, 1, 1, "full", 16)


def test_space_can_keep_tp_and_recomputation_off_pipelines(problem_1p7b):
    # the generic runtime's limits (autoplan.capability.generic_gap), as the grid applies them
    space = SearchSpace(tp_with_pp=False, checkpoint_with_pp=False)
    configs = list(enumerate_configs(problem_1p7b.graph, problem_1p7b.cluster, 512,
                                     space=space))
    staged = [c for c in configs if c.pp > 1]
    assert staged and all(c.tp == 1 and c.checkpoint == "none" for c in staged)
    assert any(c.checkpoint != "none" for c in configs if c.pp == 1)


def test_plans_are_deterministic(problem_1p7b, tmp_path):
    a, _ = plan_problem(problem_1p7b)
    b, _ = plan_problem(problem_1p7b)
    a.save(tmp_path / "a.json")
    b.save(tmp_path / "b.json")
    assert (tmp_path / "a.json").read_bytes() == (tmp_path / "b.json").read_bytes()
    doc = json.loads((tmp_path / "a.json").read_text())
    assert doc["created_by"]["autoplan"] == autoplan.__version__
    assert "torch" in doc["created_by"]


def test_estimate_agrees_with_search(problem_1p7b):
    plan, result = plan_problem(problem_1p7b)
    p = plan.parallel
    mine = estimate(None, None, global_batch=512, problem=problem_1p7b, tp=p.tp, pp=p.pp,
                    zero=p.zero, micro_batch=p.micro_batch, checkpoint=p.checkpoint,
                    schedule=p.schedule, virtual_stages=p.virtual_stages,
                    sequence_parallel=p.sequence_parallel)
    assert mine.prediction == plan.prediction


def test_more_memory_per_device_without_zero(problem_1p7b):
    def mem(zero):
        return estimate(None, None, global_batch=512, problem=problem_1p7b, zero=zero,
                        micro_batch=1).prediction.memory
    z0, z1, z2, z3 = (mem(z) for z in range(4))
    assert z0.optimizer > z1.optimizer == pytest.approx(z0.optimizer / 32)
    assert z1.grads > z2.grads and z2.params > z3.params
    assert z0.total > z1.total > z2.total > z3.total


def test_recomputation_trades_time_for_memory(problem_1p7b):
    kw = dict(global_batch=512, problem=problem_1p7b, tp=2, micro_batch=4)
    off = estimate(None, None, checkpoint="none", **kw).prediction
    on = estimate(None, None, checkpoint="full", **kw).prediction
    assert on.memory.activations < off.memory.activations / 4
    assert on.step_time_s > off.step_time_s
    assert on.time.recompute > 0 and off.time.recompute == 0
    assert on.hardware_tflops_per_device > on.model_tflops_per_device


def test_pipeline_bubble_shrinks_with_more_micro_batches(problem_1p7b):
    kw = dict(global_batch=512, problem=problem_1p7b, pp=4, tp=1)
    few = estimate(None, None, micro_batch=16, **kw).prediction     # m = 4
    many = estimate(None, None, micro_batch=2, **kw).prediction     # m = 32
    frac = lambda p: p.time.bubble / p.step_time_s                  # noqa: E731
    assert frac(few) > frac(many)
    inter = estimate(None, None, micro_batch=2, schedule="interleaved_1f1b", virtual_stages=2,
                     **kw).prediction
    assert inter.time.bubble < many.time.bubble


def test_bad_configuration_names_field(problem_1p7b):
    with pytest.raises(ConfigError, match="tp"):
        estimate(None, None, global_batch=512, problem=problem_1p7b, tp=16)
    with pytest.raises(ConfigError, match="micro_batch"):
        estimate(None, None, global_batch=512, problem=problem_1p7b, micro_batch=3)


def test_infeasible_explains_memory():
    with pytest.raises(InfeasibleError) as info:
        # ~72B parameters: 16 bytes each over 8 devices is ~145 GB per device even at ZeRO-3
        big = autoplan.resolve_model("gpt", hidden=12288, layers=40, heads=96,
                                     vocab_size=51200, seq_len=2048)
        autoplan.optimize(big, "dgx-a100", nodes=1, global_batch=8)
    msg = str(info.value)
    assert "does not fit" in msg and "GB per device" in msg and "85.9 GB" in msg
    assert "devices" in msg


def test_unknown_model_lists_known():
    with pytest.raises(UnknownNameError, match="unknown model 'gpt-5'.*gpt-1.7b"):
        autoplan.optimize("gpt-5", "dgx-a100", global_batch=8)


def test_plan_mesh_builds_on_fake_process_group_1024_ranks(tmp_path):
    """The plan's (pp, dp, tp) mesh is constructible at 1024 ranks and keeps TP in a node."""
    import subprocess
    import sys

    plan = autoplan.optimize("gpt-39b", "dgx-a100", nodes=128, global_batch=1536)
    path = plan.save(tmp_path / "plan.json")
    code = f"""
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.testing._internal.distributed.fake_pg import FakeStore
from autoplan.plan import Plan
plan = Plan.load({str(path)!r})
for rank in (0, plan.world_size - 1):
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=plan.world_size)
    mesh = init_device_mesh("cpu", plan.mesh.shape, mesh_dim_names=plan.mesh.axis_names)
    tp_ranks = dist.get_process_group_ranks(mesh["tp"].get_group()) if plan.parallel.tp > 1 else [rank]
    node = {{r // 8 for r in tp_ranks}}
    assert len(node) == 1, tp_ranks
    stage = [s for s in plan.stages if rank in s.ranks]
    assert stage and mesh.get_coordinate()[0] == stage[0].index % plan.parallel.pp
    dist.destroy_process_group()
print("ok", plan.world_size)
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "ok 1024"
    assert isinstance(Plan.load(path), Plan)


def test_pipeline_boundaries_send_sequence_slices_without_sequence_parallelism():
    """engine.pipeline.scatter_gather on a fake process group of 2 TP ranks: a stage's
    output leaves as this rank's half of the sequence (Megatron's scatter/gather, what
    autoplan.cost.pipeline_comm prices), the next stage all-gathers the whole sequence; not
    under sequence parallelism (the stream is sharded already) nor where tp does not divide
    the sequence."""
    import subprocess
    import sys

    code = """
import torch, torch.nn as nn, torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.testing._internal.distributed.fake_pg import FakeStore
from engine.pipeline import scatter_gather
dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
class PM:
    tp_mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    num_stages = 3
chunks = {i: nn.Identity() for i in range(3)}
assert scatter_gather(chunks, PM, tp=2, sequence_parallel=False, seq_len=8)
x = torch.randn(2, 8, 4, requires_grad=True)
first = chunks[0](x)
assert first.shape == (2, 4, 4) and torch.equal(first, x[:, :4])
middle = chunks[1](first)
assert middle.shape == (2, 4, 4)
assert chunks[2](middle).shape == (2, 8, 4)
middle.sum().backward()
assert x.grad.shape == (2, 8, 4)
assert not scatter_gather({0: nn.Identity()}, PM, tp=2, sequence_parallel=True, seq_len=8)
assert not scatter_gather({0: nn.Identity()}, PM, tp=2, sequence_parallel=False, seq_len=7)
print("ok")
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, cwd=pathlib.Path(__file__).resolve().parents[1])
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "ok"


def test_user_module_by_import_path():
    plan = autoplan.optimize("import:tests.user_model:build", "dgx-a100", global_batch=64,
                             precision="fp32")
    assert plan.model == {"source": "import", "name": "tests.user_model:build", "config": {}}
    assert plan.num_params == sum(p.numel() for p in __import__(
        "tests.user_model", fromlist=["build"]).build().parameters())
    assert [s.layer_names for s in plan.stages][0][1:4] == ("layers.0", "layers.1", "layers.2")


def test_import_path_errors_are_clear():
    with pytest.raises(ConfigError, match="cannot import 'no_such_pkg.mod'"):
        autoplan.optimize("import:no_such_pkg.mod:build", "dgx-a100", global_batch=8)
    with pytest.raises(ConfigError, match="has no attribute 'nope'"):
        autoplan.optimize("import:tests.user_model:nope", "dgx-a100", global_batch=8)


def test_planner_only_proposes_what_the_engine_runs():
    """GPT-2 (fused QKV in one Conv1D, tied embeddings): no TP, no pipeline."""
    spec = autoplan.resolve_model("hf:gpt2", n_layer=2, n_embd=256, n_head=8)
    problem = prepare(spec, "dgx-a100", global_batch=64)
    plan, result = plan_problem(problem)
    assert all(c.parallel.tp == 1 and c.parallel.pp == 1 for c in result.ranked)
    with pytest.raises(ConfigError, match="cannot run this for gpt2"):
        estimate(None, None, global_batch=64, problem=problem, tp=2)
