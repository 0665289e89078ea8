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

Version 2 (written by the search planner, :mod:`autoplan.planner.search.search`) adds, all optional,
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

Version 3:

* ``planner`` is typed (:class:`~autoplan.plan_meta.PlannerInfo`: ``name``, ``label``,
  ``evaluated``, ``feasible``, ``note``, and free-form ``details`` that nothing decides on),
  and ``runtime`` (``"uniform"``, ``"per_op"`` or null: the engine chooses) is the plan's own
  field, validated at load.
* ``prediction.stage_times``: per plan stage, seconds per micro-batch of forward, backward,
  recomputation, in-layer communication and the send, from the one step composition
  (:mod:`autoplan.cost.step`) — what the report draws, without re-tracing the model.
* :meth:`Plan.label` says what the placements do (a ``tp`` axis with no sharded weight is
  not called tensor parallelism).

Version 4 (this one; older files are migrated on read, :mod:`autoplan.plan_migrate`) adds
``pricing``: the runtime assumptions the prediction was priced under (fused kernels, the
float8 recipe, the attention kernel, the context-parallel exchange; :mod:`autoplan.pricing`),
null in older plans.

The parts (configuration, mesh, stages, prediction) are in :mod:`autoplan.plan_parts`, the
field checks in :mod:`autoplan.plan_fields`.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any, Callable

from autoplan import plan_fields as pf
from autoplan.errors import PlanError
from autoplan.placement import REPLICATED, PlacementError, check_plan_text, shard_dim
from autoplan.plan_fields import (MAX_COUNT, MAX_DEPTH, MAX_DEVICES, MAX_FIGURE,  # noqa: F401
                                  atomic_write_bytes, atomic_write_text)
from autoplan.plan_meta import RUNTIMES, PlannerInfo, check_runtime, split_runtime  # noqa: F401
from autoplan.plan_migrate import PLAN_VERSION, READABLE_VERSIONS, migrate
from autoplan.pricing import Pricing
from autoplan.plan_parts import (MESH_AXES, SCHEDULES, MemoryBreakdown,  # noqa: F401
                                 MeshSpec, ParallelConfig, Prediction, Stage, StageTime,
                                 TimeBreakdown, stage_from_dict, stage_ranks)
from autoplan.precision import PLAN_KEYS as PRECISION_KEYS
from autoplan.precision import from_plan
from autoplan.trust import check_plan_names
from autoplan.user_files import read_bytes

PLAN_FORMAT = "autoplan.plan"
LAYOUTS = ("uniform", "stages")


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
    planner: PlannerInfo = field(default_factory=PlannerInfo)
    created_by: dict[str, str] = field(default_factory=dict)
    version: int = PLAN_VERSION
    layout: str = "uniform"
    comparison: dict[str, Any] = field(default_factory=dict)
    runtime: str | None = None         # RUNTIMES; None: the engine chooses from the plan
    pricing: Pricing | None = None     # the runtime assumptions priced (None: not recorded)

    def __post_init__(self) -> None:
        # a version-2 style ``planner`` mapping (code written against it): typed here, its
        # ``runtime`` moved to the plan's own field
        planner, runtime = split_runtime(self.planner)
        if runtime is not None and self.runtime is None:
            self.runtime = runtime
        self.planner = PlannerInfo.of(planner)
        check_runtime(self.runtime)

    # ---- derived -------------------------------------------------------------------------
    @property
    def world_size(self) -> int:
        return self.mesh.size

    def distinct_devices(self) -> int:
        """Devices doing work no other device repeats: each stage's submesh less the copies
        along its :meth:`Stage.repeated_axes` (the whole world where none repeat)."""
        if not self.stages:
            return self.world_size
        total = sum(math.prod(st.mesh_shape) // math.prod(st.repeated_axes().values())
                    for st in self.stages)
        return min(total, self.world_size)

    def label(self) -> str:
        """The configuration as its placements make it: ``parallel.label()``, except that a
        ``tp`` axis along which no weight is sharded is not tensor parallelism and says so
        (``tp4(repl)``: the weights are replicated on it, only activations are split); a
        ``"stages"`` plan's label is its planner's (each stage has its own mesh)."""
        if self.layout == "stages":
            return self.planner.label or self.parallel.label()
        out = self.parallel.label()
        p = self.parallel
        if p.tp > 1 and self.param_placements and not any(
                shard_dim(axes.get("tp", REPLICATED)) is not None
                for axes in self.param_placements.values()):
            out = out.replace(f"tp{p.tp}", f"tp{p.tp}(repl)", 1)
        return out

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
                raise PlanError(f"field 'stages[{i}].checkpoint_layers': "
                                f"{pf.show.repr(sorted(bad))} not in this stage")
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
                                    f"{pf.show.repr(axis)}")
                _placement(placement, f"param_placements.{name}.{axis}", strided=False)
        if self.prediction is not None:
            pf.finite_tree(self.prediction.to_dict(), "prediction")

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
                raise PlanError(f"field '{where}.data_axes': unknown axis {pf.show.repr(axis)}")
        for op, axes in st.activation_placements.items():
            for axis, placement in axes.items():
                if axis not in st.axis_names:
                    raise PlanError(f"field '{where}.activation_placements.{op}': unknown axis "
                                    f"{pf.show.repr(axis)}")
                _placement(placement, f"{where}.activation_placements.{op}.{axis}")

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
            "planner": self.planner.to_dict(),
            "runtime": self.runtime,
            "layout": self.layout,
            "comparison": self.comparison,
            "pricing": self.pricing.to_dict() if self.pricing is not None else None,
        }

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=True, default=pf.json_default) + "\n"

    def save(self, path: str | os.PathLike) -> Path:
        """Validate, then write atomically: a crash never leaves a half-written plan. A plan
        larger than autoplan reads back (:data:`autoplan.user_files.MAX_BYTES`) is refused
        before anything is written."""
        from autoplan.user_files import MAX_BYTES

        self.validate()
        data = self.to_json().encode()
        if len(data) > MAX_BYTES:
            raise PlanError(f"{path}: the plan would be {len(data):,} bytes, more than the "
                            f"{MAX_BYTES:,} autoplan reads back; plan for fewer devices")
        return atomic_write_bytes(path, data)

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
                            f"{pf.show.repr(str(exc))})") from None

    @classmethod
    def _from_dict(cls, d: dict[str, Any], source: str) -> "Plan":
        if not isinstance(d, dict):
            raise PlanError("the top level must be a JSON object")
        for key in d:
            if not isinstance(key, str):
                raise PlanError(f"field '{key}': keys must be strings")
        check_plan_names(d)                    # autoplan.trust: no control chars in names
        if d.get("format") != PLAN_FORMAT:
            raise PlanError(f"field 'format': expected {PLAN_FORMAT!r}, got "
                            f"{pf.show.repr(d.get('format'))}")
        version = d.get("version")
        if not pf.is_int(version) or version not in READABLE_VERSIONS:
            raise PlanError(f"field 'version': this autoplan reads plan versions "
                            f"{', '.join(map(str, READABLE_VERSIONS))}, the file is version "
                            f"{pf.show.repr(version)}")
        known = {f.name for f in fields(cls)} | {"format"}
        unknown = sorted(set(d) - known)
        if unknown:
            raise PlanError(f"field '{unknown[0]}': unknown key")
        for key in ("model", "model_fingerprint", "num_params", "cluster", "global_batch",
                    "mesh", "parallel", "stages"):
            if key not in d:
                raise PlanError(f"field '{key}': missing")
        for key, value in d.items():           # no section nests deeper than a plan needs
            pf.plain(value, key)
        d = migrate(d)                         # versions 1 and 2 (autoplan.plan_migrate)
        mesh = dict(pf.as_object(d["mesh"], "mesh"))
        for key in ("shape", "axis_names"):
            if key in mesh:
                mesh[key] = tuple(pf.as_list(mesh[key], f"mesh.{key}"))
        if "shape" not in mesh:
            raise PlanError("field 'mesh.shape': missing")
        if not pf.is_name(d["model_fingerprint"]):
            raise PlanError(f"field 'model_fingerprint': must be a non-empty string, got "
                            f"{pf.show.repr(d['model_fingerprint'])}")
        num_params = pf.count(d["num_params"], "num_params", low=0)
        global_batch = pf.count(d["global_batch"], "global_batch")
        seq_len = d.get("seq_len")
        if seq_len is not None:
            pf.count(seq_len, "seq_len")
        param_placements = pf.string_table(pf.optional_object(d, "param_placements"),
                                         "param_placements")
        precision = pf.optional_object(d, "precision")
        for key, value in precision.items():
            if key not in PRECISION_KEYS:
                raise PlanError(f"field 'precision.{key}': unknown key; known: "
                                f"{', '.join(PRECISION_KEYS)}")
            if not pf.is_name(value):
                raise PlanError(f"field 'precision.{key}': must be a dtype name, got "
                                f"{pf.show.repr(value)}")
        matmul = precision.get("matmul")
        if matmul is not None and matmul != precision.get("compute"):
            try:
                from_plan(precision)
            except ValueError:
                raise PlanError(f"field 'precision.matmul': {matmul!r} GEMMs "
                                f"with {precision.get('compute', 'float32')!r} compute is "
                                f"no training precision (mixed-fp8: float8 with "
                                f"bfloat16)") from None
        created_by = pf.optional_object(d, "created_by")
        for key, value in created_by.items():
            if not isinstance(value, str):
                raise PlanError(f"field 'created_by.{key}': must be a string, got "
                                f"{pf.show.repr(value)}")
        alternatives = d.get("alternatives")
        alternatives = [] if alternatives is None else pf.as_list(alternatives, "alternatives")
        for i, alt in enumerate(alternatives):
            pf.as_object(alt, f"alternatives[{i}]")
        layout = d.get("layout", "uniform")
        if not isinstance(layout, str) or layout not in LAYOUTS:
            raise PlanError(f"field 'layout': must be one of {LAYOUTS}, got {pf.show.repr(layout)}")
        prediction = d.get("prediction")
        plan = cls(
            model=_model(d["model"], source),
            model_fingerprint=d["model_fingerprint"],
            num_params=num_params,
            cluster=_cluster(d["cluster"], source),
            global_batch=global_batch,
            seq_len=seq_len,
            mesh=pf.from_dict(MeshSpec, mesh, "mesh"),
            parallel=pf.from_dict(ParallelConfig, pf.as_object(d["parallel"], "parallel"),
                                  "parallel"),
            stages=[stage_from_dict(s, i)
                    for i, s in enumerate(pf.as_list(d["stages"], "stages"))],
            param_placements=param_placements,
            precision=precision,
            prediction=None if prediction is None else Prediction.from_dict(prediction),
            alternatives=alternatives,
            planner=PlannerInfo.of(pf.optional_object(d, "planner")),
            runtime=check_runtime(d.get("runtime")),
            created_by=created_by,
            version=PLAN_VERSION,           # older files migrated on read (plan_migrate)
            layout=layout,
            comparison=pf.optional_object(d, "comparison"),
            pricing=None if d.get("pricing") is None else Pricing.from_dict(d["pricing"]),
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
            raw = read_bytes(path)
        except OSError as exc:
            raise PlanError(f"{path}: cannot read plan ({exc.strerror or exc})") from None
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            line = raw.count(b"\n", 0, exc.start) + 1
            raise PlanError(f"{path}: not UTF-8 text (byte {exc.start}, line {line})") from None
        try:
            data = json.loads(text, object_pairs_hook=pf.no_duplicates)
        except json.JSONDecodeError as exc:
            raise PlanError(f"{path}: not valid JSON (line {exc.lineno}: {exc.msg})") from None
        except pf.DuplicateKey as exc:
            raise PlanError(f"{path}: not valid JSON: duplicate key "
                            f"{pf.show.repr(exc.args[0])}") from None
        except RecursionError:
            raise PlanError(f"{path}: not valid JSON: nested too deeply") from None
        except ValueError as exc:              # e.g. an integer of more than 4300 digits
            raise PlanError(f"{path}: not valid JSON: a value cannot be read "
                            f"({pf.show.repr(str(exc))})") from None
        return cls.from_dict(data, source=str(path))


# ---- loading: sections that need the plan's own types --------------------------------------

def _placement(text: Any, where: str, *, strided: bool = True) -> None:
    """A placement as the plan writes it (:func:`autoplan.placement.check_plan_text`)."""
    try:
        check_plan_text(text, where, strided=strided)
    except PlacementError:
        kinds = "Replicate(), Shard(d), Partial()" + (" or _StridedShard(d)" if strided else "")
        raise PlanError(f"field '{where}': {pf.show.repr(text)} is not a placement as a plan "
                        f"writes it ({kinds})") from None


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

    pf.as_object(value, name)
    try:
        check(value)
    except AutoplanError as exc:
        raise _nested_error(exc, name, source) from None
    return value
