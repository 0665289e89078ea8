"""The tracer: layers, FLOPs, parameters, TP roles, activation memory, errors.

Sizes are small but not degenerate (h=256, a=8, s=128, b=2) so the whole file runs in
seconds; the 175B timing lives in benchmarks/, not here.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from autoplan.errors import ConfigError, TraceError
from autoplan.graph import OpGraph
from autoplan.models import build_model, resolve
from autoplan.models.gpt_config import GPTConfig
from autoplan.trace import trace, trace_module

H, A, S, B = 256, 8, 128, 2
SBH = S * B * H


def _gpt(**overrides) -> dict:
    config = dict(vocab_size=512, seq_len=S, hidden=H, layers=2, heads=A)
    config.update(overrides)
    return config


@pytest.fixture(scope="module")
def eager_fp16() -> OpGraph:
    """Korthikanti's setting: GPT style, materialised attention, dropout, fp16."""
    return trace(resolve("gpt", **_gpt(attention="eager", dropout=0.1)), B, S,
                 dtype=torch.float16)


@pytest.fixture(scope="module")
def sdpa_fp16() -> OpGraph:
    return trace(resolve("gpt", **_gpt(attention="sdpa", dropout=0.1)), B, S,
                 dtype=torch.float16)


def _by_module(graph: OpGraph, layer: int) -> dict[str, set[str]]:
    """module path -> TP roles of its non-view compute ops in ``layer``."""
    roles: dict[str, set[str]] = {}
    for node in graph:
        if node.layer == layer and node.params and node.op.startswith(("aten.addmm",
                                                                        "aten.mm")):
            roles.setdefault(node.module_path, set()).add(node.tp_role)
    return roles


# ---- layers -----------------------------------------------------------------------------

def test_gpt_layers_are_pre_blocks_post_with_one_kind():
    graph = trace(resolve("gpt", **_gpt(layers=4)), 2, 64)
    assert [layer.name for layer in graph.layers] == \
        ["<pre>", "blocks.0", "blocks.1", "blocks.2", "blocks.3", "<post>"]
    kinds = {layer.kind for layer in graph.blocks()}
    assert len(kinds) == 1 and next(iter(kinds)).startswith("Block#")
    assert graph.layer_kinds()[next(iter(kinds))] == [1, 2, 3, 4]
    # every op is in exactly one layer, in execution order, and knows its layer
    names = [n for layer in graph.layers for n in layer.nodes]
    assert names == list(graph.nodes)
    for layer in graph.layers:
        assert all(graph.nodes[n].layer == layer.index for n in layer.nodes)
    assert graph.nodes[graph.layers[1].nodes[0]].module_path.startswith("blocks.0.")
    assert graph.trace_seconds > 0
    assert graph.batch.batch_size == 2 and graph.batch.seq_len == 64


def _layer_counts(graph: OpGraph) -> list[tuple[str, str, int]]:
    return [(layer.name, layer.kind, len(layer.nodes)) for layer in graph.layers]


@pytest.mark.parametrize("style", ["gpt", "llama"])
def test_one_block_gpt_has_pre_block_post_like_two_blocks(style):
    # Regression: a one-element block list used to be rejected as a block candidate (at
    # least two units were required), so every op landed in <pre> and <post> was empty.
    one = trace(resolve("gpt", **_gpt(layers=1, style=style)), 1, 64)
    two = trace(resolve("gpt", **_gpt(layers=2, style=style)), 1, 64)
    assert [layer.name for layer in one.layers] == ["<pre>", "blocks.0", "<post>"]
    pre, block, post = _layer_counts(one)
    # each layer holds the same ops as in the two-block model, blocks.0 the same kind
    assert _layer_counts(two) == [pre, block, ("blocks.1", block[1], block[2]), post]
    assert pre[2] > 0 and block[2] > 0 and post[2] > 0
    assert {one.nodes[n].module_path.split(".")[0] for n in one.layers[1].nodes} == {"blocks"}
    assert not any(one.nodes[n].module_path.startswith("blocks.")
                   for layer in (one.layers[0], one.layers[2]) for n in layer.nodes)
    assert [b.name for b in one.blocks()] == ["blocks.0"]


def test_one_block_mlp_has_pre_block_post():
    one = trace(resolve("mlp-tiny", depth=1), 8)
    two = trace(resolve("mlp-tiny", depth=2), 8)
    pre, block, post = _layer_counts(one)
    assert [pre[0], block[0], post[0]] == ["<pre>", "blocks.0", "<post>"]
    assert _layer_counts(two) == [pre, block, ("blocks.1", block[1], block[2]), post]


def test_one_block_gpt_plan_names_its_three_layers():
    import autoplan

    spec = resolve("gpt-tiny", layers=1)
    plan = autoplan.optimize(spec, "local-cpu", global_batch=4, planner="uniform")
    names = [name for stage in plan.stages for name in stage.layer_names]
    assert names == ["<pre>", "blocks.0", "<post>"]
    assert plan.stages[0].layers[0] == 0 and plan.stages[-1].layers[1] == 3


def test_param_count_matches_closed_form():
    for config in (_gpt(), _gpt(style="llama", kv_heads=2, tie_embeddings=True)):
        spec = resolve("gpt", **config)
        graph = trace(spec, 1, 32)
        assert graph.num_params == GPTConfig.from_dict(spec.config).num_params()
        assert sum(layer.stats.params for layer in graph.layers) == graph.num_params


# ---- FLOPs (PaLM appendix B: 2N per token forward, 6N forward + backward) --------------------

def test_gpt_flops_follow_2n_and_6n(eager_fp16):
    cfg = GPTConfig.from_dict(resolve("gpt", **_gpt()).config)
    tokens = B * S
    n_matmul = cfg.num_params() - cfg.vocab_size * H - cfg.seq_len * H   # no embeddings
    attention = 4 * B * S * S * H * cfg.layers          # QK^T and AV, forward
    fwd = 2 * n_matmul * tokens + attention
    assert eager_fp16.fwd_flops == pytest.approx(fwd, rel=0.02)
    total = eager_fp16.fwd_flops + eager_fp16.bwd_flops
    assert total == pytest.approx(6 * n_matmul * tokens + 3 * attention, rel=0.03)
    block = eager_fp16.layers[1].stats
    assert block.matmul_flops == pytest.approx(24 * tokens * H * H + 4 * B * S * S * H,
                                               rel=0.01)
    assert block.bwd_flops == pytest.approx(2 * block.fwd_flops, rel=0.02)


def test_first_op_on_tokens_has_no_input_gradient(eager_fp16):
    embedding = next(n for n in eager_fp16 if n.op == "aten.embedding.default")
    # backward only accumulates the weight gradient (one add per element of the grad)
    assert embedding.bwd_flops <= B * S * H


# ---- activation memory (Korthikanti et al. 2022, arXiv 2205.05198) -------------------------

def test_saved_activations_match_korthikanti(eager_fp16):
    stats = eager_fp16.layers[1].stats
    assert stats.saved_bytes == pytest.approx(SBH * (34 + 5 * A * S / H), rel=0.10)
    assert stats.saved_bytes_attn == pytest.approx(SBH * 5 * A * S / H, rel=0.10)
    for t in (2, 4, 8):
        per_device = (stats.saved_bytes - stats.saved_bytes_tp) + stats.saved_bytes_tp / t
        assert per_device == pytest.approx(SBH * (10 + 24 / t + 5 * A * S / (H * t)),
                                           rel=0.10)
    assert stats.input_bytes == 2 * SBH           # full recomputation keeps only this
    assert stats.output_bytes == 2 * SBH
    attention_ops = [n for n in eager_fp16 if n.layer == 1 and n.saved_is_attention_matrix]
    assert {n.op for n in attention_ops} >= {"aten._softmax.default"}


def test_sdpa_drops_the_attention_matrix(sdpa_fp16, eager_fp16):
    stats = sdpa_fp16.layers[1].stats
    assert stats.saved_bytes_attn == 0
    assert stats.saved_bytes == pytest.approx(SBH * 34, rel=0.10)
    assert not any(n.saved_is_attention_matrix for n in sdpa_fp16)
    assert any("scaled_dot_product_flash_attention" in n.op for n in sdpa_fp16)
    assert sdpa_fp16.layers[1].kind != eager_fp16.layers[1].kind


def test_node_saved_bytes_add_up(eager_fp16):
    # per-producer and per-consumer attributions count the same storages
    assert sum(n.saved_bytes for n in eager_fp16) == \
        sum(layer.stats.saved_bytes for layer in eager_fp16.layers)


# ---- tensor-parallel roles ----------------------------------------------------------------

def test_gpt_tp_roles_and_param_dims(eager_fp16):
    roles = _by_module(eager_fp16, 1)
    for name in ("attn.q", "attn.k", "attn.v", "mlp.fc1"):
        assert roles[f"blocks.0.{name}"] == {"column"}
    for name in ("attn.o", "mlp.fc2"):
        assert roles[f"blocks.0.{name}"] == {"row"}
    softmax = next(n for n in eager_fp16 if n.layer == 1 and n.op == "aten._softmax.default")
    assert softmax.tp_role == "sharded"
    norm = next(n for n in eager_fp16 if n.module_path == "blocks.0.norm1")
    assert norm.tp_role == "replicated"
    p = eager_fp16.params
    assert (p["blocks.0.attn.q.weight"].tp_role, p["blocks.0.attn.q.weight"].tp_dim) == \
        ("column", 0)
    assert (p["blocks.0.attn.o.weight"].tp_role, p["blocks.0.attn.o.weight"].tp_dim) == \
        ("row", 1)
    assert p["blocks.0.mlp.fc1.bias"].tp_dim == 0
    assert p["blocks.0.mlp.fc2.bias"].tp_dim is None
    assert p["blocks.0.norm1.weight"].tp_dim is None
    # the token embedding is vocabulary parallel (Megatron's VocabParallelEmbedding): its
    # lookup is a row op whose output is all-reduced; learned positions stay replicated
    assert (p["tok_emb.weight"].tp_role, p["tok_emb.weight"].tp_dim) == ("row", 0)
    assert p["pos_emb.weight"].tp_dim is None
    pre = eager_fp16.layers[0].stats
    assert pre.tp_allreduce_fwd_bytes == 2 * SBH and pre.params_tp == p["tok_emb.weight"].numel
    stats = eager_fp16.layers[1].stats
    # Megatron: two all-reduces forward (after o, fc2) and two backward (norm outputs)
    assert stats.tp_allreduce_fwd_bytes == 2 * 2 * SBH
    assert stats.tp_allreduce_bwd_bytes == 2 * 2 * SBH
    assert stats.params_tp == stats.params - 2 * H - 4 * H   # row biases and norms replicated
    assert 0.99 < stats.fwd_flops_tp / stats.fwd_flops <= 1.0


def test_llama_style_tp_roles():
    graph = trace(resolve("gpt", **_gpt(style="llama", kv_heads=2)), 1, 64)
    roles = _by_module(graph, 1)
    for name in ("attn.q", "attn.k", "attn.v", "mlp.gate", "mlp.up"):
        assert roles[f"blocks.0.{name}"] == {"column"}
    for name in ("attn.o", "mlp.down"):
        assert roles[f"blocks.0.{name}"] == {"row"}
    assert graph.params["blocks.0.mlp.down.weight"].tp_dim == 1


# ---- other models -----------------------------------------------------------------------

def test_mlp_traces_with_blocks():
    graph = trace(resolve("mlp-tiny"), 8)
    assert [layer.name for layer in graph.layers] == ["<pre>", "blocks.0", "blocks.1", "<post>"]
    assert len(graph.layer_kinds()) == 3
    assert graph.batch.seq_len is None
    assert _by_module(graph, 1) == {"blocks.0.fc1": {"column"}, "blocks.0.fc2": {"row"}}


def test_wide_resnet_flattens_groups_into_blocks():
    spec = resolve("wrn-28-10")
    graph = trace(spec, 2)
    blocks = graph.blocks()
    assert [b.name for b in blocks] == [f"groups.{g}.{j}" for g in range(3) for j in range(4)]
    kinds = [b.kind for b in blocks]
    assert len(set(kinds)) == 6                         # first and other blocks, per group
    assert kinds[1] == kinds[2] == kinds[3] != kinds[0]
    assert graph.num_params == 36_479_194               # 36.5M (Zagoruyko & Komodakis, Table 2)
    convs = {graph.nodes[n].module_path: graph.nodes[n].tp_role for n in blocks[4].nodes
             if graph.nodes[n].op == "aten.convolution.default"}
    assert convs == {"groups.1.0.conv1": "column", "groups.1.0.conv2": "row",
                     "groups.1.0.shortcut": "replicated"}
    assert graph.params["groups.1.0.conv1.weight"].tp_dim == 0
    assert graph.params["groups.1.0.conv2.weight"].tp_dim == 1
    assert blocks[4].stats.output_bytes == blocks[4].stats.input_bytes // 2   # stride 2, 2x width


def test_hf_gpt2_traces():
    spec = resolve("hf:gpt2", n_layer=2, n_embd=64, n_head=4, vocab_size=256)
    graph = trace(spec, 2, 32)
    assert [layer.name for layer in graph.layers] == \
        ["<pre>", "transformer.h.0", "transformer.h.1", "<post>"]
    assert graph.layers[1].kind == graph.layers[2].kind
    roles = _by_module(graph, 1)
    assert roles["transformer.h.0.attn.c_attn"] == {"column"}
    assert roles["transformer.h.0.attn.c_proj"] == {"row"}
    assert roles["transformer.h.0.mlp.c_fc"] == {"column"}
    assert roles["transformer.h.0.mlp.c_proj"] == {"row"}
    # HF Conv1D stores (in, out): column shards dim 1, row dim 0
    assert graph.params["transformer.h.0.attn.c_attn.weight"].tp_dim == 1
    assert graph.params["transformer.h.0.mlp.c_proj.weight"].tp_dim == 0
    model = build_model(spec)
    assert graph.num_params == sum(p.numel() for p in model.parameters())


def test_hf_gpt2_one_layer_has_its_block():
    one = trace(resolve("hf:gpt2", n_layer=1, n_embd=64, n_head=4, vocab_size=256), 2, 32)
    two = trace(resolve("hf:gpt2", n_layer=2, n_embd=64, n_head=4, vocab_size=256), 2, 32)
    assert [layer.name for layer in one.layers] == ["<pre>", "transformer.h.0", "<post>"]
    assert [len(layer.nodes) for layer in one.layers] == \
        [len(two.layers[i].nodes) for i in (0, 1, 3)]
    assert one.layers[1].kind == two.layers[1].kind


def test_hf_llama_traces():
    spec = resolve("hf:llama", num_hidden_layers=2, hidden_size=64, intermediate_size=128,
                   num_attention_heads=4, num_key_value_heads=2, vocab_size=256)
    graph = trace(spec, 2, 32)
    assert [layer.name for layer in graph.layers] == \
        ["<pre>", "model.layers.0", "model.layers.1", "<post>"]
    assert graph.layers[1].kind == graph.layers[2].kind
    roles = _by_module(graph, 1)
    for name in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj",
                 "mlp.up_proj"):
        assert roles[f"model.layers.0.{name}"] == {"column"}
    for name in ("self_attn.o_proj", "mlp.down_proj"):
        assert roles[f"model.layers.0.{name}"] == {"row"}
    assert graph.fwd_flops > 0 and graph.bwd_flops > graph.fwd_flops


def test_hf_llama_one_layer_has_its_block():
    spec = resolve("hf:llama", num_hidden_layers=1, hidden_size=64, intermediate_size=128,
                   num_attention_heads=4, num_key_value_heads=2, vocab_size=256)
    graph = trace(spec, 2, 32)
    assert [layer.name for layer in graph.layers] == ["<pre>", "model.layers.0", "<post>"]
    assert all(graph.nodes[n].module_path.startswith("model.layers.0")
               for n in graph.layers[1].nodes)
    assert graph.layers[0].nodes and graph.layers[2].nodes



def _attention_nodes(graph: OpGraph) -> list:
    return [n for n in graph.nodes.values() if "attention" in n.op]


def test_hf_causal_attention_traces_as_the_gpu_runs_it_flash_and_causal():
    """transformers cannot read fake position ids; on a GPU, rows 0..s-1 are not packed and
    SDPA runs causal without a mask (flash). The trace follows the GPU, and restores
    transformers' detection afterwards."""
    import transformers.masking_utils as masking

    before = masking.find_packed_sequence_indices
    spec = resolve("hf:llama", num_hidden_layers=2, hidden_size=256, intermediate_size=512,
                   num_attention_heads=4, num_key_value_heads=2, vocab_size=512)
    graph = trace(spec, 1, 128, dtype=torch.bfloat16)
    attn = _attention_nodes(graph)
    assert len(attn) == 2
    for node in attn:
        assert "flash" in node.op and node.causal
        assert len(node.input_meta) == 3            # q, k, v: no (b, 1, s, s) mask
        assert node.input_meta[1].shape[1] == 2     # grouped-query k/v keep their 2 heads
    assert masking.find_packed_sequence_indices is before


def test_hf_same_model_built_in_and_through_transformers_price_alike():
    """Llama through hf: and as autoplan's built-in GPT: one model, one price."""
    from autoplan.api import estimate, prepare

    common = dict(hidden_size=512, intermediate_size=1536, num_hidden_layers=2,
                  num_attention_heads=8, num_key_value_heads=2, vocab_size=4096,
                  max_position_embeddings=2048)
    hf = resolve("hf:llama", **common)
    own = resolve("gpt", hidden=512, ffn_hidden=1536, layers=2, heads=8, kv_heads=2,
                  vocab_size=4096, seq_len=2048, style="llama")
    steps, acts = [], []
    for spec in (hf, own):
        problem = prepare(spec, "dgx-h100", nodes=1, global_batch=8, seq_len=2048)
        plan = estimate(None, None, global_batch=8, problem=problem, dp=8, micro_batch=1)
        steps.append(plan.prediction.step_time_s)
        acts.append(plan.prediction.memory.activations)
    assert steps[0] == pytest.approx(steps[1], rel=0.1)
    assert acts[0] == pytest.approx(acts[1], rel=0.15)

# ---- API and errors ---------------------------------------------------------------------

class _Net(nn.Module):
    def __init__(self, inner: nn.Module):
        super().__init__()
        self.body = nn.ModuleList([inner])
        self.head = nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body[0](x)).sum()


class _ItemGate(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.fc(x)
        return y * 2 if y.sum().item() > 0 else y


class _Nonzero(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x[torch.nonzero(x > 0)[:, 0]]


@pytest.mark.parametrize("inner, op", [(_ItemGate, "_local_scalar_dense"),
                                       (_Nonzero, "nonzero")])
def test_data_dependent_model_raises_trace_error(inner, op):
    with torch.device("meta"):
        model = _Net(inner())
    with pytest.raises(TraceError) as info:
        trace_module(model, input_spec=[((4, 8), torch.float32)])
    message = str(info.value)
    assert "'body.0'" in message and inner.__name__ in message and op in message


def test_trace_module_with_input_spec_or_batch():
    with torch.device("meta"):
        model = _Net(nn.Sequential(nn.Linear(8, 8), nn.ReLU()))
    graph = trace_module(model, input_spec=[((4, 8), torch.float32)], model_name="net")
    assert graph.model_name == "net" and graph.batch.input_shapes == ((4, 8),)
    assert graph.num_params == 8 * 8 + 8 + 8 + 1
    again = trace_module(model, (torch.empty(4, 8, device="meta"),))
    assert again.fingerprint == graph.fingerprint and len(again) == len(graph)
    with pytest.raises(ConfigError):
        trace_module(model)


# ---- fused q/k/v projection (Megatron-LM's linear_qkv layout) ------------------------------

def _fused_from_separate(attn_sep, attn_fused, cfg) -> None:
    """Copy separate q/k/v weights into the fused projection's group layout
    (:meth:`autoplan.models.gpt.Attention._split_qkv`)."""
    hd, groups = cfg["hidden"] // cfg["heads"], cfg.get("kv_heads") or cfg["heads"]
    rep = cfg["heads"] // groups
    parts = [getattr(attn_sep, n) for n in ("q", "k", "v")]
    w = [p.weight.view(groups, -1, hd, cfg["hidden"]) for p in parts]
    attn_fused.qkv.weight.data.copy_(torch.cat(w, 1).reshape(-1, cfg["hidden"]))
    if parts[0].bias is not None:
        b = [p.bias.view(groups, -1, hd) for p in parts]
        attn_fused.qkv.bias.data.copy_(torch.cat(b, 1).reshape(-1))
    assert w[0].shape[1] == rep


@pytest.mark.parametrize("extra", [dict(), dict(style="llama", kv_heads=2)])
def test_fused_qkv_computes_the_separate_projections_and_traces_as_one_column_gemm(extra):
    cfg = dict(vocab_size=97, seq_len=16, hidden=64, layers=2, heads=4, attention="eager",
               **extra)
    sep = build_model(resolve("gpt", **cfg), device="cpu")
    sep.init_weights(seed=0)
    fused = build_model(resolve("gpt", **cfg, fused_qkv=True), device="cpu")
    fused.load_state_dict({k: v for k, v in sep.state_dict().items()
                           if ".attn.q." not in k and ".attn.k." not in k
                           and ".attn.v." not in k}, strict=False)
    for i in ("0", "1"):
        _fused_from_separate(sep.blocks[i].attn, fused.blocks[i].attn, cfg)
    tokens = torch.randint(0, 97, (2, 16))
    sep.eval(), fused.eval()
    torch.testing.assert_close(fused(tokens, tokens), sep(tokens, tokens))

    g_sep = trace(resolve("gpt", **cfg), 1, 16)
    g_fused = trace(resolve("gpt", **cfg, fused_qkv=True), 1, 16)
    assert _by_module(g_fused, 1)["blocks.0.attn.qkv"] == {"column"}
    assert (g_fused.params["blocks.0.attn.qkv.weight"].tp_role,
            g_fused.params["blocks.0.attn.qkv.weight"].tp_dim) == ("column", 0)
    s_sep, s_fused = g_sep.layers[1].stats, g_fused.layers[1].stats
    # the same arithmetic and TP collectives, one GEMM instead of three
    assert s_fused.fwd_flops == pytest.approx(s_sep.fwd_flops, rel=1e-6)
    assert s_fused.params_tp == s_sep.params_tp
    assert s_fused.tp_allreduce_fwd_bytes == s_sep.tp_allreduce_fwd_bytes
    gemms = lambda g: sum(1 for n in g.layers[1].nodes  # noqa: E731
                          if g.nodes[n].op.startswith(("aten.addmm", "aten.mm")))
    assert gemms(g_fused) == gemms(g_sep) - 2


def test_attention_with_a_narrower_value_head_runs_the_efficient_kernel():
    """DeepSeek's MLA: q/k heads of 192, v heads of 128. Flash needs one head dimension, so
    a GPU runs the memory-efficient kernel, causal, and the trace does too (the flash
    kernel's meta function would give the output q's width and break the next matmul)."""
    spec = resolve("deepseek-v3", num_hidden_layers=1)
    graph = trace(spec, 1, 128, dtype=torch.bfloat16)
    attn = _attention_nodes(graph)
    assert attn and all("efficient" in n.op and n.causal for n in attn)
    q, _, v = (m.shape for m in attn[0].input_meta[:3])
    assert q[-1] == 192 and v[-1] == 128


def test_the_packed_sequence_answer_is_the_tracing_threads_alone_and_always_undone():
    """Only a thread that traces gets "not packed"; another thread (a user's own training
    in the same process) keeps transformers' check, and the last trace out restores it,
    also when a trace fails."""
    import threading

    import transformers.masking_utils as masking

    from autoplan.trace.cuda_semantics import CudaSemantics

    own = masking.find_packed_sequence_indices
    packed = torch.tensor([[0, 1, 2, 0, 1]])            # two documents in one row
    elsewhere = {}

    def other_thread():
        elsewhere["answer"] = masking.find_packed_sequence_indices(packed)

    with CudaSemantics():
        kept = masking.find_packed_sequence_indices     # a reference kept past the trace
        with CudaSemantics():                            # nested traces
            assert masking.find_packed_sequence_indices(packed) is None
            worker = threading.Thread(target=other_thread)
            worker.start()
            worker.join()
        assert masking.find_packed_sequence_indices is not own
    assert masking.find_packed_sequence_indices is own
    assert elsewhere["answer"].tolist() == [[0, 0, 0, 1, 1]]
    assert kept(packed).tolist() == [[0, 0, 0, 1, 1]]
    with pytest.raises(RuntimeError):
        with CudaSemantics():
            raise RuntimeError("a trace that fails")
    assert masking.find_packed_sequence_indices is own


def test_square_feature_maps_are_not_attention_matrices():
    # without a sequence length (an image model) a tensor (..., n, n) is an attention matrix
    # only when attention made it: a CNN's square feature maps once all counted, so
    # "selective" recomputation was priced as freeing a ResNet's activations
    from autoplan.trace.saved import _is_attention_shape

    assert not _is_attention_shape((8, 64, 56, 56), None, "aten.relu.default")
    assert not _is_attention_shape((8, 64, 56, 56), None, "aten.convolution.default")
    assert _is_attention_shape((8, 12, 197, 197), None, "aten._softmax.default")
    assert _is_attention_shape((8, 12, 64, 64), 64, "aten.relu.default")    # seq known
    assert not _is_attention_shape((8, 12, 64, 64), 128, "aten._softmax.default")
