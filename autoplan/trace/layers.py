"""Split the forward ops into layers: the repeated blocks, plus what runs before and after.

Blocks are found from the module tree and the op sequence, not from names:

1. Candidates are the containers (``nn.ModuleList``, ``nn.ModuleDict``, ``nn.Sequential``)
   anywhere in the model. A candidate's *units* are its children, or — second variant — its
   children with child containers replaced by their own children. The second variant
   flattens groups of blocks (Wide-ResNet's three groups, torchvision's ``layer1..4``-style
   Sequentials inside a list) into one sequence of blocks.
2. A candidate is valid when at least one unit ran and each unit that ran did so as one
   contiguous run of ops (a module called twice, or interleaved with other code, is not a
   block). One unit is enough: a model built with a single block (``layers=1``) has a
   one-element block list, and that element is still its block.
3. A unit's signature is its op sequence: aten op, output shapes and dtypes, and module path
   relative to the unit. Units with equal signatures are structurally identical copies.
4. The first candidate chosen covers the most ops with units that have at least one
   identical sibling; ties go to fewer, larger units. With no repeats anywhere, the valid
   candidate with the most units is used (so a one-unit candidate is chosen only when no
   candidate with two or more units is valid; among one-unit candidates the shallowest
   wins); with no valid candidate at all, the model is one layer.
5. Then, best score first, every other candidate whose ops lie wholly outside the blocks
   chosen so far is added if it has repeated units, or if its units are all of the classes
   of the first candidate's repeated blocks (ResNet-18's ``layer2``: a downsampling
   ``BasicBlock`` and a plain one, no two identical): an encoder-decoder's encoder and decoder stacks
   (T5, BART, ``nn.Transformer``), a CNN's stages (ResNet's ``layer1..4``, ConvNeXt's
   ``stages``), each a run of blocks a pipeline stage boundary can fall inside. A candidate
   nested in a chosen block (its attention heads' list) or spanning one (the list of stages
   around the chosen stages' blocks) overlaps it and is skipped.

Layers: ``<pre>`` (ops before the first block), one layer per block named by its FQN
(ops between two blocks go with the earlier one), ``<post>`` (ops after the last block).
``<pre>`` and ``<post>`` are always present, possibly empty. A block's ``kind`` is
``<Class>#<6 hex digits of its signature>``: equal kinds are interchangeable copies.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Sequence

import torch.nn as nn

from autoplan.trace.capture import CapturedOp

_CONTAINERS = (nn.ModuleList, nn.ModuleDict, nn.Sequential)


@dataclass(frozen=True)
class LayerSpan:
    name: str          # "<pre>", the block FQN, "<post>"
    kind: str
    start: int         # op indices [start, stop)
    stop: int


@dataclass(frozen=True)
class _Span:
    first: int
    last: int
    count: int


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def _module_spans(ops: Sequence[CapturedOp]) -> dict[str, _Span]:
    """For every module path that ran: first and last op index and number of ops inside."""
    first: dict[str, int] = {}
    last: dict[str, int] = {}
    count: dict[str, int] = {}
    for op in ops:
        path = op.module_path
        if not path:
            continue
        parts = path.split(".")
        for k in range(1, len(parts) + 1):
            prefix = ".".join(parts[:k])
            if prefix not in first:
                first[prefix] = op.index
            last[prefix] = op.index
            count[prefix] = count.get(prefix, 0) + 1
    return {p: _Span(first[p], last[p], count[p]) for p in first}


def _relative(path: str, unit: str) -> str:
    if path == unit:
        return ""
    if path.startswith(unit + "."):
        return path[len(unit) + 1:]
    return "/" + path          # outside the unit (code between blocks)


def signature(ops: Sequence[CapturedOp], unit: str) -> str:
    """sha1 over (op, output shapes and dtypes, module path relative to ``unit``)."""
    h = hashlib.sha1()
    for op in ops:
        outs = ",".join(f"{tuple(t.shape)}:{t.dtype}" for t in op.out_tensors)
        h.update(f"{op.func}|{outs}|{_relative(op.module_path, unit)};".encode())
    return h.hexdigest()


def _candidate_units(model: nn.Module) -> list[list[str]]:
    candidates: list[list[str]] = []
    for fqn, module in model.named_modules():
        if not isinstance(module, _CONTAINERS):
            continue
        direct = [_join(fqn, name) for name, _ in module.named_children()]
        flat: list[str] = []
        for name, child in module.named_children():
            path = _join(fqn, name)
            if isinstance(child, _CONTAINERS):
                flat.extend(_join(path, n) for n, _ in child.named_children())
            else:
                flat.append(path)
        candidates.append(direct)
        if flat != direct:
            candidates.append(flat)
    return candidates


def _score(units: list[str], spans: dict[str, _Span], ops: Sequence[CapturedOp]
           ) -> tuple[tuple[int, int, int], list[str]] | None:
    """(score, units that ran in execution order), or None for an invalid candidate.

    Score, compared as a tuple: ops covered by repeated units; then fewer units when
    something repeats (bigger blocks), more units when nothing does; then shallower."""
    ran = sorted((u for u in units if u in spans), key=lambda u: spans[u].first)
    if not ran:
        return None          # a single unit is fine: a one-block model's block list
    prev_last = -1
    for u in ran:
        s = spans[u]
        if s.count != s.last - s.first + 1 or s.first <= prev_last:
            return None          # not one contiguous run, or overlapping another unit
        prev_last = s.last
    sigs = [signature(ops[spans[u].first:spans[u].last + 1], u) for u in ran]
    copies = {sig: sigs.count(sig) for sig in set(sigs)}
    covered = sum(spans[u].count for u, sig in zip(ran, sigs) if copies[sig] > 1)
    size = -len(ran) if covered else len(ran)
    depth = -min(u.count(".") for u in ran)
    return (covered, size, depth), ran


def detect_layers(model: nn.Module, ops: Sequence[CapturedOp]) -> list[LayerSpan]:
    """Layers of the traced forward (see the module docstring)."""
    n = len(ops)
    spans = _module_spans(ops)
    scored = [s for s in (_score(units, spans, ops) for units in _candidate_units(model))
              if s is not None]
    if not scored:
        return [LayerSpan("<pre>", "<pre>", 0, n), LayerSpan("<post>", "<post>", n, n)]
    scored.sort(key=lambda s: s[0], reverse=True)        # stable: ties keep model order
    modules = dict(model.named_modules())
    blocks = list(scored[0][1])
    taken = [(spans[u].first, spans[u].last) for u in blocks]
    classes = {type(modules[u]) for u in blocks} if scored[0][0][0] else set()
    for (covered, _, _), units in scored[1:]:
        low, high = spans[units[0]].first, spans[units[-1]].last
        same_kind = all(type(modules[u]) in classes for u in units)
        if (covered or same_kind) and all(high < a or low > b for a, b in taken):
            blocks += units
            taken.append((low, high))
    blocks.sort(key=lambda u: spans[u].first)
    layers = [LayerSpan("<pre>", "<pre>", 0, spans[blocks[0]].first)]
    for k, unit in enumerate(blocks):
        start = spans[unit].first
        stop = spans[blocks[k + 1]].first if k + 1 < len(blocks) else spans[unit].last + 1
        sig = signature(ops[start:stop], unit)
        kind = f"{type(modules[unit]).__name__}#{sig[:6]}"
        layers.append(LayerSpan(unit, kind, start, stop))
    layers.append(LayerSpan("<post>", "<post>", spans[blocks[-1]].last + 1, n))
    return layers
