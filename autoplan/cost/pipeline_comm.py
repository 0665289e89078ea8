"""What a pipeline stage boundary sends, and what it costs on each side.

One place for the rule the engine runs (:mod:`engine.pipeline`) and the pricers follow.

**Scatter/gather** (Narayanan et al. 2021, sec. 4.1). The activation leaving a stage is the
residual stream, (b, s, h). Under sequence parallelism each tensor-parallel rank already
holds its (b, s/t, h) shard and sends that. Without it every TP rank holds the whole,
identical tensor; sending it from each of the t ranks would move t copies over the
inter-node link, so each rank sends only its 1/t slice of the sequence and the receiving
stage all-gathers the slices over its TP group (NVLink inside a node)::

    shards     = t   if sequence parallel, or t > 1 and t divides s
               = 1   otherwise (the whole tensor, from every TP rank)
    send(c)    = send_recv(out_bytes(c) / (shards · cp))           across the boundary
    gather(c)  = all_gather(out_bytes(c) / cp, TP group)  if scattered without SP, else 0

In backward the gradient takes the same path reversed (an all-gather on the sending stage's
side), so each boundary costs ``send + gather`` in each direction. The engine runs this rule
(:func:`engine.pipeline.scatter_gather`). The pricers charge the send (the grid:
:meth:`autoplan.planner.grid.estimate.Estimator._send`; the search divides a stage's output
over its whole submesh); the all-gather runs inside a node over NVLink and is left out (for a
GPT-3 175B micro-batch of one sequence, 6 MB per rank: ~30 us against ~0.5 ms for the send
over InfiniBand).

Both ends: a rank pays, per micro-batch, its own boundary (its output's send paired with its
gradient's receipt) and the one before it (its input's receipt paired with its input
gradient's send): torch's ``Schedule1F1B`` batches exactly those pairs
(``fwd_send_bwd_recv``, ``bwd_send_fwd_recv``). The step model charges each boundary twice
to its sending chunk (:attr:`autoplan.cost.step.ChunkCost.time`): the sum over ranks is the
same, but the last rank, which receives and sends once each, is charged nothing, and the
first twice its one pair. Where the last stage is the slowest (it holds the LM head) the
steady state is under-priced by one send per micro-batch.
"""

from __future__ import annotations


def boundary_shards(tp: int, sequence_parallel: bool, seq_len: int | None) -> int:
    """Slices a stage's output is sent in, one per TP rank (module docstring): ``tp`` under
    sequence parallelism or when ``tp`` divides the sequence, else 1."""
    if tp <= 1:
        return 1
    if sequence_parallel:
        return tp
    return tp if seq_len and seq_len % tp == 0 else 1
