"""autoplan: an automatic parallelism planner for PyTorch training.

    import autoplan
    plan = autoplan.optimize("gpt-7.5b", "dgx-a100", nodes=16, global_batch=512)
    plan.save("plan.json")            # then: torchrun --nproc_per_node=8 ... -m engine.run plan.json

    graph = autoplan.trace(autoplan.resolve_model("gpt-1.7b"), batch_size=1)

``autoplan.trace`` is the tracing subpackage whichever way it was reached (``import
autoplan.trace`` binds the attribute to the package); calling it calls
:func:`autoplan.trace.trace`.

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
    "trace": ("autoplan.trace", None),   # the package, callable as autoplan.trace.trace
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
        mod = importlib.import_module(module)
        return mod if attr is None else getattr(mod, attr)
    raise AttributeError(f"module 'autoplan' has no attribute {name!r}")
