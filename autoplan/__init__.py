"""autoplan: an automatic parallelism planner for PyTorch training.

    import autoplan
    plan = autoplan.optimize("gpt-7.5b", "dgx-a100", nodes=16, global_batch=512)
    plan.save("plan.json")            # then: torchrun --nproc_per_node=8 ... -m engine.run plan.json

The data flow (../DESIGN.md): trace (autoplan.trace) -> OpGraph -> cost model (autoplan.cost,
with the cluster from autoplan.cluster) -> planner (autoplan.planner) -> Plan (autoplan.plan)
-> engine (the ``engine`` package, under torchrun).
"""

from __future__ import annotations

from typing import Any

__version__ = "0.1.0"

_LAZY = {
    "optimize": ("autoplan.api", "optimize"),
    "estimate": ("autoplan.api", "estimate"),
    "prepare": ("autoplan.api", "prepare"),
    "parallelize": ("autoplan.parallelize", "parallelize"),
    "trace": ("autoplan.trace", "trace"),
    "trace_module": ("autoplan.trace", "trace_module"),
    "load_cluster": ("autoplan.cluster", "load_cluster"),
    "Cluster": ("autoplan.cluster", "Cluster"),
    "Plan": ("autoplan.plan", "Plan"),
    "ParallelConfig": ("autoplan.plan", "ParallelConfig"),
    "ModelSpec": ("autoplan.models.registry", "ModelSpec"),
    "resolve_model": ("autoplan.models.registry", "resolve"),
}

__all__ = ["__version__", *_LAZY]


def __getattr__(name: str) -> Any:
    """Import submodules on first use, so `import autoplan` and the CLI start fast."""
    if name in _LAZY:
        import importlib

        module, attr = _LAZY[name]
        return getattr(importlib.import_module(module), attr)
    raise AttributeError(f"module 'autoplan' has no attribute {name!r}")
