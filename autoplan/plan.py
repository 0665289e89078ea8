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
  plan, the stage's ``axis_names`` in a ``"stages"`` plan). In a search plan they are the
  placements a parameter is *computed* with; its stage's ZeRO shards it further along the
  data axes at rest (the engine's :mod:`engine.zero`). ``_StridedShard(d)`` (a flattened
  dim sharded along its inner factor) is allowed in activation placements.
* ``comparison``: what the uniform planner's best configuration predicts for the same
  model, cluster and batch (``autoplan show`` puts it next to this plan's prediction).
"""

from __future__ import annotations

import json
import math
import os
import re
import reprlib
import tempfile
from dataclasses import MISSING, asdict, dataclass, field, fields
from pathlib import Path
from typing import Any, Callable

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
#: The most devices a plan may span (as :data:`autoplan.cluster.MAX_WORLD_SIZE`).
MAX_DEVICES = 2 ** 24
#: Bound of every other count in a plan (batch sizes, micro-batches, layers, parameters): far
#: beyond any real run, small enough that products of counts stay exact and printable.
MAX_COUNT = 2 ** 62
#: Bound of a predicted figure's magnitude (seconds, bytes, rates), so that sums stay finite.
MAX_FIGURE = 1e300
#: How deeply a plan's free-form sections (``planner``, ``alternatives``, ...) may nest.
MAX_DEPTH = 32
PRECISION_KEYS = ("params", "compute", "reduce")
_show = reprlib.Repr()
_show.maxlevel, _show.maxstring, _show.maxlong, _show.maxother = 3, 60, 40, 60
_show.maxlist = _show.maxdict = _show.maxtuple = 6


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
    ep: int = 1                        # expert parallelism: experts split over ep of the dp ranks
    cp: int = 1                        # context parallelism: each sequence split over cp ranks

    def __post_init__(self) -> None:
        for name in ("dp", "tp", "pp", "micro_batch", "num_micro_batches", "virtual_stages",
                     "ep", "cp"):
            _count(getattr(self, name), f"parallel.{name}",
                   high=MAX_DEVICES if name in ("dp", "tp", "pp", "ep", "cp") else MAX_COUNT)
        if self.dp % self.ep:
            raise PlanError(f"field 'parallel.ep': expert parallelism folds into data "
                            f"parallelism, so ep ({self.ep}) must divide dp ({self.dp})")
        if not _is_int(self.zero) or self.zero not in (0, 1, 2, 3):
            raise PlanError(f"field 'parallel.zero': must be 0, 1, 2 or 3, "
                            f"got {_show.repr(self.zero)}")
        if not isinstance(self.sequence_parallel, bool):
            raise PlanError(f"field 'parallel.sequence_parallel': must be true or false, "
                            f"got {_show.repr(self.sequence_parallel)}")
        if not isinstance(self.schedule, str) or self.schedule not in SCHEDULES:
            raise PlanError(f"field 'parallel.schedule': must be one of {SCHEDULES}, "
                            f"got {_show.repr(self.schedule)}")
        if not isinstance(self.checkpoint, str) or self.checkpoint not in ("none", "full"):
            raise PlanError(f"field 'parallel.checkpoint': must be 'none' or 'full', "
                            f"got {_show.repr(self.checkpoint)}")
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
        if self.checkpoint != "none":
            parts.append("ckpt")
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
        _sequence(self.shape, "mesh.shape", _is_int)
        _sequence(self.axis_names, "mesh.axis_names", _is_name)
        if len(self.shape) != len(self.axis_names):
            raise PlanError(f"field 'mesh.shape': {list(self.shape)} has {len(self.shape)} axes "
                            f"but axis_names has {len(self.axis_names)}")
        if len(set(self.axis_names)) != len(self.axis_names):
            raise PlanError(f"field 'mesh.axis_names': {list(self.axis_names)} repeats a name")
        if any(s < 1 or s > MAX_DEVICES for s in self.shape):
            raise PlanError(f"field 'mesh.shape': sizes must be integers from 1 to "
                            f"{MAX_DEVICES}, got {_show.repr(list(self.shape))}")
        if self.size > MAX_DEVICES:
            raise PlanError(f"field 'mesh.shape': {list(self.shape)} is more than "
                            f"{MAX_DEVICES} devices")
        if not isinstance(self.device_type, str) or self.device_type not in ("cpu", "cuda"):
            raise PlanError(f"field 'mesh.device_type': must be 'cpu' or 'cuda', got "
                            f"{_show.repr(self.device_type)}")

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
        d = dict(_object(d, "prediction"))
        for key in ("memory", "time"):
            if key not in d:
                raise PlanError(f"field 'prediction.{key}': missing")
        d["memory"] = _figures(MemoryBreakdown, d["memory"], "prediction.memory")
        d["time"] = _figures(TimeBreakdown, d["time"], "prediction.time")
        per_stage = _list(d.get("memory_per_stage", []), "prediction.memory_per_stage")
        d["memory_per_stage"] = tuple(
            _figures(MemoryBreakdown, m, f"prediction.memory_per_stage[{i}]")
            for i, m in enumerate(per_stage))
        times = _list(d.get("stage_times", []), "prediction.stage_times")
        d["stage_times"] = tuple(_figures(StageTime, t, f"prediction.stage_times[{i}]")
                                 for i, t in enumerate(times))
        for f in fields(cls):
            if f.name not in ("memory", "time", "memory_per_stage", "stage_times") \
                    and f.name in d:
                _figure(d[f.name], f"prediction.{f.name}")
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
                raise PlanError(f"field 'stages[{i}].checkpoint_layers': {_show.repr(sorted(bad))} "
                                "not in this stage")
            self._validate_stage_v2(i, st)
        if len(seen) != self.world_size:       # every rank of seen is in range (above)
            missing = []
            for r in range(self.world_size):   # the first few: never a set of the whole world
                if r not in seen:
                    missing.append(r)
                    if len(missing) == 5:
                        break
            raise PlanError(f"field 'stages': ranks {missing}"
                            f"{' ...' if len(missing) == 5 else ''} belong to no stage")
        known_axes = set(self.mesh.axis_names) | {a for st in self.stages
                                                  for a in st.axis_names}
        for name, axes in self.param_placements.items():
            for axis, placement in axes.items():
                if axis not in known_axes:
                    raise PlanError(f"field 'param_placements.{name}': unknown mesh axis "
                                    f"{_show.repr(axis)}")
                if not isinstance(placement, str) or not _PLACEMENT.match(placement):
                    raise PlanError(f"field 'param_placements.{name}.{axis}': "
                                    f"{_show.repr(placement)} is not Replicate(), Shard(d) or "
                                    "Partial()")
        if self.prediction is not None:
            _finite_tree(self.prediction.to_dict(), "prediction")

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
                raise PlanError(f"field '{where}.data_axes': unknown axis {_show.repr(axis)}")
        for op, axes in st.activation_placements.items():
            for axis, placement in axes.items():
                if axis not in st.axis_names:
                    raise PlanError(f"field '{where}.activation_placements.{op}': unknown axis "
                                    f"{_show.repr(axis)}")
                if not isinstance(placement, str) or not _ACT_PLACEMENT.match(placement):
                    raise PlanError(f"field '{where}.activation_placements.{op}.{axis}': "
                                    f"{_show.repr(placement)} is not a DTensor placement")

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
        """Build and validate a plan from its JSON form; every error is a :class:`PlanError`
        whose message starts with ``source`` and names the field."""
        try:
            return cls._from_dict(d, source)
        except PlanError as exc:
            raise PlanError(f"{source}: {exc}") from None
        except RecursionError:
            raise PlanError(f"{source}: field '<top level>': nested too deeply") from None
        except (KeyError, TypeError, ValueError) as exc:     # a check this loader lacks
            raise PlanError(f"{source}: malformed plan ({type(exc).__name__}: "
                            f"{_show.repr(str(exc))})") from None

    @classmethod
    def _from_dict(cls, d: dict[str, Any], source: str) -> "Plan":
        if not isinstance(d, dict):
            raise PlanError("the top level must be a JSON object")
        for key in d:
            if not isinstance(key, str):
                raise PlanError(f"field '{key}': keys must be strings")
        if d.get("format") != PLAN_FORMAT:
            raise PlanError(f"field 'format': expected {PLAN_FORMAT!r}, got "
                            f"{_show.repr(d.get('format'))}")
        version = d.get("version")
        if not _is_int(version) or version not in READABLE_VERSIONS:
            raise PlanError(f"field 'version': this autoplan reads plan versions "
                            f"{', '.join(map(str, READABLE_VERSIONS))}, the file is version "
                            f"{_show.repr(version)}")
        known = {f.name for f in fields(cls)} | {"format"}
        unknown = sorted(set(d) - known)
        if unknown:
            raise PlanError(f"field '{unknown[0]}': unknown key")
        for key in ("model", "model_fingerprint", "num_params", "cluster", "global_batch",
                    "mesh", "parallel", "stages"):
            if key not in d:
                raise PlanError(f"field '{key}': missing")
        for key, value in d.items():           # no section nests deeper than a plan needs
            _plain(value, key)
        mesh = dict(_object(d["mesh"], "mesh"))
        for key in ("shape", "axis_names"):
            if key in mesh:
                mesh[key] = tuple(_list(mesh[key], f"mesh.{key}"))
        if "shape" not in mesh:
            raise PlanError("field 'mesh.shape': missing")
        if not _is_name(d["model_fingerprint"]):
            raise PlanError(f"field 'model_fingerprint': must be a non-empty string, got "
                            f"{_show.repr(d['model_fingerprint'])}")
        num_params = _count(d["num_params"], "num_params", low=0)
        global_batch = _count(d["global_batch"], "global_batch")
        seq_len = d.get("seq_len")
        if seq_len is not None:
            _count(seq_len, "seq_len")
        param_placements = _string_table(_optional_object(d, "param_placements"),
                                         "param_placements")
        precision = _optional_object(d, "precision")
        for key, value in precision.items():
            if key not in PRECISION_KEYS:
                raise PlanError(f"field 'precision.{key}': unknown key; known: "
                                f"{', '.join(PRECISION_KEYS)}")
            if not _is_name(value):
                raise PlanError(f"field 'precision.{key}': must be a dtype name, got "
                                f"{_show.repr(value)}")
        created_by = _optional_object(d, "created_by")
        for key, value in created_by.items():
            if not isinstance(value, str):
                raise PlanError(f"field 'created_by.{key}': must be a string, got "
                                f"{_show.repr(value)}")
        alternatives = d.get("alternatives")
        alternatives = [] if alternatives is None else _list(alternatives, "alternatives")
        for i, alt in enumerate(alternatives):
            _object(alt, f"alternatives[{i}]")
        layout = d.get("layout", "uniform")
        if not isinstance(layout, str) or layout not in LAYOUTS:
            raise PlanError(f"field 'layout': must be one of {LAYOUTS}, got {_show.repr(layout)}")
        prediction = d.get("prediction")
        plan = cls(
            model=_model(d["model"], source),
            model_fingerprint=d["model_fingerprint"],
            num_params=num_params,
            cluster=_cluster(d["cluster"], source),
            global_batch=global_batch,
            seq_len=seq_len,
            mesh=_from_dict(MeshSpec, mesh, "mesh"),
            parallel=_from_dict(ParallelConfig, _object(d["parallel"], "parallel"), "parallel"),
            stages=[_stage_from_dict(s, i)
                    for i, s in enumerate(_list(d["stages"], "stages"))],
            param_placements=param_placements,
            precision=precision,
            prediction=None if prediction is None else Prediction.from_dict(prediction),
            alternatives=alternatives,
            planner=_optional_object(d, "planner"),
            created_by=created_by,
            version=PLAN_VERSION,           # a version-1 file is read as version 2 (defaults)
            layout=layout,
            comparison=_optional_object(d, "comparison"),
        )
        plan.validate()
        return plan

    @classmethod
    def load(cls, path: str | os.PathLike) -> "Plan":
        """Read and validate a plan file; anything wrong with it -- unreadable, not UTF-8,
        not JSON, a duplicate key, a wrong field -- is a :class:`PlanError` naming the file
        (and the field, when the text is a JSON object)."""
        path = Path(path)
        try:
            raw = path.read_bytes()
        except OSError as exc:
            raise PlanError(f"{path}: cannot read plan ({exc.strerror or exc})") from None
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            line = raw.count(b"\n", 0, exc.start) + 1
            raise PlanError(f"{path}: not UTF-8 text (byte {exc.start}, line {line})") from None
        try:
            data = json.loads(text, object_pairs_hook=_no_duplicates)
        except json.JSONDecodeError as exc:
            raise PlanError(f"{path}: not valid JSON (line {exc.lineno}: {exc.msg})") from None
        except _DuplicateKey as exc:
            raise PlanError(f"{path}: not valid JSON: duplicate key "
                            f"{_show.repr(exc.args[0])}") from None
        except RecursionError:
            raise PlanError(f"{path}: not valid JSON: nested too deeply") from None
        except ValueError as exc:              # e.g. an integer of more than 4300 digits
            raise PlanError(f"{path}: not valid JSON: a value cannot be read "
                            f"({_show.repr(str(exc))})") from None
        return cls.from_dict(data, source=str(path))


# ---- loading: checks that name the field -----------------------------------------------------

class _DuplicateKey(ValueError):
    pass


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise _DuplicateKey(key)
        out[key] = value
    return out


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_name(value: Any) -> bool:
    return isinstance(value, str) and bool(value)


def _count(value: Any, where: str, *, low: int = 1, high: int = MAX_COUNT) -> int:
    if not _is_int(value) or not low <= value <= high:
        raise PlanError(f"field '{where}': must be an integer from {low} to {high}, got "
                        f"{_show.repr(value)}")
    return value


def _object(value: Any, where: str) -> dict:
    if not isinstance(value, dict):
        raise PlanError(f"field '{where}': must be an object, got {_kind(value)}")
    return value


def _optional_object(d: dict, key: str) -> dict:
    """``d[key]``: an object, or {} when absent or null."""
    value = d.get(key)
    return {} if value is None else _object(value, key)


def _list(value: Any, where: str) -> list:
    if not isinstance(value, (list, tuple)):
        raise PlanError(f"field '{where}': must be a list, got {_kind(value)}")
    return list(value)


def _sequence(value: Any, where: str, ok) -> None:
    if not isinstance(value, (list, tuple)):
        raise PlanError(f"field '{where}': must be a list, got {_kind(value)}")
    for i, item in enumerate(value):
        if not ok(item):
            what = "an integer" if ok is _is_int else "a non-empty string"
            raise PlanError(f"field '{where}': item {i} must be {what}, got "
                            f"{_show.repr(item)}")


def _string_table(table: dict, where: str) -> dict[str, dict[str, str]]:
    """An object of objects of strings (name -> mesh axis -> placement)."""
    for name, row in table.items():
        _object(row, f"{where}.{name}")
        for key, value in row.items():
            if not isinstance(value, str):
                raise PlanError(f"field '{where}.{name}.{key}': must be a string, got "
                                f"{_show.repr(value)}")
    return table


def _kind(value: Any) -> str:
    return {dict: "an object", list: "a list", str: "a string", bool: "a boolean",
            type(None): "null", int: "an integer", float: "a number"}.get(type(value),
                                                                       type(value).__name__)


def _figure(value: Any, where: str) -> float:
    """A finite number of sane magnitude (a sum of a few stays finite)."""
    if (not isinstance(value, (int, float)) or isinstance(value, bool)
            or (isinstance(value, float) and not math.isfinite(value))
            or not -MAX_FIGURE <= value <= MAX_FIGURE):
        raise PlanError(f"field '{where}': must be a finite number, got {_show.repr(value)}")
    return value


def _figures(cls, d: Any, where: str):
    """A :class:`MemoryBreakdown` / :class:`TimeBreakdown` of finite numbers."""
    d = _object(d, where)
    for key, value in d.items():
        if key in {f.name for f in fields(cls)}:
            _figure(value, f"{where}.{key}")
    return _from_dict(cls, d, where)


def _finite_tree(value: Any, where: str) -> None:
    """Every number under ``value`` (an object / list tree) finite."""
    stack = [(value, where)]
    while stack:
        node, at = stack.pop()
        if isinstance(node, dict):
            stack.extend((v, f"{at}.{k}") for k, v in node.items())
        elif isinstance(node, (list, tuple)):
            stack.extend((v, f"{at}[{i}]") for i, v in enumerate(node))
        elif isinstance(node, float) and not math.isfinite(node):
            raise PlanError(f"field '{at}': must be a finite number, got {node!r}")


def _plain(value: Any, where: str) -> None:
    """JSON data of bounded depth with finite numbers (written back as standard JSON)."""
    stack = [(value, where, 0)]
    while stack:
        node, at, depth = stack.pop()
        if isinstance(node, (dict, list)):
            if depth >= MAX_DEPTH:
                raise PlanError(f"field '{where}': nested more than {MAX_DEPTH} levels deep")
            items = node.items() if isinstance(node, dict) else enumerate(node)
            fmt = "{}.{}" if isinstance(node, dict) else "{}[{}]"
            stack.extend((v, fmt.format(at, k), depth + 1) for k, v in items)
        elif isinstance(node, float) and not math.isfinite(node):
            raise PlanError(f"field '{at}': must be a finite number, got {node!r}")


def _nested_error(exc: Exception, prefix: str, source: str) -> PlanError:
    """A ConfigError of an embedded section (cluster, model) as a PlanError whose field
    starts with ``prefix``."""
    name = getattr(exc, "field", None)
    message = getattr(exc, "detail", None) or str(exc)
    for lead in (f"{source}: ", f"field '{name}': "):
        message = message.removeprefix(lead)
    if name and not (name == prefix or name.startswith(prefix + ".")):
        name = f"{prefix}.{name}"
    return PlanError(f"field '{name or prefix}': {message}")


def _cluster(value: Any, source: str) -> dict[str, Any]:
    """The embedded cluster, checked by :meth:`autoplan.cluster.Cluster.from_dict`; kept as
    written (so a plan saves back byte for byte)."""
    from autoplan.cluster import Cluster

    return _embedded(value, "cluster", source, lambda d: Cluster.from_dict(d, source=source))


def _model(value: Any, source: str) -> dict[str, Any]:
    """The embedded model spec, checked by :meth:`autoplan.models.registry.ModelSpec.from_dict`."""
    from autoplan.models.registry import ModelSpec

    return _embedded(value, "model", source,
                     lambda d: ModelSpec.from_dict(d, source_file=source))


def _embedded(value: Any, name: str, source: str, check: Callable[[dict], Any]
              ) -> dict[str, Any]:
    """``value`` as written, once an object that ``check`` accepts; what ``check`` raises
    is named under field ``name``."""
    from autoplan.errors import AutoplanError

    _object(value, name)
    try:
        check(value)
    except AutoplanError as exc:
        raise _nested_error(exc, name, source) from None
    return value


def _stage_from_dict(d: Any, i: int) -> Stage:
    where = f"stages[{i}]"
    d = dict(_object(d, where))
    for key in ("index", "layers", "layer_names", "ranks", "mesh_shape"):
        if key not in d:
            raise PlanError(f"field '{where}.{key}': missing")
    _count(d["index"], f"{where}.index", low=0)
    for key, ok in (("layers", _is_int), ("layer_names", _is_name), ("ranks", _is_int),
                    ("mesh_shape", _is_int), ("checkpoint_layers", _is_name),
                    ("axis_names", _is_name), ("data_axes", _is_name)):
        if key in d:
            _sequence(d[key], f"{where}.{key}", ok)
            d[key] = tuple(d[key])
    if len(d["layers"]) != 2 or not 0 <= d["layers"][0] <= MAX_COUNT \
            or not 0 <= d["layers"][1] <= MAX_COUNT:
        raise PlanError(f"field '{where}.layers': must be [start, end], two integers >= 0, "
                        f"got {_show.repr(list(d['layers']))}")
    for r in d["ranks"]:
        if not 0 <= r < MAX_DEVICES:
            raise PlanError(f"field '{where}.ranks': rank {_show.repr(r)} out of range")
    for n in d["mesh_shape"]:
        if not 1 <= n <= MAX_DEVICES:
            raise PlanError(f"field '{where}.mesh_shape': sizes must be integers from 1 to "
                            f"{MAX_DEVICES}, got {_show.repr(list(d['mesh_shape']))}")
    if len(set(d.get("axis_names", ()))) != len(d.get("axis_names", ())):
        raise PlanError(f"field '{where}.axis_names': {_show.repr(list(d['axis_names']))} "
                        "repeats a name")
    for key in ("zero", "micro_batch"):
        value = d.get(key)
        if value is not None and not _is_int(value):
            raise PlanError(f"field '{where}.{key}': must be an integer or null, got "
                            f"{_show.repr(value)}")
    if d.get("micro_batch") is not None:
        _count(d["micro_batch"], f"{where}.micro_batch")
    if "activation_placements" in d:
        d["activation_placements"] = _string_table(
            _object(d["activation_placements"], f"{where}.activation_placements"),
            f"{where}.activation_placements")
    if "predicted" in d:
        predicted = _object(d["predicted"], f"{where}.predicted")
        _finite_tree(predicted, f"{where}.predicted")
    return _from_dict(Stage, d, where)


def _from_dict(cls, d: dict, where: str):
    if not isinstance(d, dict):
        raise PlanError(f"field '{where}': must be an object, got {_kind(d)}")
    known = {f.name for f in fields(cls)}
    extra = set(d) - known - {"total"}     # 'total' is derived, written for readers
    if extra:
        raise PlanError(f"field '{where}.{sorted(extra)[0]}': unknown key")
    missing = [f.name for f in fields(cls) if f.name not in d
               and f.default is MISSING and f.default_factory is MISSING]
    if missing:
        raise PlanError(f"field '{where}.{missing[0]}': missing")
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
    return _atomic_write(path, text, "w")


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> Path:
    """Write ``data`` to ``path`` via a temp file in the same folder and ``os.replace``."""
    return _atomic_write(path, data, "wb")


def _atomic_write(path: str | os.PathLike, content: str | bytes, mode: str) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, mode) as f:
            f.write(content)
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
