"""Export a plan as Megatron-LM command-line arguments (a bash array for ``pretrain_gpt.py``).

Mapping (Megatron-LM ``megatron/training/arguments.py``):

* ``--tensor-model-parallel-size tp``, ``--pipeline-model-parallel-size pp``; the
  data-parallel size is implied (world size / (tp x pp x cp)).
* interleaved 1F1B with v chunks per rank -> ``--num-layers-per-virtual-pipeline-stage
  L / (pp v)``; Megatron then needs the micro-batch count to be a multiple of pp.
* ``--sequence-parallel``; ``--micro-batch-size``; ``--global-batch-size``.
* the prediction's runtime assumptions (``plan.pricing``, :mod:`autoplan.pricing`): the
  attention kernel -> ``--attention-backend flash`` (FlashAttention-2) or ``fused`` (cuDNN
  through Transformer Engine; Megatron-Core's ``AttnBackend``), the context-parallel exchange
  -> ``--cp-comm-type allgather`` or ``p2p`` (the ring), so the run does what was priced
  rather than Megatron's defaults (``auto``, ``p2p``); a float8 recipe or unfused kernels
  Megatron-LM does not run are noted.
* context parallelism -> ``--context-parallel-size cp``; expert parallelism ->
  ``--expert-model-parallel-size ep`` (Megatron-Core folds the expert-parallel group into
  data parallelism as the plan does), with ``--num-experts`` / ``--moe-router-topk`` of a
  built-in MoE GPT.
* full recomputation of every block -> ``--recompute-granularity full --recompute-method
  uniform --recompute-num-layers 1``; selective recomputation -> ``--recompute-granularity
  selective`` (Megatron's selective recomputes the core attention, Korthikanti et al. 2022,
  as the plan prices it).
* TP-communication overlap -> ``--tp-comm-overlap`` (Transformer Engine userbuffers; needs
  ``--sequence-parallel``, which the plan then has).
* ZeRO-1 -> ``--use-distributed-optimizer``; bf16 compute -> ``--bf16``; ``mixed-fp8`` ->
  ``--fp8-format hybrid`` (Transformer Engine's float8 linear layers).
* the built-in GPT / Llama model -> ``--num-layers --hidden-size --num-attention-heads
  --ffn-hidden-size --seq-length --max-position-embeddings`` (+ ``--group-query-attention
  --num-query-groups --swiglu --normalization RMSNorm --position-embedding-type rope
  --disable-bias-linear`` for Llama style).

Not expressible: ZeRO-2 / ZeRO-3 (the distributed optimizer shards optimizer states only),
the GPipe schedule (Megatron runs 1F1B), stages with unequal block counts (Megatron splits
layers evenly), recomputing only some blocks, per-stage meshes.
"""

from __future__ import annotations

import shlex

from autoplan.export.common import (Export, NotExpressibleError, compute_dtype, device_note,
                                    float8_linears, gpt_config, pricing_of, uniform_layout)
from autoplan.models.names import describe
from autoplan.plan import Plan

TARGET = "Megatron-LM"


def megatron_args(plan: Plan) -> tuple[list[tuple[str, ...]], list[str]]:
    """([(flag, value...), ...], notes) for ``plan``; NotExpressibleError if it cannot be."""
    layout = uniform_layout(plan, TARGET)
    p = plan.parallel
    reasons = []
    if p.zero in (2, 3):
        reasons.append(f"ZeRO-{p.zero} (parallel.zero = {p.zero}): Megatron-LM's distributed "
                       "optimizer shards optimizer states only (ZeRO-1); export --to "
                       "deepspeed or torchtitan, or plan with zero <= 1")
    if p.pp > 1 and p.schedule == "gpipe":
        reasons.append("the GPipe schedule: Megatron-LM runs 1F1B (interleaved with virtual "
                       "stages)")
    ends = _uneven_ends(layout.blocks_per_chunk) if p.virtual_stages == 1 else None
    if p.pp > 1 and not layout.even and ends is None:
        reasons.append(f"unequal blocks per stage {list(layout.blocks_per_chunk)}: Megatron-LM "
                       f"splits {layout.num_layers} layers evenly over {len(plan.stages)} "
                       "(virtual) stages, but for the first and last stage (without virtual "
                       "stages)")
    if p.virtual_stages > 1 and p.num_micro_batches % p.pp:
        reasons.append(f"{p.num_micro_batches} micro-batches with the interleaved schedule: "
                       f"Megatron-LM needs a multiple of pp = {p.pp}")
    if layout.op:
        reasons.append("op-level recomputation (torchtitan's policy, every other matmul "
                       "saved): Megatron-LM recomputes whole layers or chosen modules "
                       "(--recompute-granularity full / selective); export --to torchtitan, "
                       "or plan with checkpoint 'selective' or 'full'")
    if reasons:
        raise NotExpressibleError(TARGET, reasons)

    pricing, notes = pricing_of(plan)
    notes = device_note(plan) + notes
    args: list[tuple[str, ...]] = [
        ("--tensor-model-parallel-size", str(p.tp)),
        ("--pipeline-model-parallel-size", str(p.pp)),
    ]
    if p.virtual_stages > 1:
        args.append(("--num-layers-per-virtual-pipeline-stage",
                     str(layout.blocks_per_chunk[0])))
    if p.pp > 1 and not layout.even and ends:
        first, last = ends
        if first is not None:
            args.append(("--decoder-first-pipeline-num-layers", str(first)))
        if last is not None:
            args.append(("--decoder-last-pipeline-num-layers", str(last)))
    if p.sequence_parallel:
        args.append(("--sequence-parallel",))
    if p.cp > 1:
        args += [("--context-parallel-size", str(p.cp)),
                 ("--cp-comm-type", "p2p" if pricing.cp_comm == "ring" else "allgather")]
    if p.ep > 1:
        args.append(("--expert-model-parallel-size", str(p.ep)))
    args += [("--micro-batch-size", str(p.micro_batch)),
             ("--global-batch-size", str(plan.global_batch))]
    if layout.checkpoint:
        args += [("--recompute-granularity", "full"), ("--recompute-method", "uniform"),
                 ("--recompute-num-layers", "1")]
    elif layout.selective:
        args.append(("--recompute-granularity", "selective"))
    if p.tp_comm_overlap is True:
        args.append(("--tp-comm-overlap",))
        notes.append("--tp-comm-overlap runs on Transformer Engine's userbuffers (install "
                     "TE with userbuffers support; Megatron-LM initialises them itself)")
    elif p.tp_comm_overlap == "backward":
        notes.append("the prediction assumes Megatron-LM's default overlap of the input "
                     "gradients' TP collectives with the weight-gradient GEMMs (it needs "
                     "CUDA_DEVICE_MAX_CONNECTIONS=1 in the environment)")
    if p.zero == 1:
        args.append(("--use-distributed-optimizer",))
    dtype = compute_dtype(plan)
    if dtype == "bfloat16":
        args.append(("--bf16",))
    elif dtype == "float16":
        args.append(("--fp16",))
    if float8_linears(plan):
        args.append(("--fp8-format", "hybrid"))
        if pricing.float8_recipe != "transformer-engine":
            notes.append("--fp8-format hybrid runs Transformer Engine's float8 linear layers, "
                         "whose casts are cheaper than the torchao casts the plan was priced "
                         "with: expect a faster step (plan with --float8-recipe "
                         "transformer-engine to price them)")
    args.append(("--attention-backend", "fused" if pricing.attention_kernel == "cudnn"
                 else "flash"))
    if not pricing.fused:
        notes.append("the plan was priced for eager (unfused) element-wise kernels; Megatron-LM "
                     "fuses them: expect a faster step than predicted")
    if plan.seq_len:
        args.append(("--seq-length", str(plan.seq_len)))
    cfg = gpt_config(plan)
    if cfg is None:
        notes.append(f"{describe(plan.model)} is not a built-in GPT: add its model arguments "
                     "(--num-layers, --hidden-size, ...) yourself")
    else:
        args += _model_args(cfg)
        notes.append(f"vocabulary: the plan's model has {cfg.vocab_size} entries; Megatron-LM "
                     "takes it from the tokenizer, padded to --make-vocab-size-divisible-by "
                     "x tp")
    return args, notes


def _uneven_ends(blocks: tuple[int, ...]) -> tuple[int | None, int | None] | None:
    """(first, last) stage block counts that differ from the middle stages' common count
    (None where equal), as Megatron-core's ``--decoder-first-pipeline-num-layers`` /
    ``--decoder-last-pipeline-num-layers`` express them; None when the middle stages differ
    among themselves (not expressible)."""
    if len(blocks) < 2:
        return None
    middle = set(blocks[1:-1])
    if len(middle) > 1:
        return None
    if not middle:                       # two stages: name both
        return blocks[0], blocks[-1]
    (mid,) = middle
    return (blocks[0] if blocks[0] != mid else None, blocks[-1] if blocks[-1] != mid else None)


def _model_args(cfg) -> list[tuple[str, ...]]:
    args = [("--num-layers", str(cfg.layers)), ("--hidden-size", str(cfg.hidden)),
            ("--num-attention-heads", str(cfg.heads)), ("--ffn-hidden-size", str(cfg.ffn)),
            ("--max-position-embeddings", str(cfg.seq_len)),
            ("--norm-epsilon", repr(cfg.norm_eps)),
            ("--attention-dropout", repr(cfg.dropout)), ("--hidden-dropout", repr(cfg.dropout))]
    if cfg.kv_heads and cfg.kv_heads != cfg.heads:
        args += [("--group-query-attention",), ("--num-query-groups", str(cfg.kv_heads))]
    if cfg.style == "llama":
        args += [("--swiglu",), ("--normalization", "RMSNorm"),
                 ("--position-embedding-type", "rope"), ("--rotary-base", f"{cfg.rope_theta:g}"),
                 ("--disable-bias-linear",)]
    if not cfg.tie_embeddings:
        args.append(("--untie-embeddings-and-output-weights",))
    if cfg.experts:
        args += [("--num-experts", str(cfg.experts)), ("--moe-router-topk", str(cfg.top_k)),
                 ("--moe-ffn-hidden-size", str(cfg.moe_ffn))]
        if cfg.shared_experts:
            args.append(("--moe-shared-expert-intermediate-size",
                         str(cfg.shared_experts * cfg.moe_ffn)))
        if cfg.capacity_factor != 1.0:
            args.append(("--moe-expert-capacity-factor", f"{cfg.capacity_factor:g}"))
    return args


def to_megatron(plan: Plan) -> Export:
    args, notes = megatron_args(plan)
    p = plan.parallel
    cl = plan.cluster
    lines = ["#!/bin/bash",
             "# Megatron-LM arguments written by `autoplan export --to megatron`",
             f"# plan: {describe(plan.model)}, {p.label()}",
             f"# launch on {cl.get('nodes')} nodes x {cl.get('devices_per_node')} GPUs = "
             f"{plan.world_size} ranks; data-parallel size {p.dp} = {plan.world_size} / "
             f"(tp {p.tp} x pp {p.pp}{f' x cp {p.cp}' if p.cp > 1 else ''}) is implied",
             "MEGATRON_PARALLEL_ARGS=("]
    lines += ["    " + " ".join(shlex.quote(a) for a in arg) for arg in args]
    lines += [")",
              "# torchrun --nnodes ... --nproc_per_node ... pretrain_gpt.py \\",
              '#     "${MEGATRON_PARALLEL_ARGS[@]}" <data, tokenizer, optimizer arguments>']
    return Export(TARGET, "\n".join(lines) + "\n", tuple(notes), ".sh")
