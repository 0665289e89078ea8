"""Plan: what to run, as a versioned JSON document, separate from solver and runtime.

A plan is written by a planner (:mod:`autoplan.planner`), read by the engine
(``torchrun -m engine.run PLAN``) and shown by the CLI. It records:

* what it was planned for: the model spec and its fingerprint, the cluster, the batch;
* the device mesh (axes ``pp``, ``dp``, ``tp``; ranks laid out row-major, so ``tp`` is the
  fastest-varying axis and stays inside a node);
* the parallel configuration (degrees, ZeRO stage, sequence parallelism, micro-batching,
  schedule) and the pipeline stages (layer range, ranks, activation-checkpointed layers);
* per-parameter placements along each mesh axis, DTensor style (``Shard(0)``,
  ``Replicate()``);
* the prediction: step time with its breakdown, throughput, TFLOP/s per device counted with
  and without recomputation, MFU, memory per device with its breakdown;
* the top alternatives the planner considered.

Files are written atomically (temp file + ``os.replace``), keys sorted, no timestamps, so the
same inputs give a byte-identical file. Loading validates everything and names the field.

Version 2 (written by the search planner, :mod:`autoplan.planner.search`) adds, all optional,
so version-1 files load unchanged (and are held, and saved again, as version 2):

* ``layout``: ``"uniform"`` — one ``(pp, dp, tp)`` mesh, every stage on a ``(dp, tp)``
  submesh (version 1's meaning, what the engine executes) — or ``"stages"``: stages on
  submeshes of their own sizes and shapes. In a ``"stages"`` plan ``mesh`` is the flat list
  of ranks (shape ``(world,)``, axis ``"rank"``), ``parallel.dp = parallel.tp = 1``,
  ``parallel.pp`` the number of pipeline ranks, ``parallel.micro_batch`` the whole
  micro-batch (samples per pipeline step) and ``parallel.zero`` the largest stage's; each
  stage says how it splits them.
* per stage: ``axis_names`` of its ``mesh_shape`` (its ``ranks`` laid out row-major over
  it), ``zero`` (its ZeRO stage; None: ``parallel.zero``), ``micro_batch`` (samples per
  data-parallel rank on this stage; None: ``parallel.micro_batch``), ``data_axes`` (the axes
  it shards the batch along — gradients are summed and ZeRO shards states over them),
  ``activation_placements`` (op name -> axis -> placement, for the ops whose placement the
  search chose; the rest follow their input as DTensor propagates it) and ``predicted``
  (seconds and bytes of the stage per micro-batch).
* ``param_placements`` may name a stage's own axes (``parallel`` axes of a ``"uniform"``
  plan, the stage's ``axis_names`` in a ``"stages"`` plan); ``_StridedShard(d)`` (a
  flattened dim sharded along its inner factor) is allowed in activation placements.
* ``comparison``: what the uniform planner's best configuration predicts for the same
  model, cluster and batch (``autoplan show`` puts it next to this plan's prediction).
"""

from __future__ import annotations

import json
import os
import re
import tempfile
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

from autoplan.errors import PlanError

PLAN_FORMAT = "autoplan.plan"
PLAN_VERSION = 2
READABLE_VERSIONS = (1, 2)
SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b")
MESH_AXES = ("pp", "dp", "tp")
LAYOUTS = ("uniform", "stages")
_PLACEMENT = re.compile(r"^(Replicate\(\)|Shard\(-?\d+\)|Partial\(\w*\))$")
_ACT_PLACEMENT = re.compile(r"^(Replicate\(\)|Shard\(-?\d+\)|Partial\(\w*\)|"
                            r"_StridedShard\(-?\d+\))$")


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
    checkpoint: str = "none"           # "none" | "full" (every block's input only)

    def __post_init__(self) -> None:
        for name in ("dp", "tp", "pp", "micro_batch", "num_micro_batches", "virtual_stages"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise PlanError(f"field 'parallel.{name}': must be a positive integer, got {value!r}")
        if self.zero not in (0, 1, 2, 3):
            raise PlanError(f"field 'parallel.zero': must be 0, 1, 2 or 3, got {self.zero!r}")
        if self.schedule not in SCHEDULES:
            raise PlanError(f"field 'parallel.schedule': must be one of {SCHEDULES}, "
                            f"got {self.schedule!r}")
        if self.checkpoint not in ("none", "full"):
            raise PlanError(f"field 'parallel.checkpoint': must be 'none' or 'full', "
                            f"got {self.checkpoint!r}")
        if self.virtual_stages > 1 and self.schedule != "interleaved_1f1b":
            raise PlanError("field 'parallel.virtual_stages': > 1 needs schedule "
                            "'interleaved_1f1b'")
        if self.sequence_parallel and self.tp == 1:
            raise PlanError("field 'parallel.sequence_parallel': needs tp > 1")

    @property
    def world_size(self) -> int:
        return self.dp * self.tp * self.pp

    def global_batch(self) -> int:
        return self.dp * self.micro_batch * self.num_micro_batches

    def label(self) -> str:
        """Short human label, e.g. 'dp8 tp4 pp2 z1 mb2x16 1f1b ckpt'."""
        parts = [f"dp{self.dp}", f"tp{self.tp}" + ("+sp" if self.sequence_parallel else ""),
                 f"pp{self.pp}" + (f"v{self.virtual_stages}" if self.virtual_stages > 1 else ""),
                 f"z{self.zero}", f"mb{self.micro_batch}x{self.num_micro_batches}",
                 self.schedule]
        if self.checkpoint != "none":
            parts.append("ckpt")
        return " ".join(parts)


@dataclass(frozen=True, kw_only=True)
class MeshSpec:
    shape: tuple[int, ...]
    axis_names: tuple[str, ...] = MESH_AXES
    device_type: str = "cpu"           # "cpu" (gloo) or "cuda" (nccl)

    def __post_init__(self) -> None:
        if len(self.shape) != len(self.axis_names):
            raise PlanError(f"field 'mesh.shape': {list(self.shape)} has {len(self.shape)} axes "
                            f"but axis_names has {len(self.axis_names)}")
        if any(not isinstance(s, int) or s < 1 for s in self.shape):
            raise PlanError(f"field 'mesh.shape': sizes must be positive integers, got "
                            f"{list(self.shape)}")
        if self.device_type not in ("cpu", "cuda"):
            raise PlanError(f"field 'mesh.device_type': must be 'cpu' or 'cuda', got "
                            f"{self.device_type!r}")

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

    @property
    def total(self) -> float:
        return (self.compute + self.recompute + self.tp_comm + self.dp_comm + self.pp_comm
                + self.bubble + self.optimizer)

    def to_dict(self) -> dict:
        return {**asdict(self), "total": self.total}


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
    memory_per_stage: tuple[MemoryBreakdown, ...] = ()

    def to_dict(self) -> dict:
        d = {f.name: getattr(self, f.name) for f in fields(self)}
        d["memory"] = self.memory.to_dict()
        d["time"] = self.time.to_dict()
        d["memory_per_stage"] = [m.to_dict() for m in self.memory_per_stage]
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "Prediction":
        d = dict(d)
        d["memory"] = _from_dict(MemoryBreakdown, d["memory"], "prediction.memory")
        d["time"] = _from_dict(TimeBreakdown, d["time"], "prediction.time")
        d["memory_per_stage"] = tuple(_from_dict(MemoryBreakdown, m, "prediction.memory_per_stage")
                                      for m in d.get("memory_per_stage", ()))
        return _from_dict(cls, d, "prediction")


@dataclass(kw_only=True)
class Plan:
    model: dict[str, Any]              # ModelSpec.to_dict()
    model_fingerprint: str
    num_params: int
    cluster: dict[str, Any]            # Cluster.to_dict()
    global_batch: int
    seq_len: int | None
    mesh: MeshSpec
    parallel: ParallelConfig
    stages: list[Stage]
    param_placements: dict[str, dict[str, str]] = field(default_factory=dict)
    precision: dict[str, str] = field(default_factory=lambda: {
        "params": "float32", "compute": "float32", "reduce": "float32"})
    prediction: Prediction | None = None
    alternatives: list[dict[str, Any]] = field(default_factory=list)
    planner: dict[str, Any] = field(default_factory=dict)
    created_by: dict[str, str] = field(default_factory=dict)
    version: int = PLAN_VERSION
    layout: str = "uniform"
    comparison: dict[str, Any] = field(default_factory=dict)

    # ---- derived -------------------------------------------------------------------------
    @property
    def world_size(self) -> int:
        return self.mesh.size

    def validate(self) -> None:
        """Cross-field checks; raises PlanError naming the field."""
        p = self.parallel
        if self.layout not in LAYOUTS:
            raise PlanError(f"field 'layout': must be one of {LAYOUTS}, got {self.layout!r}")
        if self.layout == "uniform" and self.mesh.size != p.world_size:
            raise PlanError(f"field 'mesh.shape': {list(self.mesh.shape)} has {self.mesh.size} "
                            f"devices but parallel dp*tp*pp = {p.world_size}")
        if p.global_batch() != self.global_batch:
            raise PlanError(f"field 'global_batch': {self.global_batch} != dp*micro_batch*"
                            f"num_micro_batches = {p.global_batch()}")
        if len(self.stages) != p.pp * p.virtual_stages:
            raise PlanError(f"field 'stages': {len(self.stages)} stages for pp={p.pp} x "
                            f"virtual_stages={p.virtual_stages}")
        seen: set[int] = set()
        for i, st in enumerate(self.stages):
            if st.index != i:
                raise PlanError(f"field 'stages[{i}].index': expected {i}, got {st.index}")
            start, end = st.layers
            if end <= start:
                raise PlanError(f"field 'stages[{i}].layers': empty range {list(st.layers)}")
            if i and start != self.stages[i - 1].layers[1]:
                raise PlanError(f"field 'stages[{i}].layers': starts at {start}, previous stage "
                                f"ends at {self.stages[i - 1].layers[1]}")
            if len(st.layer_names) != end - start:
                raise PlanError(f"field 'stages[{i}].layer_names': {len(st.layer_names)} names "
                                f"for layers {list(st.layers)}")
            for r in st.ranks:
                if not 0 <= r < self.world_size:
                    raise PlanError(f"field 'stages[{i}].ranks': rank {r} outside world size "
                                    f"{self.world_size}")
            seen.update(st.ranks)
            bad = set(st.checkpoint_layers) - set(st.layer_names)
            if bad:
                raise PlanError(f"field 'stages[{i}].checkpoint_layers': {sorted(bad)} not in "
                                "this stage")
            self._validate_stage_v2(i, st)
        if seen != set(range(self.world_size)):
            raise PlanError(f"field 'stages': ranks {sorted(set(range(self.world_size)) - seen)} "
                            "belong to no stage")
        known_axes = set(self.mesh.axis_names) | {a for st in self.stages
                                                  for a in st.axis_names}
        for name, axes in self.param_placements.items():
            for axis, placement in axes.items():
                if axis not in known_axes:
                    raise PlanError(f"field 'param_placements.{name}': unknown mesh axis {axis!r}")
                if not _PLACEMENT.match(placement):
                    raise PlanError(f"field 'param_placements.{name}.{axis}': {placement!r} is not "
                                    "Replicate(), Shard(d) or Partial()")

    def _validate_stage_v2(self, i: int, st: "Stage") -> None:
        where = f"stages[{i}]"
        if len(st.axis_names) != len(st.mesh_shape):
            raise PlanError(f"field '{where}.axis_names': {list(st.axis_names)} for mesh_shape "
                            f"{list(st.mesh_shape)}")
        if self.layout == "stages":
            size = 1
            for n in st.mesh_shape:
                size *= n
            if size != len(st.ranks):
                raise PlanError(f"field '{where}.mesh_shape': {list(st.mesh_shape)} has {size} "
                                f"devices but the stage has {len(st.ranks)} ranks")
        if st.zero is not None and st.zero not in (0, 1, 2, 3):
            raise PlanError(f"field '{where}.zero': must be 0, 1, 2 or 3, got {st.zero!r}")
        if st.micro_batch is not None and (isinstance(st.micro_batch, bool) or
                                           not isinstance(st.micro_batch, int) or
                                           st.micro_batch < 1):
            raise PlanError(f"field '{where}.micro_batch': must be a positive integer, got "
                            f"{st.micro_batch!r}")
        for axis in st.data_axes:
            if axis not in st.axis_names:
                raise PlanError(f"field '{where}.data_axes': unknown axis {axis!r}")
        for op, axes in st.activation_placements.items():
            for axis, placement in axes.items():
                if axis not in st.axis_names:
                    raise PlanError(f"field '{where}.activation_placements.{op}': unknown axis "
                                    f"{axis!r}")
                if not _ACT_PLACEMENT.match(placement):
                    raise PlanError(f"field '{where}.activation_placements.{op}.{axis}': "
                                    f"{placement!r} is not a DTensor placement")

    # ---- JSON ----------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return {
            "format": PLAN_FORMAT,
            "version": self.version,
            "created_by": dict(self.created_by),
            "model": self.model,
            "model_fingerprint": self.model_fingerprint,
            "num_params": self.num_params,
            "cluster": self.cluster,
            "global_batch": self.global_batch,
            "seq_len": self.seq_len,
            "mesh": asdict(self.mesh),
            "parallel": asdict(self.parallel),
            "stages": [asdict(s) for s in self.stages],
            "param_placements": self.param_placements,
            "precision": self.precision,
            "prediction": self.prediction.to_dict() if self.prediction else None,
            "alternatives": self.alternatives,
            "planner": self.planner,
            "layout": self.layout,
            "comparison": self.comparison,
        }

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=True, default=_json_default) + "\n"

    def save(self, path: str | os.PathLike) -> Path:
        """Validate, then write atomically: a crash never leaves a half-written plan."""
        self.validate()
        return atomic_write_text(path, self.to_json())

    @classmethod
    def from_dict(cls, d: dict[str, Any], *, source: str = "<dict>") -> "Plan":
        try:
            return cls._from_dict(d)
        except PlanError as exc:
            raise PlanError(f"{source}: {exc}") from None
        except (KeyError, TypeError, ValueError) as exc:
            raise PlanError(f"{source}: malformed plan ({type(exc).__name__}: {exc})") from None

    @classmethod
    def _from_dict(cls, d: dict[str, Any]) -> "Plan":
        if not isinstance(d, dict):
            raise PlanError("top level must be a JSON object")
        if d.get("format") != PLAN_FORMAT:
            raise PlanError(f"field 'format': expected {PLAN_FORMAT!r}, got {d.get('format')!r}")
        if d.get("version") not in READABLE_VERSIONS:
            raise PlanError(f"field 'version': this autoplan reads plan versions "
                            f"{', '.join(map(str, READABLE_VERSIONS))}, the file is version "
                            f"{d.get('version')!r}")
        known = {f.name for f in fields(cls)} | {"format"}
        unknown = sorted(set(d) - known)
        if unknown:
            raise PlanError(f"field '{unknown[0]}': unknown key")
        for key in ("model", "model_fingerprint", "num_params", "cluster", "global_batch",
                    "mesh", "parallel", "stages"):
            if key not in d:
                raise PlanError(f"field '{key}': missing")
        mesh = d["mesh"]
        plan = cls(
            model=d["model"],
            model_fingerprint=d["model_fingerprint"],
            num_params=d["num_params"],
            cluster=d["cluster"],
            global_batch=d["global_batch"],
            seq_len=d.get("seq_len"),
            mesh=_from_dict(MeshSpec, {**mesh, "shape": tuple(mesh["shape"]),
                                       "axis_names": tuple(mesh.get("axis_names", MESH_AXES))},
                            "mesh"),
            parallel=_from_dict(ParallelConfig, d["parallel"], "parallel"),
            stages=[_stage_from_dict(s, i) for i, s in enumerate(d["stages"])],
            param_placements=d.get("param_placements") or {},
            precision=d.get("precision") or {},
            prediction=Prediction.from_dict(d["prediction"]) if d.get("prediction") else None,
            alternatives=d.get("alternatives") or [],
            planner=d.get("planner") or {},
            created_by=d.get("created_by") or {},
            version=PLAN_VERSION,           # a version-1 file is read as version 2 (defaults)
            layout=d.get("layout", "uniform"),
            comparison=d.get("comparison") or {},
        )
        plan.validate()
        return plan

    @classmethod
    def load(cls, path: str | os.PathLike) -> "Plan":
        path = Path(path)
        try:
            text = path.read_text()
        except OSError as exc:
            raise PlanError(f"{path}: cannot read plan ({exc.strerror})") from None
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise PlanError(f"{path}: not valid JSON (line {exc.lineno}: {exc.msg})") from None
        return cls.from_dict(data, source=str(path))


def _stage_from_dict(d: dict, i: int) -> Stage:
    d = dict(d)
    for key in ("layers", "layer_names", "ranks", "mesh_shape", "checkpoint_layers",
                "axis_names", "data_axes"):
        if key in d:
            d[key] = tuple(d[key])
    return _from_dict(Stage, d, f"stages[{i}]")


def _from_dict(cls, d: dict, where: str):
    if not isinstance(d, dict):
        raise PlanError(f"field '{where}': must be an object")
    known = {f.name for f in fields(cls)}
    extra = set(d) - known - {"total"}     # 'total' is derived, written for readers
    if extra:
        raise PlanError(f"field '{where}.{sorted(extra)[0]}': unknown key")
    try:
        return cls(**{k: v for k, v in d.items() if k in known})
    except TypeError as exc:
        raise PlanError(f"field '{where}': {exc}") from None


def _json_default(obj: Any) -> Any:
    if isinstance(obj, tuple):
        return list(obj)
    raise TypeError(f"cannot serialise {type(obj).__name__}")


def atomic_write_text(path: str | os.PathLike, text: str) -> Path:
    """Write ``text`` to ``path`` via a temp file in the same folder and ``os.replace``."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    return path
