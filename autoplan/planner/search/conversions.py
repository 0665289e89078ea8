"""Placement conversions of the search: which collective turns one placement of a tensor
into another on a logical mesh, and where gradients come back (Alpa, Zheng et al. 2022,
sec. 4.2: resharding costs between an op's output and its consumer's input)."""

from __future__ import annotations

import functools
from dataclasses import dataclass

from autoplan.planner.search.strategies import AXES, Spec, Strategy

__all__ = ["Conversion", "conversions", "grad_spec", "required_grad", "splits"]


@dataclass(frozen=True)
class Conversion:
    collective: str            # all_gather | all_reduce | reduce_scatter | all_to_all
    axis: int
    divisor: int               # the collective moves full_bytes / divisor


@functools.lru_cache(maxsize=65536)
def conversions(src: Spec, dst: Spec, sizes: tuple[int, ...]) -> tuple[Conversion, ...]:
    """Collectives that turn placement ``src`` into ``dst`` on a mesh of ``sizes``."""
    out = []
    for a in range(AXES):
        p, q = src[a], dst[a]
        if p == q or sizes[a] == 1 or q == "P" and p == "R":
            continue
        if p == "R" and q.startswith("S"):
            continue                            # a local slice
        if p == "P":
            coll = "all_reduce" if q == "R" else "reduce_scatter"
        elif q == "R" or q == "P":
            coll = "all_gather"
        else:
            coll = "all_to_all"
        div = 1
        for b in range(AXES):
            if b != a and (src[b].startswith("S") or dst[b].startswith("S")):
                div *= sizes[b]
        out.append(Conversion(coll, a, div))
    return tuple(out)


def splits(strategy: Strategy, activation_inputs: tuple[bool, ...]) -> tuple[bool, ...]:
    """Per axis: does the op's work divide along it (module docstring)?"""
    out = []
    for a in range(AXES):
        s = any(o is not None and o[a] != "R" for o in strategy.outputs)
        s = s or any(act and spec[a].startswith("S")
                     for spec, act in zip(strategy.inputs, activation_inputs))
        out.append(s)
    return tuple(out)


@functools.lru_cache(maxsize=65536)
def grad_spec(spec: Spec, split: tuple[bool, ...]) -> Spec:
    """Placement of the gradient a consumer hands back for an input placed ``spec`` (a pure
    function, cached: the search asks it for every pair of candidates of every edge)."""
    return tuple("R" if p == "P" else ("P" if p == "R" and split[a] else p)
                 for a, p in enumerate(spec))


@functools.lru_cache(maxsize=65536)
def required_grad(spec: Spec) -> Spec:
    """Placement a producer needs its output's gradient in (cached as :func:`grad_spec`)."""
    return tuple("R" if p == "P" else p for p in spec)
