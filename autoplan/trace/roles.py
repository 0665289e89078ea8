"""Megatron-style tensor-parallel roles (Shoeybi et al. 2019, arXiv 1909.08053).

The rule (also in :mod:`autoplan.graph`), applied to each layer on its own. A *weight op*
is a matmul/convolution reading a parameter.

* Seeds: the layer's residual-stream input — the tensors entering the layer whose shape
  equals a tensor leaving it; for a layer that changes shape (a downsampling residual
  block, ``<pre>``, ``<post>``), the largest tensor entering it (floating point first, the
  one read first on a tie: the tokens, not the labels).
* R, the residual stream: ops reachable from a seed without passing a weight op, plus ops
  from which the layer output is reachable without passing a weight op (the residual adds
  and what feeds them directly, e.g. the dropout after a projection).
* ``column``: a weight op with an activation input in R (or a seed). ``row``: a weight op
  whose output flows into R (or out of the layer) through non-weight ops. A weight op that is both — a projection
  from the stream straight back into it, like a 1x1 shortcut convolution — is
  ``replicated``: Megatron has no sharding for it without an extra collective.
* ``sharded``: ops fed by a column op, outside R, that lead to a row op (attention, the
  MLP activation) — or that never return to R at all (the cross-entropy after a
  column-parallel LM head: vocabulary-parallel loss, as
  ``torch.distributed.tensor.parallel.loss_parallel`` computes it).
* The token embedding — an ``embedding`` lookup of a parameter by indices the batch feeds
  in (the token ids; not positions made inside the model) — is ``row``: vocabulary
  parallel, each rank holding 1/t of the vocabulary's rows and the partial lookups summed
  over TP (Megatron-LM's ``VocabParallelEmbedding``, Shoeybi et al. 2019 sec. 3; torchtitan
  shards ``tok_embeddings`` the same way with ``RowwiseParallel``).
* Everything else is ``replicated``. Views of a parameter (``t(weight)``) take the role of
  the weight op they feed.

Parameter sharding dims (:func:`param_tp_dim`): a column op shards the weight on its output
features, a row op on its input features, found through the strides of the operand the
parameter feeds (so ``nn.Linear`` weights (out, in) give 0 / 1 and Hugging Face ``Conv1D``
weights (in, out) give 1 / 0); convolution weights (out, in, k...) give 0 / 1. Biases of
column ops are sharded on dim 0; a token embedding's weight (vocab, hidden) on dim 0; biases
of row ops, and all other parameters (position embeddings, norms), are replicated.
"""

from __future__ import annotations

from collections import deque
from typing import Iterable

import torch

from autoplan.graph import TPRole
from autoplan.trace.capture import CapturedOp, storage_key
from autoplan.trace.dataflow import Dataflow
from autoplan.trace.flops import tensor_nbytes

_CONV = frozenset({"convolution", "_convolution", "conv1d", "conv2d", "conv3d",
                   "cudnn_convolution", "convolution_overrideable", "_slow_conv2d_forward"})
# positions of the (left, right) matrix operands among the op's tensor arguments
_MATMUL_OPERANDS = {"mm": (0, 1), "bmm": (0, 1), "addmm": (1, 2), "baddbmm": (1, 2),
                    "matmul": (0, 1)}


def _bfs(starts: Iterable[int], step, accept) -> set[int]:
    seen: set[int] = set()
    queue = deque(starts)
    while queue:
        i = queue.popleft()
        if i in seen or not accept(i):
            continue
        seen.add(i)
        queue.extend(step(i))
    return seen


def layer_roles(ops: list[CapturedOp], flow: Dataflow, start: int, stop: int
                ) -> dict[int, TPRole]:
    """TP role of every op in the layer [start, stop) (module docstring)."""
    inside = range(start, stop)
    in_layer = lambda i: start <= i < stop           # noqa: E731
    weight = flow.is_weight_op

    # tensors entering the layer (activations from earlier layers, batch inputs) and leaving it
    entering: list[tuple[torch.Tensor, int]] = []    # (tensor, consuming op)
    for i in inside:
        io = flow.io[i]
        entering.extend((t, i) for t, p in io.activations if not in_layer(p))
        entering.extend((t, i) for t, _ in io.batch_inputs)
    outputs = {i for i in inside if any(c >= stop for c in flow.consumers[i])}
    out_shapes = {tuple(t.shape) for i in outputs for t in ops[i].out_tensors}
    seeds = [(t, i) for t, i in entering if tuple(t.shape) in out_shapes]
    if not seeds and entering:
        # the largest entering tensor, floating point first, the earliest consumed on a tie
        main = min(entering, key=lambda e: (not e[0].is_floating_point(),
                                            -tensor_nbytes(e[0]), e[1]))[0]
        seeds = [(t, i) for t, i in entering if storage_key(t) == storage_key(main)]
    seed_consumers = {i for _, i in seeds}

    # R: forward from the seeds, backward from the outputs, never through a weight op
    residual = _bfs(seed_consumers, lambda i: [c for c in flow.consumers[i] if in_layer(c)],
                    lambda i: not weight[i])
    residual |= _bfs(outputs, lambda i: [p for p in flow.producers[i] if in_layer(p)],
                     lambda i: not weight[i])

    roles: dict[int, TPRole] = {i: "replicated" for i in inside}
    column: set[int] = set()
    row: set[int] = set()
    for i in inside:
        if not weight[i]:
            continue
        fed_by_r = i in seed_consumers or any(p in residual for p in flow.producers[i])
        # does the output reach R (or leave the layer) through non-weight ops?
        reached = _bfs((c for c in flow.consumers[i] if in_layer(c)),
                       lambda j: [c for c in flow.consumers[j] if in_layer(c)],
                       lambda j: not weight[j])
        feeds_r = i in outputs or any(j in residual or j in outputs for j in reached)
        if fed_by_r and not feeds_r:
            column.add(i)
        elif feeds_r and not fed_by_r:
            row.add(i)

    # sharded: downstream of a column op, outside R, leading to a row op or to no R at all
    downstream = _bfs((c for i in column for c in flow.consumers[i] if in_layer(c)),
                      lambda i: [c for c in flow.consumers[i] if in_layer(c)],
                      lambda i: not weight[i] and i not in residual)
    to_row = _bfs((p for i in row for p in flow.producers[i] if p in downstream),
                  lambda i: [p for p in flow.producers[i] if p in downstream],
                  lambda i: True)
    to_residual = _bfs((p for i in residual for p in flow.producers[i] if p in downstream),
                       lambda i: [p for p in flow.producers[i] if p in downstream],
                       lambda i: True)
    for i in downstream:
        if i in to_row or i not in to_residual:
            roles[i] = "sharded"
    for i in column:
        roles[i] = "column"
    for i in row:
        roles[i] = "row"
    for i in inside:
        if token_embedding(ops[i], flow.io[i]):
            roles[i] = "row"
    # views of parameters follow the weight op they feed
    for i in inside:
        if weight[i] and roles[i] in ("column", "row"):
            for v in flow.io[i].param_views:
                if in_layer(v):
                    roles[v] = roles[i]
    return roles


def token_embedding(op: CapturedOp, io) -> bool:
    """Is ``op`` a token embedding: an ``embedding`` lookup of a 2-D parameter by indices
    that are a batch input (module docstring)?"""
    if op.func.overloadpacket.__name__ != "embedding" or not io.params or not io.batch_inputs:
        return False
    weight = op.in_tensors[0] if op.in_tensors else None
    return weight is not None and weight.dim() == 2 and any(
        storage_key(t) == storage_key(weight) for t, _ in io.params)


def param_tp_dim(op: CapturedOp, param: torch.Tensor, role: TPRole) -> int | None:
    """The dim of ``param`` sharded when ``op`` (a column or row op) reads it, or None."""
    if role not in ("column", "row"):
        return None
    if op.func.overloadpacket.__name__ == "embedding":
        return 0 if role == "row" else None          # vocabulary parallel (module docstring)
    if param.dim() <= 1:
        return 0 if role == "column" else None
    name = op.func.overloadpacket.__name__
    if name in _CONV:
        return 0 if role == "column" else 1
    operands = _MATMUL_OPERANDS.get(name)
    if operands is not None:
        key = storage_key(param)
        for pos, operand in enumerate(op.in_tensors):
            if storage_key(operand) != key or operand.dim() < 2:
                continue
            # weight as the right operand x @ W: out features on dim -1, input on dim -2;
            # as the left operand W @ x: out features on dim -2, input on dim -1.
            right = pos == operands[1]
            out_dim, in_dim = (-1, -2) if right else (-2, -1)
            op_dim = out_dim if role == "column" else in_dim
            found = _matching_dim(param, operand, op_dim)
            if found is not None:
                return found
    return 0 if role == "column" else 1


def _matching_dim(param: torch.Tensor, view: torch.Tensor, view_dim: int) -> int | None:
    """The dim of ``param`` that dim ``view_dim`` of its view ``view`` walks along."""
    size, stride = view.shape[view_dim], view.stride()[view_dim]
    matches = [d for d in range(param.dim())
               if param.shape[d] == size and param.stride()[d] == stride]
    return matches[0] if len(matches) == 1 else None
