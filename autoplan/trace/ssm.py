"""The selective scan of Mamba-style layers as the one fused kernel a GPU runs.

Mamba's selective state-space layer (Gu & Dao 2023, "Mamba: Linear-Time Sequence Modeling
with Selective State Spaces", arXiv 2312.00752, sec. 3.3.2) computes, per channel d and
state n, over the sequence positions t::

    h_t = exp(delta_t A) h_{t-1} + delta_t B_t u_t        y_t = C_t h_t + D u_t
    out = y * silu(z)

On a GPU, transformers calls the ``mamba_ssm`` CUDA kernel (``selective_scan_fn``, through
the kernels hub): one kernel that keeps the state h in SRAM, writes only y and, in backward,
recomputes the states instead of saving them (sec. 3.3.2, "recomputation"). Without those
kernels -- on the meta device autoplan traces on -- transformers' fallback loops over the
sequence in Python, a dozen ops per position: a trace of tens of thousands of ops per layer,
with the (b, d, l, n) discretised tensors materialised, which the GPU never does.

While autoplan traces, transformers' ``mamba_selective_scan`` (Mamba, Falcon-Mamba, Jamba,
Zamba: the same function in each model's module) becomes :func:`selective_scan`, one custom
op ``autoplan::selective_scan`` with the kernel's footprint:

* reads u, delta, z (b, d, l), B, C (b, n, l), A (d, n), D, delta_bias (d); writes y
  (b, d, l); saves its inputs for backward (not the states);
* FLOPs 9 b d l n forward (discretisation, the state update and the output product: the
  count of the reference scan used by VMamba's ``flops_selective_scan_ref``, Liu et al.
  2024, arXiv 2401.10166), plus b d l each for the D skip and the gate; backward three times
  the forward (the states recomputed, then the gradient pass of twice the forward);
* its time is memory-bound (about 12 FLOPs per byte at n = 16), priced from its bytes
  like any fused kernel (:mod:`autoplan.cost.compute`, ``FUSED_KERNEL_OPS``).

RWKV-4's WKV recurrence (transformers' ``rwkv_linear_attention``, a CUDA kernel on the GPU,
a loop over the sequence elsewhere) becomes ``autoplan::wkv`` the same way: reads k, v
(b, l, d) and the two (d) vectors, writes (b, l, d), ``WKV_FLOPS`` = 20 FLOPs per element
forward (two maxima, four exponentials and the running sums of eq. 13-16 of Peng et al.
2023, arXiv 2305.13048), three times that backward (the kernel re-runs the recurrence).

On real tensors the op runs a reference scan (and its backward through autograd over the
reference), so a traced model that is run stays correct; the engine does not use it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.utils.flop_counter import register_flop_formula

__all__ = ["scan_route", "selective_scan", "wkv", "wkv_route"]


def _reference(u, delta, A, B, C, D, z, delta_bias, delta_softplus: bool):
    """y of the selective scan (module docstring), position by position, in float32."""
    dtype = u.dtype
    delta = delta.float()
    if delta_bias is not None:
        delta = delta + delta_bias.float()[..., None]
    if delta_softplus:
        delta = F.softplus(delta)
    b, d, length = u.shape
    state = u.new_zeros((b, d, A.shape[-1]), dtype=torch.float32)
    ys = []
    for t in range(length):
        dA = torch.exp(delta[:, :, t, None] * A.float()[None])
        dBu = delta[:, :, t, None] * B.float()[:, None, :, t] * u.float()[:, :, t, None]
        state = dA * state + dBu
        ys.append((state * C.float()[:, None, :, t]).sum(-1))
    y = torch.stack(ys, dim=-1)
    if D is not None:
        y = y + u.float() * D.float()[None, :, None]
    if z is not None:
        y = y * F.silu(z.float())
    return y.to(dtype)


@torch.library.custom_op("autoplan::selective_scan", mutates_args=())
def _scan_op(u: torch.Tensor, delta: torch.Tensor, A: torch.Tensor, B: torch.Tensor,
             C: torch.Tensor, D: torch.Tensor | None, z: torch.Tensor | None,
             delta_bias: torch.Tensor | None, delta_softplus: bool) -> torch.Tensor:
    return _reference(u, delta, A, B, C, D, z, delta_bias, delta_softplus)


@_scan_op.register_fake
def _(u, delta, A, B, C, D, z, delta_bias, delta_softplus):
    return torch.empty_like(u)


def _like(t: torch.Tensor | None, ref: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(t) if t is not None else ref.new_empty((0,))


@torch.library.custom_op("autoplan::selective_scan_backward", mutates_args=())
def _scan_backward_op(grad: torch.Tensor, u: torch.Tensor, delta: torch.Tensor,
                      A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
                      D: torch.Tensor | None, z: torch.Tensor | None,
                      delta_bias: torch.Tensor | None, delta_softplus: bool
                      ) -> list[torch.Tensor]:
    return _reference_grads(grad, [u, delta, A, B, C, D, z, delta_bias], delta_softplus)


def _reference_grads(grad, inputs, delta_softplus: bool) -> list[torch.Tensor]:
    """Gradients of the reference scan by ``torch.func.vjp`` (an empty tensor for an
    absent input)."""
    present = [t for t in inputs if t is not None]

    def f(*xs):
        it = iter(xs)
        return _reference(*(next(it) if t is not None else None for t in inputs),
                          delta_softplus)

    _, vjp = torch.func.vjp(f, *present)
    found = iter(vjp(grad))
    return [next(found) if t is not None else _like(t, inputs[0]) for t in inputs]


@_scan_backward_op.register_fake
def _(grad, u, delta, A, B, C, D, z, delta_bias, delta_softplus):
    return [_like(t, u) for t in (u, delta, A, B, C, D, z, delta_bias)]


def _setup(ctx, inputs, output):
    u, delta, A, B, C, D, z, delta_bias, softplus = inputs
    ctx.softplus = softplus
    ctx.present = [t is not None for t in (D, z, delta_bias)]
    ctx.save_for_backward(u, delta, A, B, C, *(t for t in (D, z, delta_bias)
                                               if t is not None))


def _backward(ctx, grad):
    saved = list(ctx.saved_tensors)
    u, delta, A, B, C = saved[:5]
    rest = iter(saved[5:])
    D, z, bias = (next(rest) if p else None for p in ctx.present)
    grads = _scan_backward_op(grad, u, delta, A, B, C, D, z, bias, ctx.softplus)
    out = [g if t is not None else None
           for g, t in zip(grads, (u, delta, A, B, C, D, z, bias))]
    return (*out, None)


_scan_op.register_autograd(_backward, setup_context=_setup)


def _forward_flops(u_shape, n: int, skip: bool, gate: bool) -> int:
    b, d, length = u_shape
    return (9 * n + int(skip) + int(gate)) * b * d * length


@register_flop_formula(torch.ops.autoplan.selective_scan)
def _scan_flops(u, delta, A, B, C, D, z, *args, out_val=None, **kwargs) -> int:
    # (flop_counter hands formulas the tensors' shapes)
    return _forward_flops(tuple(u), int(A[-1]), D is not None, z is not None)


@register_flop_formula(torch.ops.autoplan.selective_scan_backward)
def _scan_backward_flops(grad, u, delta, A, B, C, D, z, *args, out_val=None, **kwargs) -> int:
    return 3 * _forward_flops(tuple(u), int(A[-1]), D is not None, z is not None)


def selective_scan(hidden_states, dt, A, B, C, D=None, z=None, delta_bias=None,
                   delta_softplus=False, return_last_state=False, **kwargs):
    """transformers' ``mamba_selective_scan`` as one fused op (module docstring). With
    ``return_last_state`` (a cache being filled: inference, not a training step) the
    last state comes from the reference loop too."""
    y = torch.ops.autoplan.selective_scan(hidden_states, dt, A, B, C, D, z, delta_bias,
                                          bool(delta_softplus))
    if return_last_state:
        return y, hidden_states.new_zeros((hidden_states.shape[0], hidden_states.shape[1],
                                           A.shape[-1]))
    return y


# ---- RWKV-4's WKV recurrence -----------------------------------------------------------------

def _wkv_reference(time_decay, time_first, key, value):
    """RWKV-4's WKV (Peng et al. 2023, "RWKV: Reinventing RNNs for the Transformer Era",
    arXiv 2305.13048, eq. 13-16), position by position in float32 with the running maximum
    for stability, as transformers' ``rwkv_linear_attention_cpu`` computes it."""
    b, length, d = key.shape
    num = key.new_zeros((b, d), dtype=torch.float32)
    den = key.new_zeros((b, d), dtype=torch.float32)
    top = key.new_zeros((b, d), dtype=torch.float32) - 1e38
    decay = -torch.exp(time_decay.float())
    first = time_first.float()
    outs = []
    for t in range(length):
        k, v = key[:, t].float(), value[:, t].float()
        m = torch.maximum(top, k + first)
        e1, e2 = torch.exp(top - m), torch.exp(k + first - m)
        outs.append((e1 * num + e2 * v) / (e1 * den + e2))
        m2 = torch.maximum(top + decay, k)
        e1, e2 = torch.exp(top + decay - m2), torch.exp(k - m2)
        num, den, top = e1 * num + e2 * v, e1 * den + e2, m2
    return torch.stack(outs, dim=1).to(key.dtype)


@torch.library.custom_op("autoplan::wkv", mutates_args=())
def _wkv_op(time_decay: torch.Tensor, time_first: torch.Tensor, key: torch.Tensor,
            value: torch.Tensor) -> torch.Tensor:
    return _wkv_reference(time_decay, time_first, key, value)


@_wkv_op.register_fake
def _(time_decay, time_first, key, value):
    return torch.empty_like(key)


@torch.library.custom_op("autoplan::wkv_backward", mutates_args=())
def _wkv_backward_op(grad: torch.Tensor, time_decay: torch.Tensor, time_first: torch.Tensor,
                     key: torch.Tensor, value: torch.Tensor) -> list[torch.Tensor]:
    _, vjp = torch.func.vjp(_wkv_reference, time_decay, time_first, key, value)
    return list(vjp(grad))


@_wkv_backward_op.register_fake
def _(grad, time_decay, time_first, key, value):
    return [torch.empty_like(t) for t in (time_decay, time_first, key, value)]


def _wkv_setup(ctx, inputs, output):
    ctx.save_for_backward(*inputs)


def _wkv_backward(ctx, grad):
    return tuple(_wkv_backward_op(grad, *ctx.saved_tensors))


_wkv_op.register_autograd(_wkv_backward, setup_context=_wkv_setup)

#: FLOPs per (batch, position, channel) of the WKV kernel's forward: two maxima, four
#: exponentials, their arguments, and the numerator, denominator and state updates
WKV_FLOPS = 20


@register_flop_formula(torch.ops.autoplan.wkv)
def _wkv_flops(time_decay, time_first, key, value, *args, out_val=None, **kwargs) -> int:
    b, length, d = tuple(key)
    return WKV_FLOPS * b * length * d


@register_flop_formula(torch.ops.autoplan.wkv_backward)
def _wkv_backward_flops(grad, time_decay, time_first, key, value, *args, out_val=None,
                        **kwargs) -> int:
    b, length, d = tuple(key)
    return 3 * WKV_FLOPS * b * length * d


def wkv(time_decay, time_first, key, value, state=None, return_state=False):
    """transformers' ``rwkv_linear_attention`` as one fused op (module docstring), for a
    call without a recurrent state (:func:`wkv_route` leaves those to transformers)."""
    return torch.ops.autoplan.wkv(time_decay, time_first, key, value), None


def scan_route(own, *args, **kwargs):
    """The trace's answer for transformers' ``mamba_selective_scan`` (``own``):
    :func:`selective_scan` (:mod:`autoplan.trace.cuda_semantics` routes it)."""
    return selective_scan(*args, **kwargs)


def wkv_route(own, *args, **kwargs):
    """The trace's answer for transformers' ``rwkv_linear_attention`` (``own``): :func:`wkv`,
    or transformers' own function for a call carrying a recurrent state (generation)."""
    if kwargs.get("state") is not None:
        return own(*args, **kwargs)
    return wkv(*args, **kwargs)
