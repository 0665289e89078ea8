"""Export a plan as a DeepSpeed config (JSON).

Mapping (DeepSpeed config reference, deepspeed.ai/docs/config-json):
``train_batch_size`` = global batch, ``train_micro_batch_size_per_gpu`` = micro-batch,
``gradient_accumulation_steps`` = micro-batches per step, ``zero_optimization.stage`` = ZeRO
stage, ``bf16.enabled`` / ``fp16.enabled`` from the compute precision,
``activation_checkpointing`` when blocks are recomputed (it configures
``deepspeed.checkpointing.checkpoint``, which the model must call around each block).

Not expressible in the JSON: tensor and pipeline parallelism (DeepSpeed takes them from the
model code: Megatron-DeepSpeed's ``--tensor-model-parallel-size`` /
``--pipeline-model-parallel-size`` or ``PipelineModule(num_stages=...)``; export --to
megatron for those), and so also sequence parallelism and the interleaved schedule
(DeepSpeed's pipeline engine has none), and selective recomputation (no attention-core
granularity in the config).
"""

from __future__ import annotations

import json

from autoplan.export.common import (Export, NotExpressibleError, compute_dtype, device_note,
                                    float8_linears, pricing_of, uniform_layout)
from autoplan.plan import Plan
from autoplan.pricing import differences

TARGET = "DeepSpeed"


def deepspeed_config(plan: Plan) -> tuple[dict, list[str]]:
    """(config dict, notes); NotExpressibleError when the plan uses TP, PP or interleaving."""
    layout = uniform_layout(plan, TARGET)
    p = plan.parallel
    reasons = []
    if p.tp > 1:
        reasons.append(f"tensor parallelism (tp = {p.tp}) is outside DeepSpeed's JSON config: "
                       "it comes from the model code (Megatron-DeepSpeed "
                       "--tensor-model-parallel-size); export --to megatron")
    if p.ep > 1 or p.cp > 1:
        reasons.append(f"expert / context parallelism (ep = {p.ep}, cp = {p.cp}) is outside "
                       "DeepSpeed's JSON config (DeepSpeed-MoE and Ulysses are set up in "
                       "the model code); export --to megatron or torchtitan")
    if p.pp > 1:
        reasons.append(f"pipeline parallelism (pp = {p.pp}) is outside DeepSpeed's JSON config: "
                       "it comes from the model code (PipelineModule(num_stages=...) or "
                       "Megatron-DeepSpeed --pipeline-model-parallel-size)")
    if p.virtual_stages > 1:
        reasons.append("the interleaved 1F1B schedule: DeepSpeed's pipeline engine has no "
                       "interleaved schedule")
    if layout.selective:
        reasons.append("selective recomputation (the attention core only): DeepSpeed's "
                       "activation_checkpointing recomputes whatever function the model "
                       "wraps, not an attention-core granularity; export --to megatron "
                       "(--recompute-granularity selective)")
    if float8_linears(plan):
        reasons.append("float8 linear layers (mixed-fp8): DeepSpeed's config has no float8 "
                       "training (Transformer Engine layers go in the model code); export "
                       "--to torchtitan or megatron")
    if layout.op:
        reasons.append("op-level recomputation (every other matmul saved): DeepSpeed's "
                       "activation_checkpointing has no per-op policy; export --to torchtitan "
                       "(selective_ac_option = \"op\")")
    if reasons:
        raise NotExpressibleError(TARGET, reasons)
    pricing, notes = pricing_of(plan)
    notes = device_note(plan) + notes
    notes += differences(pricing, "DeepSpeed",
                         {"attention_kernel": "flash2"}, cp=False, float8=False)
    config: dict = {
        "train_batch_size": plan.global_batch,
        "train_micro_batch_size_per_gpu": p.micro_batch,
        "gradient_accumulation_steps": p.num_micro_batches,
        "zero_optimization": {"stage": p.zero},
    }
    dtype = compute_dtype(plan)
    if dtype == "bfloat16":
        config["bf16"] = {"enabled": True}
    elif dtype == "float16":
        config["fp16"] = {"enabled": True}
    if layout.checkpoint:
        config["activation_checkpointing"] = {
            "partition_activations": False, "cpu_checkpointing": False,
            "contiguous_memory_optimization": False, "synchronize_checkpoint_boundary": False,
            "profile": False}
        notes.append("activation_checkpointing configures deepspeed.checkpointing.checkpoint; "
                     "the model must call it around each transformer block")
    return config, notes


def to_deepspeed(plan: Plan) -> Export:
    config, notes = deepspeed_config(plan)
    return Export(TARGET, json.dumps(config, indent=2, sort_keys=True) + "\n", tuple(notes),
                  ".json")
