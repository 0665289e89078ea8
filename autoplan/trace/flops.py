"""FLOPs and bytes of one aten op, from PyTorch's own formulas where they exist.

FLOPs (multiply and add counted separately, as ``torch.utils.flop_counter`` does):

* matmul, convolution and attention ops: the formula registered in
  ``torch.utils.flop_counter.flop_registry`` — the one ``FlopCounterMode`` uses. E.g.
  ``mm``/``addmm`` 2·m·n·k (the bias add is not counted), ``bmm``/``baddbmm`` 2·b·m·n·k,
  ``convolution`` 2·numel(out)·(c_in/groups)·prod(kernel), flash / memory-efficient SDPA
  4·b·h·s_q·s_k·d forward and 2.5x that backward (the recomputed scores included).
* ``convolution_backward``: its grad-input and grad-weight convolutions, each exactly the
  forward's MACs, so 2·F per requested gradient with F = N·prod(weight.shape)·prod(spatial
  of the non-transposed side's output) — (c_out, c_in/groups, k...) is the stored weight, so
  groups are counted once. (torch's own formula counts the grad-weight convolution with all
  c_in channels against every output channel, groups times too many: a depthwise
  convolution's backward came out 65x its forward instead of 2x.)
* pointwise ops (``torch.Tag.pointwise``): 1 FLOP per output element.
* reductions (``torch.Tag.reduction``): 1 FLOP per input element (n-1 adds for n values).
* other arithmetic without a registered formula (norms, softmax, losses, their backward,
  the embedding gradient's scatter-add): 1 FLOP per element of its largest input — small
  next to the matmuls; these ops are memory-bound, their time comes from the bytes below.
* views, copies, gathers, factories: 0.

Bytes: a view (an output aliasing an input, not a mutation) moves nothing; any other op
reads its tensor inputs (an expanded input counts only its storage) and writes its outputs.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils.flop_counter import flop_registry

# Ops that only move or create data: no arithmetic.
_DATA_MOVEMENT = frozenset({
    "clone", "copy_", "_to_copy", "cat", "stack", "embedding", "index", "index_select",
    "gather", "constant_pad_nd", "repeat", "fill_", "zero_", "slice_scatter",
    "select_scatter", "contiguous", "lift_fresh_copy", "_unsafe_index", "new_zeros",
    "new_ones", "new_empty", "new_full", "zeros_like", "ones_like", "empty_like",
    "full_like", "scalar_tensor", "tril", "triu",
})


def is_matmul_like(func: torch._ops.OpOverload) -> bool:
    """An op with a registered FLOP formula: matmul, convolution or attention."""
    return func.overloadpacket in flop_registry


def tensor_nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def read_nbytes(t: torch.Tensor) -> int:
    """Bytes an op reads from ``t``: an expanded (stride-0) tensor reads only its storage."""
    n = tensor_nbytes(t)
    try:
        return min(n, t.untyped_storage().nbytes())
    except (RuntimeError, NotImplementedError):      # tensors without storage
        return n


def forward_flops(func: torch._ops.OpOverload, args: tuple, kwargs: dict[str, Any], out: Any,
                  in_tensors: list[torch.Tensor], out_tensors: list[torch.Tensor],
                  is_view: bool) -> float:
    """FLOPs of one call of ``func`` (see the module docstring for the rules)."""
    if func.overloadpacket is torch.ops.aten.convolution_backward:
        return conv_backward_flops(*args[:3], transposed=bool(args[7]), output_mask=args[10])
    formula = flop_registry.get(func.overloadpacket)
    if formula is not None:
        return float(formula(*args, **kwargs, out_val=out))
    if is_view or not in_tensors or func.overloadpacket.__name__ in _DATA_MOVEMENT:
        return 0.0
    if not any(t.is_floating_point() or t.is_complex() for t in in_tensors + out_tensors):
        return 0.0
    tags = func.tags
    out_numel = max((t.numel() for t in out_tensors), default=0)
    in_numel = max((t.numel() for t in in_tensors), default=0)
    if torch.Tag.pointwise in tags:
        return float(out_numel)
    return float(in_numel)


def conv_forward_flops(x_shape, w_shape, out_shape, *, transposed: bool = False) -> int:
    """2·N·prod(weight)·prod(spatial): the MACs of a (grouped) convolution counted twice.
    The weight is stored (c_out, c_in/groups, k...) — (c_in, c_out/groups, k...) when
    transposed — so every output element costs (c_in/groups)·prod(k) MACs; a transposed
    convolution runs the MACs of the regular one from its output back to its input."""
    spatial = list(x_shape[2:] if transposed else out_shape[2:])
    n = 1
    for d in list(w_shape) + spatial:
        n *= int(d)
    return 2 * int(x_shape[0]) * n


def conv_backward_flops(grad_out, x, w, *, transposed: bool, output_mask) -> float:
    """grad-input and grad-weight of a (grouped) convolution: each the forward's FLOPs."""
    forward = conv_forward_flops(tuple(x.shape), tuple(w.shape), tuple(grad_out.shape),
                                 transposed=transposed)
    mask = list(output_mask) if output_mask is not None else [True, True, False]
    return float(forward * (int(bool(mask[0])) + int(bool(mask[1]))))


def moved_bytes(in_tensors: list[torch.Tensor], out_tensors: list[torch.Tensor],
                is_view: bool) -> tuple[int, int]:
    """(bytes read, bytes written) of one op."""
    if is_view:
        return 0, 0
    return (sum(read_nbytes(t) for t in in_tensors),
            sum(tensor_nbytes(t) for t in out_tensors))

