"""Pipeline parallelism with ``torch.distributed.pipelining``.

Each plan stage this rank runs becomes a ``PipelineStage`` over its (TP/FSDP-wrapped) chunk,
communicating with neighbouring pipeline ranks on the ``pp`` mesh axis. Shapes of the
activations sent between stages are inferred by the library on the first step (under
sequence parallelism each tensor-parallel rank sends its ``(b, s/tp, h)`` shard to the same
tensor-parallel rank of the next stage).

Schedules (plan ``parallel.schedule``):

* ``gpipe`` — ``ScheduleGPipe`` (Huang et al. 2019): all forwards, then all backwards;
* ``1f1b`` — ``Schedule1F1B`` (Narayanan et al. 2019, PipeDream-Flush);
* ``interleaved_1f1b`` — ``ScheduleInterleaved1F1B`` (Narayanan et al. 2021), with
  ``virtual_stages`` chunks per rank, chunk ``c`` on pipeline rank ``c % pp``.

Without sequence parallelism every tensor-parallel rank holds the whole stage output;
each sends only its slice of the sequence and the next stage all-gathers them over its
TP group (Megatron-LM's scatter/gather, Narayanan et al. 2021 sec. 4.1;
:func:`scatter_gather`, the rule in :mod:`autoplan.cost.pipeline_comm`), so the
inter-node link carries one copy, not ``tp``.

The per-rank batch is split into ``parallel.num_micro_batches`` micro-batches of
``parallel.micro_batch`` rows; the loss function is the model's mean cross-entropy per
micro-batch and the schedule scales gradients by ``1 / num_micro_batches`` (``scale_grads``),
so gradients equal those of the mean loss over the whole batch.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn as nn
from torch.distributed.pipelining import (PipelineStage, Schedule1F1B, ScheduleGPipe,
                                          ScheduleInterleaved1F1B)
from torch.distributed.pipelining.schedules import _PipelineSchedule
from torch.distributed.tensor import DTensor, Replicate, Shard

from autoplan.cost.pipeline_comm import boundary_shards
from engine.mesh import ParallelMesh

SCHEDULES = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B,
             "interleaved_1f1b": ScheduleInterleaved1F1B}


def build_schedule(chunks: dict[int, nn.Module], pm: ParallelMesh, *, schedule: str,
                   num_micro_batches: int,
                   loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
                   ) -> _PipelineSchedule:
    group = pm.pp_mesh.get_group()
    stages = [PipelineStage(chunk, stage_index=index, num_stages=pm.num_stages,
                            device=pm.device, group=group)
              for index, chunk in sorted(chunks.items())]
    cls = SCHEDULES[schedule]
    if schedule == "interleaved_1f1b":
        return cls(stages, n_microbatches=num_micro_batches, loss_fn=loss_fn)
    (stage,) = stages
    return cls(stage, n_microbatches=num_micro_batches, loss_fn=loss_fn)


def scatter_gather(chunks: dict[int, nn.Module], pm: ParallelMesh, *, tp: int,
                   sequence_parallel: bool, seq_len: int | None) -> bool:
    """Send stage outputs as sequence slices of the TP group (module docstring) where
    :func:`~autoplan.cost.pipeline_comm.boundary_shards` says so without sequence
    parallelism (under it the stream is sharded already). Hooks on each chunk: its output
    (not on the last stage) becomes this rank's slice, ``Replicate -> Shard(1)`` (no
    communication; the gradient is all-gathered in backward), and its input (not on the
    first stage) the whole sequence, ``Shard(1) -> Replicate`` (an all-gather; the gradient
    is sliced). Returns whether it applied."""
    if sequence_parallel or boundary_shards(tp, sequence_parallel, seq_len) == 1:
        return False
    mesh = pm.tp_mesh

    def gather(module, args):
        x = DTensor.from_local(args[0], mesh, [Shard(1)], run_check=False)
        return (x.redistribute(mesh, [Replicate()]).to_local(), *args[1:])

    def scatter(module, args, out):
        y = DTensor.from_local(out, mesh, [Replicate()], run_check=False)
        return y.redistribute(mesh, [Shard(1)]).to_local().contiguous()

    for index, chunk in chunks.items():
        if index > 0:
            chunk.register_forward_pre_hook(gather)
        if index < pm.num_stages - 1:
            chunk.register_forward_hook(scatter)
    return True


def has_first_stage(pm: ParallelMesh) -> bool:
    return 0 in pm.stages


def has_last_stage(pm: ParallelMesh) -> bool:
    return pm.num_stages - 1 in pm.stages
