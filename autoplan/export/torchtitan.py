"""Export a plan as a torchtitan job config (TOML).

Field names follow torchtitan's ``JobConfig`` (``torchtitan/config/job_config.py``) as of
2025: ``[training] local_batch_size / global_batch_size / seq_len / mixed_precision_param``,
``[parallelism] data_parallel_replicate_degree / data_parallel_shard_degree /
tensor_parallel_degree / pipeline_parallel_degree / pipeline_parallel_schedule /
pipeline_parallel_microbatch_size / module_fqns_per_model_part / fsdp_reshard_after_forward /
enable_async_tensor_parallel``, ``[activation_checkpoint] mode``.

Mapping (torchtitan applies FSDP2 for sharded data parallelism and DDP for replicated):

* ZeRO-3 -> ``data_parallel_shard_degree = dp`` with ``fsdp_reshard_after_forward =
  "always"`` (parameters gathered again for backward, as the planner assumes);
  ZeRO-0 -> ``data_parallel_replicate_degree = dp`` (DDP).
* ZeRO-1 / ZeRO-2: torchtitan has no optimizer-only or gradient-only sharding: refused.
* torchtitan's DDP path handles 1-D meshes only (``"DDP has not supported > 1D
  parallelism"``): ZeRO-0 with dp > 1 and TP or PP is refused.
* The number of micro-batches is ``local_batch_size / pipeline_parallel_microbatch_size``
  with PP; without PP, ``global_batch_size / (local_batch_size * dp)`` accumulation steps.
* Stage boundaries: ``module_fqns_per_model_part`` lists each stage's modules by torchtitan's
  Llama names (``tok_embeddings``, ``layers.N``, ``norm``, ``output``); torchtitan before
  mid-2025 took ``pipeline_parallel_split_points`` instead (written as a comment).
* torchtitan's tensor parallelism always shards the sequence (sequence parallelism); a plan
  without it gets a note (torchtitan will use less activation memory than predicted).
* ``mixed-fp8`` -> ``[model] converters = ["float8"]`` and a ``[float8]`` section
  (tensorwise recipe, ``output`` filtered out, bf16 FSDP all-gathers as priced).
* TP-communication overlap -> ``enable_async_tensor_parallel = true`` (torchtitan needs
  ``compile`` on the model for it, noted).
* the context-parallel exchange the plan was priced with (``plan.pricing``) ->
  ``context_parallel_rotate_method = "allgather"`` or ``"alltoall"`` (the ring); a cuDNN
  attention kernel or Transformer Engine float8 casts, which torchtitan does not run, are
  noted.
* op-level recomputation (``parallel.checkpoint = "op"``, torchtitan's own policy) ->
  ``mode = "selective"`` with ``selective_ac_option = "op"``; selective recomputation (the
  attention core) -> the same, noted as an approximation: torchtitan's op policy saves the
  attention kernel's outputs and every other matmul and recomputes the rest, not
  Korthikanti's attention-core-only policy the plan prices; full -> ``mode = "full"``.
"""

from __future__ import annotations

from typing import Any

from autoplan.export.common import (Export, NotExpressibleError, compute_dtype, device_note,
                                    float8_linears, gpt_config, pricing_of, uniform_layout)
from autoplan.models.names import describe, preset_of
from autoplan.plan import Plan
from autoplan.pricing import differences

TARGET = "torchtitan"
SCHEDULE_NAMES = {"gpipe": "GPipe", "1f1b": "1F1B", "interleaved_1f1b": "Interleaved1F1B"}
#: autoplan presets with a torchtitan model flavor of the same architecture.
FLAVORS = {"llama3-8b": ("llama3", "8B"), "llama3-70b": ("llama3", "70B"),
           "llama3-405b": ("llama3", "405B")}


def toml_value(value: Any) -> str:
    """A TOML literal for str, bool, int, float and (nested) lists of them."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, str):
        return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(toml_value(v) for v in value) + "]"
    raise TypeError(f"no TOML form for {type(value).__name__}")


def torchtitan_fqns(layer_names: tuple[str, ...]) -> list[str]:
    """torchtitan Llama module names of a stage's layers."""
    out: list[str] = []
    for name in layer_names:
        if name == "<pre>":
            out.append("tok_embeddings")
        elif name == "<post>":
            out += ["norm", "output"]
        else:
            out.append("layers." + name.rsplit(".", 1)[-1])
    return out


def to_torchtitan(plan: Plan, *, steps: int | None = None) -> Export:
    layout = uniform_layout(plan, TARGET)
    p = plan.parallel
    reasons = []
    if p.zero in (1, 2):
        reasons.append(f"ZeRO-{p.zero} (parallel.zero = {p.zero}): torchtitan shards "
                       "parameters, gradients and optimizer states together (FSDP2, ZeRO-3) or "
                       "replicates them (DDP); plan with zero 0 or 3")
    if p.zero == 0 and p.dp > 1 and (p.tp > 1 or p.pp > 1):
        reasons.append(f"replicated data parallelism (ZeRO-0, dp = {p.dp}) together with "
                       "TP/PP: torchtitan's DDP supports 1-D meshes only; plan with zero 3")
    if reasons:
        raise NotExpressibleError(TARGET, reasons)

    pricing, notes = pricing_of(plan)
    notes = device_note(plan) + notes
    lines = ["# torchtitan job config written by `autoplan export --to torchtitan`",
             f"# plan: {describe(plan.model)}, {plan.parallel.label()}",
             "# field names: torchtitan JobConfig (torchtitan/config/job_config.py), 2025", ""]
    preset = preset_of(plan.model)
    lines.append("[model]")
    if preset in FLAVORS:
        name, flavor = FLAVORS[preset]
        lines += [f"name = {toml_value(name)}", f"flavor = {toml_value(flavor)}"]
    else:
        cfg = gpt_config(plan)
        arch = (f"layers={cfg.layers} hidden={cfg.hidden} heads={cfg.heads} "
                f"kv_heads={cfg.kv_heads or cfg.heads} ffn={cfg.ffn} vocab={cfg.vocab_size} "
                f"style={cfg.style}") if cfg else describe(plan.model)
        lines += [f"# no torchtitan flavor is known to match {describe(plan.model)} ({arch});",
                  "# set name / flavor to a model registered with torchtitan"]
        notes.append(f"no torchtitan model flavor matches {describe(plan.model)}: set "
                     "[model] name and flavor")
    if float8_linears(plan):
        lines.append('converters = ["float8"]    # torchao Float8Linear in the blocks')
    local = p.micro_batch * p.num_micro_batches if p.pp > 1 else p.micro_batch
    lines += ["", "[training]",
              f"local_batch_size = {local}"
              + ("    # micro_batch x micro-batches per step" if p.pp > 1 else ""),
              f"global_batch_size = {plan.global_batch}"
              + ("" if p.pp > 1 or p.num_micro_batches == 1 else
                 f"    # {p.num_micro_batches} gradient-accumulation steps"),
              f"seq_len = {plan.seq_len}" if plan.seq_len else "# seq_len: the model's",
              f"mixed_precision_param = "
              f"{toml_value('bfloat16' if compute_dtype(plan) == 'bfloat16' else 'float32')}",
              'mixed_precision_reduce = "float32"']
    if steps is not None:
        lines.append(f"steps = {steps}")
    shard = p.dp if p.zero == 3 else 1
    replicate = p.dp if p.zero == 0 else 1
    lines += ["", "[parallelism]",
              f"data_parallel_replicate_degree = {replicate}",
              f"data_parallel_shard_degree = {shard}",
              f"tensor_parallel_degree = {p.tp}",
              f"enable_async_tensor_parallel = {toml_value(p.tp_comm_overlap is True)}",
              f"pipeline_parallel_degree = {p.pp}",
              f"context_parallel_degree = {p.cp}",
              f"expert_parallel_degree = {p.ep}"]
    if p.cp > 1:
        lines.append("context_parallel_rotate_method = "
                     + toml_value("alltoall" if pricing.cp_comm == "ring" else "allgather"))
    # the exchange is set above; what torchtitan always runs is noted where it differs
    notes += differences(pricing, TARGET, {"attention_kernel": "flash2",
                                           "float8_recipe": "torchao"},
                         cp=p.cp > 1, float8=float8_linears(plan))
    if p.zero == 3 and p.dp > 1:
        lines.append('fsdp_reshard_after_forward = "always"    # ZeRO-3: gather again for '
                     'backward')
    if p.pp > 1:
        parts = [torchtitan_fqns(st.layer_names) for st in plan.stages]
        splits = [f[0] for f in parts[1:]]
        lines += [f"pipeline_parallel_schedule = {toml_value(SCHEDULE_NAMES[p.schedule])}",
                  f"pipeline_parallel_microbatch_size = {p.micro_batch}",
                  f"module_fqns_per_model_part = {toml_value(parts)}",
                  "# torchtitan before module_fqns_per_model_part (early 2025) instead took:",
                  f"# pipeline_parallel_split_points = {toml_value(splits)}"]
    if p.tp > 1 and not p.sequence_parallel:
        notes.append("torchtitan's tensor parallelism always uses sequence parallelism; the "
                     "plan predicts without it (activation memory will be lower)")
    if p.tp_comm_overlap is True:
        notes.append("enable_async_tensor_parallel needs torch.compile of the model "
                     "([compile] enable = true, components = [\"model\"])")
    elif p.tp_comm_overlap == "backward":
        notes.append("torchtitan's tensor parallelism does not overlap the input gradients' "
                     "collectives with the weight-gradient GEMMs: the plan's prediction, "
                     "which assumes it (Megatron-LM's default), is optimistic here")
    if float8_linears(plan):
        lines += ["", "[float8]", 'recipe_name = "tensorwise"',
                  'filter_fqns = ["output"]    # the output projection stays bf16',
                  "enable_fsdp_float8_all_gather = false    # the plan priced bf16 gathers"]
        notes.append("float8 linear layers want [compile] enable = true: torch.compile "
                     "fuses the casts, which the plan priced fused")
    mode = "full" if layout.checkpoint else "selective" if layout.selective or layout.op \
        else "none"
    lines += ["", "[activation_checkpoint]", f"mode = {toml_value(mode)}"]
    if layout.selective or layout.op:
        lines.append('selective_ac_option = "op"')
    if layout.selective:
        notes.append("torchtitan's op-level selective checkpointing saves the attention "
                     "kernel's outputs and every other matmul and recomputes the rest; the plan "
                     "priced Korthikanti et al.'s attention-core-only recomputation (Megatron-LM "
                     "--recompute-granularity selective), so memory and recompute time differ")
    return Export(TARGET, "\n".join(lines) + "\n", tuple(notes), ".toml")
