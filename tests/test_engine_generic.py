"""The generic runtime (issue 15): models no adapter knows, run from the plan alone.

Multi-process (gloo, fp32, dropout 0, tiny configs, 4 steps): Hugging Face OPT (causal LM),
BERT (masked LM) and T5 (encoder-decoder) and a plain user ``nn.Module``, each planned by
the planner's builder over the tracer's graph (``tests/engine_helpers.py``), run under data
parallelism / ZeRO, tensor parallelism and two pipeline stages on 2 ranks; every step's loss
must match a one-process run of the same model to 1e-5 relative. All references share one
1-rank launch and all layouts one 2-rank launch. A user's own training loop around
``autoplan.parallelize`` matches a plain single-process PyTorch loop (no autoplan at all).

Without processes: which runtime a plan gets, what the generic runtime refuses and why, and
that the capability module the planner imports pulls in neither ``engine`` nor
``torch.distributed``.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from autoplan.capability import ADAPTED_HF, generic_gap, runtime_for
from autoplan.errors import PlanError
from autoplan.models.registry import ModelSpec, resolve
from engine.generic import LossModule
from engine_helpers import (REPO, losses, make_plan, max_rel_diff, run_plans, torchrun,
                            user_batches, user_module)

STEPS = 4
TOL = 1e-5
OPTIONS = ["--lr", "0.001", "--warmup-steps", "1", "--log-every", "10"]
_OPT = dict(num_hidden_layers=2, hidden_size=32, num_attention_heads=4, ffn_dim=64,
            vocab_size=128, max_position_embeddings=64, word_embed_proj_dim=32, dropout=0.0,
            attention_dropout=0.0)
SPECS = {
    "opt": resolve("hf:opt", **_OPT),                               # tied, as OPT ships
    "opt_untied": resolve("hf:opt", **_OPT, tie_word_embeddings=False),
    "bert": ModelSpec("import", "tests.engine_helpers:bert_mlm", {}),      # tied decoder
    "bert_untied": ModelSpec("import", "tests.engine_helpers:bert_mlm", {"tied": False}),
    "t5": ModelSpec("import", "tests.engine_helpers:t5_seq2seq", {}),
    "user": ModelSpec("import", "tests.user_model:build", {"width": 32, "depth": 4}),
}
_BASE = dict(global_batch=4, seq_len=16)
WORLD2 = {
    "opt_dp2_zero3": ("opt", dict(dp=2, zero=3, num_micro_batches=2)),
    "opt_tp2": ("opt", dict(tp=2)),
    "opt_untied_pp2_1f1b": ("opt_untied", dict(pp=2, num_micro_batches=2)),
    "bert_dp2_zero1": ("bert", dict(dp=2, zero=1)),
    "bert_tp2": ("bert", dict(tp=2)),
    "bert_untied_pp2_gpipe": ("bert_untied", dict(pp=2, schedule="gpipe",
                                                  num_micro_batches=2)),
    "t5_dp2_zero2": ("t5", dict(dp=2, zero=2)),
    "user_dp2_zero0_ckpt": ("user", dict(dp=2, zero=0, checkpoint=True)),
    "user_tp2": ("user", dict(tp=2)),
    "user_pp2_1f1b": ("user", dict(pp=2, num_micro_batches=2)),
}


def _plan(model: str, **layout):
    return make_plan(spec=SPECS[model], **{**_BASE, **layout})


# ---- without processes -------------------------------------------------------------------

def test_runtime_choice_is_data():
    plan = _plan("user")
    assert runtime_for(SPECS["user"], plan) == "generic"
    assert runtime_for(SPECS["opt"], plan) == "generic"
    assert runtime_for(resolve("hf:llama", num_hidden_layers=1), plan) == "adapted"
    assert runtime_for(ModelSpec("builtin", "gpt", {}), plan) == "adapted"
    from engine.hf_arch import ARCHITECTURES
    from engine.runtime import RUNTIMES, select

    assert sorted(ARCHITECTURES) == sorted(ADAPTED_HF)
    gpt = make_plan()                                   # the built-in GPT: uniform runtime
    assert select(gpt, ModelSpec.from_dict(gpt.model)) is RUNTIMES["uniform"]
    assert select(plan, SPECS["user"]) is RUNTIMES["generic"]


@pytest.mark.parametrize("model", ["opt", "t5", "user"])
def test_the_planners_plan_is_one_the_generic_runtime_runs(model):
    # the search once returned stages beginning with <post>, weights sharded over dp without
    # ZeRO-3 and (balanced pipelines ignoring max_stages) a tied model split over stages;
    # OPT ties its LM head, T5 shares its embedding between encoder and decoder
    from autoplan.api import optimize

    import dataclasses

    spec = dataclasses.replace(SPECS[model], trusted=True)     # the test's own module
    plan = optimize(spec, "local-cpu", global_batch=8, seq_len=16)
    assert generic_gap(plan) is None, plan.planner
    if model in ("opt", "t5"):                 # a weight used twice: no pipeline stages
        assert plan.parallel.pp == 1
    assert all(st.layer_names[0] not in ("<pre>", "<post>") for st in plan.stages[1:])


def test_capability_module_imports_no_engine():
    code = ("import sys, autoplan.capability; bad = sorted(m for m in sys.modules if "
            "m == 'engine' or m.startswith(('engine.', 'torch.distributed'))); "
            "assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=REPO)


def test_generic_gap_names_the_field():
    assert generic_gap(_plan("user", tp=2)) is None
    assert generic_gap(_plan("user", pp=2, num_micro_batches=2)) is None
    assert "sequence_parallel" in generic_gap(_plan("user", tp=2, sp=True))
    assert "pipeline stages" in generic_gap(make_plan(spec=SPECS["user"], tp=2, pp=2,
                                                      global_batch=4))
    assert "checkpoint_layers" in generic_gap(_plan("user", pp=2, checkpoint=True))
    # labels read by the last stage skip the stages between, which the multi-stage
    # schedules refuse (torchvision ResNet-18 as 2 x 4 chunks: "only supports
    # adjacent-stage communication")
    assert "interleaved" in generic_gap(_plan("user", pp=2, num_micro_batches=2,
                                              schedule="interleaved_1f1b", virtual_stages=2))


def test_planners_propose_no_interleaved_schedule_for_the_generic_runtime():
    """Both planners keep to what the generic runtime runs: the grid's space and the
    search's options lose interleaved 1F1B for a model without an adapter."""
    from autoplan.api import runnable_space
    from autoplan.planner.grid.uniform import SearchSpace

    space = runnable_space(SPECS["user"], SearchSpace())
    assert "interleaved_1f1b" not in space.schedules and "1f1b" in space.schedules
    assert "interleaved_1f1b" in runnable_space(resolve("gpt-small"), SearchSpace()).schedules


def test_no_tensor_parallelism_of_convolutions_on_the_generic_runtime(monkeypatch):
    """DTensor's convolution backward asserts its input is a DTensor (it handles spatially
    sharded inputs only): a 2-rank tp2 plan of torchvision ResNet-18 failed in backward.
    The grid keeps tp = 1 for a traced graph with convolutions; the runtime's TP errors in
    backward are PlanErrors naming the field."""
    from autoplan.api import prepare, runnable_space
    from autoplan.planner.grid.uniform import SearchSpace

    from user_model import TinyConvClassifier as Tiny

    batch = Tiny.example_inputs()
    problem = prepare(Tiny(), "local-cpu", global_batch=8, example_inputs=batch)
    assert runnable_space(problem.spec, SearchSpace(), problem.graph).tp == (1,)
    assert runnable_space(problem.spec, SearchSpace()).tp is None
    from autoplan.trust import TRUST_ENV

    monkeypatch.setenv(TRUST_ENV, "1")            # the suite's own module
    user = prepare(SPECS["user"], "local-cpu", global_batch=8)
    assert runnable_space(user.spec, SearchSpace(), user.graph).tp is None


def test_the_search_gets_no_virtual_stages_for_the_generic_runtime(monkeypatch):
    import autoplan
    import autoplan.planner.search.search as search_module

    seen = []

    def spy(*args, options, **kwargs):
        seen.append(options)
        raise PlanError("stop here: only the options are checked")

    monkeypatch.setattr(search_module, "search", spy)
    from autoplan.trust import TRUST_ENV

    monkeypatch.setenv(TRUST_ENV, "1")
    autoplan.optimize(SPECS["user"], "local-cpu", global_batch=8)
    assert seen and seen[0].virtual_stages == ()


def test_check_all_picks_the_generic_runtime_and_refuses_with_the_reason(tmp_path,
                                                                        monkeypatch):
    from autoplan.trust import TRUST_ENV

    monkeypatch.setenv(TRUST_ENV, "1")          # the plan names the suite's own module
    from engine.runtime import check_all, select

    plan = _plan("user", tp=2, sp=True)
    path = plan.save(tmp_path / "p.json")
    assert select(plan, SPECS["user"]).name == "generic"
    with pytest.raises(PlanError, match=r"plan .*p\.json: field 'parallel.sequence_parallel'"):
        check_all(plan, str(path), world_size=2)
    check_all(_plan("user", tp=2), str(path), world_size=2)


@pytest.mark.parametrize("factory, split", [("bert_mlm", "model.bert.encoder.layer.1"),
                                              ("t5_seq2seq", "model.decoder.block.0")])
def test_weights_tied_across_pipeline_stages_are_refused(factory, split):
    """BERT's decoder is its word embedding; T5's encoder, decoder and head share one
    embedding: two stages would train two copies apart."""
    from torch.distributed.pipelining import SplitPoint, pipeline

    import engine_helpers
    from engine.generic import _check_tied_across_stages, _FirstStageInputs

    model = getattr(engine_helpers, factory)()
    ids = torch.randint(0, 128, (2, 16))
    pipe = pipeline(_FirstStageInputs(model), mb_args=(ids, ids),
                    split_spec={f"module.{split}": SplitPoint.BEGINNING})
    with pytest.raises(PlanError, match=r"field 'stages': the tied weights .* fall in "
                                        r"pipeline stages \[0, 1\]"):
        _check_tied_across_stages(model, pipe)
    if factory == "bert_mlm":
        untied = engine_helpers.bert_mlm(tied=False)
        pipe = pipeline(_FirstStageInputs(untied), mb_args=(ids, ids),
                        split_spec={f"module.{split}": SplitPoint.BEGINNING})
        _check_tied_across_stages(untied, pipe)


def test_loss_module_finds_the_loss():
    lin = torch.nn.Linear(3, 2)
    x, y = torch.randn(4, 3), torch.tensor([0, 1, 1, 0])
    ce = LossModule(lin, torch.nn.functional.cross_entropy)
    assert torch.equal(ce(x, y), torch.nn.functional.cross_entropy(lin(x), y))

    class WithLoss(torch.nn.Module):
        def forward(self, x):
            return {"loss": x.sum()}

    assert LossModule(WithLoss())(x) == x.sum()
    with pytest.raises(PlanError, match="not a scalar loss"):
        LossModule(lin)(x)


# ---- multi-process: loss parity against one process ----------------------------------------

@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("generic")
    refs = {f"{name}_ref": _plan(name) for name in SPECS}
    done = run_plans(1, out, refs, steps=STEPS, extra=OPTIONS, timeout=400)
    assert done.returncode == 0, done.stderr[-3000:]
    plans = {name: _plan(model, **layout) for name, (model, layout) in WORLD2.items()}
    done = run_plans(2, out, plans, steps=STEPS, extra=OPTIONS, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    return out


@pytest.mark.multiproc
@pytest.mark.parametrize("name", sorted(WORLD2))
def test_generic_loss_parity(runs, name):
    model = WORLD2[name][0]
    got, ref = losses(runs / name), losses(runs / f"{model}_ref")
    assert len(got) == STEPS
    assert max_rel_diff(got, ref) <= TOL, (got, ref)


@pytest.mark.multiproc
def test_parallelize_in_a_user_training_loop(tmp_path):
    """``autoplan.parallelize`` inside the user's own loop (data parallel + ZeRO-3 with
    micro-batches, and two pipeline stages) against plain PyTorch in one process."""
    spec = SPECS["user"]
    plans = {"dp2_zero3": make_plan(spec=spec, dp=2, zero=3, num_micro_batches=2,
                                    global_batch=8),
             "pp2_1f1b": make_plan(spec=spec, pp=2, num_micro_batches=4, global_batch=8)}
    paths = [str(plan.save(tmp_path / f"{name}.json")) for name, plan in plans.items()]
    done = torchrun(2, [str(REPO / "tests" / "engine_helpers.py"), "parallelize",
                        str(tmp_path), str(STEPS), *paths], timeout=400)
    assert done.returncode == 0, done.stderr[-3000:]
    model = user_module()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ref = []
    for x, y in user_batches(8, STEPS):
        loss = model(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        ref.append(loss.item())
    for name in plans:
        got = json.loads((tmp_path / f"{name}.json").read_text())
        assert max(abs(a - b) / abs(b) for a, b in zip(got, ref)) <= TOL, (name, got, ref)
