"""Trace three blocks, replicate the middle one: the OpGraph of a deep stack of equal blocks.

    graph = trace_replicated(resolve("llama3-405b"), 1, 8192, dtype=torch.bfloat16)

Tracing runs every op of the model on fake tensors, so it costs time in proportion to the
number of blocks L (126 for Llama-3 405B), although every block of a built-in GPT is the same
module run on the same shapes. Here the model is traced with k = :data:`TRACED_BLOCKS` = 3
blocks — the first, one middle block, the last — and the L-block graph is assembled from it:

    <pre>, block 0, (block 1 renamed to 1 .. L-2), block 2 renamed to L-1, <post>

**Why it is exact.** Every quantity the tracer stores is a function of the ops of one layer
and the tensors crossing that layer's boundary (:mod:`~autoplan.trace.stats`,
:mod:`~autoplan.trace.saved`, :mod:`~autoplan.trace.roles`): an op's shapes, FLOPs and
bytes come from its own arguments; TP roles are computed within a layer; saved activations
count in the layer whose backward needs them; ``input_bytes`` / ``output_bytes`` are the
tensors entering from and leaving for other layers. In the built-in GPT family
(:mod:`autoplan.models.gpt`) block i is ``Block(cfg)`` applied to the output of block i-1
(:meth:`GPT.forward` loops ``x = block(x)``; the config's ``layers`` only sets how many
blocks there are), so block i's ops are block 1's with ``blocks.1`` renamed ``blocks.i``,
its only activation input is the previous block's output (or the embedding's, for block 0)
and its output is read only by the next block (or ``<post>``). Hence, in the L-block trace,

* ``<pre>`` and block 0 see the same ops, successor and reads as in the 3-block trace;
* every block 1 .. L-2 has a block before and after it, exactly like the 3-block trace's
  block 1;
* block L-1 has a block before it and ``<post>`` after it, like the 3-block trace's block 2,
  and ``<post>`` reads the last block's output as there.

Node names are the tracer's ``<op>_<n>`` with n counting that op over the whole forward
(:mod:`~autoplan.trace.capture`), so they are regenerated in execution order; a node's
inputs (dataflow edges) are remapped by position within its block (same block, previous
block, or ``<pre>``); ``layer``, ``module_path``, parameter FQNs and layer names are
renamed to the block's index; the params dict lists every block's parameters in
``named_parameters`` order. The fingerprint and name are the full spec's.

The argument is checked on the traced graph before it is trusted: the three blocks have
one kind and equal op sequences; the last block reads the middle one exactly as the middle
one reads the first; no block reads another block's parameters or a block further back;
``<post>`` reads only ``<pre>``, the last block and itself; regenerating the 3-block
graph's own names gives its names back. A failed check (:class:`NotReplicable`) falls back
to tracing the whole model. ``tests/test_trace_replicate.py`` compares the two, node for
node, on GPT-2 style, Llama style (GQA, SwiGLU, RMSNorm), MoE and odd block counts.

Only the built-in GPT family is replicated (:func:`truncated_spec`); Hugging Face, vision
and user ``nn.Module`` models are traced whole.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any, Callable

from autoplan.graph import Layer, OpGraph, OpNode, ParamInfo

#: Blocks traced before replication: the first, one middle block, the last.
TRACED_BLOCKS = 3


class NotReplicable(Exception):
    """The traced graph does not have the shape replication relies on (the reason)."""


def truncated_spec(spec: Any, blocks: int = TRACED_BLOCKS) -> tuple[Any, int] | None:
    """(the spec with ``blocks`` blocks, the full spec's block count L), or None when
    ``spec`` is not replicated: not a built-in GPT, or L <= ``blocks``."""
    from autoplan.models.gpt_config import GPTConfig
    from autoplan.models.registry import ModelSpec

    if type(spec) is not ModelSpec or spec.source != "builtin" or spec.name != "gpt":
        return None
    layers = GPTConfig.from_dict(spec.config).layers
    if layers <= blocks:
        return None
    return ModelSpec("builtin", "gpt", {**spec.config, "layers": blocks}), layers


def trace_replicated(spec: Any, batch_size: int, seq_len: int | None = None, *,
                     dtype=None) -> OpGraph:
    """:func:`autoplan.trace.trace` of ``spec``, built from a 3-block trace when ``spec``
    qualifies (module docstring), else the whole model traced."""
    import time

    from autoplan.models import resolve
    from autoplan.trace.tracer import trace

    if isinstance(spec, str):
        spec = resolve(spec)
    small = truncated_spec(spec)
    if small is None:
        return trace(spec, batch_size, seq_len, dtype=dtype)
    t0 = time.perf_counter()
    graph = trace(small[0], batch_size, seq_len, dtype=dtype)
    try:
        full = replicate(graph, small[1], model_name=spec.name,
                         fingerprint=spec.fingerprint())
    except NotReplicable as exc:
        import logging

        logging.getLogger(__name__).info("tracing all %d blocks of %s: %s", small[1],
                                         spec.name, exc)
        return trace(spec, batch_size, seq_len, dtype=dtype)
    full.trace_seconds = time.perf_counter() - t0
    return full


def _op_base(op: str) -> str:
    """``aten._unsafe_view.default`` -> ``_unsafe_view`` (the name the capture counts)."""
    parts = op.split(".")
    return parts[-2] if len(parts) >= 3 else op


def _fresh_names(order: list[str]) -> list[str]:
    """Node names for ops ``order`` (aten op strings) in execution order, as the capture
    names them: the op's base name, then ``_1``, ``_2``, ... for later calls."""
    count: dict[str, int] = {}
    out = []
    for op in order:
        base = _op_base(op)
        n = count.get(base, 0)
        count[base] = n + 1
        out.append(base if n == 0 else f"{base}_{n}")
    return out


def _block_prefix(graph: OpGraph) -> str:
    """``blocks`` for layers named ``blocks.0 .. blocks.k-1`` (checks the layout)."""
    layers = graph.layers
    k = len(layers) - 2
    if k != TRACED_BLOCKS or layers[0].name != "<pre>" or layers[-1].name != "<post>":
        raise NotReplicable(f"expected <pre>, {TRACED_BLOCKS} blocks, <post>; got "
                            f"{[layer.name for layer in layers]}")
    prefix = layers[1].name.rpartition(".")[0]
    if [layer.name for layer in layers[1:-1]] != [f"{prefix}.{i}" for i in range(k)]:
        raise NotReplicable(f"blocks are not named {prefix}.0 .. {prefix}.{k - 1}")
    if len({layer.kind for layer in layers[1:-1]}) != 1:
        raise NotReplicable("the traced blocks are not all of one kind")
    seqs = [[(graph.nodes[n].op, graph.nodes[n].output_meta) for n in layer.nodes]
            for layer in layers[1:-1]]
    if any(s != seqs[0] for s in seqs[1:]):
        raise NotReplicable("the traced blocks run different op sequences")
    return prefix


class _Paths:
    """Which block an FQN or module path is under, and its renaming to another block."""

    def __init__(self, prefix: str):
        self.pattern = re.compile(rf"^{re.escape(prefix)}\.(\d+)(?=\.|$)")
        self.prefix = prefix
        self._split: dict[str, tuple[int | None, str]] = {}

    def split(self, path: str) -> tuple[int | None, str]:
        """(block index, the rest of ``path`` after ``<prefix>.<index>``), or (None, path)
        for a path outside the blocks (memoised: every copy of a block renames the same)."""
        hit = self._split.get(path)
        if hit is None:
            m = self.pattern.match(path)
            hit = (int(m.group(1)), path[m.end():]) if m else (None, path)
            self._split[path] = hit
        return hit

    def block(self, path: str) -> int | None:
        return self.split(path)[0]

    def renamer(self, src: int | None, dst: int | None) -> Callable[[str], str]:
        """Rename paths under block ``src`` to block ``dst``; a path under any other block
        is a NotReplicable (a block reading another block's parameters)."""
        def rename(path: str) -> str:
            b, rest = self.split(path)
            if b != src and b is not None:
                raise NotReplicable(f"{path} is read outside its block")
            if b is None or src == dst:
                return path
            return f"{self.prefix}.{dst}{rest}"
        return rename


def replicate(small: OpGraph, blocks: int, *, model_name: str, fingerprint: str) -> OpGraph:
    """The graph of the same model with ``blocks`` blocks, from ``small``, its trace with
    :data:`TRACED_BLOCKS` (module docstring). Raises :class:`NotReplicable` when ``small``
    fails a check."""
    from autoplan.trace.tracer import graph_dtype

    prefix = _block_prefix(small)
    paths = _Paths(prefix)
    L = blocks
    if L <= TRACED_BLOCKS:
        raise NotReplicable(f"{L} blocks: trace them all")
    if _fresh_names([n.op for n in small.nodes.values()]) != list(small.nodes):
        raise NotReplicable("node names do not follow the capture's numbering")
    layer_of = {name: node.layer for name, node in small.nodes.items()}
    pos = {name: p for layer in small.layers for p, name in enumerate(layer.nodes)}
    _check_reads(small, layer_of, pos)

    # Segments in execution order: (small layer, full layer, block index in the full model)
    segments = [(0, 0, None), (1, 1, 0)] + [(2, 1 + j, j) for j in range(1, L - 1)] + \
        [(3, L, L - 1), (4, L + 1, None)]
    order = [(seg, name) for seg, (sl, _, _) in enumerate(segments)
             for name in small.layers[sl].nodes]
    fresh = _fresh_names([small.nodes[name].op for _, name in order])
    new_name = {key: fresh[i] for i, key in enumerate(order)}

    def source(seg: int, producer: str) -> str:
        """The full graph's name of ``producer`` as read by segment ``seg`` (segment index
        = full layer index); :func:`_check_reads` allowed only these reads."""
        lp, sl = layer_of[producer], segments[seg][0]
        if lp == 0:
            return new_name[(0, producer)]
        if lp == sl:
            return new_name[(seg, producer)]
        if sl == 2 and seg > 2:            # a middle copy reads the copy before it
            return new_name[(seg - 1, small.layers[2].nodes[pos[producer]])]
        return new_name[(seg - 1, producer)]    # the segment before, traced as it is

    nodes: dict[str, OpNode] = {}
    for seg, name in order:
        sl, fl, block = segments[seg]
        node = small.nodes[name]
        src_block = {1: 0, 2: 1, 3: 2}.get(sl)
        rename = paths.renamer(src_block, block)
        nodes[new_name[(seg, name)]] = dataclasses.replace(
            node, name=new_name[(seg, name)], inputs=[source(seg, p) for p in node.inputs],
            params=[rename(p) for p in node.params], module_path=rename(node.module_path),
            layer=fl, input_meta=list(node.input_meta), output_meta=list(node.output_meta))

    layers = []
    for seg, (sl, fl, block) in enumerate(segments):
        src = small.layers[sl]
        name = src.name if block is None else f"{prefix}.{block}"
        layers.append(Layer(index=fl, name=name, kind=src.kind,
                            nodes=[new_name[(seg, n)] for n in src.nodes], stats=src.stats))
    params = _replicate_params(small.params, paths, L)
    return OpGraph(model_name=model_name, fingerprint=fingerprint, batch=small.batch,
                   nodes=nodes, params=params, layers=layers, dtype=graph_dtype(params))


def _check_reads(small: OpGraph, layer_of: dict[str, int], pos: dict[str, int]) -> None:
    """Each layer reads only what replication can remap: <pre>, its own layer, the block just
    before it (blocks), the last block (<post>); and the last block reads the middle one at
    the positions the middle one reads the first."""
    allowed = {0: {0}, 1: {0, 1}, 2: {0, 1, 2}, 3: {0, 2, 3}, 4: {0, 3, 4}}
    pattern: dict[int, list[list[tuple[str, Any]]]] = {2: [], 3: []}
    for layer in small.layers:
        for name in layer.nodes:
            node = small.nodes[name]
            for p in node.inputs:
                if layer_of[p] not in allowed[layer.index]:
                    raise NotReplicable(f"{name} in layer {layer.index} reads {p} of layer "
                                        f"{layer_of[p]}")
            if layer.index in pattern:
                rel = [("pre", p) if layer_of[p] == 0 else
                       ("self" if layer_of[p] == layer.index else "prev", pos[p])
                       for p in node.inputs]
                pattern[layer.index].append(rel)
    if pattern[2] != pattern[3]:
        raise NotReplicable("the last block reads its predecessor unlike the middle block")


def _replicate_params(params: dict[str, ParamInfo], paths: _Paths, L: int
                      ) -> dict[str, ParamInfo]:
    """Block 1's parameters copied to blocks 1 .. L-2, block 2's renamed to L-1, in
    ``named_parameters`` order; their layers moved with them."""
    layer_map = {0: 0, 1: 1, 3: L, 4: L + 1}
    middle = [p for p in params.values() if paths.block(p.name) == 1]
    out: dict[str, ParamInfo] = {}
    emitted = False
    for p in params.values():
        b = paths.block(p.name)
        expected = {0: 1, 1: 2, 2: 3}.get(b) if b is not None else None
        if b is not None and (b > 2 or p.layer != expected):
            raise NotReplicable(f"parameter {p.name} belongs to layer {p.layer}")
        if b is None and p.layer not in (0, 1, 4):
            raise NotReplicable(f"parameter {p.name} outside the blocks is first read by "
                                f"block {p.layer - 1}")
        if b == 1:
            if not emitted:
                for j in range(1, L - 1):
                    rename = paths.renamer(1, j)
                    for q in middle:
                        name = rename(q.name)
                        out[name] = dataclasses.replace(q, name=name, layer=1 + j)
                emitted = True
            continue
        name = paths.renamer(2, L - 1)(p.name) if b == 2 else p.name
        out[name] = dataclasses.replace(p, name=name, layer=layer_map[p.layer])
    return out


@dataclasses.dataclass(frozen=True)
class ShortRun:
    """How the 3-block model of a replicated spec lines up with its full graph."""

    spec: Any                           # the 3-block spec
    runs: list[int]                     # graph layers its ops are: <pre>, 0, 1, L-1, <post>
    exact: list[int]                    # of which those whose reads are the graph's too
    rename: Callable[[str], str]        # its parameter FQNs -> the graph's (block 2 is L-1)


def traced_layers(spec: Any, graph: OpGraph) -> ShortRun | None:
    """How the 3-block model of ``spec`` lines up with ``graph`` (its full trace, replicated
    or not), or None when ``spec`` is not replicated or ``graph`` is not laid out as its
    trace. Its ops are those of the graph's ``<pre>``, blocks 0, 1 and L-1 and ``<post>``,
    with the same arguments, except that block L-1 reads block 1 there, block L-2 here: so
    every layer but block L-1 is ``exact``."""
    small = truncated_spec(spec)
    if small is None or len(graph.layers) != small[1] + 2:
        return None
    L = small[1]
    prefix = graph.layers[1].name.rpartition(".")[0]
    if [graph.layers[i].name for i in (1, 2, L)] != [f"{prefix}.{b}" for b in (0, 1, L - 1)]:
        return None
    paths = _Paths(prefix)
    to_last = paths.renamer(2, L - 1)

    def rename(fqn: str) -> str:
        return to_last(fqn) if paths.block(fqn) == 2 else fqn
    return ShortRun(small[0], [0, 1, 2, L, L + 1], [0, 1, 2, L + 1], rename)
