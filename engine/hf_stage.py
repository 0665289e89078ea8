"""A pipeline stage of a Hugging Face causal LM: its own modules, the adapter's forward.

:func:`build_hf_chunk` builds the whole transformers model on the meta device
(:func:`autoplan.models.hf.build`) and moves its top-level children (``model`` and ``lm_head``,
or ``transformer`` and ``lm_head``) into an :class:`HFStage`, so every parameter keeps its
name in the unsplit model (``model.layers.3.self_attn.q_proj.weight``). Then, as for the
built-in GPT (:mod:`engine.model`):

* the decoder-layer ``nn.ModuleList`` becomes an ``nn.ModuleDict`` keyed by the original
  indices, holding only this stage's blocks (a ModuleList would renumber on deletion);
* the modules of ``<pre>`` / ``<post>`` of other stages are set to ``None``;
* ``forward(x, targets=None)`` runs the architecture's adapter (:mod:`engine.hf_arch`): token
  ids in on the stage holding ``<pre>`` (else hidden states), logits out on the stage holding
  ``<post>`` (else hidden states), the loss when ``targets`` is given.

Initial values (:class:`HFInit`) follow transformers' default scheme, drawn per parameter from
a generator seeded by its name (:meth:`autoplan.models.gpt.GPT.param_seed`), so every layout
starts from the same weights; buffers (rotary tables) are recomputed from the config.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Collection

import torch
import torch.nn as nn

from autoplan.errors import PlanError
from autoplan.models.gpt import GPT
from autoplan.models.registry import ModelSpec, build_model
from engine.hf_arch import HFAdapter, adapter_for
from engine.tensor_parallel import TPLayout

PRE, POST = "<pre>", "<post>"


def _parent(root: nn.Module, path: str) -> tuple[nn.Module, str]:
    head, _, attr = path.rpartition(".")
    return (root.get_submodule(head) if head else root), attr


def tied_embeddings(model: nn.Module, adapter: HFAdapter) -> bool:
    """Does the LM head share its weight with the input embedding?"""
    head = model.get_submodule(adapter.head).weight
    return any(model.get_submodule(e).weight is head for e in adapter.embeddings)


class HFStage(nn.Module):
    """The modules of one stage of a transformers causal LM, run by its adapter.

    Chunk protocol shared with the built-in GPT (:mod:`engine.model`): ``blocks`` (the
    stage's blocks by index), ``block_prefix`` (their FQN prefix), ``tp_layout``.
    """

    def __init__(self, model: nn.Module, adapter: HFAdapter, keep: Collection[str]):
        super().__init__()
        self.adapter = adapter
        self.config = model.config
        self.block_prefix = adapter.blocks
        #: the residual stream's sequence shards between stages (tp under sequence
        #: parallelism): a stage without <pre> receives (b, s / sequence_shards, h)
        self.sequence_shards = 1
        self.cp = None       # ContextParallel, set by shard_sequence
        for name, child in model.named_children():
            self.add_module(name, child)
        parent, attr = _parent(self, adapter.blocks)
        layers = getattr(parent, attr)
        setattr(parent, attr, nn.ModuleDict({str(i): layer for i, layer in enumerate(layers)
                                             if f"{adapter.blocks}.{i}" in keep}))
        self.has_pre, self.has_post = PRE in keep, POST in keep
        for paths, kept in ((adapter.pre, self.has_pre), (adapter.post, self.has_post)):
            if not kept:
                for path in paths:
                    setattr(*_parent(self, path), None)

    @property
    def blocks(self) -> nn.ModuleDict:
        return self.get_submodule(self.block_prefix)

    @property
    def tp_layout(self) -> TPLayout | None:
        return self.adapter.tp_layout

    def initial_buffers(self) -> dict[str, torch.Tensor]:
        return self.adapter.buffers(self)

    def shard_sequence(self, group, seq_len: int, method: str = "all-gather") -> None:
        """Context parallelism over ``group``, as :meth:`autoplan.models.gpt.GPT.
        shard_sequence`: this stage's inputs are then this rank's tokens (two chunks of
        ``seq_len``), rotary positions theirs, and each block's attention exchanges keys
        and values over the group (:func:`engine.hf_arch.cp_attention_name`), masked by
        position with the layer's sliding window where it has one."""
        from autoplan.models.capabilities import hf_cp_gap, layer_window
        from autoplan.models.context_parallel import ContextParallel
        from engine.hf_arch import cp_attention_name

        gap = hf_cp_gap(self.config.model_type, self.config)
        if gap:
            raise PlanError(f"context parallelism: {gap}")
        self.cp = ContextParallel(group, group.size(), group.rank(), seq_len, method)
        for key, block in self.blocks.items():      # each layer with its own window
            block.get_submodule(self.adapter.attention).autoplan_cp = replace(
                self.cp, window=layer_window(self.config, int(key)))
        self.config._attn_implementation = cp_attention_name()

    def forward(self, x: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        """Token ids (b, s) on the first stage, else hidden states; returns hidden states,
        or logits (b, s, vocab) on the last stage, or the loss when ``targets`` is given."""
        if self.has_pre:
            seq_len = x.shape[1]
            hidden = self.adapter.embed(self, x)
        else:
            seq_len = x.shape[1] * self.sequence_shards
            hidden = x
        ctx = self.adapter.context(self, hidden, seq_len)
        for key, block in self.blocks.items():
            hidden = self.adapter.block(block, int(key), hidden, ctx)
        if not self.has_post:
            return hidden
        logits = self.adapter.logits(self, hidden)
        return logits if targets is None else GPT.loss(logits, targets)


def layer_names(spec: ModelSpec, num_layers: int) -> list[str]:
    blocks = adapter_for(spec.name).blocks
    return [PRE, *(f"{blocks}.{i}" for i in range(num_layers)), POST]


def build_hf_chunk(spec: ModelSpec, names: Collection[str]) -> HFStage:
    """The stage of ``spec`` holding layers ``names``, on the meta device."""
    adapter = adapter_for(spec.name)
    model = build_model(spec, device="meta")
    every = layer_names(spec, len(model.get_submodule(adapter.blocks)))
    keep = set(names)
    unknown = keep - set(every)
    if unknown:
        raise PlanError(f"layer name(s) {sorted(unknown)} are not layers of this model "
                        f"(<pre>, {every[1]}..{every[-2]}, <post>)")
    placed = (adapter.blocks, *adapter.pre, *adapter.post, *adapter.shared)
    for name, _ in model.named_parameters():
        if not name.startswith(tuple(f"{p}." for p in placed)):
            raise PlanError(f"{spec.name}: parameter {name} belongs to no part the engine's "
                            f"adapter places (blocks, <pre>, <post>); see engine/hf_arch.py")
    if tied_embeddings(model, adapter) and (PRE in keep) != (POST in keep):
        raise PlanError("a model with tied embeddings (tie_word_embeddings) needs <pre> and "
                        "<post> in the same pipeline stage")
    return HFStage(model, adapter, keep)


class HFInit:
    """Initial value of every parameter of a Hugging Face model, by name (see module)."""

    def __init__(self, spec: ModelSpec):
        from autoplan.models.hf import hf_config

        self.adapter = adapter_for(spec.name)
        self.config = hf_config(spec)

    param_seed = staticmethod(GPT.param_seed)

    def init_value(self, name: str, shape: torch.Size | tuple[int, ...], *,
                   generator: torch.Generator | None = None) -> torch.Tensor:
        return self.adapter.init_value(self.config, name, tuple(shape), generator)
