"""Build one pipeline stage's model chunk on the meta device, and initialise it.

A plan names layers ``"<pre>"`` (token and position embeddings, embedding dropout),
``"blocks.0"`` .. ``"blocks.{L-1}"`` and ``"<post>"`` (final norm, LM head; the loss is the
pipeline's loss function). A stage's chunk is the whole model built on the meta device with
every module of other stages removed (``del blocks["7"]``, ``tok_emb = None``): remaining
parameters keep their FQNs, so plan placements, initial values and checkpoints all use the
names of the unsplit model (the torchtitan convention).

Initialisation happens after sharding (:func:`materialize`): every parameter is allocated on
the device with ``to_empty`` and filled from the model's per-parameter rule
(:meth:`autoplan.models.gpt.GPT.init_value`, a generator seeded by the parameter's name); a
sharded parameter (a DTensor from tensor parallelism and/or FSDP) keeps its own shard of the
full value, cut with ``distribute_tensor(..., src_data_rank=None)`` (local, no
communication). So every plan starts from bit-identical weights, whatever its split.
"""

from __future__ import annotations

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor, distribute_tensor

from autoplan.errors import PlanError
from autoplan.models.registry import ModelSpec, build_model

PRE, POST = "<pre>", "<post>"
_WRAPPER_PREFIXES = ("_checkpoint_wrapped_module.", "_fsdp_wrapped_module.")


def check_supported(spec: ModelSpec) -> None:
    """The engine runs the built-in GPT family (GPT and Llama styles)."""
    if spec.source != "builtin" or spec.name != "gpt":
        raise PlanError(f"the engine runs built-in 'gpt' family models; this plan's model is "
                        f"source={spec.source!r} name={spec.name!r}")


def build_chunk(spec: ModelSpec, layer_names: tuple[str, ...] | list[str]) -> nn.Module:
    """The model restricted to ``layer_names``, on the meta device (no memory)."""
    check_supported(spec)
    model = build_model(spec, device="meta")
    keep = set(layer_names)
    blocks = {f"blocks.{k}" for k in model.blocks.keys()}
    unknown = keep - blocks - {PRE, POST}
    if unknown:
        raise PlanError(f"layer name(s) {sorted(unknown)} are not layers of this model "
                        f"(<pre>, blocks.0..blocks.{len(blocks) - 1}, <post>)")
    if model.cfg.tie_embeddings and (PRE in keep) != (POST in keep):
        raise PlanError("a model with tied embeddings needs <pre> and <post> in the same "
                        "pipeline stage")
    for key in list(model.blocks.keys()):
        if f"blocks.{key}" not in keep:
            del model.blocks[key]
    if any(True for _ in model.buffers()):
        raise PlanError("the engine initialises parameters only; this model has buffers")
    if PRE not in keep:
        model.tok_emb = None
        model.pos_emb = None
    if POST not in keep:
        model.norm = None
        model.head = None
    return model


def clean_fqn(name: str) -> str:
    """A parameter's name in the unsplit model (wrapper prefixes removed)."""
    for prefix in _WRAPPER_PREFIXES:
        name = name.replace(prefix, "")
    return name


@torch.no_grad()
def materialize(chunk: nn.Module, init_model: nn.Module, device: torch.device,
                seed: int) -> None:
    """Allocate ``chunk``'s parameters on ``device`` and give each its deterministic initial
    value (``init_model`` supplies ``init_value`` / ``param_seed``; it may be on meta)."""
    chunk.to_empty(device=device)
    for name, param in chunk.named_parameters():
        fqn = clean_fqn(name)
        gen = torch.Generator(device="cpu").manual_seed(init_model.param_seed(seed, fqn))
        full = init_model.init_value(fqn, param.shape, generator=gen)
        if isinstance(param, DTensor):
            local = distribute_tensor(full, param.device_mesh, param.placements,
                                      src_data_rank=None).to_local()
            target = param.to_local()
        else:
            local, target = full, param
        if tuple(local.shape) != tuple(target.shape):
            raise RuntimeError(f"init of {fqn}: shard shape {tuple(local.shape)} != "
                               f"{tuple(target.shape)}")
        target.copy_(local.to(device=target.device, dtype=target.dtype))
