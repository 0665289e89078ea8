"""Activation recomputation of a block as the plan names it: full, selective or op.

* ``full`` — ``checkpoint_wrapper`` (non-reentrant): the block keeps only its input and runs
  its whole forward again in backward.
* ``selective`` — the same wrapper with torch's selective activation checkpointing
  (``torch.utils.checkpoint.create_selective_checkpoint_contexts``): a policy marks every op
  of the block's forward PREFER_SAVE except the attention core -- the fused attention kernels
  (``scaled_dot_product_attention``'s flash / efficient / math / cuDNN variants) and, for
  eager attention, the batched matmuls Q K^T and P V, the softmax, the mask, the dropout and
  the scaling of an attention-matrix-shaped tensor -- which are PREFER_RECOMPUTE: in backward
  only those run again (Korthikanti et al. 2022, sec. 5; what :mod:`autoplan.cost.recompute`
  prices). Every other op's output comes from the forward's cache, so the gradients are the
  forward's exactly; RNG state is preserved as for full recomputation.

* ``op`` — torchtitan's op-level selective checkpointing (``selective_ac_option = "op"``,
  torchtitan ``parallelisms/parallelize_llama.py`` at 9dec370, Dec. 2024): the outputs of the
  attention kernels, of the sequence-parallel reduce-scatters and of every *other* matmul
  (the 1st, 3rd, ... ``mm`` / ``addmm`` of each block's forward: a linear layer, with or
  without bias) are MUST_SAVE; everything else -- the other matmuls, norms, activations,
  residual adds, all-gathers -- is PREFER_RECOMPUTE. The counter starts afresh on every
  forward and every recomputation of the block (one policy per checkpoint call), so the
  recomputation saves and recomputes the same matmuls as the forward.
  :func:`autoplan.cost.recompute.op_saved_nodes` names the same ops on the traced graph.

A policy decides from the op and its inputs (it does not see outputs): ``bmm`` / ``baddbmm``
(the built-in GPT and the adapted Hugging Face blocks run their linear layers as ``mm`` /
``addmm``, so a batched matmul inside a block is attention's), ``_softmax``, ``masked_fill``,
``native_dropout`` and the attention kernels always; element-wise ``mul`` / ``div`` / ``add``
/ ``where`` only on a tensor whose last two dimensions are equal (an attention matrix).
"""

from __future__ import annotations

import functools

import torch
import torch.nn as nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (CheckpointImpl,
                                                                         checkpoint_wrapper)
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from autoplan.cost.recompute import OP_MATMULS
from autoplan.plan_parts import PARTIAL_RECOMPUTE

MODES = ("full", *PARTIAL_RECOMPUTE)

_aten = torch.ops.aten


def _overloads(*packets) -> frozenset:
    out = set()
    for packet in packets:
        if packet is None:
            continue
        for name in packet.overloads():
            out.add(getattr(packet, name))
    return frozenset(out)


#: Always recomputed under selective recomputation (module docstring).
CORE_OPS = _overloads(
    _aten.bmm, _aten.baddbmm, _aten._softmax, _aten.softmax, _aten.masked_fill,
    _aten.native_dropout, _aten.scaled_dot_product_attention,
    _aten._scaled_dot_product_flash_attention, _aten._scaled_dot_product_efficient_attention,
    _aten._scaled_dot_product_attention_math,
    getattr(_aten, "_scaled_dot_product_cudnn_attention", None),
    getattr(_aten, "_scaled_dot_product_flash_attention_for_cpu", None))
#: Recomputed when they read an attention-matrix-shaped tensor.
ELEMENTWISE_OPS = _overloads(_aten.mul, _aten.div, _aten.add, _aten.where)


def _attention_shaped(x) -> bool:
    return isinstance(x, torch.Tensor) and x.dim() >= 3 and x.shape[-1] == x.shape[-2] > 1


def attention_core_policy(ctx, func, *args, **kwargs) -> CheckpointPolicy:
    """PREFER_RECOMPUTE for the attention core, PREFER_SAVE for everything else."""
    if func in CORE_OPS or (func in ELEMENTWISE_OPS and any(_attention_shaped(a)
                                                             for a in args)):
        return CheckpointPolicy.PREFER_RECOMPUTE
    return CheckpointPolicy.PREFER_SAVE


#: Counted as the block's matmuls under ``op``: the ops the cost model counts
#: (:data:`autoplan.cost.recompute.OP_MATMULS`, linear layers with or without bias).
MATMUL_OPS = _overloads(*(getattr(_aten, name) for name in OP_MATMULS))
#: Always saved under ``op``: attention kernels and the sequence-parallel reduce-scatter.
OP_SAVED = _overloads(
    _aten._scaled_dot_product_flash_attention, _aten._scaled_dot_product_efficient_attention,
    getattr(_aten, "_scaled_dot_product_cudnn_attention", None),
    getattr(_aten, "_scaled_dot_product_flash_attention_for_cpu", None),
    getattr(torch.ops._c10d_functional, "reduce_scatter_tensor", None))


def op_level_policy():
    """A fresh ``op`` policy (module docstring) for one checkpoint call: its own counters of
    the matmuls seen in the forward and in the recomputation."""
    seen = {False: 0, True: 0}

    def policy(ctx, func, *args, **kwargs) -> CheckpointPolicy:
        if func in MATMUL_OPS:
            seen[ctx.is_recompute] += 1
            return (CheckpointPolicy.MUST_SAVE if seen[ctx.is_recompute] % 2 == 1
                    else CheckpointPolicy.PREFER_RECOMPUTE)
        if func in OP_SAVED:
            return CheckpointPolicy.MUST_SAVE
        return CheckpointPolicy.PREFER_RECOMPUTE

    return policy


def _op_level_contexts():
    return create_selective_checkpoint_contexts(op_level_policy())


def wrap(block: nn.Module, mode: str) -> nn.Module:
    """``block`` recomputed in backward as ``mode`` says (module docstring)."""
    if mode not in MODES:
        raise ValueError(f"recomputation mode must be one of {MODES}, got {mode!r}")
    if mode == "full":
        return checkpoint_wrapper(block, checkpoint_impl=CheckpointImpl.NO_REENTRANT)
    if mode == "op":
        return checkpoint_wrapper(block, checkpoint_impl=CheckpointImpl.NO_REENTRANT,
                                  context_fn=_op_level_contexts)
    return checkpoint_wrapper(
        block, checkpoint_impl=CheckpointImpl.NO_REENTRANT,
        context_fn=functools.partial(create_selective_checkpoint_contexts,
                                     attention_core_policy))


def mode_of(plan) -> str:
    """The mode of a plan's ``checkpoint_layers``: 'selective' or 'op' when
    ``parallel.checkpoint`` says so, else 'full' (a search plan recomputes some stages fully
    and says 'none')."""
    mode = plan.parallel.checkpoint
    return mode if mode in PARTIAL_RECOMPUTE else "full"
