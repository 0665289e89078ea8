"""The cost model: compute (roofline per op), communication (alpha-beta per collective and
link level) and memory (ZeRO model states, activations, pipeline in-flight counts).

Each piece is a plain function or a small class over a :class:`~autoplan.cluster.Cluster`,
:class:`~autoplan.cluster.DeviceSpec` and the traced :class:`~autoplan.graph.OpGraph`; the
planners combine them into step times and per-device memory.
"""

from autoplan.cost.comm import COLLECTIVES, CommModel, Group, bus_factor
from autoplan.cost.compute import (DEFAULT_EFFICIENCY, ComputeModel, Efficiency,
                                   default_efficiency, op_kind)
from autoplan.cost.memory import (activation_bytes, in_flight_micro_batches,
                                  model_state_bytes, recompute_peak_bytes)

__all__ = [
    "COLLECTIVES", "CommModel", "Group", "bus_factor",
    "DEFAULT_EFFICIENCY", "ComputeModel", "Efficiency", "default_efficiency", "op_kind",
    "activation_bytes", "in_flight_micro_batches", "model_state_bytes",
    "recompute_peak_bytes",
]
