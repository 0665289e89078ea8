"""Tensor (and sequence) parallelism from the plan's parameter placements.

Each weight's placement on the ``tp`` mesh axis picks a ``torch.distributed.tensor.parallel``
style for its module (Megatron-LM, Shoeybi et al. 2019; sequence parallelism, Korthikanti
et al. 2022, arXiv 2205.05198):

=====================  ===============  ==============================================
module                 ``tp`` weight    style
=====================  ===============  ==============================================
``nn.Linear``          ``Shard(0)``     ``ColwiseParallel`` (bias ``Shard(0)``)
``nn.Linear``          ``Shard(1)``     ``RowwiseParallel`` (bias ``Replicate()``),
                                        output ``Shard(1)`` (reduce-scatter) under SP,
                                        else ``Replicate()`` (all-reduce)
``nn.Embedding``       ``Shard(0)``     ``RowwiseParallel`` (vocabulary-parallel), output
                                        ``Replicate()``
``nn.Embedding``       ``Shard(1)``     ``ColwiseParallel``, output ``Replicate()``
LM head (``head``)     ``Shard(0)``     ``ColwiseParallel``, output ``Replicate()`` (the
                                        logits are gathered before the loss)
anything               ``Replicate()``  none (plain replicated tensor)
=====================  ===============  ==============================================

With sequence parallelism the residual stream between blocks is the local shard
``(b, s/tp, h)`` of a ``Shard(1)`` activation:

* every norm (``blocks.i.norm1``, ``norm2``, final ``norm``) gets ``SequenceParallel``
  (its weight becomes a replicated DTensor whose partial gradients DTensor reduces);
* ``blocks.i.attn`` and ``blocks.i.mlp`` get ``PrepareModuleInput(Shard(1) -> Replicate())``:
  one all-gather before q/k/v (gate/up, fc1), matching the row-parallel reduce-scatter after;
* the embeddings stay replicated (the learned position table is added to full sequences), and
  the first block of the stage holding ``<pre>`` slices its input: ``Replicate -> Shard(1)``
  (no communication forward, an all-gather of the gradient backward);
* a replicated head gets ``PrepareModuleInput(Shard(1) -> Replicate())``.

Dropout modules are elementwise and run on whatever local tensor reaches them; every rank of a
tensor-parallel group seeds dropout identically (:mod:`engine.train`), so replicated regions
stay identical across the group.
"""

from __future__ import annotations

import re

import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (ColwiseParallel, ParallelStyle,
                                               PrepareModuleInput, RowwiseParallel,
                                               SequenceParallel, parallelize_module)

from autoplan.errors import PlanError

_SHARD = re.compile(r"^Shard\((-?\d+)\)$")
_NORMS = ("LayerNorm", "RMSNorm")


def parse_placement(text: str, where: str) -> Shard | Replicate:
    """``"Shard(d)"`` / ``"Replicate()"`` -> the DTensor placement (``Partial`` is a plan for
    activations, not a parameter layout, and is rejected)."""
    if text == "Replicate()":
        return Replicate()
    m = _SHARD.match(text)
    if m:
        return Shard(int(m.group(1)))
    raise PlanError(f"field 'param_placements.{where}': {text!r} is not a parameter "
                    "placement the engine can apply (Shard(d) or Replicate())")


def tp_placement(placements: dict[str, dict[str, str]], fqn: str) -> Shard | Replicate:
    return parse_placement(placements.get(fqn, {}).get("tp", "Replicate()"), f"{fqn}.tp")


def tp_plan(chunk: nn.Module, placements: dict[str, dict[str, str]], *,
            sequence_parallel: bool) -> dict[str, ParallelStyle]:
    """Module FQN -> parallel style for this chunk (a pure function, checked at launch).

    Raises :class:`PlanError` naming the parameter when a placement cannot be honoured.
    """
    plan: dict[str, ParallelStyle] = {}
    seq = Shard(1)
    for name, module in chunk.named_modules():
        if not name:
            continue
        if isinstance(module, (nn.Linear, nn.Embedding)):
            style = _weight_style(name, module, placements, sequence_parallel)
            if style is not None:
                plan[name] = style
            elif sequence_parallel and name == "head":
                plan[name] = PrepareModuleInput(input_layouts=(seq,),
                                                desired_input_layouts=(Replicate(),),
                                                use_local_output=True)
            elif sequence_parallel and (".attn." in f".{name}." or ".mlp." in f".{name}."):
                raise PlanError(f"field 'param_placements.{name}.weight': sequence "
                                "parallelism needs every attention/MLP linear sharded on "
                                "'tp' (Shard(0) or Shard(1)), got Replicate()")
        elif type(module).__name__ in _NORMS:
            for pname, _ in module.named_parameters(recurse=False):
                if not isinstance(tp_placement(placements, f"{name}.{pname}"), Replicate):
                    raise PlanError(f"field 'param_placements.{name}.{pname}.tp': norm "
                                    "parameters must be Replicate()")
            if sequence_parallel:
                plan[name] = SequenceParallel()
        else:
            for pname, _ in module.named_parameters(recurse=False):
                if not isinstance(tp_placement(placements, f"{name}.{pname}"), Replicate):
                    raise PlanError(f"field 'param_placements.{name}.{pname}.tp': the engine "
                                    f"shards only Linear and Embedding weights on 'tp'")
    if sequence_parallel:
        blocks = getattr(chunk, "blocks", {})
        for key in blocks.keys():
            for sub in ("attn", "mlp"):
                plan[f"blocks.{key}.{sub}"] = PrepareModuleInput(
                    input_layouts=(seq,), desired_input_layouts=(Replicate(),))
        if getattr(chunk, "tok_emb", None) is not None and len(blocks):
            first = next(iter(blocks.keys()))
            plan[f"blocks.{first}"] = PrepareModuleInput(
                input_layouts=(Replicate(),), desired_input_layouts=(seq,),
                use_local_output=True)
    return plan


def _weight_style(name: str, module: nn.Module, placements: dict[str, dict[str, str]],
                  sp: bool) -> ParallelStyle | None:
    weight = tp_placement(placements, f"{name}.weight")
    bias = None
    if getattr(module, "bias", None) is not None:
        bias = tp_placement(placements, f"{name}.bias")
    if isinstance(weight, Replicate):
        if bias is not None and not isinstance(bias, Replicate):
            raise PlanError(f"field 'param_placements.{name}.bias.tp': {bias} with a replicated "
                            "weight")
        return None
    dim = weight.dim % 2
    embedding = isinstance(module, nn.Embedding)
    # nn.Linear weight is (out, in): Shard(0) = column parallel; nn.Embedding is (vocab, h):
    # Shard(0) = vocabulary (row) parallel.
    column = (dim == 0) != embedding
    if column and bias is not None and bias != Shard(0):
        raise PlanError(f"field 'param_placements.{name}.bias.tp': a column-parallel layer's "
                        f"bias must be Shard(0), got {bias}")
    if not column and bias is not None and not isinstance(bias, Replicate):
        raise PlanError(f"field 'param_placements.{name}.bias.tp': a row-parallel layer's bias "
                        f"must be Replicate(), got {bias}")
    if embedding:
        cls = ColwiseParallel if column else RowwiseParallel
        return cls(input_layouts=Replicate(), output_layouts=Replicate())
    if name == "head":
        if not column:
            raise PlanError("field 'param_placements.head.weight.tp': the LM head can be "
                            "sharded on the vocabulary (Shard(0)) only")
        return ColwiseParallel(input_layouts=Shard(1) if sp else Replicate(),
                               output_layouts=Replicate())
    if column:
        return ColwiseParallel()
    return RowwiseParallel(output_layouts=Shard(1) if sp else Replicate())


def apply_tp(chunk: nn.Module, tp_mesh: DeviceMesh, placements: dict[str, dict[str, str]], *,
             sequence_parallel: bool) -> None:
    plan = tp_plan(chunk, placements, sequence_parallel=sequence_parallel)
    if plan:
        parallelize_module(chunk, tp_mesh, plan)
