"""What every exporter checks first: the plan is uniform and uses only fields we know.

Megatron-LM, torchtitan and DeepSpeed describe *uniform* parallelism: one (dp, tp) for every
pipeline stage, stages of equal size on consecutive rank blocks, one checkpointing policy.
:func:`uniform_layout` returns that layout or lists why the plan is not uniform; plans with
per-stage meshes (Alpa-style) or with plan fields this module does not know (a newer plan
format) are refused rather than exported wrongly. A search plan is exported when the uniform
layout expresses it exactly (:func:`autoplan.capability.uniform_gap` finds nothing), and
refused with that reason when it places ops individually.
"""

from __future__ import annotations

from dataclasses import MISSING, dataclass, fields
from typing import Any, Iterable

from autoplan.errors import AutoplanError
from autoplan.plan import MESH_AXES, MeshSpec, ParallelConfig, Plan, Stage, stage_ranks
from autoplan.precision import float8_gemms
from autoplan.pricing import Pricing

#: The plan fields the exporters understand; any other field with a non-default value
#: makes a plan not expressible.
KNOWN_FIELDS: dict[type, frozenset[str]] = {
    Plan: frozenset({"model", "model_fingerprint", "num_params", "cluster", "global_batch",
                     "seq_len", "mesh", "parallel", "stages", "param_placements", "precision",
                     "prediction", "alternatives", "planner", "created_by", "version",
                     "pricing"}),
    ParallelConfig: frozenset({"dp", "tp", "pp", "zero", "sequence_parallel", "micro_batch",
                               "num_micro_batches", "schedule", "virtual_stages",
                               "checkpoint", "ep", "cp", "tp_comm_overlap"}),
    MeshSpec: frozenset({"shape", "axis_names", "device_type"}),
    Stage: frozenset({"index", "layers", "layer_names", "ranks", "mesh_shape", "axis_names",
                      "checkpoint_layers"}),
}


class NotExpressibleError(AutoplanError):
    """The plan uses something the target runtime cannot express; names each feature."""

    def __init__(self, target: str, reasons: Iterable[str]):
        self.target = target
        self.reasons = list(reasons)
        super().__init__(f"{target} cannot express this plan: " + "; ".join(self.reasons))


@dataclass(frozen=True)
class Layout:
    """A uniform plan, as the runtimes see it."""

    blocks_per_chunk: tuple[int, ...]      # repeated blocks in each model chunk
    checkpoint: bool                       # every block fully recomputed
    selective: bool = False                # every block's attention core recomputed
    op: bool = False                       # every block under op-level recomputation

    @property
    def num_layers(self) -> int:
        return sum(self.blocks_per_chunk)

    @property
    def even(self) -> bool:
        return len(set(self.blocks_per_chunk)) == 1


@dataclass(frozen=True)
class Export:
    """An exported configuration: the file's text and what the reader should know."""

    target: str
    text: str
    notes: tuple[str, ...] = ()
    suffix: str = ""                       # the usual file extension


def _unknown_fields(obj: Any, where: str) -> list[str]:
    """Fields of ``obj`` (a dataclass) outside KNOWN_FIELDS whose value is not the default."""
    known = next(names for cls, names in KNOWN_FIELDS.items() if isinstance(obj, cls))
    out = []
    for f in fields(obj):
        if f.name in known:
            continue
        default = (f.default if f.default is not MISSING else
                   f.default_factory() if f.default_factory is not MISSING else MISSING)
        value = getattr(obj, f.name)
        if default is MISSING or value != default:
            out.append(f"plan field '{where}{f.name}' (not known to the exporter)")
    return out


def is_block(name: str) -> bool:
    """Layer names '<pre>' and '<post>' are the non-repeated parts; others are blocks."""
    return not name.startswith("<")


def _as_uniform(plan: Plan, target: str) -> Plan:
    """A search plan the uniform layout expresses exactly, as the uniform planner would have
    written it (its per-op detail dropped: every op follows the Megatron styles anyway);
    NotExpressibleError, with the reason, for one that places ops individually."""
    from dataclasses import replace

    from autoplan.capability import uniform_gap
    from autoplan.placement import PlacementError

    try:
        why = uniform_gap(plan)
    except PlacementError as exc:
        why = str(exc)
    if why is not None:
        raise NotExpressibleError(target, [
            f"the plan places ops individually (the engine's per-op runtime runs it): {why}; "
            "plan with --planner uniform for a configuration to export"])
    zero = {plan.parallel.zero if st.zero is None else st.zero for st in plan.stages}
    if zero != {plan.parallel.zero}:
        raise NotExpressibleError(target, [f"per-stage ZeRO stages {sorted(zero)}"])
    stages = [replace(st, axis_names=("dp", "tp"), zero=None, micro_batch=None, data_axes=(),
                      activation_placements={}, predicted={}) for st in plan.stages]
    return replace(plan, stages=stages, comparison={})


def uniform_layout(plan: Plan, target: str) -> Layout:
    """The plan's uniform layout; NotExpressibleError listing every non-uniform feature."""
    if plan.planner.get("name") == "auto":
        plan = _as_uniform(plan, target)
    reasons = _unknown_fields(plan, "") + _unknown_fields(plan.parallel, "parallel.")
    reasons += _unknown_fields(plan.mesh, "mesh.")
    for st in plan.stages:
        reasons += _unknown_fields(st, f"stages[{st.index}].")
    p = plan.parallel
    axes, stage = (MESH_AXES, (p.dp, p.tp)) if p.cp == 1 else (
        ("pp", "dp", "cp", "tp"), (p.dp, p.cp, p.tp))
    if tuple(plan.mesh.axis_names) != axes or tuple(plan.mesh.shape) != (p.pp, *stage):
        reasons.append(f"mesh {dict(zip(plan.mesh.axis_names, plan.mesh.shape))} is not the "
                       f"uniform {axes} = {(p.pp, *stage)}")
    shapes = {tuple(st.mesh_shape) for st in plan.stages}
    if shapes != {stage}:
        reasons.append(f"per-stage meshes {sorted(shapes)} (heterogeneous stages; the target "
                       f"runs one {axes[1:]} = {stage} everywhere)")
    for st in plan.stages:
        expected = stage_ranks(p, st.index % p.pp)
        if tuple(st.ranks) != expected:
            reasons.append(f"stage {st.index} on ranks {st.ranks[0]}..{st.ranks[-1]} (the "
                           f"target puts it on {expected[0]}..{expected[-1]})")
            break
    blocks = tuple(sum(1 for n in st.layer_names if is_block(n)) for st in plan.stages)
    ckpt_sets = [(set(st.checkpoint_layers), {n for n in st.layer_names if is_block(n)})
                 for st in plan.stages]
    full = all(c == b for c, b in ckpt_sets)
    none = all(not c for c, _ in ckpt_sets)
    if not (full or none):
        reasons.append("activation checkpointing of only some blocks (the target recomputes "
                       "all blocks or none)")
    if reasons:
        raise NotExpressibleError(target, reasons)
    recomputed = full and any(b for _, b in ckpt_sets)
    selective = recomputed and plan.parallel.checkpoint == "selective"
    op = recomputed and plan.parallel.checkpoint == "op"
    return Layout(blocks_per_chunk=blocks, checkpoint=recomputed and not (selective or op),
                  selective=selective, op=op)


def compute_dtype(plan: Plan) -> str:
    """'bfloat16', 'float16' or 'float32': the plan's compute precision."""
    return (plan.precision or {}).get("compute", "float32")


def float8_linears(plan: Plan) -> bool:
    """Whether the plan runs its blocks' linear layers in float8 (``mixed-fp8``)."""
    return float8_gemms(plan.precision)


def device_note(plan: Plan) -> list[str]:
    if plan.mesh.device_type != "cuda":
        return [f"the plan is for {plan.mesh.device_type} devices; the exported configuration "
                "assumes GPUs"]
    return []


def pricing_of(plan: Plan) -> tuple[Pricing, list[str]]:
    """The runtime assumptions ``plan``'s prediction was priced under (:mod:`autoplan.pricing`)
    and notes: a plan that does not record them (written before plan version 4) is taken as
    priced under autoplan's defaults, and the note says so."""
    if plan.pricing is not None:
        return plan.pricing, []
    default = Pricing()
    return default, [f"the plan does not record the runtime assumptions its prediction was "
                     f"priced under (a plan from before format version 4); the export "
                     f"assumes autoplan's defaults: {default.describe()}"]


def gpt_config(plan: Plan):
    """The built-in GPT's config (:class:`autoplan.models.gpt.GPTConfig`), or None for other
    models (Hugging Face, import paths, MLPs)."""
    model = plan.model or {}
    if model.get("source") != "builtin" or model.get("name") != "gpt":
        return None
    from autoplan.models.gpt_config import GPTConfig

    return GPTConfig.from_dict(model.get("config") or {})
