"""Trace the ops a CUDA training step runs, although the trace runs on the meta device.

Two composite ops pick their kernel by device, and on the meta (and CPU) device they pick
one that a GPU run does not use, with a different memory footprint:

* ``F.dropout``: ATen's ``dropout`` calls the fused ``native_dropout`` (output plus a 1-byte
  bool mask, what Korthikanti et al. 2022, arXiv 2205.05198, count as ``sbh`` per dropout)
  only on CUDA-like devices; elsewhere it multiplies by a mask of the input's dtype. Here it
  always becomes ``aten.native_dropout``.
* ``F.scaled_dot_product_attention``: on CUDA, PyTorch picks the flash kernel (fp16/bf16, no
  explicit mask, one head dimension for q, k and v) or the memory-efficient kernel
  (otherwise: a mask, or DeepSeek's MLA with 192-wide q/k heads and 128-wide v heads); on
  the meta device it falls back to the math path, which materialises and saves the
  (b, heads, s, s) matrix. Here it becomes ``aten._scaled_dot_product_flash_attention`` or
  ``aten._scaled_dot_product_efficient_attention``, both of which have meta kernels,
  autograd formulas and FLOP formulas in ``torch.utils.flop_counter``.

One decision is made on tensor *values* the trace does not have:

* transformers (``masking_utils.find_packed_sequence_indices``) reads the position ids to
  tell packed sequences (several documents in one row) from plain ones. On a GPU with plain
  rows (positions 0..s-1, which every batch autoplan builds has) it finds none, builds no
  mask and calls SDPA with ``is_causal=True``: the flash kernel, doing half the FLOPs of the
  full square and saving no mask. On fake tensors it cannot read the values and assumes
  packing, so the traced layer ran the memory-efficient kernel on the full square with a
  (b, 1, s, s) mask: a Llama 3 8B step priced 20% slower, with 33% more activation memory,
  through ``hf:llama`` than as the same model built in. While tracing, the detection
  answers "not packed", as it does on the GPU for such rows -- in the tracing thread only
  (any other thread gets transformers' own answer), and transformers' function is back in
  place when the last trace ends. (Sliding-window layers and explicit padding masks still
  build their masks, as they do on the GPU.)

Two more kernels have no meta-device counterpart: Mamba's selective scan and RWKV's WKV,
which transformers runs as Python loops over the sequence without their CUDA kernels; while
tracing each becomes one fused op (:mod:`autoplan.trace.ssm`), thread by thread as above.

The rewrite of dropout and SDPA is a :class:`torch.overrides.TorchFunctionMode`, active
only while tracing; transformers' functions are answered for by name (:data:`ROUTES`, one
mechanism for all three, :class:`_Patches`).
"""

from __future__ import annotations

import sys
import threading
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from autoplan.trace.ssm import scan_route, wkv_route

_aten = torch.ops.aten
_FLASH_DTYPES = (torch.float16, torch.bfloat16)
_FLASH_MAX_HEAD_DIM = 256


def _dropout(input: torch.Tensor, p: float = 0.5, training: bool = True,
             inplace: bool = False) -> torch.Tensor:
    if not training or p == 0.0:
        return input
    if p >= 1.0:
        return input * 0.0
    out, _mask = _aten.native_dropout(input, p, True)
    if inplace:
        return input.copy_(out)
    return out


def _sdpa(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
          attn_mask: torch.Tensor | None = None, dropout_p: float = 0.0,
          is_causal: bool = False, scale: float | None = None,
          enable_gqa: bool = False) -> torch.Tensor:
    head_dim = query.shape[-1]
    if attn_mask is None and query.dtype in _FLASH_DTYPES and head_dim <= _FLASH_MAX_HEAD_DIM \
            and key.shape[-1] == value.shape[-1] == head_dim:
        # FlashAttention-2 handles grouped-query attention natively (k, v keep their heads).
        return _aten._scaled_dot_product_flash_attention(
            query, key, value, dropout_p, is_causal, False, scale=scale)[0]
    if key.shape[-3] != query.shape[-3]:          # the efficient kernel needs equal heads
        rep = query.shape[-3] // key.shape[-3]
        key = key.repeat_interleave(rep, dim=-3)
        value = value.repeat_interleave(rep, dim=-3)
    bias = None
    if attn_mask is not None:
        if attn_mask.dtype == torch.bool:
            bias = torch.zeros(attn_mask.shape, dtype=query.dtype, device=query.device)
            bias = bias.masked_fill(~attn_mask, float("-inf"))
        else:
            bias = attn_mask.to(query.dtype)
        bias = bias.expand(*query.shape[:-1], key.shape[-2])
    need_lse = torch.is_grad_enabled() and any(t.requires_grad for t in (query, key, value))
    return _aten._scaled_dot_product_efficient_attention(
        query, key, value, bias, need_lse, dropout_p, is_causal, scale=scale)[0]


def _not_packed(own, position_ids, *args, **kwargs):
    """transformers' ``find_packed_sequence_indices`` while autoplan traces: None (no packed
    sequences), what it returns on a GPU for positions 0..s-1 (module docstring)."""
    return None


#: transformers' functions a trace answers for, by name, wherever a ``transformers.*``
#: module defines them: ``route(transformers' own function, *args, **kwargs)``
ROUTES: dict[str, Callable[..., Any]] = {
    "find_packed_sequence_indices": _not_packed,
    "mamba_selective_scan": scan_route,
    "rwkv_linear_attention": wkv_route,
}


class _Patches:
    """Enter (+1) or leave (-1) a trace: the first trace in the process puts a router in
    place of every function of :data:`ROUTES` in the imported ``transformers.*`` modules,
    and the last one out restores transformers' own, whatever the nesting and also after
    a failed trace. The router answers with the route in a thread that is tracing and with
    transformers' own function anywhere else (a user's own training in the same process,
    a reference kept past the trace). Tracing never imports transformers' modules."""

    lock = threading.Lock()
    depth = 0                                   # traces running in this process
    own: dict[tuple[str, str], Callable[..., Any]] = {}   # (module, name) -> transformers'
    local = threading.local()                   # .depth: traces running in this thread

    @classmethod
    def step(cls, step: int) -> None:
        cls.local.depth = getattr(cls.local, "depth", 0) + step
        with cls.lock:
            cls.depth += step
            if step > 0:
                for name, module in list(sys.modules.items()):
                    if not name.startswith("transformers."):
                        continue
                    for attr, route in ROUTES.items():
                        own = getattr(module, attr, None)
                        if callable(own) and (name, attr) not in cls.own:
                            cls.own[(name, attr)] = own
                            setattr(module, attr, cls._router(own, route))
            elif cls.depth == 0:
                for (name, attr), own in cls.own.items():
                    if (module := sys.modules.get(name)) is not None:
                        setattr(module, attr, own)
                cls.own = {}

    @classmethod
    def _router(cls, own: Callable[..., Any], route: Callable[..., Any]):
        def router(*args, **kwargs):
            if getattr(cls.local, "depth", 0) > 0:
                return route(own, *args, **kwargs)
            return own(*args, **kwargs)
        router.__wrapped__ = own
        return router


class CudaSemantics(TorchFunctionMode):
    """Route dropout and SDPA to the kernels a CUDA training step uses (module docstring)."""

    def __init__(self) -> None:
        super().__init__()
        self._rewrites: dict[Callable[..., Any], Callable[..., Any]] = {
            F.dropout: _dropout,
            torch.dropout: _dropout,
            F.scaled_dot_product_attention: _sdpa,
        }

    def __enter__(self):
        _Patches.step(+1)
        try:
            return super().__enter__()
        except BaseException:
            _Patches.step(-1)
            raise

    def __exit__(self, *exc):
        try:
            return super().__exit__(*exc)
        finally:
            _Patches.step(-1)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        rewrite = self._rewrites.get(func)
        if rewrite is not None:
            return rewrite(*args, **kwargs)
        return func(*args, **kwargs)
