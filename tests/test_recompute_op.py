"""Op-level recomputation (torchtitan's ``selective_ac_option = "op"``): the rule on the
traced graph, the engine's policy (bit-equal gradients, the ops it runs again), the cost
model (memory and recomputation between selective and full), the plan field, the exporters,
and loss parity on two gloo ranks."""

from __future__ import annotations


import pytest
import torch

from autoplan.api import estimate, prepare
from autoplan.cost.recompute import (korthikanti_layer_bytes, op_recomputed_nodes,
                                     op_saved_nodes)
from autoplan.export.common import NotExpressibleError
from autoplan.export.deepspeed import deepspeed_config
from autoplan.export.megatron import megatron_args
from autoplan.export.torchtitan import to_torchtitan
from autoplan.models import resolve
from autoplan.plan import ParallelConfig, Plan
from engine_helpers import (TINY, TINY_LLAMA, losses, make_plan, max_rel_diff,
                            recompute_backward_ops, run_plans)


@pytest.fixture(scope="module")
def llama():
    spec = resolve("gpt", **dict(TINY_LLAMA, seq_len=64))
    return prepare(spec, "dgx-a100", nodes=1, global_batch=16, seq_len=64)


def test_the_rule_saves_attention_and_every_other_matmul(llama):
    """Per block: the attention kernel and the 1st, 3rd, ... matmul in forward order are
    saved; every other op with work is recomputed; nothing outside the blocks is either."""
    g = llama.graph
    saved, again = op_saved_nodes(g), op_recomputed_nodes(g)
    assert not saved & again
    for layer in g.blocks():
        mms = [n for n in layer.nodes if g.nodes[n].op.split(".")[1] in ("mm", "addmm")]
        assert len(mms) == 7                           # q, k, v, o, w1, w3, w2
        assert [n in saved for n in mms] == [True, False] * 3 + [True]
        assert any("attention" in g.nodes[n].op and n in saved for n in layer.nodes)
        kinds = {g.nodes[n].op.split(".")[1] for n in layer.nodes if n in again}
        assert {"mm", "mul"} <= kinds
    outside = {n for l in g.layers if l.name.startswith("<") for n in l.nodes}
    assert not (saved | again) & outside
    with pytest.raises(ValueError, match="Korthikanti"):
        korthikanti_layer_bytes("op", s=2048, b=1, h=4096, a=32)


def test_engine_policy_runs_half_the_matmuls_again_with_equal_gradients():
    """One process: op-level recomputation gives gradients bit-equal to none; in backward
    it runs again about half of each block's linear layers and every norm and GeLU, and no
    attention kernel (full recomputation runs all of them)."""
    grads, ran = recompute_backward_ops(TINY, (None, "op", "full"))
    assert all(torch.equal(a, b) for a, b in zip(grads[None], grads["op"]))
    blocks, attn = TINY["layers"], "_scaled_dot_product_flash_attention_for_cpu"
    # full recomputation runs each block's n linear layers again, op-level the even ones
    assert ran[None]["addmm"] == 0
    n, rest = divmod(ran["full"]["addmm"], blocks)
    assert rest == 0 and n >= 4 and ran["op"]["addmm"] == (n // 2) * blocks
    assert ran["op"]["native_layer_norm"] == 2 * blocks and ran["op"]["gelu"] == blocks
    assert ran["op"][attn] == 0 < ran["full"][attn]


def test_op_memory_and_time_lie_between_selective_and_full(llama):
    """Keeping the layer input, the attention outputs and every other matmul's: less memory
    than without recomputation, more than full; recomputing the rest: more time than
    selective, less than full; the hardware FLOPs count what it recomputes."""
    pred = {ck: estimate(None, None, global_batch=16, problem=llama, tp=2,
                         sequence_parallel=True, checkpoint=ck).prediction
            for ck in ("none", "selective", "op", "full")}
    act = {k: p.memory.activations for k, p in pred.items()}
    rec = {k: p.time.recompute for k, p in pred.items()}
    assert act["full"] < act["op"] < act["none"]
    assert rec["selective"] < rec["op"] < rec["full"]
    assert pred["op"].time.compute == pytest.approx(pred["none"].time.compute)
    hw = {k: p.hardware_tflops_per_device * p.step_time_s for k, p in pred.items()}
    assert hw["none"] < hw["op"] < hw["full"]
    assert "op-ckpt" in estimate(None, None, global_batch=16, problem=llama,
                                 checkpoint="op").parallel.label()


def test_plan_field_and_exporters():
    with pytest.raises(Exception, match="'op'"):
        ParallelConfig(checkpoint="ops")
    plan = make_plan(tp=2, sp=True, checkpoint="op", device_type="cuda",
                     precision={"params": "float32", "compute": "bfloat16",
                                "reduce": "float32"})
    assert plan.parallel.checkpoint == "op"
    assert Plan.from_dict(plan.to_dict()).parallel == plan.parallel
    tt = to_torchtitan(plan)
    assert 'mode = "selective"' in tt.text and 'selective_ac_option = "op"' in tt.text
    assert not any("Korthikanti" in n for n in tt.notes)       # torchtitan's own policy
    with pytest.raises(NotExpressibleError, match="op-level recomputation"):
        megatron_args(plan)
    with pytest.raises(NotExpressibleError, match="op-level recomputation"):
        deepspeed_config(make_plan(dp=2, checkpoint="op", device_type="cuda",
                                   precision={"params": "float32", "compute": "bfloat16",
                                              "reduce": "float32"}))


STEPS = 8
OPTIONS = ["--lr", "0.003", "--warmup-steps", "1", "--log-every", "12"]


@pytest.mark.multiproc
def test_op_level_loss_parity_two_ranks(tmp_path):
    """Two gloo ranks under op-level recomputation (data parallel; TP with sequence
    parallelism) train like one process without recomputation: losses within 1e-5."""
    from engine.launch import run_local

    path = make_plan().save(tmp_path / "ref.json")
    assert run_local(path, steps=STEPS, out_dir=tmp_path / "ref", extra_args=OPTIONS) == 0
    ref = losses(tmp_path / "ref")
    plans = {"dp2_op": make_plan(dp=2, checkpoint="op"),
             "tp2_sp_op": make_plan(tp=2, sp=True, checkpoint="op")}
    proc = run_plans(2, tmp_path, plans, steps=STEPS, extra=OPTIONS)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-8000:]
    for name in plans:
        diff = max_rel_diff(losses(tmp_path / name), ref)
        print(f"parity {name}: max relative loss difference {diff:.2e}")
        assert diff <= 1e-5, name


def test_the_grid_enumerates_op_only_when_asked(llama, capsys, tmp_path):
    """The uniform grid prices op-level configurations when its space names the mode
    (``autoplan plan --op-recompute``): more configurations, a plan never slower."""
    import json

    from autoplan.api import plan_problem
    from autoplan.cli import main
    from autoplan.planner.grid.uniform import SearchSpace

    base, res = plan_problem(llama, planner="uniform", top_k=0)
    wider, res_op = plan_problem(llama, planner="uniform", top_k=0,
                                 space=SearchSpace(checkpoint=SearchSpace.checkpoint + ("op",)))
    assert "op" not in SearchSpace.checkpoint and res_op.evaluated > res.evaluated
    assert wider.prediction.step_time_s <= base.prediction.step_time_s * (1 + 1e-12)
    argv = ["plan", "gpt", "--layers", "2", "--hidden", "256", "--heads", "4", "--vocab", "1024",
            "--seq-len", "256", "--cluster", "dgx-a100", "--global-batch", "16",
            "--planner", "uniform", "--op-recompute", "--json", "-o", str(tmp_path / "p.json")]
    assert main(argv) == 0
    assert json.loads(capsys.readouterr().out)["prediction"]["fits"] is True


def test_the_search_recomputes_op_by_op_per_stage(llama):
    """The search's stages take op-level recomputation when its options ask for it (as
    ``autoplan plan --op-recompute`` does): priced between none and full, written as an
    'op' plan whose recomputed stages name their blocks, never beside another mode."""
    from autoplan.planner.search.search import SearchOptions, search
    from autoplan.planner.search.to_plan import build_search_plan

    p = llama
    # stages that must recompute (no 'none' in the options) choose between full and
    # op-level, and op-level recomputes less
    only = search(p.spec, p.graph, p.cluster, global_batch=16,
                  options=SearchOptions(checkpoint=(True, "op"), micro_batches=(2,),
                                        max_stages=2))
    best = only.ranked[0]
    assert all(st.op_level and st.recompute == "op" for st in best.choice.stages)
    assert best.prediction.time.recompute > 0
    for c in only.ranked:
        assert len({st.recompute for st in c.choice.stages} - {"none"}) <= 1
    plan = build_search_plan(only, p.spec, p.cluster, global_batch=16,
                             seq_len=p.seq_len, precision=p.precision_dict, top_k=0)
    assert plan.parallel.checkpoint == "op" and "op-ckpt" in plan.planner["label"]
    assert all(st.checkpoint_layers for st in plan.stages if any(
        n.startswith("blocks.") for n in st.layer_names))


def test_op_level_stages_hold_less_than_none_and_more_than_full(llama):
    """One uniform configuration written as the search's stages (TP 2 with sequence
    parallelism): op-level keeps less than no recomputation and more than full, and
    recomputes less than full."""
    from autoplan.planner.search.compose import analyse
    from autoplan.planner.search.costs import CostModel
    from autoplan.planner.search.evaluate import Evaluator
    from autoplan.planner.search.megatron import uniform_choice

    ev = Evaluator(CostModel(llama.graph, llama.cluster), analyse(llama.spec, llama.graph))
    pred = {ck: ev.predict(uniform_choice(ev, ParallelConfig(
        dp=4, tp=2, sequence_parallel=True, micro_batch=2, num_micro_batches=2,
        checkpoint=ck))) for ck in ("none", "op", "full")}
    act = {k: v.memory.activations for k, v in pred.items()}
    rec = {k: v.time.recompute for k, v in pred.items()}
    assert act["full"] < act["op"] < act["none"]
    assert 0 == rec["none"] < rec["op"] < rec["full"]
