"""A deep built-in GPT's graph built from a 3-block trace equals the whole model's trace.

:mod:`autoplan.trace.replicate` traces the first, one middle and the last block and
replicates the middle one; here the result is compared with tracing all L blocks, node for
node (every OpNode field, inputs included), layer for layer (names, kinds, nodes, stats),
parameter for parameter (in order), on GPT-2 style, Llama style (GQA, SwiGLU, RMSNorm), MoE
and tied-embedding models with odd and even L; the 3-block re-run of
:func:`~autoplan.planner.search.record.record_layers` against the whole-model re-run; and a
plan made with replication against one made without.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from autoplan.graph import OpGraph
from autoplan.models import resolve
from autoplan.trace import replicate as rep
from autoplan.trace import trace

SMALL = dict(vocab_size=512, seq_len=64, hidden=64, heads=4)
SPECS = {
    "gpt2-eager-dropout": dict(SMALL, layers=5, attention="eager", dropout=0.1),
    "gpt2-tied": dict(SMALL, layers=4, tie_embeddings=True),
    "llama-gqa": dict(SMALL, layers=7, style="llama", kv_heads=2),
    "moe-shared": dict(SMALL, layers=5, experts=4, top_k=2, shared_experts=1),
    "llama-moe": dict(SMALL, layers=6, style="llama", kv_heads=1, experts=4, top_k=1),
}


def _differences(full: OpGraph, built: OpGraph) -> list[str]:
    """Every way ``built`` differs from ``full`` (empty: equal)."""
    out = []
    if list(full.nodes) != list(built.nodes):
        out.append("node names or order")
    for name, node in full.nodes.items():
        other = built.nodes.get(name)
        if other is None:
            continue
        out += [f"{name}.{f.name}: {getattr(node, f.name)!r} != {getattr(other, f.name)!r}"
                for f in dataclasses.fields(node) if getattr(node, f.name) !=
                getattr(other, f.name)]
    if list(full.params.items()) != list(built.params.items()):
        out.append("params (names, order or ParamInfo)")
    if len(full.layers) != len(built.layers):
        out.append(f"{len(full.layers)} layers != {len(built.layers)}")
    out += [f"layer {a.index} ({a.name})" for a, b in zip(full.layers, built.layers) if a != b]
    out += [f for f in ("model_name", "fingerprint", "batch", "dtype")
            if getattr(full, f) != getattr(built, f)]
    if full.summary() | {"trace_seconds": 0} != built.summary() | {"trace_seconds": 0}:
        out.append("summary (totals)")
    return out


def _closed_form_params(spec) -> int:
    from autoplan.models.gpt_config import GPTConfig

    return GPTConfig.from_dict(spec.config).num_params()


def _replicated(spec, batch: int, seq: int, dtype) -> OpGraph:
    """The replicated graph, never the fallback (a NotReplicable fails the test)."""
    small, layers = rep.truncated_spec(spec)
    assert small.config["layers"] == rep.TRACED_BLOCKS
    return rep.replicate(trace(small, batch, seq, dtype=dtype), layers,
                         model_name=spec.name, fingerprint=spec.fingerprint())


@pytest.mark.parametrize("name", sorted(SPECS))
def test_replicated_graph_equals_the_full_trace(name):
    spec = resolve("gpt", **SPECS[name])
    full = trace(spec, 2, 64, dtype=torch.float16)
    built = _replicated(spec, 2, 64, torch.float16)
    assert _differences(full, built) == []
    assert len(built.layers) == SPECS[name]["layers"] + 2
    assert built.num_params == full.num_params == _closed_form_params(spec)


def test_trace_replicated_of_a_preset_equals_its_full_trace_at_fp32_batch_1():
    spec = resolve("gpt-tiny", layers=8)
    full = trace(spec, 1)
    built = rep.trace_replicated(spec, 1)
    assert _differences(full, built) == []
    assert built.fingerprint == spec.fingerprint() != resolve("gpt-tiny").fingerprint()


@pytest.mark.parametrize("layers", [1, 2, 3])
def test_three_blocks_or_fewer_are_traced_whole(layers):
    spec = resolve("gpt", **dict(SMALL, layers=layers))
    assert rep.truncated_spec(spec) is None
    assert _differences(trace(spec, 1, 64), rep.trace_replicated(spec, 1, 64)) == []


def test_other_sources_are_not_replicated():
    assert rep.truncated_spec(resolve("mlp")) is None
    assert rep.truncated_spec(resolve("hf:gpt2", n_layer=6)) is None


def test_a_graph_not_laid_out_as_three_blocks_is_not_replicable():
    spec = resolve("gpt", **dict(SMALL, layers=4))
    with pytest.raises(rep.NotReplicable, match="expected <pre>, 3 blocks"):
        rep.replicate(trace(spec, 1, 64), 8, model_name="x", fingerprint="y")


def test_a_failed_check_falls_back_to_the_whole_trace(monkeypatch):
    spec = resolve("gpt", **dict(SMALL, layers=5))

    def refuse(*args, **kwargs):
        raise rep.NotReplicable("refused by the test")

    monkeypatch.setattr(rep, "replicate", refuse)
    assert _differences(trace(spec, 1, 64), rep.trace_replicated(spec, 1, 64)) == []


def test_a_block_reading_another_blocks_parameter_is_not_replicable():
    """Cross-check of the guard: make block 1 read block 0's weight (weight sharing)."""
    spec = resolve("gpt", **dict(SMALL, layers=3))
    graph = trace(spec, 1, 64)
    node = next(n for n in graph.nodes.values() if n.layer == 2 and n.params)
    node.params = [p.replace("blocks.1.", "blocks.0.") for p in node.params]
    with pytest.raises(rep.NotReplicable, match="read outside its block"):
        rep.replicate(graph, 6, model_name="x", fingerprint="y")


@pytest.mark.parametrize("name", ["gpt2-eager-dropout", "llama-gqa", "moe-shared"])
def test_three_block_recording_equals_the_whole_model_recording(name):
    from autoplan.planner.search.record import record_layers

    spec = resolve("gpt", **SPECS[name])
    graph = rep.trace_replicated(spec, 1, 64, dtype=torch.float16)
    L = SPECS[name]["layers"]
    wanted = [0, 1, 2, L + 1]                 # what analyse() asks for: kinds and transitions
    short = record_layers(spec, graph, wanted)
    whole = record_layers(spec, graph, wanted, truncate=False)
    assert short.ops == whole.ops and short.unmatched == whole.unmatched
    assert sum(len(ops) for ops in short.ops.values()) > 0


def test_recording_the_last_block_runs_the_whole_model():
    """Block L-1 reads block L-2, which the 3-block run does not have: not truncated."""
    spec = resolve("gpt", **SPECS["gpt2-tied"])
    graph = rep.trace_replicated(spec, 1, 64)
    run = rep.traced_layers(spec, graph)
    assert run.runs == [0, 1, 2, 4, 5] and 4 not in run.exact
    from autoplan.planner.search.record import record_layers

    assert record_layers(spec, graph, [4]).ops == \
        record_layers(spec, graph, [4], truncate=False).ops


def test_plan_is_the_same_with_and_without_replication(monkeypatch):
    """End to end through the search planner (it probes DTensor on a fake 2 x 2 mesh, in
    this one process): trace and recording both replicated, or both whole."""
    from autoplan.api import optimize

    spec = resolve("gpt", **dict(SMALL, layers=6))
    replicated = optimize(spec, "dgx-a100", nodes=1, global_batch=16).to_dict()
    monkeypatch.setattr(rep, "truncated_spec", lambda spec, blocks=3: None)
    whole = optimize(spec, "dgx-a100", nodes=1, global_batch=16).to_dict()
    assert replicated["planner"]["name"] == "auto"
    assert replicated == whole
