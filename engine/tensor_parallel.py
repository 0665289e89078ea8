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
* the embeddings stay replicated (the learned position table is added to full sequences),
  and the residual stream is sliced where it leaves them: ``Replicate -> Shard(1)`` (no
  communication forward, an all-gather of the gradient backward) on the input of the
  embedding dropout (``TPLayout.embedding_dropout``, the built-in GPT's ``drop``), so that
  the dropout and its mask run on the sequence shard as in Megatron-LM (its embedding
  scatters to the sequence-parallel region before its dropout), else on the input of the
  first block of the stage holding ``<pre>``;
* a replicated head gets ``PrepareModuleInput(Shard(1) -> Replicate())``.

Module names above are the built-in GPT's; a chunk with a ``tp_layout`` attribute
(:class:`TPLayout`: block container, mixers, head, embedding — e.g. a Hugging Face Llama's
``model.layers.i.self_attn``, which its block calls with ``hidden_states=`` as a keyword)
gets the same styles on its own names. Norms are recognised by class name (``*LayerNorm``,
``*RMSNorm``); only those on the residual stream get ``SequenceParallel``.

Dropout modules are elementwise and run on whatever local tensor reaches them; every rank of a
tensor-parallel group seeds dropout identically (:mod:`engine.train`), so replicated regions
stay identical across the group.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (ColwiseParallel, ParallelStyle,
                                               PrepareModuleInput, RowwiseParallel,
                                               SequenceParallel, parallelize_module)

from autoplan.errors import PlanError
from autoplan.placement import REPLICATED, PlacementError, parse
from autoplan.placement_dtensor import to_dtensor

_NORMS = ("LayerNorm", "RMSNorm")          # class-name suffixes (LlamaRMSNorm, nn.LayerNorm)


@dataclass(frozen=True, kw_only=True)
class TPLayout:
    """Where the parts the styles above refer to live in a model chunk.

    ``mixers`` are each block's token/channel mixers whose linears are sharded (attention,
    MLP), with the keyword under which the block passes them the residual stream (``None``:
    the first positional argument). The defaults are the built-in GPT's names
    (:data:`GPT_LAYOUT` adds its embedding dropout, ``drop``); Hugging Face architectures
    give their own (:mod:`engine.hf_arch`).
    """

    blocks: str = "blocks"                 # the block container (keys "0".."L-1")
    mixers: tuple[tuple[str, str | None], ...] = (("attn", None), ("mlp", None))
    head: str = "head"                     # the LM head (nn.Linear)
    embedding: str = "tok_emb"             # the token embedding (present on the first stage)
    embedding_dropout: str | None = None   # a dropout between the embeddings and the blocks


GPT_LAYOUT = TPLayout(embedding_dropout="drop")


def parse_placement(text: str, where: str) -> Shard | Replicate:
    """``"Shard(d)"`` / ``"Replicate()"`` -> the DTensor placement (:mod:`autoplan.placement`
    parses it; ``Partial`` is a plan for activations, not a parameter layout, and is
    rejected, as is a strided shard)."""
    try:
        return to_dtensor(parse(text, where, partial=False, strided=False))
    except PlacementError:
        raise PlanError(f"field 'param_placements.{where}': {text!r} is not a parameter "
                        "placement the engine can apply (Shard(d) or Replicate())") from None


def tp_placement(placements: dict[str, dict[str, str]], fqn: str) -> Shard | Replicate:
    return parse_placement(placements.get(fqn, {}).get("tp", REPLICATED), f"{fqn}.tp")


def tp_plan(chunk: nn.Module, placements: dict[str, dict[str, str]], *,
            sequence_parallel: bool, layout: TPLayout | None = None
            ) -> dict[str, ParallelStyle]:
    """Module FQN -> parallel style for this chunk (a pure function, checked at launch).

    ``layout`` defaults to the chunk's ``tp_layout`` attribute, else the built-in GPT's.
    Raises :class:`PlanError` naming the parameter when a placement cannot be honoured.
    """
    layout = layout or getattr(chunk, "tp_layout", GPT_LAYOUT)
    blocks = _blocks(chunk, layout)
    mixer_prefixes = tuple(f"{layout.blocks}.{key}.{sub}."
                           for key in blocks.keys() for sub, _ in layout.mixers)
    plan: dict[str, ParallelStyle] = {}
    seq = Shard(1)
    for name, module in chunk.named_modules():
        if not name:
            continue
        in_mixer = f"{name}.".startswith(mixer_prefixes)
        if isinstance(module, (nn.Linear, nn.Embedding)):
            style = _weight_style(name, module, placements, sequence_parallel, layout)
            if style is not None:
                plan[name] = style
            elif sequence_parallel and name == layout.head:
                plan[name] = PrepareModuleInput(input_layouts=(seq,),
                                                desired_input_layouts=(Replicate(),),
                                                use_local_output=True)
            elif sequence_parallel and in_mixer:
                raise PlanError(f"field 'param_placements.{name}.weight': sequence "
                                "parallelism needs every attention/MLP linear sharded on "
                                "'tp' (Shard(0) or Shard(1)), got Replicate()")
        elif type(module).__name__.endswith(_NORMS):
            for pname, _ in module.named_parameters(recurse=False):
                if not isinstance(tp_placement(placements, f"{name}.{pname}"), Replicate):
                    raise PlanError(f"field 'param_placements.{name}.{pname}.tp': norm "
                                    "parameters must be Replicate()")
            # norms on the residual stream see its sequence shard; a norm inside a mixer
            # (e.g. per-head q/k norms) sees the mixer's local tensors
            if sequence_parallel and not in_mixer:
                plan[name] = SequenceParallel()
        else:
            for pname, _ in module.named_parameters(recurse=False):
                if not isinstance(tp_placement(placements, f"{name}.{pname}"), Replicate):
                    raise PlanError(f"field 'param_placements.{name}.{pname}.tp': the engine "
                                    f"shards only Linear and Embedding weights on 'tp'")
    if sequence_parallel:
        for key in blocks.keys():
            for sub, kwarg in layout.mixers:
                if kwarg is None:
                    style = PrepareModuleInput(input_layouts=(seq,),
                                               desired_input_layouts=(Replicate(),))
                else:
                    style = PrepareModuleInput(input_kwarg_layouts={kwarg: seq},
                                               desired_input_kwarg_layouts={kwarg: Replicate()})
                plan[f"{layout.blocks}.{key}.{sub}"] = style
        if _has(chunk, layout.embedding) and len(blocks):
            first = next(iter(blocks.keys()))
            at = (layout.embedding_dropout if layout.embedding_dropout
                  and _has(chunk, layout.embedding_dropout) else f"{layout.blocks}.{first}")
            plan[at] = PrepareModuleInput(input_layouts=(Replicate(),),
                                          desired_input_layouts=(seq,), use_local_output=True)
    return plan


def _has(chunk: nn.Module, path: str) -> bool:
    try:
        return chunk.get_submodule(path) is not None
    except AttributeError:
        return False


def _blocks(chunk: nn.Module, layout: TPLayout) -> nn.Module | dict:
    try:
        return chunk.get_submodule(layout.blocks)
    except AttributeError:
        return {}


def _weight_style(name: str, module: nn.Module, placements: dict[str, dict[str, str]],
                  sp: bool, layout: TPLayout) -> ParallelStyle | None:
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
    if name == layout.head:
        if not column:
            raise PlanError(f"field 'param_placements.{name}.weight.tp': the LM head can be "
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
