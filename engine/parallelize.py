"""Turn a plan stage into a sharded, initialised model chunk — in ONE fixed order.

For each plan stage this rank runs (one, or ``virtual_stages`` chunks under interleaved 1F1B):

1. **Build on meta** — the whole model on the meta device, other stages' modules removed
   (:func:`engine.model.build_chunk`; FQNs unchanged, no memory). A Hugging Face model's
   chunk runs its architecture's stage adapter (:mod:`engine.hf_stage`).
1a. **Float8** (``mixed-fp8`` plans, ``precision.matmul = float8``) — the blocks' linear
   layers become torchao ``Float8Linear`` modules (:mod:`engine.float8`), before any
   parallel wrapper, as torchtitan runs its converters.
1b. **Expert / context parallelism** — expert weights sharded ``Shard(0)`` over the
   expert-parallel mesh, attention all-gathering keys and values over the context-parallel
   one (:mod:`engine.expert_parallel`). First of all: the expert weights must be DTensors
   before the data-parallel wrappers leave them out.
2. **Tensor + sequence parallelism** — ``parallelize_module`` on the ``tp`` mesh with styles
   derived from ``plan.param_placements[fqn]["tp"]`` (:mod:`engine.tensor_parallel`). First,
   because the later wrappers must see DTensor parameters and unchanged FQNs.
3. **Activation checkpointing** — ``checkpoint_wrapper`` (non-reentrant, RNG state preserved)
   around each block in the stage's ``checkpoint_layers``: inside the TP hooks' outputs, outside
   the data-parallel unit, so recomputation happens inside FSDP's all-gathered window; with
   ``parallel.checkpoint = "selective"`` only the attention core is recomputed
   (:mod:`engine.recompute`).
4. **Data parallelism / ZeRO** — ``replicate`` (ZeRO-0) or ``fully_shard`` (ZeRO-1/2/3) per
   block, then the chunk root, on the ``dp`` mesh, with the mixed-precision policy
   (:mod:`engine.data_parallel`). FSDP shards the TP DTensors again on ``dp`` (2-D).
5. **Materialise** — ``to_empty`` on the device, then every parameter (shard) gets its
   deterministic initial value (:func:`engine.model.materialize`).
6. **Pipeline** — the chunks become ``PipelineStage`` objects under the plan's schedule
   (:mod:`engine.pipeline`); done by the caller, since it needs the optimizer-free chunks.

This is torchtitan's order (TP, AC, FSDP on a meta model, then init, then PP schedule).
Mixed precision: fp32 (``precision.params``) master weights and optimizer states; compute in
``precision.compute`` via FSDP's ``param_dtype`` when data parallel (halving all-gathers) and
``torch.autocast`` around each chunk's forward in every case (so TP-/PP-only plans get it
too); gradients reduced in ``precision.reduce``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn

from autoplan.models.registry import ModelSpec
from autoplan.plan import Plan
from autoplan.precision import float8_gemms
from autoplan.pricing import Pricing
from engine import model as model_lib
from engine.data_parallel import apply_dp, mp_policy_for
from engine.expert_parallel import apply_cp, apply_ep, expert_params
from engine.float8 import check_float8_device, convert_float8
from engine.mesh import ParallelMesh
from engine.recompute import mode_of, wrap
from engine.tensor_parallel import apply_tp

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


@dataclass(frozen=True, kw_only=True)
class Precision:
    params: torch.dtype
    compute: torch.dtype
    reduce: torch.dtype
    float8: bool = False             # the blocks' linear layers in float8 (engine.float8)

    @property
    def autocast(self) -> bool:
        return self.compute != self.params


def resolve_precision(plan: Plan, device: torch.device) -> tuple[Precision, str | None]:
    """The plan's precision, or fp32 compute where the device lacks bf16 (with a note)."""
    get = lambda k: _DTYPES[plan.precision.get(k, "float32")]  # noqa: E731
    prec = Precision(params=get("params"), compute=get("compute"), reduce=get("reduce"),
                     float8=float8_gemms(plan.precision))
    note = None
    if prec.compute == torch.bfloat16 and device.type == "cuda" \
            and not torch.cuda.is_bf16_supported():
        prec = Precision(params=prec.params, compute=torch.float32, reduce=torch.float32,
                         float8=prec.float8)
        note = "this GPU has no bfloat16: computing in float32"
    if prec.float8:
        check_float8_device(device)
    return prec, note


def block_keys(chunk: nn.Module, layer_names: tuple[str, ...] | list[str]) -> list[str]:
    """The keys in ``chunk.blocks`` of the blocks named in ``layer_names`` (a chunk holds its
    blocks as ``blocks.<key>`` whatever the model calls them, ``chunk.block_prefix``);
    ``<pre>``/``<post>`` are no blocks."""
    prefix = getattr(chunk, "block_prefix", "blocks") + "."
    return [name[len(prefix):] for name in layer_names if name.startswith(prefix)]


def apply_checkpointing(chunk: nn.Module, layer_names: tuple[str, ...],
                        mode: str = "full") -> None:
    """Wrap the chunk's blocks named in ``layer_names`` for ``mode`` recomputation ('full'
    or 'selective', :func:`engine.recompute.wrap`)."""
    for key in block_keys(chunk, layer_names):
        chunk.blocks[key] = wrap(chunk.blocks[key], mode)


def parallelize_stage(plan: Plan, spec: ModelSpec, stage_index: int, pm: ParallelMesh,
                      precision: Precision, *, seed: int) -> nn.Module:
    """Steps 1-5 of the module docstring for one stage; returns the materialised chunk."""
    stage = plan.stages[stage_index]
    p = plan.parallel
    chunk = model_lib.build_chunk(spec, stage.layer_names)                          # 1
    if precision.params != torch.float32:
        chunk.to(dtype=precision.params)
    if precision.float8:
        convert_float8(chunk, ["blocks." + k for k in block_keys(chunk, stage.layer_names)])
    if p.ep > 1:                                                                    # 1b
        apply_ep(chunk, pm)
    if p.cp > 1:
        apply_cp(chunk, pm, plan.seq_len or model_lib.model_info(spec).max_seq_len,
                 (plan.pricing or Pricing()).cp_comm)
    if p.tp > 1:                                                                    # 2
        apply_tp(chunk, pm.tp_mesh, plan.param_placements,
                 sequence_parallel=p.sequence_parallel)
        if p.sequence_parallel and hasattr(chunk, "sequence_shards"):
            chunk.sequence_shards = p.tp       # stages receive (b, s/tp, h)
    apply_checkpointing(chunk, stage.checkpoint_layers, mode_of(plan))              # 3
    if p.dp * p.cp > 1:                                                             # 4
        apply_dp(chunk, pm.dp_mesh, zero=p.zero, pipelined=p.pp > 1,
                 mp_policy=mp_policy_for(precision.params, precision.compute,
                                         precision.reduce),
                 ignored_params=set(expert_params(chunk)))
    model_lib.materialize(chunk, model_lib.initializer(spec), pm.device, seed)      # 5
    if precision.autocast:
        # Forward only (the loss included): backward then runs in the dtypes autocast chose,
        # and a pipeline schedule's backward is not inside autocast.
        chunk.forward = torch.autocast(pm.device.type, dtype=precision.compute)(chunk.forward)
    chunk.train()
    return chunk
