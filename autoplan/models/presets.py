"""Named sizes of the built-in models.

Sources: GPT-2 (Radford et al. 2019, Table 2); GPT-3 (Brown et al. 2020, Table 2.1);
Megatron-LM SC'21 runs (Narayanan et al. 2021, arXiv 2104.04473, Table 1: sequence 2048,
vocabulary 51200); Llama 3 (Dubey et al. 2024, arXiv 2407.21783, Table 3: vocabulary 128256,
GQA with 8 KV heads, FFN 14336 / 28672 / 53248); Llama 2 (Touvron et al. 2023, arXiv
2307.09288: vocabulary 32000, context 4096, GQA with 8 KV heads for 70B only; dimensions, FFN
sizes and rope base 10000 from the released params.json / Hugging Face configs: 7B 4096 x 32
layers, 32 heads, FFN 11008; 13B 5120 x 40, 40 heads, FFN 13824; 70B 8192 x 80, 64 heads,
FFN 28672); Mistral 7B (Jiang et al. 2023, arXiv 2310.06825, Table 1: dim 4096, 32 layers,
head_dim 128, FFN 14336, 32 heads, 8 KV heads, context 8192, vocabulary 32000; rope base
10000 in v0.1). Mistral's sliding-window attention (window 4096) is not modelled: attention
is costed as full causal attention over the sequence, which over-counts it beyond 4096
tokens.

Mixtures of experts, as Hugging Face architectures (their attention differs from the built-in
GPT's) with routing modelled by :mod:`autoplan.models.moe`; parameter counts (total / active)
as the tests check them against the publications:

* Mixtral 8x7B (Jiang et al. 2024, arXiv 2401.04088, Table 1: dim 4096, 32 layers, head_dim
  128, FFN 14336, 32 heads, 8 KV heads, vocabulary 32000, 8 experts, top-2; rope base 1e6):
  46.7 B / 12.9 B.
* Mixtral 8x22B (Mistral AI's release and its Hugging Face config: dim 6144, 56 layers,
  48 heads, 8 KV heads, FFN 16384, vocabulary 32768, 8 experts, top-2): 141 B / 39 B.
* Qwen3-30B-A3B (Qwen3 technical report, arXiv 2505.09388, Table 2: 48 layers, 32 Q / 4 KV
  heads, 128 experts, 8 activated; hidden 2048, expert FFN 768, head_dim 128, vocabulary
  151936 from its Hugging Face config): 30.5 B / 3.3 B.
* DeepSeek-V3 (DeepSeek-AI 2024, arXiv 2412.19437, sec. 4.2: 61 layers, hidden 7168, 128
  heads, MLA with KV rank 512 and query rank 1536, first 3 layers dense, then 1 shared + 256
  routed experts of width 2048, 8 activated, node-limited routing over 8 groups, top 4):
  671 B / 37 B (the multi-token-prediction module is not modelled).
"""

from __future__ import annotations

from autoplan.models.registry import register_preset

# GPT-2's 50257 tokens padded to a multiple of 128 (Megatron-LM's
# --make-vocab-size-divisible-by), so the vocabulary shards over any TP degree up to 8;
# GPT-3 175B uses Megatron's 51200 as in Narayanan et al. 2021.
GPT2_VOCAB_PADDED = 50304

# name: (hidden, layers, heads)
_MEGATRON_SC21 = {
    "gpt-1.7b": (2304, 24, 24),
    "gpt-3.6b": (3072, 30, 32),
    "gpt-7.5b": (4096, 36, 32),
    "gpt-18.4b": (6144, 40, 48),
    "gpt-39b": (8192, 48, 64),
    "gpt-76b": (10240, 60, 80),
    "gpt-145b": (12288, 80, 96),
    "gpt-310b": (16384, 96, 128),
    "gpt-530b": (20480, 105, 128),
    "gpt-1t": (25600, 128, 160),
}

_GPT2 = {
    "gpt2": (768, 12, 12),
    "gpt2-medium": (1024, 24, 16),
    "gpt2-large": (1280, 36, 20),
    "gpt2-xl": (1600, 48, 25),
}

# name: (hidden, layers, heads, kv_heads, ffn)
_LLAMA3 = {
    "llama3-8b": (4096, 32, 32, 8, 14336),
    "llama3-70b": (8192, 80, 64, 8, 28672),
    "llama3-405b": (16384, 126, 128, 8, 53248),
}


# name: (hidden, layers, heads, kv_heads, ffn, seq_len); Llama-2 7B/13B use multi-head
# attention (kv_heads = heads), 70B grouped-query attention (Touvron et al. 2023, table 1)
_LLAMA2_MISTRAL = {
    "llama2-7b": (4096, 32, 32, 32, 11008, 4096),
    "llama2-13b": (5120, 40, 40, 40, 13824, 4096),
    "llama2-70b": (8192, 80, 64, 8, 28672, 4096),
    "mistral-7b": (4096, 32, 32, 8, 14336, 8192),
}


# name: (hf model_type, config)
_MOE = {
    "mixtral-8x7b": ("mixtral", dict(
        vocab_size=32000, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
        num_attention_heads=32, num_key_value_heads=8, num_local_experts=8,
        num_experts_per_tok=2, max_position_embeddings=32768)),
    "mixtral-8x22b": ("mixtral", dict(
        vocab_size=32768, hidden_size=6144, intermediate_size=16384, num_hidden_layers=56,
        num_attention_heads=48, num_key_value_heads=8, num_local_experts=8,
        num_experts_per_tok=2, max_position_embeddings=65536)),
    "qwen3-30b-a3b": ("qwen3_moe", dict(
        vocab_size=151936, hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768,
        num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
        num_experts=128, num_experts_per_tok=8, max_position_embeddings=40960,
        tie_word_embeddings=False)),
    "deepseek-v3": ("deepseek_v3", dict(
        vocab_size=129280, hidden_size=7168, intermediate_size=18432, moe_intermediate_size=2048,
        num_hidden_layers=61, first_k_dense_replace=3, num_attention_heads=128,
        num_key_value_heads=128, n_routed_experts=256, n_shared_experts=1,
        num_experts_per_tok=8, q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128,
        qk_rope_head_dim=64, v_head_dim=128, n_group=8, topk_group=4,
        max_position_embeddings=163840)),
}


# The small MLP family (autoplan.models.mlp)
MLP_PRESETS: dict[str, dict] = {
    "mlp-tiny": dict(in_dim=32, hidden=64, out_dim=4, depth=2),
    "mlp-mnist": dict(in_dim=784, hidden=1024, out_dim=10, depth=4),
}

# Wide ResNets (autoplan.models.wide_resnet; Zagoruyko & Komodakis 2016): CIFAR-size networks from the paper (Table 2 / 4); 32x32 images, 10 classes.
WIDE_RESNET_PRESETS: dict[str, dict] = {
    "wrn-16-4": dict(depth=16, width=4),
    "wrn-16-8": dict(depth=16, width=8),
    "wrn-28-10": dict(depth=28, width=10),
    "wrn-40-4": dict(depth=40, width=4),
}


def register_all() -> None:
    for name, config in MLP_PRESETS.items():
        register_preset(name, "mlp", config)
    for name, config in WIDE_RESNET_PRESETS.items():
        register_preset(name, "wide-resnet", config)
    # A model small enough to train on this machine's CPU in seconds (the demo's default).
    register_preset("gpt-tiny", "gpt", dict(vocab_size=512, seq_len=64, hidden=64, layers=4,
                                            heads=4, attention="sdpa"))
    register_preset("gpt-small", "gpt", dict(vocab_size=4096, seq_len=128, hidden=256,
                                             layers=8, heads=8))
    for name, (h, l, a) in _MEGATRON_SC21.items():
        register_preset(name, "gpt", dict(vocab_size=51200, seq_len=2048, hidden=h, layers=l,
                                          heads=a))
    for name, (h, l, a) in _GPT2.items():
        register_preset(name, "gpt", dict(vocab_size=GPT2_VOCAB_PADDED, seq_len=1024, hidden=h,
                                          layers=l, heads=a, tie_embeddings=True))
    register_preset("gpt3-175b", "gpt", dict(vocab_size=51200, seq_len=2048, hidden=12288,
                                             layers=96, heads=96))
    for name, (h, l, a, kv, f) in _LLAMA3.items():
        register_preset(name, "gpt", dict(vocab_size=128256, seq_len=8192, hidden=h, layers=l,
                                          heads=a, kv_heads=kv, ffn_hidden=f, style="llama",
                                          rope_theta=500000.0))
    # Llama 3.1 405B's long-context stage: 131,072-token sequences (Dubey et al. 2024,
    # sec. 3.4.2 and Table 4: CP 16 x TP 8 x PP 16 x DP 8 on 16,384 H100s, 380 TFLOP/s/GPU).
    h, l, a, kv, f = _LLAMA3["llama3-405b"]
    register_preset("llama3-405b-128k", "gpt", dict(vocab_size=128256, seq_len=131072,
                                                    hidden=h, layers=l, heads=a, kv_heads=kv,
                                                    ffn_hidden=f, style="llama",
                                                    rope_theta=500000.0))
    for name, (h, l, a, kv, f, seq) in _LLAMA2_MISTRAL.items():
        register_preset(name, "gpt", dict(vocab_size=32000, seq_len=seq, hidden=h, layers=l,
                                          heads=a, kv_heads=kv, ffn_hidden=f, style="llama",
                                          rope_theta=10000.0))
    for name, (model_type, config) in _MOE.items():
        register_preset(name, f"hf:{model_type}", config)
