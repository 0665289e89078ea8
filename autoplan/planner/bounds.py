"""A lower bound on per-device memory, checked before the model is traced.

Whatever the plan, every trainable parameter keeps its model states somewhere: the
parameter, its gradient and the optimizer states, ``(p + g + o)`` bytes per parameter
(:data:`autoplan.cost.memory.PRECISION_BYTES`: 2 + 2 + 12 for mixed precision with Adam,
Rajbhandari et al. 2020, ZeRO, sec. 3.1). Sharding them over all ``N`` devices (ZeRO-3 over
the whole cluster, or any mix of tensor, pipeline and ZeRO sharding) at best divides them
evenly, so some device holds at least::

    states_min = (p Psi + (g + o) Psi_trainable) / N

before a single activation. If ``states_min`` (times the cluster's calibrated memory factor,
as the planners scale their predictions) exceeds a device's memory, no plan fits: the
planner says so with the numbers, in milliseconds, instead of tracing and searching first.
"""

from __future__ import annotations

import math
import time

from autoplan.cluster import Cluster
from autoplan.cost.memory import PRECISION_BYTES
from autoplan.errors import InfeasibleError
from autoplan.planner.grid.uniform import size_text

def parameter_counts(spec) -> tuple[int, int]:
    """(parameters, trainable parameters) of ``spec``'s model: the closed form of a built-in
    GPT (:meth:`autoplan.models.gpt.GPTConfig.num_params`, all trainable), else counted on
    the model built on the meta device (no weight memory; a parameter shared by two modules
    counts once)."""
    if spec.source == "builtin" and spec.name == "gpt":
        from autoplan.models.gpt_config import GPTConfig

        n = GPTConfig.from_dict(spec.config).num_params()
        return n, n
    from autoplan.models import build_model

    model = build_model(spec, device="meta")
    params = list(model.parameters())           # nn.Module.parameters() deduplicates
    total = sum(p.numel() for p in params)
    trainable = sum(p.numel() for p in params if p.requires_grad)
    return int(total), int(trainable)


def memory_factor(cluster: Cluster, precision: str) -> float:
    """The calibrated memory factor the planners multiply their predictions by (1 when the
    cluster has no calibration), as :class:`autoplan.planner.search.costs.CostModel` reads it."""
    from autoplan.cost.profiled import resolve_cost_models

    _, _, provenance = resolve_cost_models(cluster, precision, None, None)
    cal = getattr(provenance, "calibration", None)
    if cal is None or cal.is_identity:
        return 1.0
    return float(cal.factors.get("memory", 1.0))


def states_lower_bound(params: int, trainable: int, devices: int, precision: str) -> float:
    """``states_min`` of the module docstring, in bytes per device."""
    p_b, g_b, o_b = PRECISION_BYTES[precision]
    return (p_b * params + (g_b + o_b) * trainable) / devices


def check_states_fit(spec, cluster: Cluster, precision: str) -> float:
    """Raise InfeasibleError, with the numbers, when the model states alone cannot fit
    (module docstring); return the seconds the check took."""
    from autoplan.models.names import describe

    t0 = time.perf_counter()
    params, trainable = parameter_counts(spec)
    need = states_lower_bound(params, trainable, cluster.world_size, precision) \
        * memory_factor(cluster, precision)
    have = cluster.device.memory_bytes
    if need > have:
        p_b, g_b, o_b = PRECISION_BYTES[precision]
        raise InfeasibleError(
            f"model does not fit: memory per device is the binding constraint. "
            f"{describe(spec)}'s {params / 1e9:.4g}B parameters need "
            f"{size_text(states_lower_bound(params, trainable, 1, precision))} of model states "
            f"({p_b:g} + {g_b:g} + {o_b:g} bytes per parameter, {precision} precision); "
            f"sharded evenly over all {cluster.world_size} devices that is at least "
            f"{size_text(need)} per device before any activation, but each "
            f"{cluster.device.name} has {size_text(have)}; to make it fit use at least "
            f"{_devices_needed(need * cluster.world_size, have, cluster)} devices")
    return time.perf_counter() - t0


def _devices_needed(total_bytes: float, per_device: float, cluster: Cluster) -> int:
    """The fewest whole nodes' devices whose memory holds ``total_bytes``."""
    dpn = cluster.devices_per_node
    return math.ceil(total_bytes / per_device / dpn) * dpn


def _split_ways(graph, global_batch: int, devices_per_node: int) -> tuple[int, int, int, int]:
    """(samples, a node's devices, layers, context-parallel degree): the factors of
    :func:`devices_fed`."""
    from autoplan.planner.grid.uniform import context_degrees

    return (global_batch, devices_per_node, len(graph.blocks()) + 2,
            max(context_degrees(graph, 1 << 30)))


def devices_fed(graph, global_batch: int, devices_per_node: int) -> int:
    """The most ways the planners split a step: every sample of the global batch on its own
    data-parallel rank (``global_batch``), times a node's devices splitting each op (tensor
    parallelism stays inside a node), times a pipeline stage per layer (the blocks,
    ``<pre>`` and ``<post>``), times the largest context-parallel degree the sequence allows
    (:func:`autoplan.planner.grid.uniform.context_degrees`). The grid's configurations never
    exceed it; the search could in principle also shard ops across nodes, but its plans on
    larger clusters lay whole submeshes of copies (gpt-small, batch 64, 1,024 nodes: 72 of
    8,192 devices doing distinct work) and write every rank into the plan (291 MB for 16.7M
    devices), so a larger cluster is refused before searching."""
    return math.prod(_split_ways(graph, global_batch, devices_per_node))


def check_devices_fed(graph, cluster: Cluster, global_batch: int) -> None:
    """InfeasibleError when ``cluster`` has more devices than :func:`devices_fed`, naming the
    node count that holds them and the batch that would feed the cluster."""
    ways = _split_ways(graph, global_batch, cluster.devices_per_node)
    samples, per_node, layers, cp = ways
    most = math.prod(ways)
    if cluster.world_size <= most:
        return
    nodes = max(1, most // per_node)
    raise InfeasibleError(
        f"global batch {global_batch} cannot keep {cluster.world_size:,} devices busy: the "
        f"planners split a step at most {most:,} ways ({samples} samples x {per_node} "
        f"devices of a node x {layers} layers as pipeline stages"
        + (f" x {cp} context-parallel ranks" if cp > 1 else "")
        + f"); plan on --nodes {nodes:,} or fewer, or a larger --global-batch")
