"""Expert and context parallelism on a model chunk: shard the experts, split the sequence.

**Expert parallelism** (``parallel.ep`` > 1; GShard, Lepikhin et al. 2020, sec. 2.2; folded
into data parallelism as Megatron-LM and torchtitan do). Every mixture-of-experts module of
the chunk (:func:`autoplan.models.moe.expert_layers`: the built-in :class:`MoE` and
transformers' experts modules) gets its expert weights — tensors whose dimension 0 runs over
the ``E`` experts — as DTensors ``Shard(0)`` on the expert-parallel mesh
(:attr:`engine.mesh.ParallelMesh.ep_mesh`): rank ``j`` of an EP group holds experts
``j E/ep .. (j+1) E/ep - 1``. The module's forward exchanges tokens by all-to-all
(:func:`autoplan.models.moe.capacity_forward`). Being DTensors, the shards initialise from
the whole model's values (:func:`engine.model.materialize`), and the checkpoints save and
load them sharded (``torch.distributed.checkpoint``), whatever ``ep``.

Gradients. The step's loss is the mean over the ``R = dp · cp`` ranks holding a replica
(equal token counts). A replicated weight's gradient is averaged over them by FSDP2 / DDP
(the data-parallel mesh). An expert weight is left out of those wrappers
(:func:`expert_params` → ``ignored_params``): the all-to-all's backward already summed,
into this rank's shard, the gradients of the tokens the ``ep`` ranks of its group sent it;
:func:`reduce_expert_grads` then sums over the ``R / ep`` ranks holding the same experts
(the *expert data-parallel* group) and divides by ``R``:

    g_expert = (1 / R) · Σ_{ranks r} ∂ loss_r / ∂ θ_expert

which is the gradient of the global mean loss — the same as one process's.

**Context parallelism** (``parallel.cp`` > 1; Llama 3, Dubey et al. 2024, sec. 3.3.2): the
built-in GPT's attention all-gathers keys and values over the CP group, or passes them
around it as a ring where the plan was priced so (``pricing.cp_comm``;
:meth:`autoplan.models.gpt.GPT.shard_sequence`), and each rank takes its load-balanced
chunks of every sequence (:func:`autoplan.models.context_parallel.shard_rows`,
:func:`shard_batch`). The weights are replicated over the CP ranks like data parallelism
(the data-parallel mesh is ``dp · cp`` ranks: :mod:`engine.mesh`).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from autoplan.models.context_parallel import shard_rows
from autoplan.models.moe import expert_layers, set_ep_group
from engine.mesh import ParallelMesh

#: Set on a chunk by :func:`apply_ep`: (module, attribute) of each of its expert weights.
EXPERT_OWNERS = "_autoplan_expert_owners"


def apply_ep(chunk: nn.Module, pm: ParallelMesh) -> None:
    """Shard every expert weight of ``chunk`` (on the meta device, before the other
    parallelisms) ``Shard(0)`` over ``pm.ep_mesh`` and run its module expert-parallel."""
    owners = []
    group = pm.ep_mesh.get_group()
    for layer in expert_layers(chunk):
        path = layer.params[0].rpartition(".")[0]
        module = chunk.get_submodule(path)
        if layer.experts % pm.ep:
            raise ValueError(f"{path}: {layer.experts} experts do not split over "
                             f"ep={pm.ep} ranks")
        for fqn in layer.params:
            name = fqn.rpartition(".")[2]
            full = getattr(module, name)
            sharded = distribute_tensor(full.detach(), pm.ep_mesh, [Shard(0)],
                                        src_data_rank=None)
            setattr(module, name, nn.Parameter(sharded, requires_grad=full.requires_grad))
            owners.append((module, name))
        set_ep_group(module, group)
    setattr(chunk, EXPERT_OWNERS, tuple(owners))


def expert_params(chunk: nn.Module) -> list[nn.Parameter]:
    """The expert weights :func:`apply_ep` sharded (none without expert parallelism);
    looked up through their modules, so wrappers and ``to_empty`` do not hide them."""
    return [getattr(m, name) for m, name in getattr(chunk, EXPERT_OWNERS, ())]


@torch.no_grad()
def reduce_expert_grads(chunks: list[nn.Module], pm: ParallelMesh) -> None:
    """Sum the expert weights' gradients over the ranks holding the same experts, divide
    by the ``dp · cp`` replicas (module docstring); call after the step's last backward."""
    groups = pm.expert_replica_groups()
    replicas = pm.dp * pm.cp
    for chunk in chunks:
        for param in expert_params(chunk):
            if param.grad is None:
                continue
            grad = param.grad.to_local() if isinstance(param.grad, DTensor) else param.grad
            for group in groups:
                dist.all_reduce(grad, group=group)
            grad.div_(replicas)


def shard_batch(inputs: torch.Tensor, targets: torch.Tensor, pm: ParallelMesh
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """This context-parallel rank's tokens of a data-parallel rank's batch (unchanged
    without context parallelism)."""
    if pm.cp == 1:
        return inputs, targets
    return shard_rows(inputs, pm.cp, pm.cp_rank), shard_rows(targets, pm.cp, pm.cp_rank)


def apply_cp(chunk: nn.Module, pm: ParallelMesh, seq_len: int,
             method: str = "all-gather") -> None:
    """The built-in GPT chunk's attention exchanges keys and values over the CP group as
    ``method`` says: one all-gather, or the ring (the plan's ``pricing.cp_comm``)."""
    chunk.shard_sequence(pm.cp_mesh.get_group(), seq_len, method)
