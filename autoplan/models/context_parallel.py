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

This module gives the engine-side pieces both the built-in GPT and the cost model share:
which positions a rank holds, its rows of a batch, and the differentiable all-gather.
"""

from __future__ import annotations

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
        """(local queries, all keys) boolean mask: a query sees keys at or before it."""
        return self.positions(device)[:, None] >= self.all_positions(device)[None, :]


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

