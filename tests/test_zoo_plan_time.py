"""Bounded planning time off the GPT path (issue 15, item 7): what keeps the zoo's plans
under a minute of CPU time. The timings themselves are ``benchmarks/model_zoo.py``'s
``plan_s`` columns, not asserted here."""

from __future__ import annotations

import pytest

from autoplan.graph import OpNode, TensorMeta
from autoplan.profile.signature import Signature, shard_candidates
from autoplan.profile.store import OpEntry, OpProfile

T = TensorMeta


def _node(op: str, ins, outs, role="replicated", flops=0.0) -> OpNode:
    return OpNode(name=op, op=op, inputs=[], input_meta=list(ins), output_meta=list(outs),
                  fwd_flops=flops, bwd_flops=2 * flops, bytes_read=0, bytes_written=0,
                  tp_role=role)


def _mm_profile() -> OpProfile:
    node = _node("aten.mm.default", [T((64, 64), "float32"), T((64, 64), "float32")],
                 [T((64, 64), "float32")])
    entry = OpEntry(op=node.op, dtype="float32", inputs=tuple(node.input_meta),
                    outputs=tuple(node.output_meta), fwd_s=1e-4, bwd_s=2e-4, repeats=5,
                    flops=2.0 * 64 ** 3, bytes=3 * 64 * 64 * 4, source="s")
    return OpProfile(device="cpu-test", entries={entry.key: entry},
                     sources={"s": {"kind": "measured"}})


CONV = _node("aten.convolution.default",
             [T((8, 64, 56, 56), "float32"), T((128, 64, 3, 3), "float32")],
             [T((8, 128, 28, 28), "float32")], role="column", flops=2.0 * 8 * 128 * 28 * 28 * 576)


@pytest.mark.parametrize("t", [1, 2])
def test_unmeasured_op_is_roofline_without_a_replay(monkeypatch, t):
    """A convolution on a profile with no convolution: the roofline at once. Before, every
    shard candidate was reconstructed first (up to 4096 meta calls each, ~5 s per
    convolution signature and TP degree), which kept ResNet-50 on 2 CPU ranks planning for
    over 15 minutes."""
    import autoplan.profile.lookup as lookup
    import autoplan.profile.replay as replay

    def no_replay(*args, **kwargs):
        raise AssertionError("replayed an op the profile never measured")

    monkeypatch.setattr(replay, "sharded_call", no_replay)      # lookup imports it on use
    table = lookup.OpTimeTable(_mm_profile())
    found = table.explain(CONV, t)
    assert (found.fwd_s, found.bwd_s, found.source) == (None, None, "roofline")
    want = Signature.of(CONV) if t == 1 else next(iter(shard_candidates(
        Signature.of(CONV), "column", t)))
    assert found.key == want.key
    assert table.counts == {"roofline": 1}


def test_measured_op_still_replays_its_shard():
    """The short cut leaves measured ops alone: an mm of the profile's op is still looked up
    at its reconstructed TP shard (exact here)."""
    from autoplan.profile.lookup import OpTimeTable

    table = OpTimeTable(_mm_profile())
    node = _node("aten.mm.default", [T((64, 128), "float32"), T((128, 64), "float32")],
                 [T((64, 64), "float32")], role="row", flops=2.0 * 64 * 128 * 64)
    assert table.lookup(node, shard=2) == (1e-4, 2e-4)
    assert table.last_source == "exact"


def _library(budget_s: float, monkeypatch) -> tuple[list[float], object]:
    import autoplan.planner.search.library as library
    from autoplan.api import prepare
    from autoplan.models import resolve
    from autoplan.planner.search.compose import analyse
    from autoplan.planner.search.costs import CostModel
    from autoplan.planner.search.evaluate import Evaluator

    limits: list[float] = []
    real = library.solve_weights

    def spy(problem, weights, *, time_limit_s, backend):
        def recorded() -> float:       # the limit each solve is given, in order
            limits.append(time_limit_s())
            return limits[-1]
        return real(problem, weights, time_limit_s=recorded, backend=backend)

    monkeypatch.setattr(library, "solve_weights", spy)
    spec = resolve("gpt", vocab_size=512, hidden=128, layers=2, heads=4, seq_len=64)
    problem = prepare(spec, "dgx-a100", global_batch=16, precision="mixed")
    ms = analyse(problem.spec, problem.graph)
    ev = Evaluator(CostModel(problem.graph, problem.cluster, precision="mixed"), ms)
    lib = library.build_library(ev, ms, problem.cluster.world_size, 16, time_limit_s=30.0,
                                budget_s=budget_s)
    return limits, lib


def test_library_solves_share_a_cpu_budget(monkeypatch):
    """Solve i of n may take min(time_limit_s, left / (n - i)), at least MIN_SOLVE_S: the
    first gets budget / n; with the budget spent, each gets the floor; a budget that does
    not bind leaves every solve its time limit."""
    from autoplan.planner.search.library import MIN_SOLVE_S

    limits, lib = _library(60.0, monkeypatch)
    n = len(limits)
    assert n >= 4
    assert limits[0] == pytest.approx(60.0 / n)
    assert all(MIN_SOLVE_S <= lim <= 30.0 for lim in limits)
    assert all(later >= limits[0] - 1e-9 for later in limits[1:])   # quick solves leave more
    assert [s["time_limit_s"] for s in lib.solves] == limits[:len(lib.solves)]
    assert lib.layouts                       # a small model solves inside its share
    spent, lib = _library(0.0, monkeypatch)
    # with the budget spent, the solves that would only refine a library that already has
    # a layout of every kind are skipped (the first solve's weights share one build)
    assert spent == [MIN_SOLVE_S] * len(spent) and len(spent) < n
    assert lib.layouts and len(lib.skipped) >= n - len(spent)
    roomy, _ = _library(1e6, monkeypatch)
    assert roomy == [30.0] * len(roomy)


def test_a_search_that_cannot_model_the_graph_gives_the_grids_best(monkeypatch):
    """Every row plans: when the search cannot model the graph (nn.Transformer in bf16 at
    batch 1 re-runs at the probe batch with other ops, planner/record.py's PlanError), the
    default planner returns the uniform grid's best and says why, instead of failing."""
    import autoplan
    import autoplan.planner.search.search as search_module
    from autoplan.errors import PlanError
    from autoplan.models import resolve

    def cannot(*args, **kwargs):
        raise PlanError("re-running the model at batch 4 matched only 1061 of the 1225 "
                        "traced ops")

    monkeypatch.setattr(search_module, "search", cannot)
    spec = resolve("gpt", vocab_size=512, hidden=128, layers=2, heads=4, seq_len=64)
    plan = autoplan.optimize(spec, "dgx-a100", global_batch=16)
    assert plan.planner["name"] == "uniform"
    assert plan.planner["note"].startswith("the search could not run (re-running the model")
    grid = autoplan.optimize(spec, "dgx-a100", global_batch=16, planner="uniform")
    assert plan.parallel == grid.parallel


def test_the_search_re_runs_float_inputs_in_the_compute_dtype():
    """planner/record.py re-runs the forward at the probe batch: float inputs (pixels) go
    in the compute dtype as the tracer's did, else a bf16 convolution gets a float32 image
    ("Input type (float) and bias type (BFloat16)": timm ConvNeXt and torchvision ViT-B/16
    on 16 GPUs)."""
    import torch

    from autoplan.api import prepare
    from autoplan.planner.search.record import record_layers

    from user_model import TinyConvClassifier as Tiny

    batch = Tiny.example_inputs()
    problem = prepare(Tiny(), "dgx-a100", global_batch=8, example_inputs=batch)
    assert problem.graph.dtype == "bfloat16"
    rec = record_layers(problem.spec, problem.graph, list(range(len(problem.graph.layers))))
    convs = [op for ops in rec.ops.values() for op in ops if "convolution" in op.name
             or "convolution" in str(op.func)]
    assert convs and all(ref.dtype == torch.bfloat16 for op in convs for ref in op.outputs)
