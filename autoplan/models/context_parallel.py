"""Context parallelism: the sequence split over ``cp`` ranks, attention over all of it.

Each of the ``cp`` ranks of a context-parallel group holds ``s / cp`` of a sequence's
tokens and computes everything on them; only attention needs the other ranks' tokens.
Two ways to get them:

* **all-gather** (Llama 3, Dubey et al. 2024, sec. 3.3.2, used for its 128K-token
  training): before attention each rank all-gathers the keys and values of the whole
  sequence (``2 s h_kv`` elements; small under grouped-query attention) and attends its own
  queries to them; backward reduce-scatters their gradients.
* **ring** (Liu et al. 2023, "Ring Attention with Blockwise Transformers"): key/value
  blocks travel around the ring in ``cp - 1`` steps, each overlapped with the attention of
  the block in hand; the same bytes, hidden behind compute when a block's attention takes
  longer than its send.

Causal attention gives later tokens more work, so the sequence is cut into ``2 cp`` chunks
and rank ``r`` holds chunks ``r`` and ``2 cp - 1 - r`` (Llama 3 sec. 3.3.2; Megatron-LM's
context parallelism): every rank then does the same attention work.

Masks come from positions (:meth:`ContextParallel.visible`): causal, and for a layer with a
sliding window (Mistral, Qwen2's sliding layers) only the last ``window`` keys. Both
exchanges still move every block (a block wholly outside a query chunk's window is masked,
not skipped), so a window changes what is computed, not what is sent.

This module gives the engine-side pieces both the built-in GPT and the cost model share:
which positions a rank holds, its rows of a batch, the differentiable all-gather, and the
ring (:func:`ring_attention`).

**The ring as the engine runs it.** Step ``j`` (0 .. cp-1) attends this rank's queries to
the key/value block of rank ``r - j`` (its own at ``j = 0``), then passes the block on to
rank ``r + 1`` and receives rank ``r - j - 1``'s (one point-to-point send and receive, keys
and values in one message). Each step gives a block output ``o_j`` and the log-sum-exp
``l_j`` of its scores; the blocks combine exactly as FlashAttention's online softmax does
(Milakov & Gimelshein 2018; Liu et al. 2023, sec. 3)::

    l = logaddexp(l_acc, l_j),   o = exp(l_acc - l) o_acc + exp(l_j - l) o_j

A query row with every key of a block masked (a later chunk's keys) has ``l_j = -inf``
and contributes nothing. A rank keeps only its own block of keys and values for the
backward (with its output and log-sum-exp), which passes the blocks around the ring again,
each travelling with the gradient of its keys and values (:class:`_Ring`): ``cp - 1``
sends of a ``V_kv / cp`` block forward and ``cp`` of ``2 V_kv / cp`` backward, the pattern
:func:`autoplan.cost.parallel_dims.context_parallel_time` prices for the ring. This is a reference implementation on explicit matmuls (torch's fused
attention gives no log-sum-exp with a gradient), and a block's send does not overlap the
attention of the block in hand: it runs the ring's communication and memory, not a fused
kernel's speed.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


def chunk_positions(seq_len: int, cp: int, rank: int) -> torch.Tensor:
    """Positions (0 .. s-1) of the tokens rank ``rank`` of ``cp`` holds, in order:
    chunk ``rank`` then chunk ``2 cp - 1 - rank`` of ``2 cp`` equal chunks."""
    if cp < 1 or not 0 <= rank < cp:
        raise ValueError(f"need 0 <= rank < cp, got rank {rank}, cp {cp}")
    if seq_len % (2 * cp):
        raise ValueError(f"sequence length {seq_len} must be divisible by 2 x cp = {2 * cp}")
    c = seq_len // (2 * cp)
    return torch.cat([torch.arange(rank * c, (rank + 1) * c),
                      torch.arange((2 * cp - 1 - rank) * c, (2 * cp - rank) * c)])


def shard_rows(x: torch.Tensor, cp: int, rank: int, dim: int = 1) -> torch.Tensor:
    """This rank's tokens of ``x`` along its sequence dimension ``dim``."""
    return x.index_select(dim, chunk_positions(x.shape[dim], cp, rank).to(x.device))


@dataclass
class ContextParallel:
    """A rank's place in a context-parallel group: set on the model's attention modules by
    ``GPT.shard_sequence``."""

    group: object                     # torch.distributed ProcessGroup
    cp: int
    rank: int
    seq_len: int                      # the whole sequence
    method: str = "all-gather"        # autoplan.pricing.CP_COMMS
    window: int | None = None         # sliding window: a query sees the last ``window`` keys

    def __post_init__(self) -> None:
        from autoplan.errors import one_of
        from autoplan.pricing import CP_COMMS

        one_of(self.method, CP_COMMS, "context-parallel exchange")
        if self.window is not None and (isinstance(self.window, bool) or
                                        not isinstance(self.window, int) or self.window < 1):
            raise ValueError(f"sliding window must be a positive int, got {self.window!r}")

    def visible(self, queries: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
        """(queries, keys) boolean mask from their positions: a query sees the keys at or
        before it, and under a sliding window only the last ``window`` of them
        (``q - window < k <= q``, transformers' ``sliding_window_overlay``)."""
        mask = queries[:, None] >= keys[None, :]
        if self.window is not None:
            mask &= keys[None, :] > queries[:, None] - self.window
        return mask

    def positions(self, device=None) -> torch.Tensor:
        return chunk_positions(self.seq_len, self.cp, self.rank).to(device)

    def all_positions(self, device=None) -> torch.Tensor:
        """Positions of the gathered keys, in the order :meth:`gather` returns them."""
        return torch.cat([chunk_positions(self.seq_len, self.cp, r)
                          for r in range(self.cp)]).to(device)

    def gather(self, t: torch.Tensor, dim: int) -> torch.Tensor:
        """All-gather ``t`` along ``dim`` over the group (rank order); its backward
        reduce-scatters the gradient (:class:`_GatherAlong`)."""
        return _GatherAlong.apply(t, dim, self.group)

    def causal_mask(self, device=None) -> torch.Tensor:
        """(local queries, all keys) boolean mask (:meth:`visible`)."""
        return self.visible(self.positions(device), self.all_positions(device))


def _expand(t: torch.Tensor, rep: int) -> torch.Tensor:
    """Keys or values (b, kv_heads, s, hd) repeated for ``rep`` query heads each."""
    return t.repeat_interleave(rep, dim=1) if rep > 1 else t


def _probs(q: torch.Tensor, k: torch.Tensor, mask: torch.Tensor,
           lse: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(probabilities, log-sum-exp) of queries ``q`` (b, heads, sq, hd) over one block of
    expanded keys (b, heads, sk, hd) under ``mask`` (sq, sk): normalised by the block's own
    log-sum-exp, or by ``lse`` when given (the whole row's, in the backward). A row with no
    visible key has log-sum-exp -inf and probabilities 0. Scores, probabilities and
    log-sum-exp are float32 at least (as FlashAttention keeps its statistics): in bfloat16
    a log-sum-exp near 10 is off by up to 0.03, 3% in every weight of the merge."""
    scores = (q @ k.transpose(-2, -1)).to(_acc(q)) * (1.0 / math.sqrt(q.shape[-1]))
    scores = scores.masked_fill(~mask, float("-inf"))
    if lse is None:
        lse = torch.logsumexp(scores, dim=-1, keepdim=True)
    return torch.exp(scores - torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)), lse


def _acc(t: torch.Tensor) -> torch.dtype:
    """The dtype the ring accumulates in: float32, or float64 for float64 inputs."""
    return torch.float64 if t.dtype == torch.float64 else torch.float32


def _keep(like: torch.Tensor, dropout_p: float) -> torch.Tensor | None:
    """Attention dropout's scaled keep mask for one block (None without dropout)."""
    if not dropout_p:
        return None
    return torch.empty_like(like).bernoulli_(1.0 - dropout_p) / (1.0 - dropout_p)


class _Ring(torch.autograd.Function):
    """Ring attention (module docstring). The forward keeps only this rank's block of keys
    and values, its output and log-sum-exp; the backward passes the blocks around the ring
    again, each with the gradient of its keys and values that the ranks it has visited have
    added, and a last pass returns every block's gradient to its owner. Per step of the
    backward (FlashAttention-2's backward, Dao 2023, Algorithm 2, with the row's final
    log-sum-exp ``l`` and ``D = rowsum(dO * O)``)::

        P = exp(S - l),  dV += (P Z)^T dO,  dP = (dO V^T) Z,  dS = P (dP - D),
        dQ += dS K / sqrt(d),  dK += dS^T Q / sqrt(d)

    with ``Z`` the block's scaled dropout mask, drawn again from the random state the
    forward started from."""

    @staticmethod
    def forward(ctx, q, k, v, cp: ContextParallel, dropout_p: float):
        rng = _rng_state(q.device) if dropout_p else None
        positions = cp.positions(q.device)
        rep = q.shape[1] // k.shape[1]
        kv = torch.stack([k, v])
        out = lse = None
        for j in range(cp.cp):
            if j:
                kv = _pass(kv, cp.group)
            probs, l = _probs(q, _expand(kv[0], rep), _visible(cp, j, positions), None)
            keep = _keep(probs, dropout_p)
            values = _expand(kv[1], rep)
            o = ((probs if keep is None else probs * keep).to(values.dtype) @ values
                 ).to(probs.dtype)
            if out is None:
                out, lse = o, l
            else:
                new = torch.logaddexp(lse, l)
                out = torch.exp(lse - new) * out + torch.exp(l - new) * o
                lse = new
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.cp, ctx.dropout_p, ctx.rng = cp, dropout_p, rng
        return out.to(q.dtype)

    @staticmethod
    def backward(ctx, grad):
        q, k, v, out, lse = ctx.saved_tensors
        cp, dropout_p = ctx.cp, ctx.dropout_p
        positions = cp.positions(q.device)
        rep = q.shape[1] // k.shape[1]
        scale = 1.0 / math.sqrt(q.shape[-1])
        acc, dt = _acc(q), q.dtype                # accumulate wide, multiply in q's dtype
        grad = grad.to(dt)
        delta = (grad.to(acc) * out).sum(dim=-1, keepdim=True)
        dq = torch.zeros(q.shape, dtype=acc, device=q.device)
        kv, dkv = torch.stack([k, v]), torch.zeros((2, *k.shape), dtype=acc, device=k.device)
        with torch.random.fork_rng(devices=[q.device] if q.device.type == "cuda" else [],
                                   enabled=bool(dropout_p)):
            if dropout_p:
                _set_rng_state(q.device, ctx.rng)
            for j in range(cp.cp):
                if j:
                    kv, dkv = _pass(torch.stack([kv, dkv]), cp.group).unbind(0)
                keys, values = _expand(kv[0], rep).to(dt), _expand(kv[1], rep).to(dt)
                probs, _ = _probs(q, keys, _visible(cp, j, positions), lse)
                keep = _keep(probs, dropout_p)
                dprobs = (grad @ values.transpose(-2, -1)).to(acc)
                dv = (probs if keep is None else probs * keep).to(dt).transpose(-2, -1) @ grad
                if keep is not None:
                    dprobs = dprobs * keep
                dscores = (probs * (dprobs - delta) * scale).to(dt)
                dq += (dscores @ keys).to(acc)
                dk = dscores.transpose(-2, -1) @ q
                dkv = dkv + torch.stack([_fold(dk.to(acc), rep), _fold(dv.to(acc), rep)])
        dkv = _pass(dkv, cp.group)            # each block's gradient home to its owner
        return dq.to(dt), dkv[0].to(k.dtype), dkv[1].to(v.dtype), None, None


def _visible(cp: ContextParallel, step: int, positions: torch.Tensor) -> torch.Tensor:
    """(local queries, keys of the block in hand at ``step``) mask (:meth:`ContextParallel.
    visible`): the block of rank ``rank - step``."""
    keys = chunk_positions(cp.seq_len, cp.cp, (cp.rank - step) % cp.cp).to(positions.device)
    return cp.visible(positions, keys)


def _fold(t: torch.Tensor, rep: int) -> torch.Tensor:
    """A gradient over expanded key/value heads (b, heads, s, hd) summed back onto the
    ``heads / rep`` key/value heads it was repeated from."""
    if rep == 1:
        return t
    b, h, s, d = t.shape
    return t.view(b, h // rep, rep, s, d).sum(dim=2)


def _rng_state(device: torch.device) -> torch.Tensor:
    return torch.cuda.get_rng_state(device) if device.type == "cuda" else torch.get_rng_state()


def _set_rng_state(device: torch.device, state: torch.Tensor) -> None:
    if device.type == "cuda":
        torch.cuda.set_rng_state(state, device)
    else:
        torch.set_rng_state(state)


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cp: ContextParallel,
           dropout_p: float = 0.0, scale: float | None = None) -> torch.Tensor:
    """Causal attention of this rank's queries ``q`` (b, heads, s/cp, hd) over the whole
    sequence, exchanging the keys and values (b, kv_heads, s/cp, hd) as ``cp.method`` says:
    all-gathered (then one scaled-dot-product attention under :meth:`ContextParallel.
    causal_mask`, grouped-query heads repeated) or passed around the ring
    (:func:`ring_attention`). ``scale``: the scores' factor (None: 1/sqrt(hd)). Returns
    (b, heads, s/cp, hd). The built-in GPT's and the Hugging Face stages' attention
    (:mod:`engine.hf_arch`) both call this."""
    import torch.nn.functional as F

    if cp.method == "ring":
        default = 1.0 / math.sqrt(q.shape[-1])
        if scale is not None and scale != default:
            q = q * (scale / default)        # the ring scales scores by 1/sqrt(hd)
        return ring_attention(q, k, v, cp, dropout_p)
    k, v = cp.gather(k, 2), cp.gather(v, 2)
    rep = q.shape[1] // k.shape[1]
    if rep > 1:
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=cp.causal_mask(q.device),
                                          dropout_p=dropout_p, scale=scale)


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cp: ContextParallel,
                   dropout_p: float = 0.0) -> torch.Tensor:
    """Causal attention of this rank's queries ``q`` (b, heads, s/cp, hd) over the whole
    sequence, the keys and values (b, kv_heads, s/cp, hd) passed around the ring
    (:class:`_Ring`, module docstring); returns (b, heads, s/cp, hd)."""
    return _Ring.apply(q, k, v, cp, dropout_p)


def _pass(t: torch.Tensor, group) -> torch.Tensor:
    """``t`` sent to the next rank of ``group``; the tensor the previous rank sent. One
    batched send + receive, waited for before returning (blocking, like
    :class:`_GatherAlong`)."""
    import torch.distributed as dist

    n, me = dist.get_world_size(group), dist.get_rank(group)
    t = t.contiguous()
    out = torch.empty_like(t)
    ops = [dist.P2POp(dist.isend, t, dist.get_global_rank(group, (me + 1) % n), group),
           dist.P2POp(dist.irecv, out, dist.get_global_rank(group, (me - 1) % n), group)]
    for work in dist.batch_isend_irecv(ops):
        work.wait()
    return out


class _GatherAlong(torch.autograd.Function):
    """All-gather along ``dim`` in rank order, and the reduce-scatter of its gradient, as
    blocking c10d calls (``all_gather_into_tensor`` / ``reduce_scatter_tensor`` over dim 0,
    the layout both use). The functional collectives' asynchronous tensors, which this
    replaced, crashed gloo runs now and then with heap corruption (about one 20-step run in
    nine of the README's context-parallel example); a blocking call leaves no buffer in
    flight when the step moves on."""

    @staticmethod
    def forward(ctx, t: torch.Tensor, dim: int, group) -> torch.Tensor:
        import torch.distributed as dist

        ctx.dim, ctx.group = dim, group
        n = dist.get_world_size(group)
        local = t.movedim(dim, 0).contiguous()
        out = local.new_empty((n * local.shape[0], *local.shape[1:]))
        dist.all_gather_into_tensor(out, local, group=group)
        return out.movedim(0, dim)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        import torch.distributed as dist

        n = dist.get_world_size(ctx.group)
        whole = grad.movedim(ctx.dim, 0).contiguous()
        out = whole.new_empty((whole.shape[0] // n, *whole.shape[1:]))
        dist.reduce_scatter_tensor(out, whole, group=ctx.group)
        return out.movedim(0, ctx.dim), None, None

