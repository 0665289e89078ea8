"""A GPT / Llama-style decoder-only transformer, sized by a config.

Written to be traced on the meta device and sharded by PyTorch's tensor-parallel styles:
q, k, v are separate ``nn.Linear`` modules (so ``ColwiseParallel`` on each keeps the heads
whole) or, with ``fused_qkv``, one laid out by key/value group as Megatron-LM's (so a
column-parallel shard holds whole groups: :meth:`Attention._split_qkv`), heads are inferred with ``view(b, s, -1, head_dim)`` (so a TP-sharded local tensor
reshapes correctly), and blocks live in one ``nn.ModuleDict`` named ``blocks`` keyed
``"0"`` .. ``"L-1"`` (parameter FQNs ``blocks.3.attn.q.weight`` as with a ModuleList).

Pipeline-friendly (the torchtitan convention): a pipeline stage is this model with the
modules of other stages removed — ``del model.blocks["5"]``, ``model.tok_emb = None`` —
which keeps every remaining FQN. ``forward`` then takes hidden states when there is no
``tok_emb`` and returns hidden states when there is no ``head``. Initialisation is per
parameter (:meth:`GPT.init_value`, seeded by the parameter's name), so a stage, or a shard
of one, gets exactly the values the whole model would.

``style="gpt"``: LayerNorm, GELU MLP of 4h, learned positions, biases (GPT-2 / Megatron GPT).
``style="llama"``: RMSNorm, SwiGLU MLP, rotary positions, no biases (Llama 2/3).

``attention="eager"`` materialises the (b, a, s, s) score matrix (what Korthikanti et al.
count as 5·a·s/h of activation memory); ``"sdpa"`` uses ``F.scaled_dot_product_attention``
(flash-style: the matrix is not stored).
"""

from __future__ import annotations

import hashlib
import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from autoplan.models.gpt_config import GPTConfig
from autoplan.models.moe import MoE


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)


def _norm(cfg: GPTConfig) -> nn.Module:
    if cfg.style == "llama":
        return RMSNorm(cfg.hidden, cfg.norm_eps)
    return nn.LayerNorm(cfg.hidden, eps=cfg.norm_eps)


def _rotary(x: torch.Tensor, theta: float, positions: torch.Tensor | None = None
            ) -> torch.Tensor:
    """Rotary position embedding (Su et al. 2021) on (b, s, heads, head_dim); ``positions``
    (s,) default to 0 .. s-1 (context parallelism passes the rank's own)."""
    b, s, nh, hd = x.shape
    inv_freq = 1.0 / (theta ** (torch.arange(0, hd, 2, device=x.device, dtype=torch.float32) / hd))
    t = (torch.arange(s, device=x.device, dtype=torch.float32) if positions is None
         else positions.to(device=x.device, dtype=torch.float32))
    freqs = torch.outer(t, inv_freq)                       # (s, hd/2)
    cos = freqs.cos()[None, :, None, :].to(x.dtype)
    sin = freqs.sin()[None, :, None, :].to(x.dtype)
    x1, x2 = x[..., : hd // 2], x[..., hd // 2:]
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)


class Attention(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.cfg = cfg
        bias = cfg.style == "gpt"
        kv = (cfg.kv_heads or cfg.heads) * cfg.head_dim
        if cfg.fused_qkv:
            self.qkv = nn.Linear(cfg.hidden, cfg.hidden + 2 * kv, bias=bias)
        else:
            self.q = nn.Linear(cfg.hidden, cfg.hidden, bias=bias)
            self.k = nn.Linear(cfg.hidden, kv, bias=bias)
            self.v = nn.Linear(cfg.hidden, kv, bias=bias)
        self.o = nn.Linear(cfg.hidden, cfg.hidden, bias=bias)
        self.attn_drop = nn.Dropout(cfg.dropout)
        self.resid_drop = nn.Dropout(cfg.dropout)
        self.cp = None                   # ContextParallel, set by GPT.shard_sequence

    def _split_qkv(self, t: torch.Tensor):
        """q, k, v (b, s, heads, head_dim) from the fused projection's output, laid out
        as Megatron-LM lays ``linear_qkv`` out: per key/value group, its ``heads/kv_heads``
        query heads, then its key, then its value, (b, s, groups, heads/kv_heads + 2, hd).
        A column-parallel shard of whole groups therefore holds its heads' queries, keys
        and values, and ``-1`` infers the local number of groups."""
        cfg = self.cfg
        b, s = t.shape[:2]
        rep = cfg.heads // (cfg.kv_heads or cfg.heads)
        t = t.view(b, s, -1, rep + 2, cfg.head_dim)
        q = t[:, :, :, :rep].reshape(b, s, -1, cfg.head_dim)
        return q, t[:, :, :, rep], t[:, :, :, rep + 1]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        cfg = self.cfg
        b, s, _ = x.shape
        hd = cfg.head_dim
        if cfg.fused_qkv:
            q, k, v = self._split_qkv(self.qkv(x))
        else:
            q = self.q(x).view(b, s, -1, hd)
            k = self.k(x).view(b, s, -1, hd)
            v = self.v(x).view(b, s, -1, hd)
        positions = None if self.cp is None else self.cp.positions(x.device)
        if cfg.style == "llama":
            q = _rotary(q, cfg.rope_theta, positions)
            k = _rotary(k, cfg.rope_theta, positions)
        mask = None
        if self.cp is not None and (self.cp.method == "ring" or cfg.attention == "sdpa"):
            from autoplan.models.context_parallel import attend

            y = attend(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), self.cp,
                       cfg.dropout if self.training else 0.0)
            return self.resid_drop(self.o(y.transpose(1, 2).reshape(b, s, -1)))
        if self.cp is not None:          # keys and values of the whole sequence (eager)
            k, v = self.cp.gather(k, 1), self.cp.gather(v, 1)
            mask = self.cp.causal_mask(x.device)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)   # (b, heads, s, hd)
        rep = q.shape[1] // k.shape[1]
        if rep > 1:
            k = k.repeat_interleave(rep, dim=1)
            v = v.repeat_interleave(rep, dim=1)
        if cfg.attention == "sdpa":
            y = F.scaled_dot_product_attention(q, k, v, is_causal=mask is None, attn_mask=mask,
                                               dropout_p=cfg.dropout if self.training else 0.0)
        else:
            scores = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(hd))
            if mask is None:
                mask = torch.ones(s, s, dtype=torch.bool, device=x.device).tril()
            scores = scores.masked_fill(~mask, float("-inf"))
            y = self.attn_drop(scores.softmax(dim=-1)) @ v
        y = y.transpose(1, 2).reshape(b, s, -1)
        return self.resid_drop(self.o(y))


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.style = cfg.style
        if cfg.style == "llama":
            self.gate = nn.Linear(cfg.hidden, cfg.ffn, bias=False)
            self.up = nn.Linear(cfg.hidden, cfg.ffn, bias=False)
            self.down = nn.Linear(cfg.ffn, cfg.hidden, bias=False)
        else:
            self.fc1 = nn.Linear(cfg.hidden, cfg.ffn)
            self.fc2 = nn.Linear(cfg.ffn, cfg.hidden)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.style == "llama":
            return self.drop(self.down(F.silu(self.gate(x)) * self.up(x)))
        return self.drop(self.fc2(F.gelu(self.fc1(x))))


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.norm1 = _norm(cfg)
        self.attn = Attention(cfg)
        self.norm2 = _norm(cfg)
        self.mlp = MoE(cfg.hidden, cfg.moe_ffn, cfg.experts, cfg.top_k,
                       capacity_factor=cfg.capacity_factor, shared=cfg.shared_experts
                       ) if cfg.experts else MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class GPT(nn.Module):
    """Decoder-only LM. ``forward(tokens, targets=None)`` returns logits, or the mean
    cross-entropy loss when ``targets`` is given."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.cfg = cfg
        # ``_weight`` skips nn.Embedding's own normal_ init, which init_weights overrides; on
        # the meta device that init would import torch._dynamo (about 1 CPU s).
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.hidden,
                                    _weight=torch.empty(cfg.vocab_size, cfg.hidden))
        self.pos_emb = (nn.Embedding(cfg.seq_len, cfg.hidden,
                                     _weight=torch.empty(cfg.seq_len, cfg.hidden))
                        if cfg.style == "gpt" else None)
        self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleDict({str(i): Block(cfg) for i in range(cfg.layers)})
        self.norm = _norm(cfg)
        self.head = nn.Linear(cfg.hidden, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.head.weight = self.tok_emb.weight
        if not any(p.is_meta for p in self.parameters()):
            self.init_weights()

    def init_value(self, name: str, shape: torch.Size | tuple[int, ...], *,
                   generator: torch.Generator | None = None) -> torch.Tensor:
        """The initial value (fp32, CPU, full shape) of parameter ``name`` (its FQN).

        GPT-2 initialisation: weights N(0, 0.02), output projections (``o``, ``fc2``,
        ``down``) N(0, 0.02/sqrt(2·layers)); biases 0; norm weights 1.
        """
        if len(shape) == 1:
            fill = 0.0 if name.endswith("bias") else 1.0
            return torch.full(tuple(shape), fill, dtype=torch.float32)
        std = 0.02
        if name.endswith(("o.weight", "fc2.weight", "down.weight", "mlp.down")):
            std = 0.02 / math.sqrt(2 * self.cfg.layers)
        return torch.randn(tuple(shape), generator=generator, dtype=torch.float32) * std

    @staticmethod
    def param_seed(seed: int, name: str) -> int:
        """Seed of parameter ``name``'s generator: independent of which other parameters
        exist, so pipeline stages and shards reproduce the whole model's values."""
        digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
        return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)

    @torch.no_grad()
    def init_weights(self, seed: int | None = None) -> None:
        """Initialise every parameter with :meth:`init_value`; with ``seed``, each parameter
        draws from its own generator seeded by :meth:`param_seed` (deterministic)."""
        for name, p in self.named_parameters():
            gen = None
            if seed is not None:
                gen = torch.Generator(device="cpu").manual_seed(self.param_seed(seed, name))
            p.copy_(self.init_value(name, p.shape, generator=gen).to(device=p.device,
                                                                    dtype=p.dtype))

    def shard_sequence(self, group, seq_len: int, method: str = "all-gather") -> None:
        """Context parallelism over ``group``: this model's inputs are then this rank's
        tokens (:func:`autoplan.models.context_parallel.shard_rows` of sequences of
        ``seq_len``), and attention all-gathers keys and values or passes them around the
        ring, as ``method`` (:data:`autoplan.pricing.CP_COMMS`) says (module docstring
        there)."""
        from autoplan.models.context_parallel import ContextParallel

        cp = ContextParallel(group, group.size(), group.rank(), seq_len, method)
        for block in self.blocks.values():
            block.attn.cp = cp

    @staticmethod
    def loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Mean token cross-entropy, computed in fp32."""
        return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(0, 1))

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        """``tokens`` (b, s) -> logits (b, s, vocab), or the loss when ``targets`` is given.

        In a pipeline stage without ``tok_emb`` the input is the hidden states (b, s, h) of
        the previous stage; without ``head`` the output is this stage's hidden states.
        """
        x = tokens
        if self.tok_emb is not None:
            x = self.tok_emb(tokens)
            if self.pos_emb is not None:
                cp = next((b.attn.cp for b in self.blocks.values()), None)
                pos = (torch.arange(tokens.shape[1], device=tokens.device) if cp is None
                       else cp.positions(tokens.device))
                x = x + self.pos_emb(pos)
            x = self.drop(x)
        for block in self.blocks.values():
            x = block(x)
        if self.head is None:
            return x
        logits = self.head(self.norm(x))
        if targets is None:
            return logits
        return self.loss(logits, targets)
