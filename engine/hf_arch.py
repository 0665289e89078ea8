"""Stage-forward adapters for Hugging Face causal LMs, registered by ``model_type``.

Why adapters: a transformers model's ``forward`` runs token ids to logits in one call; it
cannot start from, or stop at, hidden states in the middle, which is what a pipeline stage
does. So the engine keeps the model's own modules — with their checkpoint names,
``model.layers.3.mlp.up_proj`` — and drives them with a small adapter per architecture family
that restates what the model's ``forward`` does around its blocks::

    first stage   h = adapter.embed(stage, input_ids)                  # <pre>
    every stage   ctx = adapter.context(stage, h, seq_len)             # masks, positions, rotary
                  h = adapter.block(block, i, h, ctx)  for each block i of the stage
    last stage    logits = adapter.logits(stage, h)                    # <post>: final norm, head

The loss is the engine's (:meth:`autoplan.models.gpt.GPT.loss`: mean token cross-entropy on
targets shifted by the data source), which equals transformers' causal-LM loss of
``labels=input_ids`` over the sequence one token longer.

An adapter also names the model's parts (module paths in the ``*ForCausalLM`` model):
``blocks``, the ``nn.ModuleList`` of decoder layers (the planner's layer names are
``f"{blocks}.{i}"``); ``pre`` / ``post``, the modules of ``<pre>`` / ``<post>``; ``shared``,
parameter-free modules every stage keeps (rotary tables); the input embedding tables and
the LM head. It gives the tensor-parallel layout (:class:`engine.tensor_parallel.TPLayout`)
or says why there is none, the sizes tensor parallelism must divide, the initialisation rule
and the values of the model's buffers.

Registered families (:data:`ARCHITECTURES`, read-only; a new family is an adapter subclass
plus entries here, checked against the model's own forward by ``tests/test_engine_hf.py``):

=========================  =============================  ==================================
model types                adapter                        tensor / sequence parallel
=========================  =============================  ==================================
``gpt2``                   :class:`GPT2Adapter`           no: q, k, v fused in one Conv1D
``llama``, ``mistral``,    :class:`RotaryDecoderAdapter`  yes: separate q/k/v/o and
``qwen2``                                                 gate/up/down ``nn.Linear``
``mixtral``, ``qwen3_moe``  :class:`RotaryDecoderAdapter`  no: experts are 3-D tensors (expert
                                                          parallelism instead:
                                                          :mod:`engine.expert_parallel`)
=========================  =============================  ==================================
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, Mapping

import torch
import torch.nn as nn

from autoplan.errors import PlanError
from engine.tensor_parallel import TPLayout



def _no_cache(mask_builder) -> dict:
    """``{cache_argument: None}`` for a transformers mask builder: ``cache`` since
    transformers 5.x (``past_key_values`` is deprecated there and warns once per call site
    and rank), ``past_key_values`` before."""
    import inspect

    params = inspect.signature(mask_builder).parameters
    return {"cache" if "cache" in params else "past_key_values": None}

@dataclass(frozen=True, kw_only=True)
class HFAdapter(ABC):
    """Names and stage forward of one architecture family (subclasses implement the four
    forward pieces and the sizes)."""

    blocks: str                              # the decoder layers' nn.ModuleList
    pre: tuple[str, ...]                     # modules of <pre>
    post: tuple[str, ...]                    # modules of <post>
    shared: tuple[str, ...] = ()             # parameter-free modules every stage keeps
    embeddings: tuple[str, ...]              # input embedding tables (lookups, not matmuls)
    head: str = "lm_head"
    tp_layout: TPLayout | None = None        # None: the engine refuses tensor parallelism
    no_tp_reason: str = ""
    scaled_init: tuple[str, ...] = ()        # weight-name suffixes drawn with std/sqrt(2·L)
    padded_embedding: str | None = None      # its pad_token_id row starts at zero
    attention: str = "self_attn"             # a block's attention module

    # ---- the stage forward ------------------------------------------------------------------
    @abstractmethod
    def embed(self, stage: nn.Module, input_ids: torch.Tensor) -> torch.Tensor:
        """``<pre>``: token ids (b, s) -> hidden states (b, s, h)."""

    @abstractmethod
    def context(self, stage: nn.Module, hidden: torch.Tensor, seq_len: int) -> dict[str, Any]:
        """What every block of one forward shares; ``seq_len`` is the full sequence length
        (``hidden`` may be a sequence shard under sequence parallelism)."""

    @abstractmethod
    def block(self, block: nn.Module, index: int, hidden: torch.Tensor,
              ctx: dict[str, Any]) -> torch.Tensor:
        """Block ``index`` (its position in the whole model); ``hidden`` is passed
        positionally, the rest as keywords (tensor-parallel input hooks rely on it)."""

    @abstractmethod
    def logits(self, stage: nn.Module, hidden: torch.Tensor) -> torch.Tensor:
        """``<post>``: hidden states -> logits (b, s, vocab)."""

    # ---- sizes, initial values --------------------------------------------------------------
    @abstractmethod
    def tp_divisors(self, config) -> tuple[tuple[str, int], ...]:
        """(what, size) pairs tensor parallelism must divide."""

    @abstractmethod
    def attention_width(self, config) -> int:
        """heads × head_dim (the attention term of the model FLOPs)."""

    def buffers(self, stage: nn.Module) -> dict[str, torch.Tensor]:
        """Initial values of the stage's buffers by FQN (computed from the config)."""
        return {}

    def init_value(self, config, name: str, shape: tuple[int, ...],
                   generator: torch.Generator | None) -> torch.Tensor:
        """transformers' default scheme, per parameter name: weights N(0, initializer_range)
        (``scaled_init`` ones divided by sqrt(2·layers), GPT-2's residual projections), the
        padding row of ``padded_embedding`` zero, biases 0, norm weights 1."""
        if len(shape) == 1:
            return torch.full(shape, 0.0 if name.endswith("bias") else 1.0,
                              dtype=torch.float32)
        std = float(getattr(config, "initializer_range", 0.02) or 0.02)
        if self.scaled_init and name.endswith(self.scaled_init):
            std /= math.sqrt(2 * config.num_hidden_layers)
        value = torch.randn(shape, generator=generator, dtype=torch.float32) * std
        pad = getattr(config, "pad_token_id", None)
        if name == f"{self.padded_embedding}.weight" and pad is not None:
            value[pad] = 0.0
        return value


def _positions(hidden: torch.Tensor, seq_len: int) -> torch.Tensor:
    return torch.arange(seq_len, device=hidden.device).unsqueeze(0)


def _shape_like(hidden: torch.Tensor, seq_len: int) -> torch.Tensor:
    """A (b, seq_len, 0) tensor: transformers' mask builders read only the batch size,
    query length, dtype and device of their ``inputs_embeds``."""
    return hidden.new_empty((hidden.shape[0], seq_len, 0))


@dataclass(frozen=True, kw_only=True)
class GPT2Adapter(HFAdapter):
    """GPT-2 (``GPT2LMHeadModel``): learned positions, pre-LayerNorm blocks, ``ln_f``.
    Under context parallelism each rank looks up the learned positions of its own two
    chunks, and the attention masks by position.

    No tensor parallelism: attention projects q, k and v with one fused ``Conv1D``
    (``c_attn``, weight (h, 3h)) and splits its output at fixed offsets ``split_size = h``; a
    column shard of ``c_attn`` holds a contiguous third-and-a-bit of [q | k | v], not q, k and
    v of the same heads, and the split offsets would be wrong on the local tensor.
    """

    def embed(self, stage, input_ids):
        t = stage.get_submodule("transformer")
        cp = getattr(stage, "cp", None)    # context parallel: this rank's tokens' positions
        pos = cp.positions(input_ids.device) if cp is not None else \
            torch.arange(input_ids.shape[1], device=input_ids.device)
        return t.drop(t.wte(input_ids) + t.wpe(pos))

    def context(self, stage, hidden, seq_len):
        from transformers.masking_utils import create_causal_mask

        if getattr(stage, "cp", None) is not None:     # the mask is in the CP attention
            return {"attention_mask": None}
        pos = _positions(hidden, seq_len)
        mask = create_causal_mask(config=stage.config, inputs_embeds=_shape_like(hidden, seq_len),
                                  attention_mask=None, position_ids=pos,
                                  **_no_cache(create_causal_mask))
        return {"attention_mask": mask}

    def block(self, block, index, hidden, ctx):
        return block(hidden, attention_mask=ctx["attention_mask"])

    def logits(self, stage, hidden):
        return stage.lm_head(stage.get_submodule("transformer.ln_f")(hidden))

    def tp_divisors(self, config):
        return (("heads", config.n_head),)

    def attention_width(self, config):
        return int(config.n_embd)


@dataclass(frozen=True, kw_only=True)
class RotaryDecoderAdapter(HFAdapter):
    """Llama-style decoders (``LlamaForCausalLM`` and the models that copy its layout:
    Mistral, Qwen2): ``model.embed_tokens``, ``model.layers``, ``model.norm``, ``lm_head``,
    rotary tables computed once per forward by ``model.rotary_emb``.

    Masks as the model's forward builds them: per layer from ``config.layer_types``
    (``full_attention`` / ``sliding_attention``, Qwen2) when the config has them, else a
    sliding-window mask for every layer when ``config.sliding_window`` is set (Mistral), else
    causal. Tensor parallelism: the attention reshapes with ``-1`` heads and GQA repeats
    ``num_key_value_groups`` (a ratio unchanged by sharding), so column/row styles on
    q/k/v/o and gate/up/down are correct.
    """

    def embed(self, stage, input_ids):
        return stage.get_submodule("model.embed_tokens")(input_ids)

    def context(self, stage, hidden, seq_len):
        from transformers.masking_utils import (create_causal_mask,
                                                create_sliding_window_causal_mask)

        from autoplan.models.capabilities import layer_kinds

        config = stage.config
        kinds = layer_kinds(config)
        like = _shape_like(hidden, seq_len)
        cp = getattr(stage, "cp", None)
        if cp is not None:         # this rank's tokens of the sequence: their own positions,
            pos = cp.positions(hidden.device).unsqueeze(0)        # masks in the attention
            rotary = stage.get_submodule("model.rotary_emb")(like, pos)
            return {"masks": [None] * len(kinds), "position_ids": pos,
                    "position_embeddings": rotary}
        pos = _positions(hidden, seq_len)
        builders = {"full_attention": create_causal_mask,
                    "sliding_attention": create_sliding_window_causal_mask}
        masks = {}
        for kind in sorted(set(kinds)):
            if kind not in builders:
                raise PlanError(f"{config.model_type}: attention layer type {kind!r} is not "
                                f"one the engine's adapter builds masks for ({sorted(builders)})")
            masks[kind] = builders[kind](config=config, inputs_embeds=like, attention_mask=None,
                                         position_ids=pos, **_no_cache(builders[kind]))
        rotary = stage.get_submodule("model.rotary_emb")(like, pos)
        return {"masks": [masks[k] for k in kinds], "position_ids": pos,
                "position_embeddings": rotary}

    def block(self, block, index, hidden, ctx):
        return block(hidden, attention_mask=ctx["masks"][index],
                     position_embeddings=ctx["position_embeddings"],
                     position_ids=ctx["position_ids"])

    def logits(self, stage, hidden):
        return stage.lm_head(stage.get_submodule("model.norm")(hidden))

    def tp_divisors(self, config):
        return (("num_attention_heads", config.num_attention_heads),
                ("num_key_value_heads", config.num_key_value_heads or
                 config.num_attention_heads),
                ("intermediate_size", config.intermediate_size))

    def attention_width(self, config):
        head_dim = getattr(config, "head_dim", None) or \
            config.hidden_size // config.num_attention_heads
        return int(config.num_attention_heads * head_dim)

    def buffers(self, stage):
        rotary = stage.get_submodule("model.rotary_emb")
        with torch.device("cpu"):
            fresh = type(rotary)(config=stage.config)
        return {f"model.rotary_emb.{n}": b for n, b in fresh.named_buffers()}


_GPT2 = GPT2Adapter(
    blocks="transformer.h",
    pre=("transformer.wte", "transformer.wpe", "transformer.drop"),
    post=("transformer.ln_f", "lm_head"),
    embeddings=("transformer.wte", "transformer.wpe"),
    no_tp_reason="GPT-2 projects q, k and v with one fused Conv1D (c_attn) whose output is "
                 "split at fixed offsets, so a column shard mixes heads of q, k and v",
    scaled_init=("attn.c_proj.weight", "mlp.c_proj.weight"),
    attention="attn",
)

_ROTARY = RotaryDecoderAdapter(
    blocks="model.layers",
    pre=("model.embed_tokens",),
    post=("model.norm", "lm_head"),
    shared=("model.rotary_emb",),
    embeddings=("model.embed_tokens",),
    tp_layout=TPLayout(blocks="model.layers",
                       mixers=(("self_attn", "hidden_states"), ("mlp", None)),
                       head="lm_head", embedding="model.embed_tokens"),
    padded_embedding="model.embed_tokens",
)

#: Mixtral and Qwen3-MoE: Mistral's / Qwen3's blocks with a mixture of experts for the MLP
#: (capacity routing, :mod:`autoplan.models.moe`).
_ROTARY_MOE = RotaryDecoderAdapter(
    blocks="model.layers",
    pre=("model.embed_tokens",),
    post=("model.norm", "lm_head"),
    shared=("model.rotary_emb",),
    embeddings=("model.embed_tokens",),
    no_tp_reason="its experts are 3-D weight tensors, which the tensor-parallel styles do "
                 "not shard; split them over ranks with expert parallelism (ep) instead",
    padded_embedding="model.embed_tokens",
)

#: model_type -> adapter: the Hugging Face architectures the engine runs.
ARCHITECTURES: Mapping[str, HFAdapter] = MappingProxyType({
    "gpt2": _GPT2,
    "llama": _ROTARY,
    "mistral": _ROTARY,
    "qwen2": _ROTARY,
    "mixtral": _ROTARY_MOE,
    "qwen3_moe": _ROTARY_MOE,
})


#: The name context-parallel stages give transformers' attention dispatch
#: (``config._attn_implementation``), registered by :func:`cp_attention_name`.
CP_ATTENTION = "autoplan_context_parallel"


def _cp_attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor,
                  value: torch.Tensor, attention_mask: torch.Tensor | None, *,
                  scaling: float | None = None, dropout: float = 0.0, **_: Any):
    """transformers' attention-function signature over the whole sequence of a
    context-parallel group (:func:`autoplan.models.context_parallel.attend`, the exchange
    the module's ``autoplan_cp`` says); the mask is the group's causal one, not
    ``attention_mask`` (the adapter builds none). Returns ((b, s/cp, heads, hd), None)."""
    from autoplan.models.context_parallel import attend

    out = attend(query, key, value, module.autoplan_cp, dropout, scaling)
    return out.transpose(1, 2).contiguous(), None


def cp_attention_name() -> str:
    """:data:`CP_ATTENTION`, registered with transformers' ``AttentionInterface``."""
    from transformers import AttentionInterface

    AttentionInterface.register(CP_ATTENTION, _cp_attention)
    return CP_ATTENTION


def adapter_for(model_type: str) -> HFAdapter:
    try:
        return ARCHITECTURES[model_type]
    except KeyError:
        raise PlanError(f"the engine has no stage adapter for Hugging Face model_type "
                        f"{model_type!r}; it runs {sorted(ARCHITECTURES)} (see "
                        "engine/hf_arch.py to add one)") from None
