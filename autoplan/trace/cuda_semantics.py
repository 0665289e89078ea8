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

The rewrite is a :class:`torch.overrides.TorchFunctionMode`, active only while tracing.
"""

from __future__ import annotations

import sys
import threading
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from autoplan.trace.ssm import ScanPatch

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


_PATCH_LOCK = threading.Lock()
_patch_depth = 0                            # traces running in this process
_installed: Any = None                      # the transformers.masking_utils patched, if any
_own: Callable[..., Any] | None = None      # transformers' function, once seen
_tracing = threading.local()                # .depth: traces running in this thread


def _plain_rows(position_ids: torch.Tensor):
    """transformers' ``find_packed_sequence_indices`` while autoplan traces: in a tracing
    thread, None (no packed sequences), what it returns on a GPU for positions 0..s-1
    (module docstring); anywhere else transformers' own answer (also for a reference to
    this function kept past the trace)."""
    if getattr(_tracing, "depth", 0) > 0 or _own is None:
        return None
    return _own(position_ids)


def _plain_rows_patch(step: int) -> None:
    """Enter (+1) or leave (-1) a trace. The first trace in the process puts
    :func:`_plain_rows` in transformers' place and the last one out restores transformers'
    own function, whatever the nesting; meanwhile other threads (a user's own training in
    the same process) still get transformers' real check. Nothing happens unless the
    model's code has imported ``transformers.masking_utils``: tracing never imports it."""
    global _patch_depth, _installed, _own
    _tracing.depth = getattr(_tracing, "depth", 0) + step
    with _PATCH_LOCK:
        _patch_depth += step
        if step > 0 and _installed is None:
            masking = sys.modules.get("transformers.masking_utils")
            own = getattr(masking, "find_packed_sequence_indices", None)
            if own is not None and own is not _plain_rows:
                _own, _installed = own, masking
                masking.find_packed_sequence_indices = _plain_rows
        elif step < 0 and _patch_depth == 0 and _installed is not None:
            _installed.find_packed_sequence_indices = _own
            _installed = None


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
        _plain_rows_patch(+1)
        ScanPatch.enter()
        try:
            return super().__enter__()
        except BaseException:
            ScanPatch.leave()
            _plain_rows_patch(-1)
            raise

    def __exit__(self, *exc):
        try:
            return super().__exit__(*exc)
        finally:
            ScanPatch.leave()
            _plain_rows_patch(-1)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        rewrite = self._rewrites.get(func)
        if rewrite is not None:
            return rewrite(*args, **kwargs)
        return func(*args, **kwargs)
