"""Trace a model on the meta device into an :class:`autoplan.graph.OpGraph`.

    from autoplan.trace import trace, trace_module
    graph = trace(resolve("gpt-1.7b"), batch_size=1, seq_len=2048, dtype=torch.float16)

See :mod:`autoplan.trace.tracer` for the steps and one module per concern: ``capture``
(dispatch-level recording of forward and backward), ``cuda_semantics`` (dropout and SDPA as
on a GPU), ``flops``, ``dataflow``, ``layers`` (repeated-block detection), ``roles``
(tensor-parallel roles), ``saved`` (activation memory), ``stats`` (per-layer aggregates),
``replicate`` (a deep built-in GPT's graph from a 3-block trace: what ``prepare`` uses).
"""

import sys
import types

from autoplan.trace.tracer import module_fingerprint, trace, trace_module

__all__ = ["module_fingerprint", "trace", "trace_module"]


class _CallablePackage(types.ModuleType):
    """``autoplan.trace(...)`` is :func:`trace` whether ``autoplan.trace`` names this package
    (once anything imported it, Python binds the attribute to the package) or not."""

    def __call__(self, *args, **kwargs):
        return trace(*args, **kwargs)


sys.modules[__name__].__class__ = _CallablePackage
