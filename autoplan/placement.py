"""Placements of a tensor along one mesh axis: the one parser and formatter. Torch-free.

A placement says how a tensor is laid out along one axis of a device mesh (DTensor's
vocabulary, torch.distributed.tensor): replicated, sharded along a tensor dimension, or a
partial sum still to be reduced. Two spellings exist and both are parsed here:

==================  =============  =========================================================
plan (JSON)         compact        meaning
==================  =============  =========================================================
``Replicate()``     ``R``          every device of the axis holds the whole tensor
``Shard(d)``        ``S<d>``       dimension ``d`` split in contiguous blocks along the axis
``_StridedShard(d)``  ``S<d>~k``   dimension ``d`` (a flattened one, e.g. batch x heads)
                                   split along its inner factor ``k``; activations only
``Partial()``       ``P``          each device holds a summand (``Partial(avg)`` too)
==================  =============  =========================================================

The plan writes the first column (:func:`plan_text`; :func:`check_plan_text` is what a plan
accepts); the search works on the second (:func:`compact`); people read a third, shorter one
(:func:`short`: ``R``, ``S(d)``, ``S~(d)``, ``P``); the search and the engine turn a
:class:`Placement` into DTensor's objects (:func:`autoplan.placement_dtensor.to_dtensor`).
Parsing is cached per string (the search's cost tables ask about the same few placements
over and over).
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass

REPLICATE, SHARD, PARTIAL = "R", "S", "P"

# dimensions and split factors are small numbers: at most 9 digits (a 5,000-digit one would
# exceed int()'s 4,300-digit limit and raise instead of being refused with the field)
_PLAN = re.compile(r"^(Replicate|Shard|Partial|_StridedShard)\(\s*([A-Za-z]*|-?\d{1,9})"
                   r"(?:\s*,\s*(?:split_factor\s*=\s*)?(\d{1,9}))?\s*\)$")
_COMPACT = re.compile(r"^(R|P|S(\d{1,9})(?:~(\d{1,9}))?)$")
_REDUCE_OPS = ("", "sum", "avg")


class PlacementError(ValueError):
    """A placement string that is not one; the message names where it was found."""


@dataclass(frozen=True)
class Placement:
    kind: str                      # "R", "S" or "P"
    dim: int | None = None         # the sharded tensor dimension (kind "S")
    split: int | None = None       # inner factor of a strided shard
    reduce: str = "sum"            # Partial's reduction

    @property
    def is_shard(self) -> bool:
        return self.kind == SHARD

    @property
    def strided(self) -> bool:
        return self.split is not None


def parse(text: str, where: str = "placement", *, partial: bool = True,
          strided: bool = True) -> Placement:
    """Either spelling -> :class:`Placement`; ``where`` names the field in the error.
    ``partial`` / ``strided`` False refuse those kinds (a parameter is never stored as a
    partial sum or a strided shard)."""
    p = _parse(text) if isinstance(text, str) else None
    if not isinstance(p, Placement):
        raise PlacementError(f"{where}: {_shown(text)} " + (p or "is not a placement string"))
    if p.kind == PARTIAL and not partial:
        raise PlacementError(f"{where}: {_shown(text)}: a partial sum is not allowed here")
    if p.strided and not strided:
        raise PlacementError(f"{where}: {_shown(text)}: a strided shard is not allowed here")
    return p


def _shown(value) -> str:
    """``repr(value)``, cut to 60 characters (an error message stays one short line)."""
    text = repr(value)
    return text if len(text) <= 60 else f"{text[:50]}... ({len(text)} characters)"


_NOT_ONE = "is not a placement (Replicate(), Shard(d), Partial() or _StridedShard(d))"


@functools.lru_cache(maxsize=4096)
def _parse(s: str) -> Placement | str:
    """The placement ``s`` spells, or what is wrong with it (cached: strings are few)."""
    s = s.strip()
    m = _COMPACT.match(s)
    if m:
        if s == "R":
            return Placement(REPLICATE)
        if s == "P":
            return Placement(PARTIAL)
        return Placement(SHARD, int(m.group(2)), int(m.group(3)) if m.group(3) else None)
    m = _PLAN.match(s)
    if m is None:
        return _NOT_ONE
    kind, arg, factor = m.groups()
    if kind == "Replicate" and not arg and not factor:
        return Placement(REPLICATE)
    if kind == "Partial" and arg in _REDUCE_OPS and not factor:
        return Placement(PARTIAL, reduce=arg or "sum")
    if kind in ("Shard", "_StridedShard") and arg.lstrip("-").isdigit():
        if int(arg) < 0:
            return "shards a negative dimension"
        if kind == "Shard" and factor:
            return "takes one argument (Shard(d))"
        return Placement(SHARD, int(arg), int(factor) if factor else
                         (0 if kind == "_StridedShard" else None))
    return _NOT_ONE


def check_plan_text(text: str, where: str, *, strided: bool = True) -> Placement:
    """A placement as a plan writes it (the DTensor spelling, :func:`plan_text`; ``Partial``
    may name its reduction): anything else is a PlacementError naming ``where``."""
    p = parse(text, where, strided=strided)
    if text != plan_text(p) and not (p.kind == PARTIAL and text.startswith("Partial(")):
        raise PlacementError(f"{where}: {text!r} is not written as a plan writes it "
                             f"({plan_text(p)!r})")
    return p


def compact(p: Placement) -> str:
    """``R``, ``P``, ``S<d>`` or ``S<d>~k`` (the search's spelling)."""
    if p.kind == SHARD:
        return f"S{p.dim}" + (f"~{p.split}" if p.strided else "")
    return p.kind


def plan_text(p: Placement) -> str:
    """The plan's DTensor spelling: ``Replicate()``, ``Shard(d)``, ``Partial()``,
    ``_StridedShard(d)`` (the inner factor is the search's business; the plan records only
    that the rows are not a contiguous block)."""
    if p.kind == REPLICATE:
        return "Replicate()"
    if p.kind == PARTIAL:
        return "Partial()" if p.reduce == "sum" else f"Partial({p.reduce})"
    return f"_StridedShard({p.dim})" if p.strided else f"Shard({p.dim})"


def short(text: str) -> str:
    """Either spelling -> ``R``, ``S(d)``, ``S~(d)`` or ``P`` (tables shown to people)."""
    p = parse(text)
    if p.kind == SHARD:
        return f"S~({p.dim})" if p.strided else f"S({p.dim})"
    return p.kind


def shard_text(dim: int) -> str:
    """``Shard(dim)`` as the plan writes it."""
    return plan_text(Placement(SHARD, dim))


REPLICATED = plan_text(Placement(REPLICATE))      # "Replicate()"


def to_plan_text(text: str, where: str = "placement") -> str:
    """Normalise either spelling to the plan's."""
    return plan_text(parse(text, where))


def to_compact(text: str, where: str = "placement") -> str:
    """Normalise either spelling to the compact one."""
    return compact(parse(text, where))


def shard_dim(text: str) -> int | None:
    """The tensor dimension a placement (either spelling) shards, or None."""
    p = _parse(text)
    if not isinstance(p, Placement):
        p = parse(text)
    return p.dim if p.is_shard else None
