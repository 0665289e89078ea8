"""Record the forward ops of one layer per kind *with their arguments*, for DTensor.

The :class:`~autoplan.graph.OpGraph` keeps what the cost model needs (shapes, FLOPs, bytes)
but not each op's full argument list (a view's target shape, a transpose's dims, which
output of a multi-output producer an argument is). DTensor's sharding-strategy functions
need exactly that, so the planner re-runs the model's forward once on fake tensors, with
the same machinery as the tracer (``FakeTensorMode`` over the meta device,
``functional_call``, :class:`~autoplan.trace.cuda_semantics.CudaSemantics`), and keeps the
arguments of the ops of one representative layer per kind.

The re-run uses a batch of :data:`PROBE_BATCH` samples rather than the traced micro-batch:
with a batch of 1, DTensor's view rules treat the batch dimension as a singleton that cannot
be sharded, so data parallelism would never propagate through a ``view``. Comparing the
recorded shapes with the traced ones also tells which dimensions scale with the batch
(``batch_dims``), which the planner needs to check divisibility at any micro-batch.

A deep built-in GPT is re-run with three blocks (the first, the second, the last), which
run exactly the ops of the graph's ``<pre>``, blocks 0, 1 and L-1 and ``<post>``
(:mod:`autoplan.trace.replicate`), with the same arguments but for block L-1's reads of its
predecessor; ``<pre>``, blocks 0 and 1 and ``<post>`` are all the layers the planner asks
for (one per kind and the first of each pair of consecutive kinds), so the re-run and the
alignment cost three blocks, not L. Other requests run the whole model.

The recorded op sequence is aligned with the traced one by op name (:func:`align`); a few
ops may differ (a reshape that copies at one batch size views at another), and those traced
ops are reported in ``Recording.unmatched`` and planned replicated. If less than 90% match,
:class:`~autoplan.errors.PlanError` says so.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.func import functional_call
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from autoplan.errors import PlanError
from autoplan.graph import OpGraph
from autoplan.trace.capture import storage_key
from autoplan.trace.cuda_semantics import CudaSemantics

#: Samples per batch when recording (divisible by the 2 x 2 probe mesh on both axes).
PROBE_BATCH = 4


@dataclass(frozen=True)
class TensorRef:
    """Where a tensor argument comes from.

    ``kind``: ``"op"`` (output ``output`` of the recorded op at global index ``source``),
    ``"param"`` (``source`` = FQN), ``"input"`` (batch input ``source``), ``"buffer"`` or
    ``"const"`` (anything else, e.g. a tensor made inside forward without an op record).
    """

    kind: str
    source: int | str | None
    output: int
    shape: tuple[int, ...]              # at PROBE_BATCH
    stride: tuple[int, ...]
    dtype: torch.dtype


@dataclass
class RecordedOp:
    index: int                          # global op index (= position in graph.nodes)
    name: str                           # graph node name
    func: torch._ops.OpOverload
    args: tuple                         # args with tensors replaced by TensorRef
    kwargs: dict
    outputs: tuple[TensorRef, ...]      # output tensors (kind "op", source = index)


@dataclass
class Recording:
    """The representative layer of every kind: its ops with arguments, and batch dims."""

    ops: dict[int, list[RecordedOp]]    # layer index (representative of a kind) -> ops
    probe_batch: int
    unmatched: dict[int, list[str]]     # layer index -> traced nodes not seen when re-run


class _ArgRecorder(TorchDispatchMode):
    def __init__(self, owners: dict[int, tuple[str, object]]):
        super().__init__()
        self.owners = owners
        self.calls: list[tuple] = []
        self._producer: dict[int, tuple[int, int]] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func.namespace == "prim":
            return func(*args, **kwargs)
        out = func(*args, **kwargs)
        index = len(self.calls)
        ref = lambda t: self._ref(t) if isinstance(t, torch.Tensor) else t   # noqa: E731
        rec_args = pytree.tree_map(ref, args)
        rec_kwargs = pytree.tree_map(ref, kwargs)
        outs = []
        for k, o in enumerate(t for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor)):
            outs.append(TensorRef("op", index, k, tuple(int(d) for d in o.shape),
                                  tuple(int(s) for s in o.stride()), o.dtype))
            self._producer[id(o)] = (index, k)
            key = storage_key(o)
            if key is not None and key not in self.owners:
                self.owners[key] = ("op", (index, k))
        self.calls.append((func, rec_args, rec_kwargs, tuple(outs), out))
        return out

    def _ref(self, t: torch.Tensor) -> TensorRef:
        shape = tuple(int(d) for d in t.shape)
        stride = tuple(int(s) for s in t.stride())
        hit = self._producer.get(id(t))
        if hit is not None:
            return TensorRef("op", hit[0], hit[1], shape, stride, t.dtype)
        owner = self.owners.get(storage_key(t))
        if owner is None:
            return TensorRef("const", None, 0, shape, stride, t.dtype)
        kind, src = owner
        if kind == "op":
            return TensorRef("op", src[0], src[1], shape, stride, t.dtype)
        return TensorRef(kind, src, 0, shape, stride, t.dtype)


def record_layers(spec, graph: OpGraph, layers: list[int], *,
                  probe_batch: int = PROBE_BATCH, truncate: bool = True) -> Recording:
    """Run ``spec``'s forward at ``probe_batch`` on fake tensors and keep the ops of
    ``layers`` (graph layer indices) with their arguments (module docstring). A deep
    built-in GPT whose wanted layers are among ``<pre>``, blocks 0 and 1 and ``<post>`` runs
    with three blocks instead (:func:`autoplan.trace.replicate.traced_layers`): those
    layers' ops and arguments are the same, and the alignment covers three blocks, not L
    (``truncate=False`` runs the whole model regardless)."""
    from autoplan.models import build_model, example_batch
    from autoplan.trace.replicate import traced_layers

    short = traced_layers(spec, graph) if truncate else None
    if short is not None and not set(layers) <= set(short.exact):
        short = None
    run_spec, rename = (short.spec, short.rename) if short is not None else (spec, lambda n: n)
    dtype = getattr(torch, graph.dtype, torch.float32)
    model = build_model(run_spec, device="meta", dtype=dtype)
    batch = example_batch(run_spec, probe_batch, graph.batch.seq_len, device="meta")
    # float inputs (pixels, embeddings) in the compute dtype, as the tracer traced them
    batch = tuple(t.to(dtype) if isinstance(t, torch.Tensor) and t.is_floating_point() else t
                  for t in batch)
    fake = FakeTensorMode(allow_non_fake_inputs=True)
    params = {fqn: fake.from_tensor(p) for fqn, p in model.named_parameters()}
    buffers = {fqn: fake.from_tensor(b) for fqn, b in model.named_buffers()}
    batch = tuple(pytree.tree_map(
        lambda x: fake.from_tensor(x) if isinstance(x, torch.Tensor) else x, tuple(batch)))
    owners: dict[int, tuple[str, object]] = {}
    for i, t in enumerate(t for t in pytree.tree_leaves(batch) if isinstance(t, torch.Tensor)):
        owners.setdefault(storage_key(t), ("input", i))
    for fqn, p in params.items():
        owners.setdefault(storage_key(p), ("param", rename(fqn)))
    for fqn, b in buffers.items():
        owners.setdefault(storage_key(b), ("buffer", rename(fqn)))
    rec = _ArgRecorder(owners)
    model.train()
    # saved-tensor hooks as in the tracer: autograd then saves outputs without a detach op
    with CudaSemantics(), fake, rec, \
            torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t):
        functional_call(model, {**params, **buffers}, batch)

    names = list(graph.nodes)
    index_of = {name: i for i, name in enumerate(names)}
    run = list(range(len(names))) if short is None else \
        [index_of[n] for l in short.runs for n in graph.layers[l].nodes]
    match, through = align([str(c[0]) for c in rec.calls],
                           [graph.nodes[names[g]].op for g in run])
    if len(match) < 0.9 * len(run):
        raise PlanError(f"re-running {spec.name} at batch {probe_batch} matched only "
                        f"{len(match)} of the {len(run)} traced ops; the model's op "
                        "sequence depends on the batch size too much to plan its sharding")
    match = {c: run[q] for c, q in match.items()}
    graph_to_call = {g: c for c, g in match.items()}
    is_ref = lambda x: isinstance(x, TensorRef)   # noqa: E731

    def remap(r: TensorRef) -> TensorRef:
        """Recorded producer index -> graph index; through a pass-through op to its input;
        unmatched producers become constants."""
        while r.kind == "op" and r.source in through:
            first = next((x for x in pytree.tree_leaves(rec.calls[r.source][1], is_leaf=is_ref)
                          if isinstance(x, TensorRef)), None)
            if first is None:
                break
            r = TensorRef(first.kind, first.source, first.output, r.shape, r.stride, r.dtype)
        if r.kind != "op":
            return r
        if r.source in match:
            return TensorRef("op", match[r.source], r.output, r.shape, r.stride, r.dtype)
        return TensorRef("const", None, 0, r.shape, r.stride, r.dtype)

    out: dict[int, list[RecordedOp]] = {}
    unmatched: dict[int, list[str]] = {}
    for layer_index in layers:
        ops = []
        for name in graph.layers[layer_index].nodes:
            g = index_of[name]
            c = graph_to_call.get(g)
            if c is None:
                unmatched.setdefault(layer_index, []).append(name)
                continue
            func, args, kwargs, outs, _ = rec.calls[c]
            args = pytree.tree_map_only(TensorRef, remap, args, is_leaf=is_ref)
            kwargs = pytree.tree_map_only(TensorRef, remap, kwargs, is_leaf=is_ref)
            outs = tuple(TensorRef("op", g, o.output, o.shape, o.stride, o.dtype) for o in outs)
            ops.append(RecordedOp(g, name, func, args, kwargs, outs))
        out[layer_index] = ops
    return Recording(out, probe_batch, unmatched)


def align(recorded: list[str], traced: list[str]) -> tuple[dict[int, int], set[int]]:
    """Match recorded ops to traced ops by name: (recorded index -> traced index, recorded
    ops to pass through).

    The common prefix and suffix match one to one (some longest common subsequence always
    contains them; the two runs of one model differ in a few ops, so they are nearly all of
    it), and the longest common subsequence of what is left (difflib; quadratic in the
    number of repeated names, seconds for a 126-layer model run whole) lines up the rest.
    Where one traced op faces several recorded ones (a reshape that views at batch 1 but
    copies at a larger batch: ``view`` against ``clone`` + ``_unsafe_view``), the traced op
    takes the last recorded op of the run and the others pass their first input through."""
    import difflib

    n = min(len(recorded), len(traced))
    head = 0
    while head < n and recorded[head] == traced[head]:
        head += 1
    tail = 0
    while tail < n - head and recorded[-1 - tail] == traced[-1 - tail]:
        tail += 1
    out: dict[int, int] = {k: k for k in range(head)}
    for k in range(1, tail + 1):
        out[len(recorded) - k] = len(traced) - k
    through: set[int] = set()
    sm = difflib.SequenceMatcher(a=recorded[head:len(recorded) - tail],
                                 b=traced[head:len(traced) - tail], autojunk=False)
    for tag, i1, i2, j1, j2 in sm.get_opcodes():
        i1, i2, j1, j2 = i1 + head, i2 + head, j1 + head, j2 + head
        if tag == "equal":
            for k in range(i2 - i1):
                out[i1 + k] = j1 + k
        elif tag == "replace" and j2 - j1 == 1 and i2 - i1 > 1:
            out[i2 - 1] = j1
            through.update(range(i1, i2 - 1))
    return out, through
