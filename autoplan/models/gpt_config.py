"""The configuration of the built-in GPT / Llama-style decoder (:mod:`autoplan.models.gpt`).

Torch-free, so that what only needs the numbers (a preset's parameter count for the planner's
memory lower bound, :mod:`autoplan.planner.bounds`; the sequence length) does not import torch.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Literal


@dataclass(frozen=True, kw_only=True)
class GPTConfig:
    vocab_size: int = 50304
    seq_len: int = 1024
    hidden: int = 768
    layers: int = 12
    heads: int = 12
    kv_heads: int | None = None          # grouped-query attention (Llama); None = heads
    ffn_hidden: int | None = None        # None: 4h (gpt) or the Llama rule (llama)
    style: Literal["gpt", "llama"] = "gpt"
    attention: Literal["eager", "sdpa"] = "sdpa"
    dropout: float = 0.0
    tie_embeddings: bool = False
    # One q/k/v projection (Megatron-LM's ``linear_qkv`` / ``query_key_value``, MPT's
    # ``Wqkv``): one GEMM of width (heads + 2 kv_heads) head_dim instead of three.
    fused_qkv: bool = False
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    # Mixture of experts (autoplan.models.moe): experts > 0 replaces every block's MLP by
    # `experts` SwiGLU experts of width expert_ffn (None: ffn), top_k of them per token,
    # plus shared_experts always-on ones; capacity_factor sizes each expert's token slots.
    experts: int = 0
    top_k: int = 2
    expert_ffn: int | None = None
    shared_experts: int = 0
    capacity_factor: float = 1.0

    def __post_init__(self) -> None:
        from autoplan.errors import ConfigError
        from autoplan.models.registry import MAX_LAYERS, check_config_types

        check_config_types(self, bounds={"layers": (1, MAX_LAYERS), "experts": (0, 1 << 16),
                                          "shared_experts": (0, 1 << 16)})
        if not 0.0 <= self.dropout < 1.0:
            raise ConfigError(f"dropout must be in [0, 1), got {self.dropout}",
                              field="model.dropout")
        for name in ("norm_eps", "rope_theta"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"must be positive, got {getattr(self, name)}",
                                  field=f"model.{name}")
        if self.hidden % self.heads:
            raise ConfigError(f"hidden ({self.hidden}) must be divisible by heads ({self.heads})",
                              field="model.heads")
        if self.kv_heads is not None and self.heads % self.kv_heads:
            raise ConfigError(f"heads ({self.heads}) must be divisible by kv_heads ({self.kv_heads})",
                              field="model.kv_heads")
        if self.style not in ("gpt", "llama"):
            raise ConfigError(f"style must be 'gpt' or 'llama', got {self.style!r}", field="model.style")
        if self.experts and not 1 <= self.top_k <= self.experts:
            raise ConfigError(f"top_k must be in [1, experts={self.experts}], got {self.top_k}",
                              field="model.top_k")
        if not (self.capacity_factor > 0 and math.isfinite(self.capacity_factor)):
            raise ConfigError(f"capacity_factor must be a positive number, got "
                              f"{self.capacity_factor}", field="model.capacity_factor")
        if self.attention not in ("eager", "sdpa"):
            raise ConfigError(f"attention must be 'eager' or 'sdpa', got {self.attention!r}",
                              field="model.attention")

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    @property
    def ffn(self) -> int:
        if self.ffn_hidden is not None:
            return self.ffn_hidden
        if self.style == "gpt":
            return 4 * self.hidden
        # Llama: 2/3 of 4h, rounded up to a multiple of 256
        return 256 * math.ceil(int(8 * self.hidden / 3) / 256)

    @property
    def moe_ffn(self) -> int:
        return self.expert_ffn or self.ffn

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "GPTConfig":
        from autoplan.models.registry import config_from_dict

        return config_from_dict(cls, d, "GPT")

    def num_params(self, *, active: bool = False) -> int:
        """Closed-form parameter count (used to cross-check the tracer); with ``active``,
        the parameters one token uses (``top_k`` of the routed experts)."""
        h, f, v = self.hidden, self.ffn, self.vocab_size
        kv = (self.kv_heads or self.heads) * self.head_dim
        bias = self.style == "gpt"
        attn = h * h + 2 * h * kv + h * h + (h + 2 * kv + h if bias else 0)
        if self.style == "gpt":
            mlp = 2 * h * f + (f + h)
            norms = 4 * h
        else:
            mlp = 3 * h * f
            norms = 2 * h
        if self.experts:
            routed = self.top_k if active else self.experts
            mlp = h * self.experts + 3 * h * self.moe_ffn * (routed + self.shared_experts)
        block = attn + mlp + norms
        emb = v * h + (self.seq_len * h if self.style == "gpt" else 0)
        final_norm = 2 * h if self.style == "gpt" else h
        head = 0 if self.tie_embeddings else v * h
        return emb + self.layers * block + final_norm + head
