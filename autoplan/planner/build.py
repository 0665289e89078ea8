"""Turn a uniform parallel configuration into a Plan (the Alpa "manual" option).

The device mesh is ``(pp, dp, tp)`` laid out row-major over global ranks,
``rank = (p * dp + d) * tp + t``, so the tensor-parallel group is the fastest-varying axis
(consecutive ranks: inside one node), data parallelism next, pipeline stages slowest (across
nodes first). With ``virtual_stages = v`` there are ``pp * v`` stages (model chunks); chunk
``c`` runs on pipeline rank ``c % pp`` (Narayanan et al. 2021, interleaved 1F1B).

Blocks are split as evenly as possible over the chunks (earlier chunks take the remainder);
``<pre>`` goes with the first chunk and ``<post>`` with the last.
"""

from __future__ import annotations

import autoplan
from autoplan.graph import OpGraph
from autoplan.models.registry import ModelSpec
from autoplan.placement import REPLICATED, shard_text
from autoplan.plan import MeshSpec, ParallelConfig, Plan, Prediction, Stage, stage_ranks
from autoplan.precision import PRECISIONS


def split_layers(graph: OpGraph, num_chunks: int) -> list[tuple[int, int]]:
    """[start, end) layer ranges of ``num_chunks`` pipeline chunks over the graph's layers.

    Repeated blocks are divided as evenly as possible; non-block layers before the first block
    (``<pre>``) join chunk 0, those after the last block join the last chunk. Where the blocks
    do not divide evenly, the extra blocks go to the middle chunks first, then to the first,
    then to the last: the first pipeline rank holds the most micro-batches in flight (pp
    under 1F1B, :func:`autoplan.cost.memory.in_flight_micro_batches`) and the embedding,
    the last one the head and the loss. This is the Llama 3 405B layout (Llama 3 paper,
    arXiv 2407.21783, sec. 3.3.2: "we reduce one Transformer layer each from the first and
    the last stages": 126 blocks over 16 stages, 7 on each end, 8 in between).
    """
    block_idx = [layer.index for layer in graph.blocks()]
    n_layers = len(graph.layers)
    if not block_idx:
        if num_chunks != 1:
            raise ValueError("a model without repeated blocks cannot be pipelined")
        return [(0, n_layers)]
    if num_chunks > len(block_idx):
        raise ValueError(f"{num_chunks} pipeline chunks for {len(block_idx)} blocks")
    first, last = block_idx[0], block_idx[-1]
    base, extra = divmod(len(block_idx), num_chunks)
    order = list(range(1, num_chunks - 1)) + [0, num_chunks - 1][:num_chunks]
    more = set(order[:extra])
    bounds, pos = [], first
    for c in range(num_chunks):
        size = base + (1 if c in more else 0)
        bounds.append([pos, pos + size])
        pos += size
    bounds[0][0] = 0
    bounds[-1][1] = n_layers
    assert pos == last + 1
    return [(a, b) for a, b in bounds]


def param_placements(graph: OpGraph, parallel: ParallelConfig) -> dict[str, dict[str, str]]:
    """DTensor placements of every parameter on the ``tp`` and ``dp`` mesh axes.

    ``tp``: ``Shard(tp_dim)`` for parameters of column/row-parallel ops (Megatron-LM), else
    ``Replicate()``. ``dp``: ``Shard(0)`` under ZeRO-3 (parameters sharded), else
    ``Replicate()`` (ZeRO-1/2 shard only optimizer states / gradients, recorded as the stage).
    """
    out: dict[str, dict[str, str]] = {}
    for name, info in graph.params.items():
        tp = REPLICATED
        if parallel.tp > 1 and info.tp_dim is not None:
            tp = shard_text(info.tp_dim)
        dp = shard_text(0) if parallel.zero == 3 and parallel.dp > 1 else REPLICATED
        out[name] = {"tp": tp, "dp": dp}
    return out


def build_plan(graph: OpGraph, spec: ModelSpec, cluster, parallel: ParallelConfig, *,
               global_batch: int, seq_len: int | None, precision: dict[str, str] | None = None,
               prediction: Prediction | None = None, alternatives: list[dict] | None = None,
               planner: dict | None = None) -> Plan:
    """A Plan running ``parallel`` on ``cluster`` (a Cluster or its dict)."""
    cluster_dict = cluster if isinstance(cluster, dict) else cluster.to_dict()
    chunks = split_layers(graph, parallel.pp * parallel.virtual_stages)
    names = [layer.name for layer in graph.layers]
    stages = []
    # context parallelism adds a mesh axis between dp and tp (sequence chunks of one sample)
    stage_shape, stage_axes = (parallel.dp, parallel.tp), ("dp", "tp")
    if parallel.cp > 1:
        stage_shape, stage_axes = (parallel.dp, parallel.cp, parallel.tp), ("dp", "cp", "tp")
    for c, (start, end) in enumerate(chunks):
        layer_names = tuple(names[start:end])
        ckpt = tuple(n for n in layer_names if parallel.checkpoint != "none"
                     and not n.startswith("<"))
        stages.append(Stage(index=c, layers=(start, end), layer_names=layer_names,
                            ranks=stage_ranks(parallel, c % parallel.pp),
                            mesh_shape=stage_shape, axis_names=stage_axes,
                            checkpoint_layers=ckpt))
    device_type = "cpu" if _device_name(cluster_dict).startswith("cpu") else "cuda"
    plan = Plan(
        model=spec.to_dict(),
        model_fingerprint=spec.fingerprint(),
        num_params=graph.num_params,
        cluster=cluster_dict,
        global_batch=global_batch,
        seq_len=seq_len,
        mesh=MeshSpec(shape=(parallel.pp, *stage_shape), axis_names=("pp", *stage_axes),
                      device_type=device_type),
        parallel=parallel,
        stages=stages,
        param_placements=param_placements(graph, parallel),
        precision=precision or default_precision(device_type),
        prediction=prediction,
        alternatives=alternatives or [],
        planner=planner or {"name": "manual"},
        created_by={"autoplan": autoplan.__version__, "torch": _torch_version()},
    )
    plan.validate()
    return plan


def default_precision(device_type: str) -> dict[str, str]:
    """bf16 compute with fp32 master weights on GPUs; plain fp32 on CPU."""
    return PRECISIONS["mixed" if device_type == "cuda" else "fp32"].plan_dict()


def _device_name(cluster_dict: dict) -> str:
    device = cluster_dict.get("device", {})
    if isinstance(device, dict):
        return str(device.get("name", "")).lower()
    return str(device).lower()


def _torch_version() -> str:
    """torch's release (without the local ``+cpu`` / ``+cu128`` tag); imported on use."""
    import torch

    return torch.__version__.split("+")[0]
