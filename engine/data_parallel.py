"""Data parallelism and ZeRO, on FSDP2's machinery.

The plan's ZeRO stage maps onto PyTorch's composable data-parallel APIs, each applied per
transformer block and then on the chunk's root (the rest: embeddings, final norm, head):

=====  ==========================================  ==========================================
ZeRO   API                                         memory semantics (Rajbhandari et al. 2020)
=====  ==========================================  ==========================================
0      ``replicate`` (FSDP2-based DDP)             params, grads, optimizer states replicated;
                                                   one all-reduce of grads per step
1      ``fully_shard(reshard_after_forward=False)`` optimizer states sharded (they follow the
       grad sync only on the last micro-batch       sharded params); full grads accumulate over
                                                   micro-batches, one reduce-scatter per step
2      ``fully_shard(reshard_after_forward=False)`` + grads sharded: reduce-scatter after every
                                                   micro-batch, sharded accumulation
3      ``fully_shard(reshard_after_forward=True)``  + params sharded: all-gathered again in
                                                   backward
=====  ==========================================  ==========================================

Under ZeRO-1/2 the unsharded parameters stay resident from the first forward to the last
backward of a step (``reshard_after_backward`` only on the last micro-batch), which is
ZeRO-1/2's "parameters replicated" during compute; between steps FSDP keeps only the shard
(the optimizer updates shards, the next forward all-gathers the updated values — the same
all-gather ZeRO-1/2 do after their sharded update).

Under pipeline parallelism ``torch.distributed.pipelining`` drives these switches itself: it
accumulates unsharded gradients over all micro-batches and reduces once in the stage's
post-backward, so ZeRO-2 behaves as ZeRO-1 there (as in DeepSpeed, which disallows ZeRO-2/3
with its pipeline engine).

Mixed precision: ``MixedPrecisionPolicy(param_dtype=compute, reduce_dtype=reduce)``; the
sharded master parameters and optimizer states stay in ``precision.params``.
"""

from __future__ import annotations

import torch
import torch.nn as nn
from torch.distributed._composable.replicate_with_fsdp import replicate
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard


def apply_dp(chunk: nn.Module, dp_mesh: DeviceMesh, *, zero: int, pipelined: bool,
             mp_policy: MixedPrecisionPolicy, blocks: list[nn.Module] | None = None,
             ignored_params: set[nn.Parameter] | None = None) -> None:
    """Wrap each block, then the chunk root, for ZeRO stage ``zero`` (see module table).
    ``blocks`` default to ``chunk.blocks`` (the built-in chunks), none without it.
    ``ignored_params`` (expert weights under expert parallelism) stay out of the wrappers:
    their gradients are reduced over their own group (:mod:`engine.expert_parallel`)."""
    if blocks is None:
        blocks = list(chunk.blocks.values()) if hasattr(chunk, "blocks") else []
    ignored = {"ignored_params": set(ignored_params)} if ignored_params else {}
    if zero == 0:
        for block in blocks:
            replicate(block, mesh=dp_mesh, mp_policy=mp_policy, **ignored)
        replicate(chunk, mesh=dp_mesh, mp_policy=mp_policy, **ignored)
        return
    for block in blocks:
        fully_shard(block, mesh=dp_mesh, reshard_after_forward=zero == 3, mp_policy=mp_policy,
                    **ignored)
    # The root's parameters (embeddings / head) are used first and last in a non-pipelined
    # step, so resharding them after forward would only re-gather them at once; in a
    # pipeline the stage's backward comes much later.
    fully_shard(chunk, mesh=dp_mesh, reshard_after_forward=zero == 3 and pipelined,
                mp_policy=mp_policy, **ignored)


def set_microbatch(chunk: nn.Module, *, zero: int, last: bool) -> None:
    """Gradient-accumulation switches before a micro-batch's backward (non-pipelined runs).

    ZeRO-0/1 reduce only on the last micro-batch; ZeRO-2/3 reduce-scatter every one. ZeRO-0-2
    keep unsharded parameters until the last backward; ZeRO-3 reshards after every one.
    """
    if not isinstance(chunk, FSDPModule):
        return
    chunk.set_is_last_backward(last)
    chunk.set_requires_gradient_sync(last or zero >= 2)
    chunk.set_reshard_after_backward(last or zero == 3)


def mp_policy_for(param_dtype: torch.dtype, compute: torch.dtype,
                  reduce: torch.dtype) -> MixedPrecisionPolicy:
    if compute == param_dtype and reduce == param_dtype:
        return MixedPrecisionPolicy()
    return MixedPrecisionPolicy(param_dtype=compute, reduce_dtype=reduce)
