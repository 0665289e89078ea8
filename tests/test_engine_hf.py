"""Hugging Face causal LMs through the engine (issue #6): trace, plan, run, loss parity.

Tiny GPT-2 (eager attention; tied embeddings as GPT-2 ships, and untied for pipelining),
Llama (sdpa, grouped-query attention) and Qwen2 (eager, q/k/v biases, a sliding-window layer)
built offline from their config classes, dropout 0, fp32, 10 steps. Each layout's per-step
losses must match a single-process run of the same model to 1e-4 relative at every step.
Plans come from the planner's builder over the tracer's graph (``tests/engine_helpers.py``);
the references share one 1-rank launch and the layouts of one world size share one torchrun
launch.

A tied GPT-2 killed mid-run resumes from its checkpoint to the same losses.

Without processes: every stage adapter composes to the model's own forward, stages start
from the whole model's weights, and :func:`autoplan.models.capabilities.capabilities` says
exactly what :mod:`engine.validate` accepts.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput,
                                               RowwiseParallel, SequenceParallel)

from autoplan.errors import PlanError
from autoplan.models.capabilities import capabilities
from autoplan.models.registry import ModelSpec, build_model, resolve
from engine import model as model_lib
from engine.tensor_parallel import tp_plan
from engine.validate import check_engine_support
from engine_helpers import TINY, losses, make_plan, max_rel_diff, run_plans, torchrun

STEPS = 10
OPTIONS = ["--lr", "0.003", "--warmup-steps", "1", "--log-every", "10"]
TOL = 1e-4

_GPT2 = dict(n_layer=4, n_embd=64, n_head=4, vocab_size=128, n_positions=64, resid_pdrop=0.0,
             embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0,
             attn_implementation="eager")
_LLAMA = dict(num_hidden_layers=4, hidden_size=64, num_attention_heads=4,
              num_key_value_heads=2, intermediate_size=128, vocab_size=128,
              max_position_embeddings=64, attention_dropout=0.0, bos_token_id=0,
              eos_token_id=0, attn_implementation="sdpa")
_ROTARY = dict(_LLAMA, num_hidden_layers=2, attn_implementation="eager")
#: Qwen2 with q/k/v biases, a full-attention then a sliding-window layer (window 8 < seq 32)
_QWEN2 = dict(_ROTARY, use_sliding_window=True, sliding_window=8, max_window_layers=1)
SPECS = {
    "gpt2_tied": resolve("hf:gpt2", **_GPT2),                       # GPT-2 as it ships
    "gpt2": resolve("hf:gpt2", **_GPT2, tie_word_embeddings=False),
    "llama": resolve("hf:llama", **_LLAMA),
    "qwen2": resolve("hf:qwen2", **_QWEN2),
}
#: every registered family, for the adapter checks (Mistral: a sliding window shorter than
#: the sequence)
ADAPTER_SPECS = {
    "gpt2": SPECS["gpt2"],
    "llama": resolve("hf:llama", **_ROTARY),
    "mistral": resolve("hf:mistral", **_ROTARY, sliding_window=8),
    "qwen2": SPECS["qwen2"],
    # mixtures of experts: capacity E / k, so no token is dropped (the model's own forward
    # routes one more token per sequence, which would move a capacity boundary)
    "mixtral": resolve("hf:mixtral", **_ROTARY, num_local_experts=4, num_experts_per_tok=2,
                       capacity_factor=2.0),
    "qwen3_moe": resolve("hf:qwen3_moe", **_ROTARY, num_experts=4, num_experts_per_tok=2,
                         moe_intermediate_size=32, capacity_factor=2.0),
}

WORLD2 = {
    "gpt2_tied_dp2_zero2": ("gpt2_tied", dict(dp=2, zero=2, num_micro_batches=2)),
    "gpt2_dp2_zero3_ckpt": ("gpt2", dict(dp=2, zero=3, checkpoint=True)),
    "gpt2_pp2_1f1b": ("gpt2", dict(pp=2, schedule="1f1b", num_micro_batches=4)),
    "llama_dp2_zero3_ckpt": ("llama", dict(dp=2, zero=3, checkpoint=True)),
    "llama_pp2_1f1b": ("llama", dict(pp=2, schedule="1f1b", num_micro_batches=4)),
    "llama_tp2": ("llama", dict(tp=2)),
    "llama_tp2_sp": ("llama", dict(tp=2, sp=True)),
    "qwen2_tp2_sp": ("qwen2", dict(tp=2, sp=True)),
}
WORLD4 = {
    "llama_dp2_tp2_sp": ("llama", dict(dp=2, tp=2, sp=True, zero=3)),
    "llama_pp2_tp2_sp": ("llama", dict(pp=2, tp=2, sp=True, num_micro_batches=2)),
    # without SP: sequence slices sent between stages, all-gathered there (scatter/gather)
    "llama_pp2_tp2": ("llama", dict(pp=2, tp=2, num_micro_batches=2)),
}


def _plans(layouts):
    return {name: make_plan(spec=SPECS[model], **kw) for name, (model, kw) in layouts.items()}


def _launch(nproc, out, plans):
    proc = run_plans(nproc, out, plans, steps=STEPS, extra=OPTIONS)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-8000:]
    return out


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """Single-process runs of each model, in one launch."""
    out = _launch(1, tmp_path_factory.mktemp("hf_reference"),
                  {name: make_plan(spec=spec) for name, spec in SPECS.items()})
    refs = {name: losses(out / name) for name in SPECS}
    for ref in refs.values():
        assert sorted(ref) == list(range(1, STEPS + 1))
        assert ref[STEPS] < ref[1] - 0.1          # it learns: parity is not trivial
    return refs


@pytest.fixture(scope="module")
def world2(tmp_path_factory):
    return _launch(2, tmp_path_factory.mktemp("hf_world2"), _plans(WORLD2))


@pytest.fixture(scope="module")
def world4(tmp_path_factory):
    return _launch(4, tmp_path_factory.mktemp("hf_world4"), _plans(WORLD4))


def _check(run_dir, ref, name):
    got = losses(run_dir / name)
    diff = max_rel_diff(got, ref)
    print(f"parity {name}: max relative loss difference {diff:.2e}")
    assert diff <= TOL, {k: (got[k], ref[k]) for k in ref}


@pytest.mark.multiproc
@pytest.mark.parametrize("name", sorted(WORLD2))
def test_hf_parity_two_ranks(world2, reference, name):
    _check(world2, reference[WORLD2[name][0]], name)


@pytest.mark.multiproc
@pytest.mark.parametrize("name", sorted(WORLD4))
def test_hf_parity_four_ranks(world4, reference, name):
    _check(world4, reference[WORLD4[name][0]], name)


@pytest.mark.multiproc
def test_hf_kill_and_resume(world2, tmp_path):
    """Tied GPT-2 under ZeRO-2, SIGKILLed after step 6 and resumed from its DCP checkpoint
    (one weight under two names, FSDP-sharded), reproduces world2's uninterrupted run."""
    name = "gpt2_tied_dp2_zero2"
    model, kw = WORLD2[name]
    plan = make_plan(spec=SPECS[model], **kw).save(tmp_path / "plan.json")

    def run(*extra):
        return torchrun(2, ["-m", "engine.run", str(plan), "--out", str(tmp_path / "run"),
                            "--steps", str(STEPS), *OPTIONS, "--memory", "off",
                            "--checkpoint-every", "3", *extra])

    assert run("--kill-after-step", "6").returncode != 0
    resumed = run("--resume")
    assert resumed.returncode == 0, resumed.stderr[-4000:]
    assert "resumed from" in resumed.stdout and "step_00000006" in resumed.stdout
    want, got = losses(world2 / name), losses(tmp_path / "run")
    assert sorted(got) == list(range(1, STEPS + 1))
    for step in range(7, STEPS + 1):
        assert got[step] == pytest.approx(want[step], rel=1e-6, abs=0), step


# ---- stage adapters (no processes) --------------------------------------------------------

def _materialized(spec, names, seed=0):
    chunk = model_lib.build_chunk(spec, names)
    model_lib.materialize(chunk, model_lib.initializer(spec), torch.device("cpu"), seed)
    return chunk.eval()


@pytest.mark.parametrize("model_type", sorted(ADAPTER_SPECS))
def test_stages_compose_to_the_models_own_forward(model_type):
    """First stage then last stage == the whole chunk == transformers' forward and loss."""
    spec = ADAPTER_SPECS[model_type]
    names = model_lib.model_info(spec).layer_names()
    whole = _materialized(spec, names)
    first, last = _materialized(spec, names[:2]), _materialized(spec, names[2:])
    reference = build_model(spec, device="cpu").eval()
    reference.load_state_dict(whole.state_dict(), strict=True)
    tokens = torch.randint(0, 128, (2, 17), generator=torch.Generator().manual_seed(0))
    x, y = tokens[:, :-1], tokens[:, 1:]
    with torch.no_grad():
        hidden = first(x)
        assert hidden.shape == (2, 16, 64)
        torch.testing.assert_close(last(hidden, y), whole(x, y), rtol=0, atol=0)
        # transformers shifts labels=input_ids itself, over the one-token-longer sequence
        torch.testing.assert_close(whole(x, y), reference(tokens, tokens), rtol=1e-5, atol=0)


def test_stages_start_from_the_whole_models_weights():
    spec = SPECS["llama"]
    names = model_lib.model_info(spec).layer_names()
    whole = dict(_materialized(spec, names, seed=3).named_parameters())
    stage = _materialized(spec, ["model.layers.2", "model.layers.3", "<post>"], seed=3)
    assert {n for n, _ in stage.named_parameters()} == {
        n for n in whole if n.startswith(("model.layers.2.", "model.layers.3.", "model.norm",
                                          "lm_head"))}
    for name, p in stage.named_parameters():
        torch.testing.assert_close(p, whole[name], rtol=0, atol=0)
    assert torch.equal(stage.model.norm.weight, torch.ones(64))
    assert 0.015 < whole["model.layers.0.mlp.up_proj.weight"].std() < 0.025
    # the rotary tables are recomputed from the config, as transformers does
    reference = build_model(spec, device="cpu")
    torch.testing.assert_close(stage.model.rotary_emb.inv_freq,
                               reference.model.rotary_emb.inv_freq, rtol=0, atol=0)
    other = _materialized(spec, ["model.layers.2", "model.layers.3", "<post>"], seed=4)
    assert not torch.equal(other.lm_head.weight, stage.lm_head.weight)
    gpt2 = dict(_materialized(SPECS["gpt2"], ["<pre>", "transformer.h.0"]).named_parameters())
    # GPT-2's residual projections start smaller (std / sqrt(2 * layers)); biases at zero
    assert gpt2["transformer.h.0.attn.c_proj.weight"].std() < \
        0.6 * gpt2["transformer.h.0.attn.c_attn.weight"].std()
    assert not gpt2["transformer.h.0.attn.c_attn.bias"].any()


def test_tied_embeddings_stay_tied_and_in_one_stage():
    for spec, head, emb in ((SPECS["gpt2_tied"], "lm_head", "transformer.wte"),
                            (_CAP_SPECS["builtin_gpt_tied"], "head", "tok_emb")):
        chunk = _materialized(spec, model_lib.model_info(spec).layer_names())
        assert chunk.get_submodule(head).weight is chunk.get_submodule(emb).weight
    with pytest.raises(PlanError, match="tied embeddings"):
        model_lib.build_chunk(SPECS["gpt2_tied"], ["<pre>", "transformer.h.0"])
    with pytest.raises(PlanError, match=r"model.layers.7"):
        model_lib.build_chunk(SPECS["llama"], ["model.layers.7"])


def test_tensor_parallel_styles_for_llama():
    plan = make_plan(spec=SPECS["llama"], tp=2, sp=True)
    chunk = model_lib.build_chunk(SPECS["llama"], plan.stages[0].layer_names)
    styles = tp_plan(chunk, plan.param_placements, sequence_parallel=True)
    for name in ("q_proj", "k_proj", "v_proj"):
        assert isinstance(styles[f"model.layers.1.self_attn.{name}"], ColwiseParallel)
    assert isinstance(styles["model.layers.1.mlp.gate_proj"], ColwiseParallel)
    for name in ("self_attn.o_proj", "mlp.down_proj"):
        row = styles[f"model.layers.1.{name}"]
        assert isinstance(row, RowwiseParallel) and row.output_layouts == (Shard(1),)
    assert isinstance(styles["model.layers.1.input_layernorm"], SequenceParallel)
    assert isinstance(styles["model.norm"], SequenceParallel)
    attn = styles["model.layers.1.self_attn"]             # called with hidden_states=...
    assert isinstance(attn, PrepareModuleInput)
    assert attn.input_kwarg_layouts == {"hidden_states": Shard(1)}
    assert attn.desired_input_kwarg_layouts == {"hidden_states": Replicate()}
    assert styles["model.layers.1.mlp"].input_layouts == (Shard(1),)
    first = styles["model.layers.0"]                       # the embedding output is sliced
    assert first.desired_input_layouts == (Shard(1),)
    head = styles["lm_head"]
    assert isinstance(head, ColwiseParallel) and head.input_layouts == (Shard(1),)
    # the token embedding is vocabulary parallel: its partial lookups are all-reduced
    emb = styles["model.embed_tokens"]
    assert isinstance(emb, RowwiseParallel) and emb.output_layouts == (Replicate(),)


# ---- capabilities: what the planner may propose is what the engine accepts ----------------

_CAP_SPECS = {
    "builtin_gpt": ModelSpec("builtin", "gpt", dict(TINY)),
    "builtin_gpt_tied": ModelSpec("builtin", "gpt", dict(TINY, tie_embeddings=True)),
    "llama_tied": resolve("hf:llama", **_LLAMA, tie_word_embeddings=True),
    **SPECS,
}
_LAYOUTS = {"tensor_parallel": dict(tp=2), "sequence_parallel": dict(tp=2, sp=True),
            "pipeline": dict(pp=2, num_micro_batches=2)}


@pytest.mark.parametrize("name", sorted(_CAP_SPECS))
def test_capabilities_match_what_the_engine_accepts(name):
    spec = _CAP_SPECS[name]
    caps = capabilities(spec)
    assert caps.runs
    for flag, layout in _LAYOUTS.items():
        plan = make_plan(spec=spec, **layout)
        if getattr(caps, flag):
            check_engine_support(plan, spec, "p.json")
        else:
            with pytest.raises(PlanError) as exc:
                check_engine_support(plan, spec, "p.json")
            assert caps.reason in str(exc.value) and str(exc.value).startswith("plan p.json")
    assert (caps.reason == "") == (caps.tensor_parallel and caps.pipeline)
    check_engine_support(make_plan(spec=spec, dp=2, zero=3), spec, "p.json")
    plan = make_plan(spec=spec, dp=2, cp=2)                    # context parallelism
    if caps.context_parallel:
        check_engine_support(plan, spec, "p.json")
    else:
        with pytest.raises(PlanError) as exc:
            check_engine_support(plan, spec, "p.json")
        assert caps.cp_reason and caps.cp_reason in str(exc.value)
    # sizes: the Llama has 2 KV heads, the built-in GPT 4 heads
    plan = make_plan(spec=spec, tp=4)
    if caps.allows_tp(4):
        check_engine_support(plan, spec, "p.json")
    else:
        with pytest.raises(PlanError, match="tp=4"):
            check_engine_support(plan, spec, "p.json")
    assert caps.allows_tp(4) == (name == "builtin_gpt")


def test_gpt2_tensor_parallelism_is_refused_with_the_reason():
    caps = capabilities(SPECS["gpt2"])
    assert (caps.tensor_parallel, caps.sequence_parallel, caps.pipeline) == (False, False, True)
    plan = make_plan(spec=SPECS["gpt2"], tp=2)
    # the planner shards the Conv1D weights (in, out) on the right dims ...
    assert plan.param_placements["transformer.h.0.attn.c_attn.weight"]["tp"] == "Shard(1)"
    assert plan.param_placements["transformer.h.0.attn.c_proj.weight"]["tp"] == "Shard(0)"
    # ... but a column shard of the fused q|k|v output mixes heads of q, k and v
    with pytest.raises(PlanError, match=r"asks for tp=2.*fused Conv1D \(c_attn\)"):
        check_engine_support(plan, SPECS["gpt2"], "p.json")


def test_capabilities_of_models_without_an_adapter_are_the_generic_runtimes():
    for spec in (ModelSpec("builtin", "mlp", {}),
                 ModelSpec("hf", "opt", {"tie_word_embeddings": False}),
                 ModelSpec("import", "pkg.mod:fn", {})):      # not built: checked at launch
        caps = capabilities(spec)
        assert caps.runs and "generic runtime" in caps.reason
        assert caps.tensor_parallel and caps.pipeline and not caps.sequence_parallel
        assert not caps.context_parallel and "generic runtime" in caps.cp_reason
    tied = capabilities(ModelSpec("hf", "opt", {}))       # OPT ties its LM head
    assert not tied.pipeline and "a weight is used in two places" in tied.reason
    with pytest.raises(PlanError, match=r"no stage adapter for Hugging Face model_type 'opt'"):
        model_lib.check_supported(ModelSpec("hf", "opt", {}))
    assert dataclasses.asdict(capabilities(_CAP_SPECS["builtin_gpt"])) == dict(
        tensor_parallel=True, sequence_parallel=True, pipeline=True, reason="", runs=True,
        tp_divisors=(("heads", 4), ("kv_heads", 4), ("ffn", 128), ("hidden", 32)),
        context_parallel=True, cp_reason="")
    assert capabilities(SPECS["llama"]).tp_divisors == (
        ("num_attention_heads", 4), ("num_key_value_heads", 2), ("intermediate_size", 128))
