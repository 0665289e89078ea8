"""The cluster model: device specs, links, clusters, and their YAML files.

A :class:`Cluster` is ``nodes`` machines of ``devices_per_node`` identical devices
(:class:`DeviceSpec`), joined inside a node by ``intra_node`` and across nodes by
``inter_node`` (:class:`LinkSpec`). It is plain, frozen data: the planner stores it inside
the plan JSON (:meth:`Cluster.to_dict`) and reloads it (:meth:`Cluster.from_dict`) without
needing the ``profiles/`` folder.

Units, everywhere: bandwidths in GB/s with 1 GB = 1e9 bytes, memory in GB (1e9 bytes),
peak compute in TFLOP/s (1e12 FLOP/s), latency in microseconds. Methods that return SI
values say so (``peak_flops`` -> FLOP/s, ``memory_bytes`` -> bytes).

Link bandwidth is defined so the alpha-beta model (:mod:`autoplan.cost.comm`) can use it
directly: it is the all-reduce *bus bandwidth* per device that nccl-tests reports
(busbw = algbw * 2(n-1)/n for all-reduce), i.e. the rate at which each device's share of a
ring collective moves. For ``intra_node`` it is the busbw of a group inside one node; for
``inter_node`` it is the busbw of *one NIC* (a cross-node group with one rank per node, each
rank on its own NIC), and ``nics`` says how many such NICs a node has.

Files (found under ``profiles/``, or ``$AUTOPLAN_PROFILES`` when set):

* ``devices/<name>.yaml`` -- one :class:`DeviceSpec`; every figure cites its source.
* ``clusters/<name>.yaml`` -- one cluster preset; names its device (or inlines one) and may
  override device fields under ``device_overrides``.

Loading is strict: unknown keys, wrong types, missing fields and impossible values raise
:class:`~autoplan.errors.ConfigError` naming the file and the dotted field; an unknown
preset or device name raises :class:`~autoplan.errors.UnknownNameError` listing the known
ones.
"""

from __future__ import annotations

import math
import os
from dataclasses import MISSING, dataclass, field, fields, replace
from pathlib import Path
from types import MappingProxyType
from typing import Any, Mapping

from autoplan.errors import ConfigError, UnknownNameError
from autoplan.yaml_files import profiles_root, read_yaml

#: Dtypes a device may list a dense peak for (torch spelling, plus TF32 tensor-core mode).
PEAK_DTYPES = ("float64", "float32", "tf32", "bfloat16", "float16", "float8", "int8")
_DTYPE_ALIASES: Mapping[str, str] = MappingProxyType({
    "fp64": "float64", "double": "float64", "fp32": "float32", "float": "float32",
    "bf16": "bfloat16", "fp16": "float16", "half": "float16", "fp8": "float8",
    "float8_e4m3fn": "float8", "float8_e5m2": "float8", "float8_e4m3fnuz": "float8",
    "float8_e5m2fnuz": "float8",
})
LINK_KINDS = ("nvlink", "nvswitch", "infiniband", "ethernet", "roce", "pcie", "loopback")
_GPU_FABRICS = ("nvlink", "nvswitch")
_SOURCED_FIGURES = ("peak_tflops", "memory_gb", "memory_bandwidth_gbps")


def canonical_dtype(dtype: str) -> str:
    """'torch.bfloat16' / 'bf16' / 'bfloat16' -> 'bfloat16' (see :data:`PEAK_DTYPES`)."""
    name = str(dtype).removeprefix("torch.").lower()
    return _DTYPE_ALIASES.get(name, name)


# ---- validation helpers ------------------------------------------------------------------

def _fail(message: str, where: str) -> ConfigError:
    """A ConfigError for field ``where`` whose bare message can be re-raised with a file."""
    exc = ConfigError(message, field=where)
    exc.detail = message  # type: ignore[attr-defined]
    return exc


def _rethrow(exc: ConfigError, *, source: str, prefix: str = "") -> ConfigError:
    detail = getattr(exc, "detail", str(exc))
    where = f"{prefix}{exc.field}" if exc.field else (prefix.rstrip(".") or None)
    new = ConfigError(detail, source=source, field=where)
    new.detail = detail  # type: ignore[attr-defined]
    return new


#: Every figure (TFLOP/s, GB, GB/s, us) lies in this range, so that converting it to SI units,
#: multiplying or inverting it stays finite: a NaN or inf must never reach the cost model.
FIGURE_RANGE = (1e-9, 1e12)
#: The most devices a cluster may have (2**24, ~100x the largest machines built so far): the
#: planner enumerates divisors of the world size, and an absurd count would never finish.
MAX_WORLD_SIZE = 2 ** 24


def _positive(value: Any, where: str, *, allow_zero: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise _fail(f"must be a number, got {value!r}", where)
    try:
        number = float(value)
    except OverflowError:
        raise _fail(f"must be finite, got an integer of {len(str(abs(value)))} digits",
                    where) from None
    if not math.isfinite(number):
        raise _fail(f"must be finite, got {value!r}", where)
    if number < 0 or (number == 0 and not allow_zero):
        raise _fail(f"must be {'>= 0' if allow_zero else '> 0'}, got {value!r}", where)
    low, high = FIGURE_RANGE
    if number and not low <= number <= high:
        raise _fail(f"must be between {low:g} and {high:g}, got {value!r}", where)
    return number


def _positive_int(value: Any, where: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise _fail(f"must be an integer, got {value!r}", where)
    if value < 1:
        raise _fail(f"must be >= 1, got {value!r}", where)
    if value > MAX_WORLD_SIZE:
        raise _fail(f"must be at most {MAX_WORLD_SIZE}, got {value!r}", where)
    return value


def _text(value: Any, where: str, *, empty_ok: bool = False) -> str:
    if not isinstance(value, str) or (not empty_ok and not value.strip()):
        raise _fail(f"must be a {'' if empty_ok else 'non-empty '}string, got {value!r}", where)
    return value


def _name(value: Any, where: str) -> str:
    """A name (cluster, device, family): a non-empty string without control characters that
    cannot become a path — names become file names (``profiles/calibration/<cluster>.json``)
    and words of written scripts."""
    from autoplan.trust import control_char

    _text(value, where)
    ch = control_char(value)
    if ch is not None:
        raise _fail(f"must not hold the control character {ch!r}, got {value!r}", where)
    if "/" in value or "\\" in value or value.startswith("."):
        raise _fail(f"must not hold a path separator or start with '.', got {value!r}", where)
    return value


def _mapping(value: Any, where: str) -> Mapping[str, Any]:
    if not isinstance(value, Mapping):
        raise _fail(f"must be a mapping, got {type(value).__name__}", where)
    for key in value:
        if not isinstance(key, str):
            raise _fail(f"keys must be strings, got {key!r}",
                        f"{where}.{key}" if where else str(key))
    return value


def _check_keys(d: Mapping[str, Any], cls: type, where: str = "", *,
                required: bool = True) -> None:
    """Reject keys that are not fields of ``cls``; with ``required``, demand its required
    fields (those without a default)."""
    known = {f.name for f in fields(cls)}
    for key in d:
        if key not in known:
            shown = key or '""'             # an empty key still needs a visible name
            raise _fail(f"unknown key; known: {', '.join(sorted(known))}", f"{where}{shown}")
    if required:
        for f in fields(cls):
            if f.default is MISSING and f.default_factory is MISSING and f.name not in d:
                raise _fail("missing", f"{where}{f.name}")


# ---- DeviceSpec --------------------------------------------------------------------------

@dataclass(frozen=True, kw_only=True)
class DeviceSpec:
    """One accelerator (or a CPU standing in for one).

    ``peak_tflops`` maps a dtype (:data:`PEAK_DTYPES`) to the *dense* peak in TFLOP/s (no
    structured sparsity). ``float32`` is the non-tensor-core rate; ``tf32`` the TF32
    tensor-core rate PyTorch uses for float32 matmuls only when
    ``torch.backends.cuda.matmul.allow_tf32`` is set. ``memory_gb`` is usable device memory
    in 1e9 bytes; ``memory_bandwidth_gbps`` peak DRAM/HBM bandwidth in 1e9 bytes/s.
    ``family`` picks the default achieved-efficiency constants
    (:func:`autoplan.cost.compute.default_efficiency`): ``volta``, ``ampere``, ``hopper``,
    ``cpu``, or anything else for generic GPU defaults. ``sources`` cites where each figure
    came from (keys: ``peak_tflops``, ``memory_gb``, ``memory_bandwidth_gbps``).

    Mapping fields are copied on construction; treat them as read-only.
    """

    name: str
    peak_tflops: Mapping[str, float] = field(hash=False)
    memory_gb: float
    memory_bandwidth_gbps: float
    family: str = "gpu"
    description: str = ""
    sources: Mapping[str, str] = field(default_factory=dict, hash=False)

    def __post_init__(self) -> None:
        _name(self.name, "name")
        _name(self.family, "family")
        _text(self.description, "description", empty_ok=True)
        peaks = _mapping(self.peak_tflops, "peak_tflops")
        if not peaks:
            raise _fail("must list at least one dtype", "peak_tflops")
        clean: dict[str, float] = {}
        for key, value in peaks.items():
            dtype = canonical_dtype(key)
            if dtype not in PEAK_DTYPES:
                raise _fail(f"unknown dtype; known: {', '.join(PEAK_DTYPES)}",
                            f"peak_tflops.{key}")
            clean[dtype] = _positive(value, f"peak_tflops.{key}")
        object.__setattr__(self, "peak_tflops", clean)
        object.__setattr__(self, "memory_gb", _positive(self.memory_gb, "memory_gb"))
        object.__setattr__(self, "memory_bandwidth_gbps",
                           _positive(self.memory_bandwidth_gbps, "memory_bandwidth_gbps"))
        sources = _mapping(self.sources, "sources")
        for key, value in sources.items():
            _text(value, f"sources.{key}")
        object.__setattr__(self, "sources", dict(sources))

    # ---- SI accessors --------------------------------------------------------------------
    def peak_flops(self, dtype: str) -> float:
        """Dense peak in FLOP/s for ``dtype`` ('bfloat16', 'torch.float16', 'fp32', ...)."""
        key = canonical_dtype(dtype)
        if key not in self.peak_tflops:
            raise UnknownNameError(f"dtype for device '{self.name}'", str(dtype),
                                   list(self.peak_tflops))
        return self.peak_tflops[key] * 1e12

    @property
    def memory_bytes(self) -> float:
        return self.memory_gb * 1e9

    @property
    def memory_bandwidth(self) -> float:
        """Peak memory bandwidth in bytes/s."""
        return self.memory_bandwidth_gbps * 1e9

    memory_bandwidth_bytes = memory_bandwidth      # alias: bytes/s, like memory_bytes

    @property
    def is_cpu(self) -> bool:
        return self.family == "cpu"

    # ---- dict form -----------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "family": self.family, "description": self.description,
                "peak_tflops": dict(self.peak_tflops), "memory_gb": self.memory_gb,
                "memory_bandwidth_gbps": self.memory_bandwidth_gbps,
                "sources": dict(self.sources)}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any], *, source: str = "<dict>", prefix: str = "",
                  require_sources: bool = True) -> "DeviceSpec":
        """Build from a mapping; errors name ``source`` and the field (``prefix`` + key).

        With ``require_sources`` every figure must cite its source under ``sources``.
        """
        try:
            d = _mapping(d, "")
            _check_keys(d, cls)
            spec = cls(**d)
            if require_sources:
                for key in _SOURCED_FIGURES:
                    if key not in spec.sources:
                        raise _fail("missing: say where this figure came from (a datasheet, "
                                    "a paper, or 'measured on ...')", f"sources.{key}")
            return spec
        except ConfigError as exc:
            raise _rethrow(exc, source=source, prefix=prefix) from None


# ---- LinkSpec ----------------------------------------------------------------------------

@dataclass(frozen=True, kw_only=True)
class LinkSpec:
    """A class of link between devices.

    ``bandwidth_gbps`` is the all-reduce *bus bandwidth per device* (GB/s) that nccl-tests
    reports -- busbw = algbw * 2(n-1)/n -- so an all-reduce of S bytes over n ranks takes
    2(n-1)/n * S / busbw. For an intra-node link it is what a group inside one node achieves;
    for an inter-node link it is the rate of *one NIC* (one rank per node), and ``nics`` is
    the number of such NICs per node. ``latency_us`` is the per-step latency of a collective
    algorithm over this link (a ring all-reduce over n ranks takes 2(n-1) steps; NCCL's own
    tuning model, src/graph/tuning.cc, uses a few us per step). ``source`` cites the figures.
    """

    kind: str
    bandwidth_gbps: float
    latency_us: float
    nics: int = 1
    source: str = ""

    def __post_init__(self) -> None:
        if self.kind not in LINK_KINDS:
            raise _fail(f"must be one of {', '.join(LINK_KINDS)}, got {self.kind!r}", "kind")
        object.__setattr__(self, "bandwidth_gbps",
                           _positive(self.bandwidth_gbps, "bandwidth_gbps"))
        object.__setattr__(self, "latency_us",
                           _positive(self.latency_us, "latency_us", allow_zero=True))
        _positive_int(self.nics, "nics")
        _text(self.source, "source", empty_ok=True)

    @property
    def bandwidth(self) -> float:
        """Bus bandwidth in bytes/s (per device, or per NIC for an inter-node link)."""
        return self.bandwidth_gbps * 1e9

    @property
    def latency(self) -> float:
        """Per-step latency in seconds."""
        return self.latency_us * 1e-6

    def to_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, "bandwidth_gbps": self.bandwidth_gbps,
                "latency_us": self.latency_us, "nics": self.nics, "source": self.source}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any], *, source: str = "<dict>",
                  prefix: str = "") -> "LinkSpec":
        try:
            d = _mapping(d, "")
            _check_keys(d, cls)
            return cls(**d)
        except ConfigError as exc:
            raise _rethrow(exc, source=source, prefix=prefix) from None


# ---- Cluster -----------------------------------------------------------------------------

@dataclass(frozen=True, kw_only=True)
class Cluster:
    """``nodes`` x ``devices_per_node`` devices of one kind, and the links between them.

    Both links are always present (a single-node preset still says what joins its nodes
    when widened with :meth:`with_nodes`). ``device_overrides`` records
    the overrides a preset applied to its named device (already reflected in ``device``).
    ``source`` is the file the cluster came from.
    """

    name: str
    nodes: int
    devices_per_node: int
    device: DeviceSpec
    intra_node: LinkSpec
    inter_node: LinkSpec
    description: str = ""
    device_overrides: Mapping[str, Any] = field(default_factory=dict, hash=False)
    source: str = "<dict>"

    def __post_init__(self) -> None:
        _name(self.name, "name")
        _positive_int(self.nodes, "nodes")
        _positive_int(self.devices_per_node, "devices_per_node")
        if self.nodes * self.devices_per_node > MAX_WORLD_SIZE:
            raise _fail(f"{self.nodes} nodes x {self.devices_per_node} devices is more than "
                        f"{MAX_WORLD_SIZE} devices", "nodes")
        if not isinstance(self.device, DeviceSpec):
            raise _fail("must be a DeviceSpec", "device")
        if not isinstance(self.intra_node, LinkSpec):
            raise _fail("must be a LinkSpec", "intra_node")
        if not isinstance(self.inter_node, LinkSpec):
            raise _fail("must be a LinkSpec", "inter_node")
        if self.intra_node.kind in _GPU_FABRICS and self.devices_per_node % 2:
            # NVLink / NVSwitch baseboards carry 2, 4, 8 or 16 GPUs; an odd count is a typo.
            if self.devices_per_node != 1:
                raise _fail(f"{self.intra_node.kind} boards carry an even number of devices "
                            f"(HGX: 4 or 8), got {self.devices_per_node}", "devices_per_node")
        if self.intra_node.nics != 1:
            raise _fail("applies to inter_node only (intra-node bandwidth is per device)",
                        "intra_node.nics")
        if self.intra_node.kind in _GPU_FABRICS and self.device.is_cpu:
            raise _fail(f"{self.intra_node.kind} does not connect CPUs (device "
                        f"'{self.device.name}')", "intra_node.kind")
        if self.inter_node.kind in _GPU_FABRICS:
            raise _fail(f"{self.inter_node.kind} is an intra-node fabric; inter_node needs "
                        "infiniband, roce or ethernet", "inter_node.kind")
        _text(self.description, "description", empty_ok=True)
        object.__setattr__(self, "device_overrides",
                           dict(_mapping(self.device_overrides, "device_overrides")))

    # ---- derived -------------------------------------------------------------------------
    @property
    def world_size(self) -> int:
        return self.nodes * self.devices_per_node

    @property
    def device_type(self) -> str:
        """'cpu' (gloo) or 'cuda' (nccl): what the engine's DeviceMesh uses."""
        return "cpu" if self.device.is_cpu else "cuda"

    @property
    def node_nic_bandwidth(self) -> float:
        """Bytes/s of all NICs of one node together."""
        return self.inter_node.nics * self.inter_node.bandwidth

    def with_nodes(self, nodes: int) -> "Cluster":
        """The same cluster with ``nodes`` nodes (e.g. Selene = dgx-a100 with N nodes)."""
        try:
            return replace(self, nodes=nodes)
        except ConfigError as exc:
            raise _rethrow(exc, source=self.source) from None

    def describe(self) -> str:
        """One line, e.g. '4 x 8 a100-80gb (nvswitch 230 GB/s, 8 x infiniband 24 GB/s)'."""
        inter = (f", {self.inter_node.nics} x {self.inter_node.kind} "
                 f"{self.inter_node.bandwidth_gbps:g} GB/s")
        return (f"{self.nodes} x {self.devices_per_node} {self.device.name} "
                f"({self.intra_node.kind} {self.intra_node.bandwidth_gbps:g} GB/s{inter})")

    # ---- dict form -----------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        """Self-contained form (device inline): what a plan stores."""
        return {"name": self.name, "description": self.description, "nodes": self.nodes,
                "devices_per_node": self.devices_per_node, "device": self.device.to_dict(),
                "device_overrides": dict(self.device_overrides),
                "intra_node": self.intra_node.to_dict(),
                "inter_node": self.inter_node.to_dict(),
                "source": self.source}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any], *, source: str = "<dict>",
                  profiles_dir: str | os.PathLike | None = None) -> "Cluster":
        """Build from :meth:`to_dict` output or a cluster YAML mapping.

        ``device`` is a device name (looked up in ``profiles/devices``) or an inline mapping;
        ``device_overrides`` (optional) replaces device fields, merging ``peak_tflops`` and
        ``sources`` key by key. Errors name ``source`` and the dotted field.
        """
        try:
            d = _mapping(d, "")
            _check_keys(d, cls, required=False)
            # the plain fields that are present first, then what is missing
            for key, check in (("name", _name), ("nodes", _positive_int),
                               ("devices_per_node", _positive_int)):
                if key in d:
                    check(d[key], key)
            _check_keys(d, cls)
        except ConfigError as exc:
            raise _rethrow(exc, source=source) from None
        raw_device = d["device"]
        overrides = d.get("device_overrides") or {}
        if isinstance(raw_device, str):
            try:
                device_dict = load_device(raw_device, profiles_dir=profiles_dir).to_dict()
            except UnknownNameError as exc:
                raise ConfigError(str(exc), source=source, field="device") from None
        elif isinstance(raw_device, Mapping):
            device_dict = dict(raw_device)
        else:
            raise ConfigError(f"must be a device name or a mapping, got {raw_device!r}",
                              source=source, field="device")
        if not isinstance(overrides, Mapping):
            raise ConfigError(f"must be a mapping, got {type(overrides).__name__}",
                              source=source, field="device_overrides")
        try:
            _check_keys(overrides, DeviceSpec, "device_overrides.", required=False)
            _text(d.get("source", source), "source")
        except ConfigError as exc:
            raise _rethrow(exc, source=source) from None
        for key, value in overrides.items():
            if (key in ("peak_tflops", "sources") and isinstance(value, Mapping)
                    and isinstance(device_dict.get(key, {}), Mapping)):
                device_dict[key] = {**device_dict.get(key, {}), **value}
            else:
                device_dict[key] = value
        device = DeviceSpec.from_dict(device_dict, source=source, prefix="device.")
        intra = LinkSpec.from_dict(d["intra_node"], source=source, prefix="intra_node.")
        inter = LinkSpec.from_dict(d["inter_node"], source=source, prefix="inter_node.")
        try:
            return cls(name=d["name"], nodes=d["nodes"], devices_per_node=d["devices_per_node"],
                       device=device, intra_node=intra, inter_node=inter,
                       description=d.get("description", ""), device_overrides=dict(overrides),
                       source=d.get("source", source))
        except ConfigError as exc:
            raise _rethrow(exc, source=source) from None


# ---- presets -----------------------------------------------------------------------------

def _is_file(path: Path) -> bool:
    """``path.is_file()``, False for a name the OS refuses (too long, ...) instead of OSError."""
    try:
        return path.is_file()
    except OSError:
        return False


def _names(folder: Path) -> list[str]:
    if not folder.is_dir():
        return []
    return sorted(p.stem for p in folder.glob("*.yaml"))


def list_devices(*, profiles_dir: str | os.PathLike | None = None) -> list[str]:
    return _names(profiles_root(profiles_dir) / "devices")


def list_cluster_presets(*, profiles_dir: str | os.PathLike | None = None) -> list[str]:
    return _names(profiles_root(profiles_dir) / "clusters")


def load_device(name: str, *, profiles_dir: str | os.PathLike | None = None) -> DeviceSpec:
    """The device ``profiles/devices/<name>.yaml``; UnknownNameError if there is none."""
    root = profiles_root(profiles_dir)
    path = root / "devices" / f"{name}.yaml"
    if "/" in name or "\\" in name or not _is_file(path):
        raise UnknownNameError("device", name, list_devices(profiles_dir=root))
    shown = f"devices/{name}.yaml"
    data = read_yaml(path, shown)
    if data.get("name", name) != name:
        raise ConfigError(f"must match the file name '{name}', got {data['name']!r}",
                          source=shown, field="name")
    return DeviceSpec.from_dict({"name": name, **data}, source=shown)


def _looks_like_path(name_or_path: str) -> bool:
    return (name_or_path.endswith((".yaml", ".yml")) or "/" in name_or_path
            or "\\" in name_or_path or _is_file(Path(name_or_path)))


def load_cluster(name_or_path: str | os.PathLike, *, nodes: int | None = None,
                 profiles_dir: str | os.PathLike | None = None) -> Cluster:
    """A preset from ``profiles/clusters/`` by name, or a cluster YAML file by path.

    ``nodes`` overrides the file's node count (``load_cluster("dgx-a100", nodes=64)`` is
    Selene as used for Megatron-LM SC'21).
    """
    root = profiles_root(profiles_dir)
    text = os.fspath(name_or_path)
    if _looks_like_path(text):
        path, shown = Path(text), text
        if not path.exists():
            raise ConfigError("no such file", source=shown)
    else:
        path, shown = root / "clusters" / f"{text}.yaml", f"clusters/{text}.yaml"
        if not _is_file(path):
            raise UnknownNameError("cluster preset", text, list_cluster_presets(profiles_dir=root))
    data = read_yaml(path, shown)
    data.setdefault("source", shown)
    cluster = Cluster.from_dict(data, source=shown, profiles_dir=root)
    if nodes is not None:
        if isinstance(nodes, bool) or not isinstance(nodes, int) or nodes < 1:
            raise ConfigError(f"must be a positive integer, got {nodes!r}", source=shown,
                              field="nodes")
        cluster = cluster.with_nodes(nodes)
    return cluster
