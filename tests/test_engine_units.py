"""Engine pieces that need no process group: styles, chunks, init, data, FLOPs, checks."""

from __future__ import annotations

import dataclasses
import os

import numpy as np
import pytest
import torch
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput,
                                               RowwiseParallel, SequenceParallel)

from autoplan.errors import ConfigError, PlanError
from autoplan.models.gpt_config import GPTConfig
from autoplan.models.registry import ModelSpec, build_model
from engine import model as model_lib
from engine.config import RunConfig
from engine.data import SyntheticTokens, TokenFile, local_batch, make_source
from engine.memory import LiveTensorMemory
from engine.metrics import StepRecord, format_table, model_flops_per_token, peak_flops, summarize
from engine.run import build_parser
from engine.tensor_parallel import parse_placement, tp_plan
from engine.runtime import check_all
from engine.validate import check_engine_support, check_model, check_world
from engine_helpers import TINY, TINY_LLAMA, make_plan

SPEC = ModelSpec("builtin", "gpt", dict(TINY))


# ---- tensor-parallel styles ---------------------------------------------------------------

def test_tp_plan_maps_megatron_placements_to_styles():
    plan = make_plan(tp=2)
    chunk = model_lib.build_chunk(SPEC, plan.stages[0].layer_names)
    styles = tp_plan(chunk, plan.param_placements, sequence_parallel=False)
    for name in ("q", "k", "v"):
        assert isinstance(styles[f"blocks.0.attn.{name}"], ColwiseParallel)
    assert isinstance(styles["blocks.3.mlp.fc1"], ColwiseParallel)
    row = styles["blocks.0.attn.o"]
    assert isinstance(row, RowwiseParallel) and row.output_layouts == (Replicate(),)
    assert "blocks.0.norm1" not in styles and "pos_emb" not in styles
    emb = styles["tok_emb"]                        # the token embedding: vocabulary parallel
    assert isinstance(emb, RowwiseParallel) and emb.output_layouts == (Replicate(),)
    head = styles["head"]                          # the planner shards the head's vocabulary
    assert isinstance(head, ColwiseParallel) and head.output_layouts == (Replicate(),)


def test_tp_plan_with_sequence_parallelism():
    plan = make_plan(tp=2, sp=True)
    chunk = model_lib.build_chunk(SPEC, plan.stages[0].layer_names)
    styles = tp_plan(chunk, plan.param_placements, sequence_parallel=True)
    assert styles["blocks.2.attn.o"].output_layouts == (Shard(1),)     # reduce-scatter
    assert isinstance(styles["blocks.2.norm1"], SequenceParallel)
    assert isinstance(styles["norm"], SequenceParallel)
    assert isinstance(styles["blocks.2.mlp"], PrepareModuleInput)       # one all-gather
    # the residual stream is sliced before the embedding dropout (Megatron-LM's order), so
    # the dropout's mask is sequence-sharded too; the first block gets the shard as it is
    first = styles["drop"]                                              # Replicate -> Shard(1)
    assert first.input_layouts == (Replicate(),) and first.desired_input_layouts == (Shard(1),)
    assert "blocks.0" not in styles
    assert styles["head"].input_layouts == (Shard(1),)                 # vocab-parallel head
    replicated_head = dict(plan.param_placements, **{"head.weight": {"tp": "Replicate()"}})
    styles = tp_plan(chunk, replicated_head, sequence_parallel=True)
    assert isinstance(styles["head"], PrepareModuleInput)
    assert styles["head"].desired_input_layouts == (Replicate(),)
    # a later pipeline stage receives the sequence shard already: no slicing there
    later = model_lib.build_chunk(SPEC, ("blocks.2", "blocks.3", "<post>"))
    assert "blocks.2" not in tp_plan(later, plan.param_placements, sequence_parallel=True)


def test_tp_plan_llama_and_vocab_parallel_head():
    spec = ModelSpec("builtin", "gpt", dict(TINY_LLAMA))
    plan = make_plan(tp=2, sp=True, model=TINY_LLAMA)
    placements = dict(plan.param_placements, **{"head.weight": {"tp": "Shard(0)"},
                                                "tok_emb.weight": {"tp": "Shard(0)"}})
    styles = tp_plan(model_lib.build_chunk(spec, plan.stages[0].layer_names), placements,
                     sequence_parallel=True)
    assert isinstance(styles["blocks.1.mlp.gate"], ColwiseParallel)
    assert isinstance(styles["blocks.1.mlp.down"], RowwiseParallel)
    assert isinstance(styles["blocks.1.norm2"], SequenceParallel)        # RMSNorm
    head = styles["head"]
    assert isinstance(head, ColwiseParallel) and head.input_layouts == (Shard(1),)
    assert head.output_layouts == (Replicate(),)
    assert isinstance(styles["tok_emb"], RowwiseParallel)                # vocabulary-parallel


@pytest.mark.parametrize("fqn, placement, message", [
    ("blocks.0.norm1.weight", "Shard(0)", "norm parameters must be Replicate()"),
    ("blocks.0.attn.q.bias", "Replicate()", "column-parallel layer's bias must be Shard(0)"),
    ("head.weight", "Shard(1)", "vocabulary (Shard(0)) only"),
    ("blocks.0.attn.q.weight", "Partial()", "not a parameter placement"),
])
def test_tp_plan_rejects_placements_it_cannot_apply(fqn, placement, message):
    plan = make_plan(tp=2)
    placements = dict(plan.param_placements)
    placements[fqn] = {"tp": placement}
    chunk = model_lib.build_chunk(SPEC, plan.stages[0].layer_names)
    with pytest.raises(PlanError, match=message.replace("(", r"\(").replace(")", r"\)")):
        tp_plan(chunk, placements, sequence_parallel=False)


def test_sequence_parallel_needs_sharded_block_linears():
    plan = make_plan(tp=2, sp=True)
    placements = dict(plan.param_placements)
    placements["blocks.1.mlp.fc2.weight"] = {"tp": "Replicate()"}
    with pytest.raises(PlanError, match="blocks.1.mlp.fc2.weight"):
        tp_plan(model_lib.build_chunk(SPEC, plan.stages[0].layer_names), placements,
                sequence_parallel=True)


def test_parse_placement():
    assert parse_placement("Shard(1)", "x") == Shard(1)
    assert parse_placement("Replicate()", "x") == Replicate()


# ---- chunks and initialisation ------------------------------------------------------------

def _materialized(spec, names, seed=0):
    chunk = model_lib.build_chunk(spec, names)
    model_lib.materialize(chunk, build_model(spec), torch.device("cpu"), seed)
    return chunk


@pytest.mark.parametrize("config", [TINY, TINY_LLAMA], ids=["gpt", "llama"])
def test_pipeline_chunks_compose_to_the_whole_model(config):
    spec = ModelSpec("builtin", "gpt", dict(config))
    whole = _materialized(spec, ["<pre>", *(f"blocks.{i}" for i in range(4)), "<post>"])
    first = _materialized(spec, ["<pre>", "blocks.0", "blocks.1"])
    last = _materialized(spec, ["blocks.2", "blocks.3", "<post>"])
    assert set(n for n, _ in first.named_parameters()) == {
        n for n, _ in whole.named_parameters() if n.startswith(("tok_emb", "pos_emb",
                                                                "blocks.0.", "blocks.1."))}
    tokens = torch.randint(0, config["vocab_size"], (2, 16))
    hidden = first(tokens)
    assert hidden.shape == (2, 16, config["hidden"])
    torch.testing.assert_close(last(hidden), whole(tokens), rtol=0, atol=0)


def test_materialize_gives_each_parameter_its_own_seeded_value():
    whole = build_model(SPEC, device="cpu")
    whole.init_weights(seed=3)
    chunk = _materialized(SPEC, ["blocks.2", "<post>"], seed=3)
    ref = dict(whole.named_parameters())
    for name, p in chunk.named_parameters():
        torch.testing.assert_close(p, ref[name], rtol=0, atol=0)
    assert ref["blocks.2.attn.o.weight"].std() < ref["blocks.2.attn.q.weight"].std()
    other = _materialized(SPEC, ["blocks.2", "<post>"], seed=4)
    assert not torch.equal(other.head.weight, chunk.head.weight)


def test_build_chunk_rejects_unknown_layers_and_split_tied_embeddings():
    with pytest.raises(PlanError, match="blocks.9"):
        model_lib.build_chunk(SPEC, ["blocks.9"])
    tied = ModelSpec("builtin", "gpt", dict(TINY, tie_embeddings=True))
    with pytest.raises(PlanError, match="tied embeddings"):
        model_lib.build_chunk(tied, ["<pre>", "blocks.0"])


# ---- data ---------------------------------------------------------------------------------

def test_synthetic_data_is_deterministic_and_split_over_dp_ranks():
    src = SyntheticTokens(vocab_size=128, seq_len=16, global_batch=8, seed=1)
    full = src.rows(5, 0, 8)
    assert full.shape == (8, 17) and full.dtype == torch.int64
    assert torch.equal(full, src.rows(5, 0, 8))
    assert not torch.equal(full, src.rows(6, 0, 8))
    parts = [local_batch(src, 5, dp=4, dp_rank=r, device=torch.device("cpu")) for r in range(4)]
    torch.testing.assert_close(torch.cat([x for x, _ in parts]), full[:, :-1])
    torch.testing.assert_close(torch.cat([y for _, y in parts]), full[:, 1:])
    # learnable: each row is an arithmetic progression mod V
    d = (full[:, 1:] - full[:, :-1]) % 128
    assert (d == d[:, :1]).all()


def test_token_file(tmp_path):
    tokens = np.arange(1000, dtype=np.uint16) % 100
    tokens.tofile(tmp_path / "t.bin")
    np.save(tmp_path / "t.npy", tokens)
    for name in ("t.bin", "t.npy"):
        src = make_source(str(tmp_path / name), vocab_size=100, seq_len=10, global_batch=4,
                          seed=0)
        assert isinstance(src, TokenFile)
        rows = src.rows(1, 0, 4)
        assert rows.shape == (4, 11)
        assert ((rows[:, 1:] - rows[:, :-1]) % 100 == 1).all()     # contiguous windows
        assert torch.equal(rows, src.rows(1, 0, 4))
    with pytest.raises(ConfigError, match="vocab_size 50"):
        TokenFile(tmp_path / "t.bin", vocab_size=50, seq_len=10, global_batch=4,
                  seed=0).rows(1, 0, 4)
    with pytest.raises(ConfigError, match="not found"):
        make_source(str(tmp_path / "missing.bin"), vocab_size=100, seq_len=10,
                    global_batch=4, seed=0)


# ---- metrics ------------------------------------------------------------------------------

def test_model_flops_follow_palm_appendix_b():
    cfg = GPTConfig(vocab_size=1000, seq_len=64, hidden=32, layers=2, heads=4)
    n = cfg.num_params() - 1000 * 32 - 64 * 32
    assert model_flops_per_token(cfg, 64) == 6 * n + 12 * 2 * 32 * 64
    tied = dataclasses.replace(cfg, tie_embeddings=True)
    assert model_flops_per_token(tied, 64) == model_flops_per_token(cfg, 64)
    assert peak_flops({"device": {"peak_tflops": {"bfloat16": 989}}}, "bfloat16") == 989e12
    assert peak_flops({"device": {"peak_tflops": {"bfloat16": 989}}}, "float32") is None
    assert peak_flops({}, "float32") is None


def test_summary_medians_exclude_warmup_and_tracked_steps():
    recs = [StepRecord(step=i, loss=5.0 - i / 10, step_time_s=t, tokens=100,
                       tokens_per_s=100 / t, tflops_per_device=1e-3 / t, mfu=None, lr=1e-3,
                       memory_tracked=i == 2)
            for i, t in enumerate([9.0, 5.0, 1.0, 1.0, 3.0], start=1)]
    s = summarize(recs, warmup_steps=2, world_size=2, peak=None,
                  memory_per_rank=[{"peak_bytes": 10}, {"peak_bytes": 30}],
                  prediction={"step_time_s": 0.5, "memory": {"total": 20}},
                  plan_label="dp2", plan_source="p.json", device="cpu")
    assert s["measured"]["step_time_s"] == 1.0 and s["timed_steps"] == 3
    assert s["measured"]["peak_memory_bytes"] == 30
    assert s["measured_over_predicted"] == {"step_time_s": 2.0, "peak_memory_bytes": 1.5}
    table = format_table(s)
    assert "step time (s, median)" in table and "0.5000" in table


def test_live_tensor_memory_counts_allocations_and_frees():
    keep = torch.zeros(1000)
    with LiveTensorMemory([keep]) as mem:
        a = torch.ones(250_000)                     # 1 MB
        b = a * 2                                   # +1 MB
        del a, b
        c = torch.empty(0)
        c.untyped_storage().resize_(4000)           # what FSDP does to unsharded params
    assert mem.start == 4000
    assert mem.peak == 4000 + 2_000_000
    assert mem.current == 4000 + 4000


# ---- configuration and launch checks ------------------------------------------------------

def test_run_config_rejects_unknown_keys_and_cli_covers_every_field():
    with pytest.raises(ConfigError, match="stpes"):
        RunConfig.from_dict({"stpes": 3})
    cfg = RunConfig(lr=1.0, lr_warmup=4)
    assert [cfg.lr_at(s) for s in (1, 2, 4, 9)] == [0.25, 0.5, 1.0, 1.0]
    args = vars(build_parser().parse_args(["p.json", "--out", "x", "--resume",
                                           "--checkpoint-every", "3"]))
    args.pop("plan")
    cfg = RunConfig.from_dict(args)
    assert cfg.out_dir == "x" and cfg.resume and cfg.checkpoint_every == 3


def test_world_size_message():
    plan = make_plan(dp=2, tp=2)
    with pytest.raises(PlanError) as exc:
        check_world(plan, "plans/x.json", world_size=2, local_world_size=2)
    assert str(exc.value) == ("plan plans/x.json was made for 4 ranks (mesh pp=1 dp=2 tp=2) "
                              "but torchrun started 2; relaunch with --nproc_per_node=4")
    with pytest.raises(PlanError, match="--nnodes and --nproc_per_node whose product is 4"):
        check_world(plan, "x", world_size=8, local_world_size=4)
    check_world(plan, "x", world_size=4)


def test_model_checks():
    plan = make_plan()
    assert check_model(plan, "p") == SPEC
    plan.num_params += 1
    with pytest.raises(PlanError, match="num_params"):
        check_model(plan, "p")
    other = make_plan()
    other.model = {"source": "builtin", "name": "mlp", "config": {}}
    other.model_fingerprint = ModelSpec.from_dict(other.model).fingerprint()
    # any model runs (the generic runtime, tests/test_engine_generic.py); the plan's
    # parameter count must still be the model's
    with pytest.raises(PlanError, match="field 'num_params'"):
        check_model(other, "p")


def test_engine_support_checks():
    plan = make_plan(pp=2, num_micro_batches=2)
    plan.stages[1] = dataclasses.replace(plan.stages[1], ranks=(0,))
    with pytest.raises(PlanError, match=r"stages\[1\].ranks"):
        check_engine_support(plan, SPEC, "p")
    plan = make_plan(pp=2, num_micro_batches=2)
    last = plan.stages[1]
    plan.stages[1] = dataclasses.replace(last, layer_names=last.layer_names[1:],
                                         layers=(last.layers[0] + 1, last.layers[1]))
    with pytest.raises(PlanError, match=r"missing \['blocks.2'\]"):
        check_engine_support(plan, SPEC, "p")
    plan = make_plan(tp=2, model=dict(TINY, heads=3, hidden=36))
    with pytest.raises(PlanError, match=r"tp=2 does not divide the model.s heads \(3\)"):
        check_engine_support(plan, ModelSpec("builtin", "gpt", plan.model["config"]), "p")
    plan = make_plan(precision={"params": "float32", "compute": "float16",
                                "reduce": "float32"})
    with pytest.raises(PlanError, match="precision.compute"):
        check_engine_support(plan, SPEC, "p")
    plan = make_plan(dp=2, zero=1)
    plan.param_placements["head.weight"] = {"dp": "Shard(0)", "tp": "Replicate()"}
    with pytest.raises(PlanError, match="needs ZeRO-3"):
        check_engine_support(plan, SPEC, "p")
    check_all(make_plan(pp=2, tp=2, dp=2, sp=True, zero=3, num_micro_batches=2), "p",
              world_size=8)


def test_ranks_run_the_allocator_with_expandable_segments_unless_the_user_chose(monkeypatch):
    """engine.run sets PYTORCH_ALLOC_CONF (the allocator reserve the cost model prices
    assumes expandable segments) and leaves a user's own setting, either name, alone."""
    from engine import run

    for name in ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF"):
        monkeypatch.delenv(name, raising=False)
    run._allocator_settings()
    assert run.ALLOCATOR_SETTINGS == "expandable_segments:True"
    assert os.environ["PYTORCH_ALLOC_CONF"] == run.ALLOCATOR_SETTINGS
    monkeypatch.delenv("PYTORCH_ALLOC_CONF")
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "max_split_size_mb:128")
    run._allocator_settings()
    assert "PYTORCH_ALLOC_CONF" not in os.environ
