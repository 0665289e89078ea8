"""OpGraph: the traced model, as plain data.

The tracer (:mod:`autoplan.trace`) produces an :class:`OpGraph` from an ``nn.Module`` on
the meta device; everything downstream (cost model, planners, reports) reads only this.

Contents:

* :class:`OpNode` — one aten op of the forward pass: op name, input/output shapes and
  dtypes, forward and backward FLOPs, bytes read and written, parameters read, module path,
  layer index, how many bytes of its output backward keeps alive, and its Megatron-style
  tensor-parallel role.
* :class:`Layer` — a contiguous group of ops: one repeated block (``blocks.7``) or the
  non-repeated parts before / after the blocks (``<pre>``: embeddings, ``<post>``: final
  norm, head, loss). Layers with the same ``kind`` are copies of one block.
* :class:`LayerStats` — the per-layer aggregates the cost model needs, at the traced
  micro-batch. FLOPs, bytes and activations scale linearly in the micro-batch size; the
  parameter figures do not.

Tensor-parallel roles (Megatron-LM, Shoeybi et al. 2019, arXiv 1909.08053): inside a layer,
let R be the ops reachable from the layer input without passing through a parameterised
matmul/conv (the residual stream and the norms on it). A weight op whose activation input is
in R is ``column`` parallel (weight sharded on its output features); one whose output flows
back into R is ``row`` parallel (sharded on input features, all-reduce of its output in
forward). Ops between a column and a row op work on sharded activations (``sharded``); the
rest are ``replicated``. Under TP degree t, ``sharded``/``column``/``row`` ops do 1/t of the
work; under sequence parallelism the ``replicated`` ops do too.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Iterator, Literal

TPRole = Literal["column", "row", "sharded", "replicated"]

DTYPE_BYTES: dict[str, int] = {
    "float64": 8, "float32": 4, "float16": 2, "bfloat16": 2, "int64": 8, "int32": 4,
    "int16": 2, "int8": 1, "uint8": 1, "bool": 1, "float8_e4m3fn": 1, "float8_e5m2": 1,
    "complex64": 8,
}


@dataclass(frozen=True)
class TensorMeta:
    """Shape and dtype of one tensor (dtype as torch spells it without 'torch.')."""

    shape: tuple[int, ...]
    dtype: str

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * DTYPE_BYTES.get(self.dtype, 4)


@dataclass
class OpNode:
    """One aten op of the forward graph."""

    name: str                                  # fx node name, unique in the graph
    op: str                                    # e.g. "aten.mm.default"
    inputs: list[str]                          # names of producer OpNodes (activations only)
    input_meta: list[TensorMeta]               # every tensor argument, params included
    output_meta: list[TensorMeta]
    fwd_flops: float
    bwd_flops: float
    bytes_read: int
    bytes_written: int
    params: list[str] = field(default_factory=list)   # parameter FQNs this op reads
    module_path: str = ""                      # innermost module, e.g. "blocks.3.mlp.fc1"
    module_type: str = ""                      # its class name, e.g. "Linear"
    layer: int = 0                             # index into OpGraph.layers
    saved_bytes: int = 0                       # bytes of this op's outputs backward keeps
    saved_is_attention_matrix: bool = False    # a (b, heads, s, s)-shaped saved tensor
    tp_role: TPRole = "replicated"
    causal: bool = False                       # an attention op called with is_causal=True


@dataclass(frozen=True)
class ParamInfo:
    name: str                                  # FQN, e.g. "blocks.3.mlp.fc1.weight"
    shape: tuple[int, ...]
    dtype: str
    layer: int
    tp_role: TPRole = "replicated"             # of the op that reads it
    tp_dim: int | None = None                  # dim sharded under TP (0 column, 1 row), or None
    experts: int = 0                           # E: dim 0 runs over E experts (0: not an expert weight)
    top_k: int = 0                             # experts each token uses (expert weights)

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def active_numel(self) -> float:
        """Elements one token uses: top_k / E of an expert weight, all of any other."""
        return self.numel * self.top_k / self.experts if self.experts else self.numel


@dataclass(frozen=True)
class LayerStats:
    """Aggregates of one layer at the traced micro-batch (see module docstring).

    ``*_tp`` fields are the part that divides by the TP degree; the rest is replicated
    (and divides by the TP degree too only under sequence parallelism).
    """

    fwd_flops: float = 0.0
    bwd_flops: float = 0.0
    fwd_flops_tp: float = 0.0
    bwd_flops_tp: float = 0.0
    matmul_flops: float = 0.0          # forward FLOPs of matmul/conv ops (compute-bound part)
    bytes_moved: float = 0.0           # forward bytes read + written, all ops
    bytes_moved_tp: float = 0.0
    params: int = 0                    # parameter count
    params_tp: int = 0                 # of which sharded under TP
    param_bytes: int = 0               # at the traced dtype
    saved_bytes: int = 0               # activations kept for backward (no recomputation)
    saved_bytes_tp: int = 0            # of which sharded under TP
    saved_bytes_attn: int = 0          # of which attention-matrix sized (dropped by flash attn)
    input_bytes: int = 0               # the layer's input activation (kept under recomputation)
    output_bytes: int = 0              # the layer's output activation (pipeline send size)
    tp_allreduce_fwd_bytes: int = 0    # sum of row-op outputs: all-reduced in forward under TP
    tp_allreduce_bwd_bytes: int = 0    # sum of column-op inputs: grad all-reduced in backward
    expert_params: int = 0             # of params, expert weights (split by expert parallelism)
    expert_params_tp: int = 0          # of which sharded under TP too
    moe_a2a_bytes: int = 0             # one expert all-to-all's bytes per rank (dispatch or combine)
    kv_bytes: int = 0                  # keys + values entering attention (context parallelism)


@dataclass
class Layer:
    index: int
    name: str                  # "<pre>", "blocks.7", "<post>"
    kind: str                  # blocks with equal kind are structurally identical copies
    nodes: list[str]           # OpNode names, in execution order
    stats: LayerStats = field(default_factory=LayerStats)


@dataclass(frozen=True)
class BatchSpec:
    """What the graph was traced for. ``batch_size`` is the micro-batch traced."""

    batch_size: int
    seq_len: int | None = None
    input_shapes: tuple[tuple[int, ...], ...] = ()
    input_dtypes: tuple[str, ...] = ()


@dataclass
class OpGraph:
    model_name: str
    fingerprint: str                       # sha256 over the architecture (class, config, params)
    batch: BatchSpec
    nodes: dict[str, OpNode]               # in execution order
    params: dict[str, ParamInfo]
    layers: list[Layer]
    dtype: str = "float32"                 # parameter dtype traced
    trace_seconds: float = 0.0

    # ---- convenience views -------------------------------------------------------------
    def __iter__(self) -> Iterator[OpNode]:
        return iter(self.nodes.values())

    def __len__(self) -> int:
        return len(self.nodes)

    @property
    def num_params(self) -> int:
        return sum(p.numel for p in self.params.values())

    @property
    def active_params(self) -> int:
        """Parameters one token uses (mixture of experts: top_k of E expert weights)."""
        return round(sum(p.active_numel for p in self.params.values()))

    @property
    def experts(self) -> int:
        """E of the model's mixture-of-experts layers (the largest), 0 if it has none."""
        return max((p.experts for p in self.params.values()), default=0)

    @property
    def fwd_flops(self) -> float:
        return sum(layer.stats.fwd_flops for layer in self.layers)

    @property
    def bwd_flops(self) -> float:
        return sum(layer.stats.bwd_flops for layer in self.layers)

    def layer_kinds(self) -> dict[str, list[int]]:
        """kind -> indices of the layers of that kind, e.g. {"Block#a1b2": [1, ..., 96]}."""
        kinds: dict[str, list[int]] = {}
        for layer in self.layers:
            kinds.setdefault(layer.kind, []).append(layer.index)
        return kinds

    def blocks(self) -> list[Layer]:
        """The repeated layers (everything but <pre> and <post>)."""
        return [layer for layer in self.layers if not layer.name.startswith("<")]

    def summary(self) -> dict:
        kinds = self.layer_kinds()
        return {
            "model": self.model_name,
            "fingerprint": self.fingerprint,
            "ops": len(self.nodes),
            "params": self.num_params,
            "active_params": self.active_params,
            "layers": len(self.layers),
            "layer_kinds": {k: len(v) for k, v in kinds.items()},
            "fwd_flops": self.fwd_flops,
            "bwd_flops": self.bwd_flops,
            "saved_activation_bytes": sum(l.stats.saved_bytes for l in self.layers),
            "micro_batch": self.batch.batch_size,
            "seq_len": self.batch.seq_len,
            "trace_seconds": round(self.trace_seconds, 3),
        }
