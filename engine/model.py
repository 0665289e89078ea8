"""Build one pipeline stage's model chunk on the meta device, and initialise it.

Two model families run: the built-in GPT (``source="builtin", name="gpt"``, this module) and
Hugging Face causal LMs whose ``model_type`` has a stage adapter (``source="hf"``,
:mod:`engine.hf_stage`, :mod:`engine.hf_arch`). Their chunks share one protocol, which the
parallelisms use: ``chunk.blocks`` (the stage's blocks, an ``nn.ModuleDict`` keyed by index),
``block_prefix`` (their FQN prefix, ``"blocks"`` when absent) and ``tp_layout``
(:class:`engine.tensor_parallel.TPLayout`, the built-in names when absent);
``forward(x, targets=None)``. :func:`model_info` gives the sizes the rest of the engine needs.

A plan names layers ``"<pre>"`` (token and position embeddings, embedding dropout),
``"blocks.0"`` .. ``"blocks.{L-1}"`` (Hugging Face: ``"model.layers.i"``,
``"transformer.h.i"``) and ``"<post>"`` (final norm, LM head; the loss is the pipeline's
loss function). A stage's chunk is the whole model built on the meta device with every
module of other stages removed (``del blocks["7"]``, ``tok_emb = None``): remaining
parameters keep their FQNs, so plan placements, initial values and checkpoints all use the
names of the unsplit model (the torchtitan convention).

Initialisation happens after sharding (:func:`materialize`): every parameter is allocated on
the device with ``to_empty`` and filled from the model's per-parameter rule
(:meth:`autoplan.models.gpt.GPT.init_value`, or :class:`engine.hf_stage.HFInit`; a generator
seeded by the parameter's name); buffers (a Hugging Face model's rotary tables) get the
values the chunk computes from its config (``initial_buffers``); a
sharded parameter (a DTensor from tensor parallelism and/or FSDP) keeps its own shard of the
full value, cut with ``distribute_tensor(..., src_data_rank=None)`` (local, no
communication). So every plan starts from bit-identical weights, whatever its split. Tied
weights (an LM head sharing the input embedding's) stay one parameter through ``to_empty``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor, distribute_tensor

from autoplan.errors import PlanError
from autoplan.models.registry import ModelSpec, build_model

PRE, POST = "<pre>", "<post>"
_WRAPPER_PREFIXES = ("_checkpoint_wrapped_module.", "_fsdp_wrapped_module.")


@dataclass(frozen=True, kw_only=True)
class ModelInfo:
    """What the engine needs to know about a model besides its modules."""

    block_prefix: str                  # blocks are f"{block_prefix}.{i}"
    num_blocks: int
    vocab_size: int
    max_seq_len: int
    tied_embeddings: bool              # the LM head shares the input embedding's weight
    matmul_params: int                 # parameters multiplying activations (model FLOPs)
    layers: int
    attention_width: int               # heads x head_dim

    def layer_names(self) -> list[str]:
        return [PRE, *(f"{self.block_prefix}.{i}" for i in range(self.num_blocks)), POST]


def check_supported(spec: ModelSpec) -> None:
    """The engine runs the built-in GPT family (GPT and Llama styles) and the Hugging Face
    architectures of :data:`engine.hf_arch.ARCHITECTURES`."""
    if spec.source == "builtin" and spec.name == "gpt":
        return
    if spec.source == "hf":
        from engine.hf_arch import adapter_for

        adapter_for(spec.name)
        return
    from engine.hf_arch import ARCHITECTURES

    raise PlanError(f"the engine runs built-in 'gpt' family models and Hugging Face "
                    f"{sorted(ARCHITECTURES)}; this plan's model is source={spec.source!r} "
                    f"name={spec.name!r}")


def model_info(spec: ModelSpec) -> ModelInfo:
    check_supported(spec)
    if spec.source == "builtin":
        from autoplan.models.gpt_config import GPTConfig
        from engine.metrics import gpt_matmul_params

        cfg = GPTConfig.from_dict(spec.config)
        return ModelInfo(block_prefix="blocks", num_blocks=cfg.layers,
                         vocab_size=cfg.vocab_size, max_seq_len=cfg.seq_len,
                         tied_embeddings=cfg.tie_embeddings,
                         matmul_params=gpt_matmul_params(cfg), layers=cfg.layers,
                         attention_width=cfg.heads * cfg.head_dim)
    from autoplan.models.hf import default_seq_len, hf_config
    from autoplan.models.moe import active_params
    from engine.hf_arch import adapter_for
    from engine.hf_stage import tied_embeddings

    adapter = adapter_for(spec.name)
    config = hf_config(spec)
    model = build_model(spec, device="meta")
    tied = tied_embeddings(model, adapter)
    n = active_params(model)               # a mixture of experts: the experts a token uses
    n -= sum(model.get_submodule(e).weight.numel() for e in adapter.embeddings)
    if tied:
        n += model.get_submodule(adapter.head).weight.numel()
    return ModelInfo(block_prefix=adapter.blocks,
                     num_blocks=len(model.get_submodule(adapter.blocks)),
                     vocab_size=int(config.vocab_size), max_seq_len=default_seq_len(spec),
                     tied_embeddings=tied,
                     matmul_params=n, layers=int(config.num_hidden_layers),
                     attention_width=adapter.attention_width(config))


def build_chunk(spec: ModelSpec, layer_names: tuple[str, ...] | list[str]) -> nn.Module:
    """The model restricted to ``layer_names``, on the meta device (no memory)."""
    check_supported(spec)
    if spec.source == "hf":
        from engine.hf_stage import build_hf_chunk

        return build_hf_chunk(spec, layer_names)
    return _build_gpt_chunk(spec, layer_names)


def _build_gpt_chunk(spec: ModelSpec, layer_names: tuple[str, ...] | list[str]) -> nn.Module:
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


def _shared_parameters(chunk: nn.Module) -> list[list[str]]:
    """FQN groups naming one Parameter (tied weights), first name first."""
    names: dict[int, list[str]] = {}
    for fqn, param in chunk.named_parameters(remove_duplicate=False):
        names.setdefault(id(param), []).append(fqn)
    return [group for group in names.values() if len(group) > 1]


def initializer(spec: ModelSpec):
    """What gives ``spec``'s parameters their initial values (``init_value``,
    ``param_seed``): the built-in GPT on meta, or :class:`engine.hf_stage.HFInit`."""
    check_supported(spec)
    if spec.source == "hf":
        from engine.hf_stage import HFInit

        return HFInit(spec)
    return build_model(spec, device="meta")


@torch.no_grad()
def materialize(chunk: nn.Module, init_model, device: torch.device, seed: int) -> None:
    """Allocate ``chunk``'s parameters on ``device`` and give each its deterministic initial
    value (``init_model`` supplies ``init_value`` / ``param_seed``; it may be on meta), and
    each buffer the value of ``chunk.initial_buffers()``."""
    tied = _shared_parameters(chunk)
    chunk.to_empty(device=device)
    for first, *others in tied:
        # to_empty gives each module its own new Parameter unless it swaps in place
        # (DTensors): share the first one again (a tied LM head and input embedding)
        param = chunk.get_parameter(first)
        for fqn in others:
            owner, _, attr = fqn.rpartition(".")
            setattr(chunk.get_submodule(owner), attr, param)
    buffers = dict(chunk.named_buffers())
    if buffers:
        values = chunk.initial_buffers()
        for name, buf in buffers.items():
            fqn = clean_fqn(name)
            if fqn not in values:
                raise PlanError(f"the engine has no initial value for buffer {fqn}")
            buf.copy_(values[fqn].to(device=buf.device, dtype=buf.dtype))
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
