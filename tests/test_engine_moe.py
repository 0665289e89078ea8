"""Expert and context parallelism through the engine (issue #16): plans from the planner's
builder, run by ``engine.run``'s path on 4 gloo ranks, loss parity with one process.

Three models, fp32, dropout 0, against a single-process run of the same plan's model:

* a tiny built-in MoE GPT (Llama style, 4 experts, top-2, one shared expert) with expert
  parallelism — alone, under ZeRO-3, and beside pipeline stages;
* a tiny Hugging Face Mixtral built from its config class (experts implementation
  ``"autoplan_capacity"``) with expert parallelism, with ZeRO-2 and with pipeline stages;
* a tiny Llama-style GPT at sequence 256 with context parallelism, with data and with
  tensor + sequence parallelism, keys and values all-gathered or (a plan priced for the
  ring) passed around the ring;
* the same layouts for a tiny Hugging Face Llama built from its config class (its own
  attention modules, rotary positions of each rank's chunks, the exchange registered with
  transformers' attention dispatch: ``engine.hf_arch``), the Mixtral above with
  context and expert parallelism together, and a Hugging Face GPT-2 (learned positions
  looked up for each rank's chunks) with a ring between two pipeline stages, and a
  Hugging Face Qwen2 whose second layer attends within a sliding window (masked by
  position, the window crossing the chunks' boundaries).

Capacity factor ``E / k`` = 2: no token is dropped, so one process and the sharded runs
route the same tokens (with dropping, capacity is per rank and the results differ by
design). Each layout's per-step losses must match to 1e-5 relative. A run killed after a
checkpoint resumes from its sharded expert weights to the same losses.

Without processes: the engine's checks for EP / CP plans name the field.
"""

from __future__ import annotations

from dataclasses import replace

import pytest

from autoplan.errors import ConfigError, PlanError
from autoplan.models.registry import ModelSpec, resolve
from autoplan.pricing import Pricing
from engine.validate import check_engine_support
from engine_helpers import losses, make_plan, max_rel_diff, run_plans, torchrun

STEPS = 8
OPTIONS = ["--lr", "0.003", "--warmup-steps", "1", "--log-every", "8"]
TOL = 1e-5

MOE = dict(vocab_size=128, seq_len=32, hidden=32, layers=2, heads=4, kv_heads=2,
           style="llama", ffn_hidden=64, attention="sdpa", dropout=0.0, experts=4, top_k=2,
           shared_experts=1, capacity_factor=2.0)
LONG = dict(vocab_size=128, seq_len=256, hidden=32, layers=2, heads=4, kv_heads=2,
            style="llama", ffn_hidden=64, attention="sdpa", dropout=0.0)
MIXTRAL = resolve("hf:mixtral", num_hidden_layers=2, hidden_size=32, num_attention_heads=4,
                  num_key_value_heads=2, intermediate_size=64, vocab_size=128,
                  max_position_embeddings=64, num_local_experts=4, num_experts_per_tok=2,
                  bos_token_id=0, eos_token_id=0, capacity_factor=2.0)

HF_LLAMA = resolve("hf:llama", num_hidden_layers=2, hidden_size=32, num_attention_heads=4,
                   num_key_value_heads=2, intermediate_size=64, vocab_size=128,
                   max_position_embeddings=256, bos_token_id=0, eos_token_id=0,
                   tie_word_embeddings=False)

#: GPT-2: learned positions, looked up for each rank's own chunks under CP
HF_GPT2 = resolve("hf:gpt2", n_layer=2, n_embd=32, n_head=4, vocab_size=128, n_positions=256,
                  resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0,
                  eos_token_id=0, tie_word_embeddings=False)

#: Qwen2 with a full-attention layer, then a layer with a sliding window of 48 tokens
#: (under CP over 2 ranks, chunks of 64: windows cross the chunks' boundaries)
HF_QWEN2 = resolve("hf:qwen2", num_hidden_layers=2, hidden_size=32, num_attention_heads=4,
                   num_key_value_heads=2, intermediate_size=64, vocab_size=128,
                   max_position_embeddings=256, use_sliding_window=True, sliding_window=48,
                   max_window_layers=1, bos_token_id=0, eos_token_id=0,
                   tie_word_embeddings=False)
HF_SPECS = {"hf_llama": HF_LLAMA, "hf_gpt2": HF_GPT2, "hf_qwen2": HF_QWEN2}


def _plan(model: str, cp_comm: str | None = None, **kw):
    if model == "moe":
        return make_plan(model=MOE, **kw)
    if model == "mixtral":
        return make_plan(spec=MIXTRAL, **kw)
    if model in HF_SPECS:
        plan = make_plan(spec=HF_SPECS[model], seq_len=256, global_batch=4, **kw)
    else:
        plan = make_plan(model=LONG, seq_len=256, global_batch=4, **kw)
    if cp_comm:                       # priced for (and so run with) that exchange
        plan = replace(plan, pricing=Pricing(cp_comm=cp_comm))
    return plan


WORLD4 = {
    "moe_dp4_ep4": ("moe", dict(dp=4, ep=4)),
    "moe_dp4_ep2_zero3": ("moe", dict(dp=4, ep=2, zero=3)),
    "moe_pp2_dp2_ep2_zero1": ("moe", dict(pp=2, dp=2, ep=2, zero=1, num_micro_batches=2)),
    "mixtral_dp4_ep4_zero2": ("mixtral", dict(dp=4, ep=4, zero=2, num_micro_batches=2)),
    "mixtral_pp2_dp2_ep2": ("mixtral", dict(pp=2, dp=2, ep=2, num_micro_batches=2)),
    "long_dp2_cp2": ("long", dict(dp=2, cp=2)),
    "long_cp2_tp2_sp": ("long", dict(cp=2, tp=2, sp=True)),
    "long_cp4_ring": ("long", dict(cp=4, cp_comm="ring")),
    "hf_llama_dp2_cp2": ("hf_llama", dict(dp=2, cp=2)),
    "hf_llama_cp2_tp2_sp": ("hf_llama", dict(cp=2, tp=2, sp=True)),
    "hf_llama_cp4_ring": ("hf_llama", dict(cp=4, cp_comm="ring")),
    "hf_llama_pp2_cp2_ring": ("hf_llama", dict(pp=2, cp=2, cp_comm="ring",
                                               num_micro_batches=2)),
    "hf_gpt2_pp2_cp2_ring": ("hf_gpt2", dict(pp=2, cp=2, cp_comm="ring",
                                             num_micro_batches=2)),
    "hf_qwen2_sliding_dp2_cp2_ring": ("hf_qwen2", dict(dp=2, cp=2, cp_comm="ring")),
    "mixtral_cp2_ep2_ring": ("mixtral", dict(cp=2, dp=2, ep=2, cp_comm="ring",
                                             num_micro_batches=2)),
}


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    out = tmp_path_factory.mktemp("reference")
    singles = {model: _plan(model) for model in ("moe", "mixtral", "long", *HF_SPECS)}
    done = run_plans(1, out, singles, steps=STEPS, extra=OPTIONS)          # one launch
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-8000:]
    refs = {model: losses(out / model) for model in singles}
    for ref in refs.values():
        assert sorted(ref) == list(range(1, STEPS + 1))
        assert ref[STEPS] < ref[1] - 0.1                        # it learns
    return refs


@pytest.fixture(scope="module")
def world4(tmp_path_factory):
    out = tmp_path_factory.mktemp("world4")
    plans = {name: _plan(model, **kw) for name, (model, kw) in WORLD4.items()}
    proc = run_plans(4, out, plans, steps=STEPS, extra=OPTIONS)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-8000:]
    return out


@pytest.mark.multiproc
@pytest.mark.parametrize("name", sorted(WORLD4))
def test_parity_four_ranks(world4, reference, name):
    got = losses(world4 / name)
    ref = reference[WORLD4[name][0]]
    diff = max_rel_diff(got, ref)
    print(f"parity {name}: max relative loss difference {diff:.2e}")
    assert diff <= TOL, {k: (got[k], ref[k]) for k in ref}


@pytest.mark.multiproc
def test_expert_weights_checkpoint_sharded_and_resume(world4, tmp_path):
    """Killed after step 4's checkpoint, resumed: steps 5-8 as the uninterrupted run."""
    from torch.distributed.checkpoint import FileSystemReader

    name = "moe_dp4_ep2_zero3"
    model, kw = WORLD4[name]
    plan = _plan(model, **kw).save(tmp_path / "plan.json")
    run = ["-m", "engine.run", str(plan), "--out", str(tmp_path / "run"), "--steps",
           str(STEPS), *OPTIONS, "--memory", "off", "--checkpoint-every", "4"]
    killed = torchrun(4, [*run, "--kill-after-step", "4"])
    assert killed.returncode != 0
    meta = FileSystemReader(str(tmp_path / "run" / "checkpoints" / "step_00000004")
                            ).read_metadata().state_dict_metadata
    expert = meta["model.blocks.0.mlp.gate_up"]
    assert tuple(expert.size) == (4, 128, 32)                # the whole tensor, saved by ...
    assert sorted(c.offsets[0] for c in expert.chunks) == [0, 2]   # ... its 2 expert shards
    resumed = torchrun(4, [*run, "--resume"])
    assert resumed.returncode == 0, resumed.stdout[-2000:] + resumed.stderr[-4000:]
    assert "step_00000004" in resumed.stdout
    want, got = losses(world4 / name), losses(tmp_path / "run")
    assert sorted(got) == list(range(1, STEPS + 1))
    for step in range(5, STEPS + 1):
        assert got[step] == pytest.approx(want[step], rel=1e-6, abs=0), step


@pytest.mark.parametrize("model, kw, match", [
    ("dense", dict(dp=2, ep=2), "no mixture-of-experts"),
    ("moe", dict(dp=2, ep=2, tp=2), "'parallel.tp'"),
    ("long_odd", dict(cp=4), "'seq_len'.*2 x cp = 8"),
])
def test_engine_refuses_what_it_cannot_run(model, kw, match):
    if model == "dense":
        plan, spec = make_plan(**kw), None
    elif model == "long_odd":
        cfg = dict(LONG, seq_len=36)
        plan = make_plan(model=cfg, seq_len=36, global_batch=4, **kw)
    else:
        plan = _plan(model, **kw)
    spec = ModelSpec.from_dict(plan.model)
    with pytest.raises(PlanError, match=match):
        check_engine_support(plan, spec, "p.json")


def test_cp_masks_full_and_sliding_layers_and_refuses_other_kinds():
    from types import SimpleNamespace

    from autoplan.models.capabilities import hf_cp_gap, layer_window

    mixed = SimpleNamespace(layer_types=["full_attention", "sliding_attention"],
                            sliding_window=48, num_hidden_layers=2)
    assert hf_cp_gap("qwen2", mixed) is None
    assert [layer_window(mixed, i) for i in range(2)] == [None, 48]
    mistral = SimpleNamespace(sliding_window=16, num_hidden_layers=2)   # no layer_types
    assert [layer_window(mistral, i) for i in range(2)] == [16, 16]
    chunked = SimpleNamespace(layer_types=["full_attention", "chunked_attention"],
                              num_hidden_layers=2)
    assert "chunked_attention layers" in hf_cp_gap("llama4", chunked)


def test_each_hf_layer_gets_its_own_window_under_cp():
    """A stage's attention modules carry their layer's window (None for full attention), so
    the parity run of HF_QWEN2 above exercises both masks (the mask math itself is checked
    against whole-sequence attention in tests/ring_worker.py)."""
    from types import SimpleNamespace

    from engine.hf_stage import build_hf_chunk, layer_names

    names = layer_names(HF_QWEN2, 2)
    stage = build_hf_chunk(HF_QWEN2, names)
    stage.shard_sequence(SimpleNamespace(size=lambda: 2, rank=lambda: 0), 256, "ring")
    windows = [block.self_attn.autoplan_cp.window for block in stage.blocks.values()]
    assert windows == [None, 48]
    assert stage.config._attn_implementation == "autoplan_context_parallel"


def test_engine_accepts_ep_and_cp_plans():
    from engine.runtime import check_all

    for name, (model, kw) in WORLD4.items():
        assert check_all(_plan(model, **kw), "p.json", world_size=4) is not None, name


@pytest.mark.parametrize("bad", [0, -1.0, float("inf"), "2", True])
def test_hf_capacity_factor_is_checked(bad):
    with pytest.raises(ConfigError, match="capacity_factor"):
        resolve("hf:mixtral", num_hidden_layers=1, capacity_factor=bad)
