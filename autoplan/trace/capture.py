"""Capture one training step of a model, op by op, without memory or arithmetic.

:func:`capture` runs ``loss = model(*batch)`` and ``torch.autograd.grad(loss, params)``
on fake tensors — ``FakeTensorMode`` over the meta device: shapes, dtypes, strides and
storage aliasing, no data. Parameters and inputs are converted with ``from_tensor`` (no
copy, whatever device they are on; meta-device models need no weight memory at all) and
bound with ``torch.func.functional_call``. Libraries that support ``torch.compile`` /
``torch.export`` recognise fake tensors and skip their value-dependent fast paths (e.g.
transformers' packed-sequence check), which plain meta tensors would trip over.

Three PyTorch mechanisms record the step:

* a ``TorchDispatchMode`` sees every aten op below autograd — the forward ops and the
  backward ops the autograd engine runs — with their inputs and outputs. Dispatch-level
  capture goes through any Python control flow, as ``make_fx`` does, at a fraction of its
  cost (no fx proxies): a 96-layer GPT traces in seconds;
* forward pre/post hooks on every submodule keep the module stack, so each forward op knows
  the innermost module that ran it;
* ``torch.autograd.graph.saved_tensors_hooks`` sees every tensor autograd saves for
  backward — exactly what backward keeps alive — when the saving op records its node.

Forward and backward are tied by autograd sequence numbers (the mechanism behind
``torch.fx`` node ``seq_nr``): the autograd node a forward op creates takes the next number
(``torch.autograd._get_sequence_nr()``), and while the engine runs that node's backward,
``torch._C._current_autograd_node()`` returns it. So each backward op's FLOPs are charged
to the forward op that created its node, and each saved tensor to the forward op whose
backward needs it.

Dropout and SDPA run the kernels a CUDA step would (:mod:`autoplan.trace.cuda_semantics`).
A value-dependent op (``.item()``, ``nonzero``, ...) or an op that cannot run without data
raises :class:`~autoplan.errors.TraceError` naming the module that ran it and the op.
"""

from __future__ import annotations

import functools
import logging
from collections import defaultdict
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn
from torch._subclasses.fake_tensor import (DataDependentOutputException,
                                           DynamicOutputShapeException, FakeTensorMode)
from torch.func import functional_call
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from autoplan.errors import TraceError
from autoplan.trace.cuda_semantics import CudaSemantics
from autoplan.trace.flops import forward_flops, moved_bytes

Owner = tuple[str, Any]   # ("param", fqn) | ("buffer", fqn) | ("input", i) | ("op", index)


def storage_key(t: torch.Tensor) -> int | None:
    """Identity of the storage behind ``t`` (views share it); None if it has none."""
    try:
        return t.untyped_storage()._cdata
    except (RuntimeError, NotImplementedError, TypeError):
        return None


def storage_nbytes(t: torch.Tensor) -> int:
    try:
        return t.untyped_storage().nbytes()
    except (RuntimeError, NotImplementedError, TypeError):
        return t.numel() * t.element_size()


@dataclass(eq=False)
class CapturedOp:
    """One forward aten op with its (fake) inputs and outputs."""

    index: int
    name: str
    func: torch._ops.OpOverload
    in_tensors: list[torch.Tensor]
    out_tensors: list[torch.Tensor]
    producers: list[int | None]        # per input tensor: index of the op that produced it
    module_path: str
    module_type: str
    seq_nr: int
    fwd_flops: float
    bytes_read: int
    bytes_written: int
    is_view: bool
    bwd_flops: float = 0.0
    causal: bool = False               # called with is_causal=True (attention kernels)


@dataclass(frozen=True)
class SavedTensor:
    """A tensor autograd saved for backward: its storage and the op that saved it."""

    storage: int
    nbytes: int
    seq_nr: int


@dataclass
class Capture:
    ops: list[CapturedOp]
    owners: dict[int, Owner]           # storage key -> who created it
    saved: list[SavedTensor]
    seq_owner: dict[int, int]          # autograd sequence number -> forward op index
    unattributed_bwd_flops: float
    batch: tuple[Any, ...]                     # the (fake) batch the step ran on
    input_tensors: list[torch.Tensor]          # its tensors, in order
    params: dict[str, torch.Tensor]            # the (fake) parameters, by FQN


#: forward ops one call of one module may run itself (not in its submodules) before the
#: trace stops: a Python loop over the sequence -- transformers' reference selective scan of
#: Mamba, ~14 ops a token, ~29,000 a layer at 2,048 tokens -- would be recorded op by op
#: (~1,200 ops a CPU second) into a graph of millions of ops that no planner prices in
#: reasonable time; a block of a transformer runs a few dozen
MAX_OPS_PER_CALL = 20_000


class _ModuleStack:
    """The stack of running modules, kept by forward pre/post hooks (removed by close()),
    with the forward ops each call ran itself (``counts``, parallel to ``stack``)."""

    def __init__(self, model: nn.Module):
        self.stack: list[tuple[str, str]] = [("", type(model).__name__)]
        self.counts: list[int] = [0]
        self._handles = []
        for path, module in model.named_modules():
            if module is model:
                continue
            enter = functools.partial(self._enter, path, type(module).__name__)
            self._handles.append(module.register_forward_pre_hook(enter))
            self._handles.append(module.register_forward_hook(self._exit))

    def _enter(self, path: str, cls: str, module: nn.Module, args: Any) -> None:
        self.stack.append((path, cls))
        self.counts.append(0)

    def _exit(self, module: nn.Module, args: Any, output: Any) -> None:
        self.stack.pop()
        self.counts.pop()

    def count_op(self) -> None:
        """One more forward op of the running call; TraceError past MAX_OPS_PER_CALL."""
        self.counts[-1] += 1
        if self.counts[-1] > MAX_OPS_PER_CALL:
            raise TraceError(
                f"{_describe(*self.top)} ran more than {MAX_OPS_PER_CALL:,} ops in one "
                "forward call (a Python loop over the sequence, e.g. a reference scan "
                "instead of its fused kernel); autoplan records every op, and a graph that "
                "size takes hours to plan. Trace a shorter sequence (--seq-len), or run the "
                "loop as one op (the fused kernel, or a custom op with a meta kernel)")

    @property
    def top(self) -> tuple[str, str]:
        return self.stack[-1]

    def close(self) -> None:
        for handle in self._handles:
            handle.remove()


def _describe(path: str, cls: str) -> str:
    return f"module '{path}' ({cls})" if path else f"the top-level forward of {cls}"


class _Recorder(TorchDispatchMode):
    """Records forward ops; charges backward ops' FLOPs to autograd sequence numbers."""

    def __init__(self, modules: _ModuleStack, owners: dict[int, Owner]):
        super().__init__()
        self.modules = modules
        self.owners = owners
        self.ops: list[CapturedOp] = []
        self.backward = False
        self.bwd_flops: dict[int, float] = defaultdict(float)
        self.unattributed = 0.0
        self.seq_owner: dict[int, int] = {}
        self._last_seq = torch.autograd._get_sequence_nr() - 1
        self._producer: dict[int, int] = {}          # id(tensor) -> op index
        self._name_count: dict[str, int] = defaultdict(int)

    # -- error messages ------------------------------------------------------------------
    def where(self, node: Any = None) -> str:
        if node is not None:
            idx = self.seq_owner.get(node._sequence_nr())
            if idx is not None:
                op = self.ops[idx]
                return (f"the backward of {op.func} ({op.name}) in "
                        f"{_describe(op.module_path, op.module_type)}")
            return f"the backward ({node.name()})"
        return _describe(*self.modules.top)

    # -- the dispatch hook ---------------------------------------------------------------
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func.namespace == "prim":          # prim.device etc.: metadata queries, not ops
            return func(*args, **kwargs)
        node = torch._C._current_autograd_node()
        try:
            out = func(*args, **kwargs)
        except TraceError:
            raise
        except (DataDependentOutputException, DynamicOutputShapeException) as exc:
            raise TraceError(
                f"{self.where(node)} calls {func}, whose result depends on tensor values "
                "(e.g. .item(), bool(tensor), nonzero, boolean masking); autoplan traces "
                "without data (fake tensors on the meta device), so there are no values. "
                "Make the control flow and shapes independent of the data.") from exc
        except Exception as exc:        # no meta / fake kernel, bad shapes, ...
            raise TraceError(f"{self.where(node)}: op {func} failed without data: "
                             f"{type(exc).__name__}: {exc}") from exc
        tags = func.tags
        in_tensors = [a for a in pytree.arg_tree_leaves(*args, **kwargs)
                      if isinstance(a, torch.Tensor)]
        out_tensors = [o for o in pytree.tree_leaves(out) if isinstance(o, torch.Tensor)]
        in_keys = {storage_key(t) for t in in_tensors}
        is_view = ((torch.Tag.inplace_view in tags) or
                   (not func._schema.is_mutable and
                    any(storage_key(o) in in_keys for o in out_tensors)))
        flops = forward_flops(func, args, kwargs, out, in_tensors, out_tensors, is_view)
        if self.backward:
            if node is not None:
                self.bwd_flops[node._sequence_nr()] += flops
            else:
                self.unattributed += flops
            return out
        self._record(func, in_tensors, out_tensors, flops, is_view)
        self.ops[-1].causal = _is_causal(func, args, kwargs)
        return out

    def _record(self, func, in_tensors, out_tensors, flops, is_view) -> None:
        index = len(self.ops)
        base = func.overloadpacket.__name__
        count = self._name_count[base]
        self._name_count[base] += 1
        name = base if count == 0 else f"{base}_{count}"
        seq = torch.autograd._get_sequence_nr() - 1
        if seq != self._last_seq:        # this op created an autograd node
            self.seq_owner.setdefault(seq, index)
            self._last_seq = seq
        producers: list[int | None] = []
        for t in in_tensors:
            p = self._producer.get(id(t))
            if p is None:
                owner = self.owners.get(storage_key(t))
                p = owner[1] if owner is not None and owner[0] == "op" else None
            producers.append(p)
        read, written = moved_bytes(in_tensors, out_tensors, is_view)
        self.modules.count_op()
        path, cls = self.modules.top
        self.ops.append(CapturedOp(index, name, func, in_tensors, out_tensors, producers, path,
                                   cls, seq, flops, read, written, is_view))
        for o in out_tensors:
            self._producer[id(o)] = index
            key = storage_key(o)
            if key is not None and key not in self.owners:
                self.owners[key] = ("op", index)


def _is_causal(func, args, kwargs) -> bool:
    """The ``is_causal`` argument of ``func`` (attention kernels), False if it has none."""
    for i, arg in enumerate(func._schema.arguments):
        if arg.name == "is_causal":
            value = kwargs.get("is_causal", args[i] if i < len(args) else arg.default_value)
            return bool(value)
    return False


def capture(model: nn.Module, batch: tuple) -> Capture:
    """Run one forward and backward of ``model(*batch)`` on fake tensors and record it."""
    fake = FakeTensorMode(allow_non_fake_inputs=True)
    params = {fqn: fake.from_tensor(p) for fqn, p in model.named_parameters()}
    buffers = {fqn: fake.from_tensor(b) for fqn, b in model.named_buffers()}
    batch = tuple(pytree.tree_map(
        lambda x: fake.from_tensor(x) if isinstance(x, torch.Tensor) else x, tuple(batch)))
    owners: dict[int, Owner] = {}

    def own(t: torch.Tensor, owner: Owner) -> None:
        key = storage_key(t)
        if key is not None:
            owners.setdefault(key, owner)

    input_tensors = [t for t in pytree.tree_leaves(batch) if isinstance(t, torch.Tensor)]
    for i, t in enumerate(input_tensors):
        own(t, ("input", i))
    for fqn, p in params.items():
        own(p, ("param", fqn))
    for fqn, b in buffers.items():
        own(b, ("buffer", fqn))

    saved: list[SavedTensor] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        key = storage_key(t)
        if key is not None:
            saved.append(SavedTensor(key, storage_nbytes(t),
                                     torch.autograd._get_sequence_nr() - 1))
        return t

    training = {m: m.training for m in model.modules()}
    modules = _ModuleStack(model)
    rec = _Recorder(modules, owners)
    # fake tensors log a traceback of a failing meta kernel before re-raising it; the
    # TraceError below says it in one line (a model's dtype mix: xLSTM's bmm)
    fake_log = logging.getLogger("torch._subclasses.fake_tensor")
    level = fake_log.level
    fake_log.setLevel(logging.CRITICAL)
    try:
        model.train()
        with CudaSemantics(), fake, rec, \
                torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            loss = functional_call(model, {**params, **buffers}, batch)
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            got = type(loss).__name__ if not isinstance(loss, torch.Tensor) else \
                f"a tensor of shape {tuple(loss.shape)}"
            raise TraceError(f"model(*batch) must return the scalar training loss; "
                             f"{type(model).__name__} returned {got}")
        trainable = [p for p in params.values() if p.requires_grad]
        rec.backward = True
        if loss.requires_grad and trainable:
            with fake, rec:
                torch.autograd.grad(loss, trainable, allow_unused=True)
    except TraceError:
        raise
    except Exception as exc:
        last = f" (last op: {rec.ops[-1].func})" if rec.ops else ""
        raise TraceError(f"{rec.where()}{last}: {type(exc).__name__}: {exc}") from exc
    finally:
        fake_log.setLevel(level)
        modules.close()
        for m, flag in training.items():
            m.training = flag

    unattributed = rec.unattributed
    for seq, flops in rec.bwd_flops.items():
        idx = rec.seq_owner.get(seq)
        if idx is None:
            unattributed += flops
        else:
            rec.ops[idx].bwd_flops += flops
    return Capture(rec.ops, owners, saved, rec.seq_owner, unattributed, batch, input_tensors,
                   params)
