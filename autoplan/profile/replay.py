"""Re-running one op of a traced graph from its signature alone.

An :class:`~autoplan.graph.OpNode` records the op and the shapes of its tensors, not its
other arguments (the dim of a softmax, the shape of a view, eps). :func:`reconstruct` fills
them in from the op's schema (``torch.ops.aten.X.Y._schema``): tensor arguments take the
recorded inputs in order (``Tensor[]`` takes what the later tensor arguments leave);
every other argument gets a short list of plausible values — its default first, then small
dims, sizes that occur in the shapes, the output shapes, permutations — and the
combinations are tried on the meta device (no compute) until one produces exactly the
recorded output shapes and dtypes. That call is then run on real tensors for timing.

Assumptions, stated because they change the time: attention ops without a mask are causal
(decoder-only LMs); dropout runs in training mode. Integer input tensors are indices, drawn
in range: rows of the table for embeddings, else below the smallest dim of the floating
inputs (valid for gather, index_select, cross-entropy targets, ...).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any

import torch

from autoplan.errors import AutoplanError
from autoplan.graph import TensorMeta
from autoplan.profile.signature import FLOAT_DTYPES, Signature, shard_candidates

MAX_TRIALS = 4096


class ReplayError(AutoplanError):
    """The op cannot be re-run from its signature (unknown op, arguments not found)."""


class _Device:
    """Placeholder for the ``device`` argument of factory ops, bound at call time."""


_DEVICE = _Device()


@dataclass(frozen=True)
class Slot:
    """How one schema argument is filled: ``tensor`` (index into the inputs), ``tensors``
    (a list of indices) or a constant ``value``."""

    name: str
    kwarg_only: bool
    kind: str
    value: Any


@dataclass(frozen=True)
class Call:
    """A reconstructed call of ``op``: ``call(tensors, device)`` runs it."""

    op: Any                      # torch._ops.OpOverload
    slots: tuple[Slot, ...]

    def __call__(self, tensors: list[torch.Tensor], device: torch.device) -> Any:
        args: list[Any] = []
        kwargs: dict[str, Any] = {}
        for s in self.slots:
            if s.kind == "tensor":
                v = None if s.value is None else tensors[s.value]
            elif s.kind == "tensors":
                v = [None if i is None else tensors[i] for i in s.value]
            else:
                v = device if s.value is _DEVICE else s.value
            if s.kwarg_only:
                kwargs[s.name] = v
            else:
                args.append(v)
        return self.op(*args, **kwargs)

    def arguments(self) -> dict[str, Any]:
        """The non-tensor arguments found, for messages and tests."""
        return {s.name: s.value for s in self.slots if s.kind == "value"}


def resolve_op(name: str) -> Any | None:
    """``"aten.mm.default"`` / ``"aten::mm"`` -> the OpOverload, or None if not an op."""
    text = name.replace("::", ".")
    parts = text.split(".")
    if len(parts) not in (2, 3):
        return None
    ns, op = parts[0], parts[1]
    overload = parts[2] if len(parts) == 3 else "default"
    try:
        packet = getattr(getattr(torch.ops, ns), op)
        return getattr(packet, overload)
    except (AttributeError, RuntimeError):
        return None


def torch_dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ReplayError(f"unknown dtype {name!r}")
    return dtype


def output_tensors(result: Any) -> list[torch.Tensor]:
    """The tensors of an op's result, flattened in order."""
    if isinstance(result, torch.Tensor):
        return [result]
    if isinstance(result, (tuple, list)):
        return [t for r in result for t in output_tensors(r)]
    return []


def reconstruct(sig: Signature, *, max_trials: int = MAX_TRIALS) -> Call:
    """Find the non-tensor arguments of ``sig.op`` that reproduce ``sig.outputs`` (module
    docstring). Raises :class:`ReplayError` naming the op when none do."""
    op = resolve_op(sig.op)
    if op is None or not hasattr(op, "_schema"):
        raise ReplayError(f"{sig.op}: not an aten op overload")
    if not sig.outputs:
        raise ReplayError(f"{sig.op}: has no tensor outputs to time")
    schema = op._schema
    try:
        slots = _tensor_slots(schema.arguments, len(sig.inputs))
    except ReplayError as exc:
        raise ReplayError(f"{sig.op}: {exc}") from None
    choices = [[s] if s is not None else [] for s in slots]
    masked = any(s is not None and s.kind == "tensor" and s.name == "attn_mask" and
                 s.value is not None for s in slots)
    for i, arg in enumerate(schema.arguments):
        if slots[i] is None:
            values = _candidates(arg, sig, causal=not masked)
            if not values:
                raise ReplayError(f"{sig.op}: no value to try for argument {arg.name!r} "
                                  f"({arg.real_type})")
            choices[i] = [Slot(arg.name, arg.kwarg_only, "value", v) for v in values]
    meta = [torch.empty(t.shape, dtype=torch_dtype(t.dtype), device="meta") for t in sig.inputs]
    device = torch.device("meta")
    for trial, combo in enumerate(itertools.product(*choices)):
        if trial >= max_trials:
            break
        call = Call(op, tuple(combo))
        try:
            outs = output_tensors(call(meta, device))
        except Exception:            # a wrong guess: any error means "try the next one"
            continue
        if _matches(outs, sig.outputs):
            return call
    raise ReplayError(f"{sig.op}: no arguments found (of {min(trial + 1, max_trials)} tried) "
                      f"that give outputs {[f'{t.dtype}{list(t.shape)}' for t in sig.outputs]} "
                      f"from inputs {[f'{t.dtype}{list(t.shape)}' for t in sig.inputs]}")


def sharded_call(sig: Signature, role: str, t: int) -> tuple[Signature, Call]:
    """What one of ``t`` tensor-parallel ranks runs for ``sig``: the first shard candidate
    (:func:`autoplan.profile.signature.shard_candidates`) that can be re-run, with its
    call. When none can (no floating tensor to split), the op is not divided: ``sig``."""
    if t > 1:
        for cand in shard_candidates(sig, role, t):
            try:
                return cand, reconstruct(cand)
            except ReplayError:
                continue
    return sig, reconstruct(sig)


#: Device-specific attention kernels and the portable op computing the same thing.
_PORTABLE_ATTENTION = ("aten._scaled_dot_product_efficient_attention.default",
                       "aten._scaled_dot_product_flash_attention.default",
                       "aten._scaled_dot_product_cudnn_attention.default")


def portable_call(call: Call, sig: Signature) -> Call | None:
    """For a kernel the device lacks (CUDA-only attention kernels on CPU), the portable op
    that computes the same: ``aten.scaled_dot_product_attention`` with the same q, k, v,
    mask, dropout, causality and scale, which runs the device's own kernel (on CPU the
    flash kernel for CPU or the math path). None for other ops."""
    if sig.op not in _PORTABLE_ATTENTION:
        return None
    by_name = {s.name: s for s in call.slots}
    mask = by_name.get("attn_bias") or by_name.get("attn_mask")
    value = {n: by_name[n].value for n in ("dropout_p", "is_causal", "scale") if n in by_name}
    slots = [Slot("query", False, "tensor", by_name["query"].value),
             Slot("key", False, "tensor", by_name["key"].value),
             Slot("value", False, "tensor", by_name["value"].value),
             Slot("attn_mask", False, "tensor", mask.value if mask is not None else None),
             Slot("dropout_p", False, "value", value.get("dropout_p", 0.0)),
             Slot("is_causal", False, "value", value.get("is_causal", False)),
             Slot("scale", True, "value", value.get("scale"))]
    return Call(torch.ops.aten.scaled_dot_product_attention.default, tuple(slots))


def make_inputs(sig: Signature, device: torch.device, *, requires_grad: bool,
                generator: torch.Generator | None = None) -> list[torch.Tensor]:
    """Random tensors for ``sig.inputs`` on ``device``; floating ones ~ N(0, 1) and, with
    ``requires_grad``, leaves that autograd differentiates; integer ones in index range."""
    out = []
    hi = _index_bound(sig)
    for i, t in enumerate(sig.inputs):
        dtype = torch_dtype(t.dtype)
        if t.dtype in FLOAT_DTYPES:
            x = torch.randn(t.shape, generator=generator, dtype=torch.float32).to(dtype)
            x = x.to(device).requires_grad_(requires_grad)
        elif t.dtype == "bool":
            x = (torch.rand(t.shape, generator=generator) < 0.9).to(device)
        elif dtype.is_complex:
            x = torch.randn(t.shape, generator=generator, dtype=dtype).to(device)
        else:
            bound = hi
            if "embedding" in sig.op and i == 1 and sig.inputs[0].shape:
                bound = sig.inputs[0].shape[0]
            x = torch.randint(0, max(1, bound), t.shape, generator=generator).to(dtype).to(device)
        out.append(x)
    return out


def count_flops(call: Call, sig: Signature) -> float:
    """FLOPs of the call by torch.utils.flop_counter, on the meta device (0 for ops it
    does not count, e.g. elementwise)."""
    from torch.utils.flop_counter import FlopCounterMode

    meta = [torch.empty(t.shape, dtype=torch_dtype(t.dtype), device="meta") for t in sig.inputs]
    with FlopCounterMode(display=False) as counter:
        call(meta, torch.device("meta"))
    return float(counter.get_total_flops())


# ---- argument candidates -------------------------------------------------------------------

def _tensor_slots(arguments, n_inputs: int) -> list[Slot | None]:
    """Assign the recorded tensors to Tensor / Tensor? / Tensor[] arguments, in order."""
    kinds = [_tensor_kind(a) for a in arguments]
    required_after = [sum(1 for k in kinds[i + 1:] if k == "tensor") for i in range(len(kinds))]
    slots: list[Slot | None] = []
    nxt = 0
    for i, (arg, kind) in enumerate(zip(arguments, kinds)):
        if kind == "tensor":
            if nxt >= n_inputs:
                raise ReplayError(f"argument {arg.name!r} needs a tensor; only {n_inputs} recorded")
            slots.append(Slot(arg.name, arg.kwarg_only, "tensor", nxt))
            nxt += 1
        elif kind == "optional":
            remaining = n_inputs - nxt - required_after[i]
            take = remaining > 0
            slots.append(Slot(arg.name, arg.kwarg_only, "tensor", nxt if take else None))
            nxt += int(take)
        elif kind == "list":
            count = max(0, n_inputs - nxt - required_after[i])
            slots.append(Slot(arg.name, arg.kwarg_only, "tensors", tuple(range(nxt, nxt + count))))
            nxt += count
        else:
            slots.append(None)
    if nxt != n_inputs:
        raise ReplayError(f"{n_inputs} tensors recorded but the schema takes {nxt}")
    return slots


def _tensor_kind(arg) -> str | None:
    t = arg.type
    kind = t.kind()
    if kind == "TensorType":
        return "tensor"
    if kind == "OptionalType" and t.getElementType().kind() == "TensorType":
        return "optional"
    if kind == "ListType":
        el = t.getElementType()
        if el.kind() == "TensorType" or (el.kind() == "OptionalType" and
                                         el.getElementType().kind() == "TensorType"):
            return "list"
    return None


def _candidates(arg, sig: Signature, *, causal: bool) -> list[Any]:
    """Values to try for one non-tensor argument, most plausible first."""
    real = str(arg.real_type)
    optional = real.startswith("Optional[")
    base = real[len("Optional["):-1] if optional else real
    has_default = arg.has_default_value()
    default = arg.default_value if has_default else None
    first = [default] if has_default else ([None] if optional else [])
    name = arg.name
    sizes = _sizes(sig)
    small = [-1, 0, 1, 2, 3]

    if base == "Device":
        return [_DEVICE]
    if base in ("Layout", "MemoryFormat", "Generator") or name in ("pin_memory", "non_blocking"):
        return first or ([None] if optional else [])
    if base == "ScalarType":
        out_dtype = torch_dtype(sig.outputs[0].dtype)
        return _unique(first + [out_dtype])
    if base == "bool":
        if name == "is_causal":
            return [causal, not causal]
        if name == "train":
            return [True]
        if has_default and default is not None:
            return [default, not default]
        return _unique(first + [False, True])
    if base in ("int", "SymInt"):
        return _unique(first + small + sizes)
    if base in ("List[int]", "List[SymInt]"):
        return _unique(first + _int_lists(sig, name))
    if base == "float":
        guess = {"eps": 1e-5, "p": 0.1, "dropout_p": 0.0}.get(name, 0.5)
        return _unique(first + [guess])
    if base in ("number", "Scalar"):
        return _unique(first + [0.5, 0, 1, 2] + sizes)
    if has_default or optional:
        return first
    return []


def _sizes(sig: Signature) -> list[int]:
    return sorted({d for t in (*sig.inputs, *sig.outputs) for d in t.shape if d > 3})


def _int_lists(sig: Signature, name: str) -> list[list[int]]:
    out: list[list[int]] = []
    for t in sig.outputs:
        out.append(list(t.shape))
    for t in sig.inputs:
        out.extend(list(t.shape[-k:]) for k in range(1, len(t.shape) + 1))
    ndim = len(sig.inputs[0].shape) if sig.inputs else 0
    out.extend([[d] for d in (-1, 0, 1, 2, 3)])
    out.extend([[0, 1], [-2, -1], [1, 2], []])
    if 1 < ndim <= 5:
        out.extend(list(p) for p in itertools.permutations(range(ndim)))
    return out


def _unique(values: list[Any]) -> list[Any]:
    seen: list[Any] = []
    for v in values:
        if not any(type(v) is type(s) and v == s for s in seen):
            seen.append(v)
    return seen


def _index_bound(sig: Signature) -> int:
    dims = [d for t in sig.inputs if t.dtype in FLOAT_DTYPES for d in t.shape if d > 0]
    return min(dims) if dims else 2


def _matches(outs: list[torch.Tensor], expected: tuple[TensorMeta, ...]) -> bool:
    """Same count (or, if fewer were recorded, the recorded prefix), shapes and dtypes."""
    if not outs or len(expected) > len(outs):
        return False
    return all(tuple(o.shape) == e.shape and str(o.dtype).removeprefix("torch.") == e.dtype
               for o, e in zip(outs, expected))
