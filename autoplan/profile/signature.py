"""Op signatures: what an op profile is keyed by, and their tensor-parallel shards.

A :class:`Signature` is an aten op with the dtypes and shapes of its tensor inputs and
outputs — the :class:`~autoplan.graph.OpNode` minus everything that does not change its
running time. The output shapes are part of it because they pin down the non-tensor
arguments the graph does not record (the dim of a reduction, the shape of a view).

Sharding by a tensor-parallel degree ``t`` (Megatron-LM, Shoeybi et al. 2019, arXiv
1909.08053) gives the shapes one rank works on, sizes rounded up (``ceil(d / t)``, the
largest shard of an uneven split). :func:`shard_candidates` proposes, in order:

1. for matmuls by their ``tp_role``: ``column`` splits the weight's output features (and the
   bias and the output's last dim), ``row`` the input features (the activation's last dim);
2. attention ops (q, k, v of shape ``(b, heads, s, d)``): the heads dim;
3. ``bmm``-like batched matmuls: the batch dim 0;
4. otherwise the last dim of every floating tensor (the hidden / feature dim that a
   column-parallel op leaves sharded), then dim 0, then dim 1;
5. last resort, for ops that move dims around (transposes, matmuls without a role): dim
   ``d`` of one floating input with dim ``e`` of the outputs, for every (input, d, e).

Index tensors (integer dtypes) are never split; floating tensors and boolean masks are. The profiler keeps the first candidate whose
arguments it can reconstruct (:mod:`autoplan.profile.replay`): every candidate divides the
op's work by about ``t``, they differ only in which dim carries the split.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterator

from autoplan.graph import OpNode, TensorMeta
from autoplan.profile.store import signature_key

FLOAT_DTYPES = ("float64", "float32", "float16", "bfloat16", "float8_e4m3fn", "float8_e5m2")
_SPLITTABLE = (*FLOAT_DTYPES, "bool")
_ATTENTION = ("scaled_dot_product", "flash_attention", "efficient_attention", "cudnn_attention")
_BATCHED_MATMUL = ("aten.bmm.", "aten.baddbmm.")


@dataclass(frozen=True)
class Signature:
    op: str
    inputs: tuple[TensorMeta, ...]
    outputs: tuple[TensorMeta, ...]

    @property
    def key(self) -> str:
        return signature_key(self.op, self.inputs, self.outputs)

    @property
    def dtype(self) -> str:
        """The compute dtype: of the first floating input, else of the first tensor."""
        for t in (*self.inputs, *self.outputs):
            if t.dtype in FLOAT_DTYPES:
                return t.dtype
        tensors = (*self.inputs, *self.outputs)
        return tensors[0].dtype if tensors else "none"

    @property
    def bytes(self) -> int:
        """Bytes of every input and output (a lower bound on memory traffic)."""
        return sum(t.nbytes for t in (*self.inputs, *self.outputs))

    def with_float_dtype(self, dtype: str) -> "Signature":
        """The same op with every floating tensor in ``dtype``."""
        def cast(m: TensorMeta) -> TensorMeta:
            return TensorMeta(m.shape, dtype) if m.dtype in FLOAT_DTYPES else m

        return Signature(self.op, tuple(map(cast, self.inputs)), tuple(map(cast, self.outputs)))

    @classmethod
    def of(cls, node: OpNode) -> "Signature":
        return cls(op=node.op, inputs=tuple(node.input_meta), outputs=tuple(node.output_meta))


def tp_degree(shard: float) -> int:
    """The integer TP degree from ``shard``: a degree ``t >= 1``, or a fraction ``1/t``."""
    if not shard > 0:
        raise ValueError(f"shard must be positive, got {shard!r}")
    return max(1, round(shard if shard >= 1 else 1.0 / shard))


def shard_candidates(sig: Signature, role: str, t: int) -> Iterator[Signature]:
    """Shards of ``sig`` for TP degree ``t``, most plausible first (module docstring)."""
    if t <= 1:
        yield sig
        return
    seen: set[str] = set()
    for cand in _candidates(sig, role, t):
        if cand is not None and cand.key not in seen and cand != sig:
            seen.add(cand.key)
            yield cand


def _candidates(sig: Signature, role: str, t: int) -> Iterator[Signature | None]:
    if role in ("column", "row"):
        yield _matmul_shard(sig, role, t)
    if any(a in sig.op for a in _ATTENTION):
        yield _split_all(sig, t, lambda m: 1 if len(m.shape) >= 3 else None)
    if sig.op.startswith(_BATCHED_MATMUL):
        yield _split_all(sig, t, lambda m: 0)
    yield _split_all(sig, t, lambda m: len(m.shape) - 1 if m.shape else None)
    yield _split_all(sig, t, lambda m: 0 if m.shape else None)
    yield _split_all(sig, t, lambda m: 1 if len(m.shape) >= 2 else None)
    rank = max((len(o.shape) for o in sig.outputs), default=0)
    for i, m in enumerate(sig.inputs):
        if m.dtype not in FLOAT_DTYPES:
            continue
        for d in reversed(range(len(m.shape))):
            ins = list(sig.inputs)
            ins[i] = _split(m, d, t)
            for e in reversed(range(rank)):
                yield Signature(sig.op, tuple(ins), tuple(
                    _split(o, e, t) if e < len(o.shape) else o for o in sig.outputs))


def _split(m: TensorMeta, dim: int | None, t: int) -> TensorMeta:
    if dim is None or m.dtype not in _SPLITTABLE or m.shape[dim] <= 1:
        return m
    shape = list(m.shape)
    shape[dim] = math.ceil(shape[dim] / t)
    return TensorMeta(tuple(shape), m.dtype)


def _split_all(sig: Signature, t: int, dim_of) -> Signature:
    return Signature(sig.op, tuple(_split(m, dim_of(m), t) for m in sig.inputs),
                     tuple(_split(m, dim_of(m), t) for m in sig.outputs))


def _matmul_shard(sig: Signature, role: str, t: int) -> Signature | None:
    """Positional Megatron rule for linear / mm / addmm / matmul with a 2-D weight.

    linear(x, W[out, in], b[out]); mm(x, W^T[in, out]); addmm(b, x, W^T[in, out]).
    column: out features / t (W, b, output last dim); row: in features / t (x last dim, W).
    """
    name = sig.op.split(".")[1] if sig.op.startswith("aten.") else sig.op
    ins = list(sig.inputs)
    outs = list(sig.outputs)
    if name == "linear" and len(ins) >= 2 and len(ins[1].shape) == 2:
        x, w = 0, 1
        w_out, w_in = 0, 1
        bias = 2 if len(ins) > 2 else None
    elif name in ("mm", "matmul") and len(ins) == 2 and len(ins[1].shape) == 2:
        x, w, w_out, w_in, bias = 0, 1, 1, 0, None
    elif name == "addmm" and len(ins) == 3:
        x, w, w_out, w_in, bias = 1, 2, 1, 0, 0
    else:
        return None
    if role == "column":
        ins[w] = _split(ins[w], w_out, t)
        if bias is not None:
            ins[bias] = _split(ins[bias], len(ins[bias].shape) - 1, t)
        outs = [_split(o, len(o.shape) - 1, t) for o in outs]
    else:
        ins[x] = _split(ins[x], len(ins[x].shape) - 1, t)
        ins[w] = _split(ins[w], w_in, t)
    return Signature(sig.op, tuple(ins), tuple(outs))
