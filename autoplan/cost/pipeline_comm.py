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
(:func:`engine.pipeline.scatter_gather`). The pricers charge the send of the slices (the
grid's :meth:`~autoplan.planner.grid.estimate.Estimator._send` divides the output by tp; the
search divides a stage's output over its whole submesh). The receiver's all-gather inside the
node is not priced: for GPT-3 175B at one sequence per micro-batch and TP 8 the send moves
6.3 MB per rank over InfiniBand (~0.26 ms) and the all-gather 50 MB over NVSwitch
(~0.19 ms), against ~0.1 s of a stage's compute per micro-batch; nor is the whole tensor a
rank sends where tp does not divide the sequence.

Both ends: a rank pays, per micro-batch, its own boundary (its output's send paired with its
gradient's receipt) and the one before it (its input's receipt paired with its input
gradient's send): torch's ``Schedule1F1B`` batches exactly those pairs
(``fwd_send_bwd_recv``, ``bwd_send_fwd_recv``), and a pair's two transfers run at once in
opposite directions. The step model charges each chunk s(c) + s(c - 1)
(:func:`autoplan.cost.step.path_times`): the first rank one boundary, the last (which holds
the LM head and is often the slowest) its input's.
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

