"""The parts of a plan: parallel configuration, mesh, stages, and the prediction.

Plain frozen dataclasses that validate their own fields (errors name the field as
:mod:`autoplan.plan` writes it); :class:`~autoplan.plan.Plan` puts them together and reads and
writes the file.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields
from typing import Any

from autoplan import plan_fields as pf
from autoplan.errors import PlanError
from autoplan.plan_fields import MAX_COUNT, MAX_DEVICES

SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b")
#: Activation recomputation modes (:mod:`autoplan.cost.recompute`, which prices them).
RECOMPUTE_MODES = ("none", "selective", "op", "full")
#: The modes that recompute part of each block (the rest recompute whole blocks or none).
PARTIAL_RECOMPUTE = ("selective", "op")
#: How a configuration's label names each mode.
RECOMPUTE_LABELS = {"none": "", "selective": "sel-ckpt", "op": "op-ckpt", "full": "ckpt"}
MESH_AXES = ("pp", "dp", "tp")


@dataclass(frozen=True, kw_only=True)
class ParallelConfig:
    """Uniform parallel degrees and the knobs every plan has.

    ``micro_batch`` is the per-data-parallel-rank micro-batch size; the global batch is
    ``dp * micro_batch * num_micro_batches``.
    """

    dp: int = 1
    tp: int = 1
    pp: int = 1
    zero: int = 0                      # 0: none, 1: optimizer states, 2: + grads, 3: + params
    sequence_parallel: bool = False
    micro_batch: int = 1
    num_micro_batches: int = 1
    schedule: str = "1f1b"
    virtual_stages: int = 1            # model chunks per pipeline rank (interleaved 1F1B)
    checkpoint: str = "none"           # "none" | "selective" (attention core) | "op" | "full"
    ep: int = 1                        # expert parallelism: experts split over ep of the dp ranks
    cp: int = 1                        # context parallelism: each sequence split over cp ranks
    tp_comm_overlap: bool | str = False  # TP collectives decomposed beside their GEMMs;
                                         # "backward": only the input gradients' (Megatron)

    def __post_init__(self) -> None:
        for name in ("dp", "tp", "pp", "micro_batch", "num_micro_batches", "virtual_stages",
                     "ep", "cp"):
            pf.count(getattr(self, name), f"parallel.{name}",
                     high=MAX_DEVICES if name in ("dp", "tp", "pp", "ep", "cp") else MAX_COUNT)
        if self.dp % self.ep:
            raise PlanError(f"field 'parallel.ep': expert parallelism folds into data "
                            f"parallelism, so ep ({self.ep}) must divide dp ({self.dp})")
        if not pf.is_int(self.zero) or self.zero not in (0, 1, 2, 3):
            raise PlanError(f"field 'parallel.zero': must be 0, 1, 2 or 3, "
                            f"got {pf.show.repr(self.zero)}")
        if not isinstance(self.sequence_parallel, bool):
            raise PlanError(f"field 'parallel.sequence_parallel': must be true or false, "
                            f"got {pf.show.repr(self.sequence_parallel)}")
        if not isinstance(self.schedule, str) or self.schedule not in SCHEDULES:
            raise PlanError(f"field 'parallel.schedule': must be one of {SCHEDULES}, "
                            f"got {pf.show.repr(self.schedule)}")
        if not isinstance(self.checkpoint, str) or self.checkpoint not in RECOMPUTE_MODES:
            raise PlanError(f"field 'parallel.checkpoint': must be 'none', 'selective', 'op' "
                            f"or 'full', got {pf.show.repr(self.checkpoint)}")
        if not isinstance(self.tp_comm_overlap, bool) and self.tp_comm_overlap != "backward":
            raise PlanError(f"field 'parallel.tp_comm_overlap': must be true, false or "
                            f"'backward', got {pf.show.repr(self.tp_comm_overlap)}")
        if self.tp_comm_overlap == "backward" and self.tp == 1:
            raise PlanError("field 'parallel.tp_comm_overlap': 'backward' needs tp > 1")
        if self.tp_comm_overlap is True and not self.sequence_parallel:
            raise PlanError("field 'parallel.tp_comm_overlap': needs sequence parallelism "
                            "(tp > 1, sequence_parallel true), as Megatron-LM's and "
                            "torchtitan's overlap do")
        if self.tp_comm_overlap and (self.ep > 1 or self.cp > 1):
            raise PlanError("field 'parallel.tp_comm_overlap': not priced with expert or "
                            "context parallelism (ep and cp must be 1)")
        if self.virtual_stages > 1 and self.schedule != "interleaved_1f1b":
            raise PlanError("field 'parallel.virtual_stages': > 1 needs schedule "
                            "'interleaved_1f1b'")
        if self.sequence_parallel and self.tp == 1:
            raise PlanError("field 'parallel.sequence_parallel': needs tp > 1")

    @property
    def world_size(self) -> int:
        return self.dp * self.cp * self.tp * self.pp

    def global_batch(self) -> int:
        return self.dp * self.micro_batch * self.num_micro_batches

    def label(self) -> str:
        """Short human label, e.g. 'dp8 tp4 pp2 z1 mb2x16 1f1b ckpt'."""
        parts = [f"dp{self.dp}"] + [f"{k}{getattr(self, k)}" for k in ("ep", "cp")
                                     if getattr(self, k) > 1]
        parts += [f"tp{self.tp}" + ("+sp" if self.sequence_parallel else ""),
                 f"pp{self.pp}" + (f"v{self.virtual_stages}" if self.virtual_stages > 1 else ""),
                 f"z{self.zero}", f"mb{self.micro_batch}x{self.num_micro_batches}",
                 self.schedule]
        if self.tp_comm_overlap:
            parts.append("tpoverlap" if self.tp_comm_overlap is True else "tpoverlap-bwd")
        if RECOMPUTE_LABELS[self.checkpoint]:
            parts.append(RECOMPUTE_LABELS[self.checkpoint])
        return " ".join(parts)


def stage_ranks(parallel: ParallelConfig, pipeline_rank: int) -> tuple[int, ...]:
    """Global ranks of pipeline rank ``p`` in the (pp, dp[, cp], tp) row-major mesh."""
    per_stage = parallel.dp * parallel.cp * parallel.tp
    return tuple(range(pipeline_rank * per_stage, (pipeline_rank + 1) * per_stage))


@dataclass(frozen=True, kw_only=True)
class MeshSpec:
    shape: tuple[int, ...]
    axis_names: tuple[str, ...] = MESH_AXES
    device_type: str = "cpu"           # "cpu" (gloo) or "cuda" (nccl)

    def __post_init__(self) -> None:
        pf.sequence(self.shape, "mesh.shape", pf.is_int)
        pf.sequence(self.axis_names, "mesh.axis_names", pf.is_name)
        if len(self.shape) != len(self.axis_names):
            raise PlanError(f"field 'mesh.shape': {list(self.shape)} has {len(self.shape)} axes "
                            f"but axis_names has {len(self.axis_names)}")
        if len(set(self.axis_names)) != len(self.axis_names):
            raise PlanError(f"field 'mesh.axis_names': {list(self.axis_names)} repeats a name")
        if any(s < 1 or s > MAX_DEVICES for s in self.shape):
            raise PlanError(f"field 'mesh.shape': sizes must be integers from 1 to "
                            f"{MAX_DEVICES}, got {pf.show.repr(list(self.shape))}")
        if self.size > MAX_DEVICES:
            raise PlanError(f"field 'mesh.shape': {list(self.shape)} is more than "
                            f"{MAX_DEVICES} devices")
        if not isinstance(self.device_type, str) or self.device_type not in ("cpu", "cuda"):
            raise PlanError(f"field 'mesh.device_type': must be 'cpu' or 'cuda', got "
                            f"{pf.show.repr(self.device_type)}")

    @property
    def size(self) -> int:
        out = 1
        for s in self.shape:
            out *= s
        return out


@dataclass(frozen=True, kw_only=True, eq=True)
class Stage:
    """One pipeline stage: a contiguous range of graph layers on a set of ranks."""

    index: int
    layers: tuple[int, int]            # [start, end) into the OpGraph's layers
    layer_names: tuple[str, ...]       # their names: "<pre>", "blocks.0", ..., "<post>"
    ranks: tuple[int, ...]             # global ranks of this stage's submesh
    mesh_shape: tuple[int, ...]        # (dp, tp) of the submesh
    checkpoint_layers: tuple[str, ...] = ()   # layer names whose activations are recomputed
    # version 2 (module docstring); defaults reproduce version 1's meaning
    axis_names: tuple[str, ...] = ("dp", "tp")
    zero: int | None = None
    micro_batch: int | None = None
    data_axes: tuple[str, ...] = ()
    activation_placements: dict[str, dict[str, str]] = field(default_factory=dict)
    predicted: dict[str, Any] = field(default_factory=dict)

    def repeated_axes(self) -> dict[str, int]:
        """Axes (name -> size) along which this stage's ranks all do the same work: not a
        data axis, and every op whose placement the search chose is ``Replicate()`` on it,
        so no op's work is split along it (a parameter sharded there saves memory, not
        time). Empty where the stage records no placements (a uniform plan)."""
        if not self.activation_placements:
            return {}
        return {axis: size for axis, size in zip(self.axis_names, self.mesh_shape)
                if size > 1 and axis not in self.data_axes
                and all(p.get(axis, "Replicate()") == "Replicate()"
                        for p in self.activation_placements.values())}


@dataclass(frozen=True, kw_only=True)
class MemoryBreakdown:
    """Bytes per device."""

    params: float = 0.0
    grads: float = 0.0
    optimizer: float = 0.0
    activations: float = 0.0
    other: float = 0.0                 # buffers, communication buffers, allocator slack

    @property
    def total(self) -> float:
        return self.params + self.grads + self.optimizer + self.activations + self.other

    def to_dict(self) -> dict:
        return {**asdict(self), "total": self.total}


@dataclass(frozen=True, kw_only=True)
class TimeBreakdown:
    """Seconds of one training step, on the critical path."""

    compute: float = 0.0               # forward + backward on the slowest stage, all micro-batches
    recompute: float = 0.0             # extra forward of activation checkpointing
    tp_comm: float = 0.0               # tensor-parallel collectives not hidden behind compute
    dp_comm: float = 0.0               # gradient reduction / ZeRO gathers not hidden
    pp_comm: float = 0.0               # stage-to-stage sends
    bubble: float = 0.0                # pipeline fill and drain
    optimizer: float = 0.0             # the optimizer step
    runtime: float = 0.0               # GPU runtime overhead no term prices (cost/runtime.py)

    @property
    def total(self) -> float:
        return (self.compute + self.recompute + self.tp_comm + self.dp_comm + self.pp_comm
                + self.bubble + self.optimizer + self.runtime)

    def to_dict(self) -> dict:
        return {**asdict(self), "total": self.total}


@dataclass(frozen=True, kw_only=True)
class StageTime:
    """Seconds per micro-batch of one model chunk (plan stage) on each of its devices."""

    forward: float = 0.0               # forward compute
    backward: float = 0.0              # backward compute
    recompute: float = 0.0             # forward recomputed in backward (checkpointing)
    tp_forward: float = 0.0            # in-layer (tensor-parallel) collectives of the forward
    tp_backward: float = 0.0           # ... of the backward
    tp_recompute: float = 0.0          # ... of the recomputed forward
    send: float = 0.0                  # output sent to the next stage (its gradient comes back)

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True, kw_only=True)
class Prediction:
    step_time_s: float
    tokens_per_s: float
    samples_per_s: float
    model_tflops_per_device: float     # model FLOPs (no recomputation) / step time / devices
    hardware_tflops_per_device: float  # counting recomputation's extra forward
    mfu: float                         # model FLOP/s / peak (PaLM appendix B)
    memory: MemoryBreakdown            # of the device that needs the most
    memory_limit_bytes: float
    time: TimeBreakdown
    memory_per_stage: tuple[MemoryBreakdown, ...] = ()   # per pipeline rank
    stage_times: tuple[StageTime, ...] = ()             # per plan stage (model chunk)

    def to_dict(self) -> dict:
        d = {f.name: getattr(self, f.name) for f in fields(self)}
        d["memory"] = self.memory.to_dict()
        d["time"] = self.time.to_dict()
        d["memory_per_stage"] = [m.to_dict() for m in self.memory_per_stage]
        d["stage_times"] = [t.to_dict() for t in self.stage_times]
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "Prediction":
        """Read :meth:`to_dict`'s output: every figure a finite number (``total`` is derived
        and ignored); errors name the field."""
        d = dict(pf.as_object(d, "prediction"))
        for key in ("memory", "time"):
            if key not in d:
                raise PlanError(f"field 'prediction.{key}': missing")
        d["memory"] = pf.figures(MemoryBreakdown, d["memory"], "prediction.memory")
        d["time"] = pf.figures(TimeBreakdown, d["time"], "prediction.time")
        per_stage = pf.as_list(d.get("memory_per_stage", []), "prediction.memory_per_stage")
        d["memory_per_stage"] = tuple(
            pf.figures(MemoryBreakdown, m, f"prediction.memory_per_stage[{i}]")
            for i, m in enumerate(per_stage))
        times = pf.as_list(d.get("stage_times", []), "prediction.stage_times")
        d["stage_times"] = tuple(pf.figures(StageTime, t, f"prediction.stage_times[{i}]")
                                 for i, t in enumerate(times))
        for f in fields(cls):
            if f.name not in ("memory", "time", "memory_per_stage", "stage_times") \
                    and f.name in d:
                pf.figure(d[f.name], f"prediction.{f.name}")
        return pf.from_dict(cls, d, "prediction")


def stage_from_dict(d: Any, i: int) -> Stage:
    """A stage from its JSON form; errors name ``stages[i].<field>``."""
    where = f"stages[{i}]"
    d = dict(pf.as_object(d, where))
    for key in ("index", "layers", "layer_names", "ranks", "mesh_shape"):
        if key not in d:
            raise PlanError(f"field '{where}.{key}': missing")
    pf.count(d["index"], f"{where}.index", low=0)
    for key, ok in (("layers", pf.is_int), ("layer_names", pf.is_name), ("ranks", pf.is_int),
                    ("mesh_shape", pf.is_int), ("checkpoint_layers", pf.is_name),
                    ("axis_names", pf.is_name), ("data_axes", pf.is_name)):
        if key in d:
            pf.sequence(d[key], f"{where}.{key}", ok)
            d[key] = tuple(d[key])
    if len(d["layers"]) != 2 or not 0 <= d["layers"][0] <= MAX_COUNT \
            or not 0 <= d["layers"][1] <= MAX_COUNT:
        raise PlanError(f"field '{where}.layers': must be [start, end], two integers >= 0, "
                        f"got {pf.show.repr(list(d['layers']))}")
    for r in d["ranks"]:
        if not 0 <= r < MAX_DEVICES:
            raise PlanError(f"field '{where}.ranks': rank {pf.show.repr(r)} out of range")
    for n in d["mesh_shape"]:
        if not 1 <= n <= MAX_DEVICES:
            raise PlanError(f"field '{where}.mesh_shape': sizes must be integers from 1 to "
                            f"{MAX_DEVICES}, got {pf.show.repr(list(d['mesh_shape']))}")
    if len(set(d.get("axis_names", ()))) != len(d.get("axis_names", ())):
        raise PlanError(f"field '{where}.axis_names': {pf.show.repr(list(d['axis_names']))} "
                        "repeats a name")
    for key in ("zero", "micro_batch"):
        value = d.get(key)
        if value is not None and not pf.is_int(value):
            raise PlanError(f"field '{where}.{key}': must be an integer or null, got "
                            f"{pf.show.repr(value)}")
    if d.get("micro_batch") is not None:
        pf.count(d["micro_batch"], f"{where}.micro_batch")
    if "activation_placements" in d:
        d["activation_placements"] = pf.string_table(
            pf.as_object(d["activation_placements"], f"{where}.activation_placements"),
            f"{where}.activation_placements")
    if "predicted" in d:
        predicted = pf.as_object(d["predicted"], f"{where}.predicted")
        pf.finite_tree(predicted, f"{where}.predicted")
    return pf.from_dict(Stage, d, where)
