"""Measured profiles into the cost model: which files, how they are scaled, what was used.

    compute, comm, prov = cost_models_for(cluster, "fp32")
    est = Estimator(graph, cluster, precision="fp32", compute=compute, comm=comm,
                    provenance=prov)
    prov.summary()            # 'op profile cpu-amd-epyc.json (...), link profile ...'

The :class:`~autoplan.planner.grid.estimate.Estimator` calls this by default, so every plan for a
cluster with measured profiles uses them. What is looked up (``root`` = ``profiles/`` or
``$AUTOPLAN_PROFILES``):

* **op times** — the device's op profile: ``ops/index.yaml`` maps a device name to its file
  (the CPU profile is named after the CPU model, not after the device), else
  ``ops/<device>.json``. Each op is looked up at the shapes it runs with: its TP shard
  (:mod:`autoplan.profile.lookup`) at the configuration's micro-batch
  (:mod:`autoplan.cost.batch_scale`): an exact signature, else log-log interpolation among
  measured entries of the same op, else the roofline of :mod:`autoplan.cost.compute`.
  ``CostProvenance.op_counts`` tallies which (:meth:`ProfiledOpTimes.coverage` for one graph).
* **collective times** — ``links/<cluster>.json`` if its fits are *measured* (source kind
  ``measured``): the piecewise alpha-beta fit of that collective, level and group size
  (:meth:`autoplan.profile.store.LinkProfile.predict`). A group size or level the profile did
  not measure falls back to the cluster file's alpha-beta model (:mod:`autoplan.cost.comm`),
  and is counted. The reference profiles ``links/dgx-a100.json`` and ``dgx-h100.json`` are
  *published* figures — the same nccl-tests bus bandwidths the cluster files already carry,
  with estimated latencies — so they do not replace the cluster model: GPU clusters are
  predicted exactly as before (``benchmarks/megatron_sc21.py``).
* **calibration** — ``calibration/<cluster>.json`` (:mod:`autoplan.cost.calibration`), applied
  by the Estimator to each prediction.

CPU oversubscription (``cores`` of the device's ``ops/index.yaml`` entry). The op profile is
one thread on an otherwise idle core. ``N = devices_per_node`` ranks on ``C`` cores each get

    share = min(1, C / N)            of a core when they all compute (the usual case),

so a measured op time is divided by ``share`` (4 ranks on 2 cores: x2). Roofline fallbacks are
not: a CPU cluster file already gives each rank its share of the machine (``local-cpu``:
cpu-local / 4). Collectives compete for the same cores: a gloo collective is memory copies and
reductions done by the ranks' own threads, and the link profile measured group size ``n`` in a
``W``-process launch (``world_size`` of its source, on the same ``C`` cores), where each rank
had ``min(1, C / W)`` of a core. In a run it has ``share``, so

    t_run = t_profile · min(1, C / W) / share      (2 of 4 ranks on 2 cores: x2; all 4: x1).

When ``share < 1`` the step is composed for shared cores (:mod:`autoplan.cost.shared_cores`:
the total work of all ranks over the cores, since a rank idle in a bubble or blocked in a
collective leaves its core to the others): ``CostProvenance.composer`` holds that property of
the composition (:class:`~autoplan.cost.step.StepModel`). Processes outside the run (other users of the
machine) are not in the model unless ``cores`` says how many cores they left
(:mod:`autoplan.hostload`); calibration factors fitted on runs made under such load absorb the
rest, and record the load.

``CostProvenance.calibration`` is applied to each prediction, last.
"""

from __future__ import annotations

import logging
import os
from collections import Counter
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from autoplan.cluster import Cluster
from autoplan.yaml_files import profiles_root, read_yaml
from autoplan.cost.batch_scale import batch_tensors, scaled_node
from autoplan.cost.calibration import Calibration, load_calibration
from autoplan.cost.comm import CommModel, Group
from autoplan.cost.compute import ComputeModel
from autoplan.cost.shared_cores import SharedCores
from autoplan.errors import ConfigError
from autoplan.graph import OpGraph, OpNode
from autoplan.profile.lookup import Lookup, OpTimeTable
from autoplan.profile.store import LinkProfile
from autoplan.precision import precision as precision_named

log = logging.getLogger(__name__)

INDEX = Path("ops") / "index.yaml"
_INDEX_KEYS = {"op_profile", "cores", "tp_matmul_overhead_s", "dp_module_overhead_s", "source"}


# ---- which files ---------------------------------------------------------------------------

@dataclass(frozen=True)
class DeviceProfile:
    """A device's op profile file and, for CPUs, the cores its node's ranks share."""

    op_profile: Path | None
    cores: int | None = None
    tp_matmul_overhead_s: float = 0.0      # autoplan.cost.framework_overhead
    dp_module_overhead_s: float = 0.0
    source: str = ""


def device_profile(device_name: str, root: str | os.PathLike) -> DeviceProfile:
    """The ``ops/index.yaml`` entry of ``device_name``, else ``ops/<device_name>.json`` if
    it exists, else no profile. Errors name the index file and field."""
    root = Path(root)
    index = root / INDEX
    if index.exists():
        data = read_yaml(index, str(index))
        entry = data.get(device_name)
        if entry is not None:
            if not isinstance(entry, dict):
                raise ConfigError("must be a mapping with op_profile, cores, source",
                                  source=str(index), field=device_name)
            unknown = set(entry) - _INDEX_KEYS
            if unknown:
                raise ConfigError(f"unknown key; known: {', '.join(sorted(_INDEX_KEYS))}",
                                  source=str(index),
                                  field=f"{device_name}.{sorted(unknown)[0]}")
            name = entry.get("op_profile")
            if not isinstance(name, str) or not name:
                raise ConfigError("must name a file in profiles/ops/", source=str(index),
                                  field=f"{device_name}.op_profile")
            path = root / "ops" / name
            if not path.exists():
                raise ConfigError(f"names {path}, which does not exist", source=str(index),
                                  field=f"{device_name}.op_profile")
            cores = entry.get("cores")
            if cores is not None and (isinstance(cores, bool) or not isinstance(cores, int)
                                      or cores < 1):
                raise ConfigError(f"must be a positive integer, got {cores!r}",
                                  source=str(index), field=f"{device_name}.cores")
            overheads = []
            for key in ("tp_matmul_overhead_s", "dp_module_overhead_s"):
                value = entry.get(key, 0.0)
                if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
                    raise ConfigError(f"must be a number of seconds >= 0, got {value!r}",
                                      source=str(index), field=f"{device_name}.{key}")
                overheads.append(float(value))
            return DeviceProfile(path, cores, *overheads, source=str(entry.get("source", "")))
    direct = root / "ops" / f"{device_name}.json"
    return DeviceProfile(direct if direct.exists() else None)


def core_share(cores: float | None, ranks_per_node: int) -> float:
    """Fraction of a core each of ``ranks_per_node`` ranks gets: min(1, C / N) (module
    docstring); 1 when the core count is unknown (accelerators)."""
    if cores is None:
        return 1.0
    return min(1.0, cores / ranks_per_node)


# ---- op times ------------------------------------------------------------------------------

class ProfiledOpTimes:
    """The ``measured_at`` hook of :class:`~autoplan.cost.compute.ComputeModel`: an op
    profile looked up at the op's TP shard and micro-batch, divided by the core share."""

    def __init__(self, table: OpTimeTable, *, share: float = 1.0):
        if not 0 < share <= 1:
            raise ValueError(f"share must be in (0, 1], got {share!r}")
        self.table = table
        self.share = share
        self.counts: Counter[str] = Counter()
        self._flags: dict[tuple[str, int], dict] = {}

    def _batch_flags(self, graph: OpGraph) -> dict:
        key = (graph.fingerprint, graph.batch.batch_size)
        if key not in self._flags:
            self._flags[key] = batch_tensors(graph)
        return self._flags[key]

    def explain(self, node: OpNode, graph: OpGraph, tp: int, batch_scale: float) -> Lookup:
        """The :class:`~autoplan.profile.lookup.Lookup` of ``node`` at that TP degree and
        batch scale (source "roofline" when the shapes cannot be scaled)."""
        scaled = scaled_node(node, self._batch_flags(graph)[node.name], batch_scale)
        if scaled is None:
            return Lookup(None, None, "roofline", node.name)
        return self.table.explain(scaled, tp)

    def __call__(self, node: OpNode, graph: OpGraph, tp: int, batch_scale: float
                 ) -> tuple[float, float] | None:
        found = self.explain(node, graph, tp, batch_scale)
        self.counts[found.source] += 1
        if found.fwd_s is None or found.bwd_s is None:
            return None
        return found.fwd_s / self.share, found.bwd_s / self.share

    def coverage(self, graph: OpGraph, tp: int = 1, batch_scale: float = 1.0) -> Counter:
        """How the ops of ``graph`` (views and collectives aside) would be timed: counts of
        'exact', 'interpolated' and 'roofline' (sharded ops split ``tp`` ways)."""
        from autoplan.cost.compute import op_kind

        out: Counter[str] = Counter()
        for node in graph.nodes.values():
            if op_kind(node) in ("view", "comm"):
                continue
            t = tp if node.tp_role != "replicated" else 1
            out[self.explain(node, graph, t, batch_scale).source] += 1
        return out


# ---- collective times ----------------------------------------------------------------------

class ProfiledLinkTimes:
    """The ``measured`` hook of :class:`~autoplan.cost.comm.CommModel`: a measured link
    profile's piecewise fit per group size, scaled for the cores (module docstring)."""

    def __init__(self, profile: LinkProfile, *, cores: float | None, ranks_per_node: int,
                 run_cores: float | None = None):
        """``cores``: the machine's cores (as the profile was measured on); ``run_cores``:
        the cores the run has (default: the same)."""
        self.profile = profile
        self.counts: Counter[str] = Counter()
        self._share_run = core_share(cores if run_cores is None else run_cores,
                                     ranks_per_node)
        self._cores = cores
        self._have = {(f.collective, f.level, f.group_size) for f in profile.fits
                      if f.group_size is not None}
        self._world: dict[tuple[str, str, int], int] = {}
        for p in profile.points:
            world = profile.sources.get(p.source, {}).get("world_size", p.group_size)
            key = (p.collective, p.level, p.group_size)
            self._world[key] = max(self._world.get(key, 0), int(world))

    def slowdown(self, collective: str, level: str, group_size: int) -> float:
        """t_run / t_profile for that group (module docstring)."""
        world = self._world.get((collective, level, group_size), group_size)
        return core_share(self._cores, world) / self._share_run

    def __call__(self, collective: str, nbytes: float, group: Group, level: str
                 ) -> float | None:
        if (collective, level, group.size) not in self._have \
                or level not in self.profile.levels_present:
            self.counts["cluster file"] += 1
            return None
        self.counts["measured"] += 1
        t = self.profile.predict(collective, level, nbytes, group.size)
        return t * self.slowdown(collective, level, group.size)


def measured_link_profile(path: Path) -> tuple[LinkProfile | None, str]:
    """The profile at ``path`` if its fits are measured, else None; and why."""
    if not path.exists():
        return None, f"no link profile {path.name}"
    prof = LinkProfile.load(path)
    kinds = {prof.sources.get(f.source, {}).get("kind") for f in prof.fits}
    if kinds != {"measured"}:
        return None, (f"link profile {path.name} holds {', '.join(sorted(map(str, kinds)))} "
                      "figures, not measurements: the cluster file's model is used")
    return prof, f"link profile {path.name} (measured, {prof.backend})"


# ---- all together --------------------------------------------------------------------------

@dataclass
class CostProvenance:
    """What a cost model was built from; the counters fill in as it is used."""

    cluster: str
    op_profile: str | None = None
    link_profile: str | None = None
    calibration: Calibration = field(default_factory=lambda: Calibration(cluster="?"))
    share: float = 1.0                 # core share per rank (CPU oversubscription)
    notes: list[str] = field(default_factory=list)
    op_times: ProfiledOpTimes | None = None
    link_times: ProfiledLinkTimes | None = None
    composer: SharedCores | None = None     # the step's shared-core property (share < 1)

    @property
    def op_counts(self) -> dict[str, int]:
        return dict(self.op_times.counts) if self.op_times else {}

    @property
    def link_counts(self) -> dict[str, int]:
        return dict(self.link_times.counts) if self.link_times else {}

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready: for a plan's ``planner`` metadata or a benchmark's results."""
        return {"cluster": self.cluster, "op_profile": self.op_profile,
                "link_profile": self.link_profile,
                "calibration": {"file": self.calibration.source,
                                "factors": dict(self.calibration.factors)},
                "core_share": self.share, "op_lookups": self.op_counts,
                "collective_lookups": self.link_counts, "notes": list(self.notes)}

    def summary(self) -> str:
        cal = (f"calibration {Path(self.calibration.source).name} "
               + ", ".join(f"{k} x{v:.3g}" for k, v in self.calibration.factors.items())
               if self.calibration.source else "no calibration")
        ops = f"op profile {self.op_profile}" if self.op_profile else "roofline op times"
        if self.op_counts:
            ops += " (" + ", ".join(f"{k} {v}" for k, v in sorted(self.op_counts.items())) + ")"
        links = f"link profile {self.link_profile}" if self.link_profile else \
            "cluster-file links"
        if self.link_counts:
            links += " (" + ", ".join(f"{k} {v}" for k, v in
                                      sorted(self.link_counts.items())) + ")"
        share = f"; core share {self.share:.2g}" if self.share < 1 else ""
        return f"{self.cluster}: {ops}; {links}; {cal}{share}"


def resolve_cost_models(cluster: Cluster, precision: str = "mixed",
                        compute: ComputeModel | None = None, comm: CommModel | None = None,
                        *, fused: bool = True, float8_recipe: str = "torchao",
                        attention_kernel: str = "flash2"
                        ) -> tuple[ComputeModel, CommModel, CostProvenance | None]:
    """The compute and communication models a cost estimator runs on, and their provenance:
    with neither ``compute`` nor ``comm`` given, the cluster's measured profiles and
    calibration where it has them (:func:`cost_models_for`); otherwise the ones given, the
    roofline / alpha-beta model standing in for one left out, and no provenance.
    ``fused=False``: the runtime runs the element-wise ops as traced (eager PyTorch: the
    roofline's fusion factor phi is 1, :mod:`autoplan.cost.compute`); measured op times
    already are what ran. ``float8_recipe``: whose float8 casts a ``mixed-fp8`` step pays
    (:mod:`autoplan.cost.float8`); ``attention_kernel``: which fused attention runs
    (:mod:`autoplan.cost.kernel_shape`)."""
    provenance = None
    if compute is None and comm is None:
        compute, comm, provenance = cost_models_for(cluster, precision)
    prec = precision_named(precision, "precision")
    compute = compute or ComputeModel(cluster.device, dtype=prec.compute,
                                      matmul_dtype=prec.matmul, float8_recipe=float8_recipe,
                                      attention_kernel=attention_kernel)
    unfused = not fused and compute.measured is None and compute.measured_at is None
    if unfused or compute.float8_recipe != float8_recipe \
            or compute.attention_kernel != attention_kernel:
        compute = ComputeModel(compute.device, dtype=compute.dtype,
                               efficiency=replace(compute.efficiency, fusion=1.0)
                               if unfused else compute.efficiency,
                               measured=compute.measured, measured_at=compute.measured_at,
                               matmul_dtype=compute.matmul_dtype, float8_recipe=float8_recipe,
                               attention_kernel=attention_kernel)
    return compute, comm or CommModel(cluster), provenance


def cost_models_for(cluster: Cluster, precision: str = "mixed",
                    profiles_dir: str | os.PathLike | None = None, *,
                    use_profiles: bool = True, calibrate: bool = True,
                    cores: float | None = None
                    ) -> tuple[ComputeModel, CommModel, CostProvenance]:
    """The compute and communication models for ``cluster`` from its measured profiles
    (module docstring), and where each figure comes from. ``use_profiles=False`` gives the
    plain roofline / cluster-file models; ``calibrate=False`` leaves the calibration out
    (identity); ``cores`` overrides the index's core count (e.g. the cores a shared machine
    left to a run, :mod:`autoplan.hostload`)."""
    prec = precision_named(precision, "precision")
    dtype = prec.compute
    root = profiles_root(profiles_dir)
    prov = CostProvenance(cluster=cluster.name)
    measured_at = measured = None
    if use_profiles:
        dev = device_profile(cluster.device.name, root)
        n_cores = cores if cores is not None else dev.cores
        share = core_share(n_cores, cluster.devices_per_node)
        if share < 1:
            nominal = core_share(dev.cores, cluster.devices_per_node)
            prov.composer = SharedCores(share, optimizer_scale=nominal / share,
                                               tp_matmul_overhead_s=dev.tp_matmul_overhead_s,
                                               dp_module_overhead_s=dev.dp_module_overhead_s)
            prov.share = share
        if dev.op_profile is not None:
            table = OpTimeTable.load(dev.op_profile, dtype=dtype)
            measured_at = prov.op_times = ProfiledOpTimes(table, share=share)
            prov.op_profile = dev.op_profile.name
            prov.share = share
        else:
            prov.notes.append(f"no op profile for device {cluster.device.name!r}")
        links, why = measured_link_profile(root / "links" / f"{cluster.name}.json")
        prov.notes.append(why)
        if links is not None:
            backend = "gloo" if cluster.device.is_cpu else "nccl"
            if links.backend != backend:
                prov.notes.append(f"link profile measured {links.backend}, the cluster runs "
                                  f"{backend}: not used")
            else:
                measured = prov.link_times = ProfiledLinkTimes(
                    links, cores=dev.cores, run_cores=n_cores,
                    ranks_per_node=cluster.devices_per_node)
                prov.link_profile = f"{cluster.name}.json"
    prov.calibration = (load_calibration(cluster.name, root) if calibrate
                        else Calibration(cluster=cluster.name))
    compute = ComputeModel(cluster.device, dtype=dtype, measured_at=measured_at,
                           matmul_dtype=prec.matmul)
    comm = CommModel(cluster, measured=measured)
    log.info("cost model for %s", prov.summary())
    return compute, comm, prov
