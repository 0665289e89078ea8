"""Atomic, resumable checkpoints with ``torch.distributed.checkpoint`` (DCP).

Layout under ``<out_dir>/checkpoints/``::

    step_00000010/            a complete checkpoint (DCP files + .metadata)
        train_state/rank00003.pt   per-rank: step, RNG states
    .step_00000020.tmp/       being written; never read

Saving (every rank):

1. rank 0 removes a stale temp dir and creates ``.step_N.tmp``; barrier;
2. ``dcp.save`` of ``{"model", "optim"}`` — model and optimizer state dicts from
   ``get_model_state_dict`` / ``get_optimizer_state_dict`` (sharded DTensors, FQNs of the
   unsplit model, optimizer state flattened per parameter so pipeline chunks merge), every
   rank writing its own shards;
3. each rank writes its train state (step, CPU and device RNG states: dropout masks);
4. barrier; rank 0 ``os.replace``-s the temp dir to ``step_N`` (atomic on POSIX) and prunes
   old checkpoints; barrier.

A crash at any point leaves either the previous complete checkpoints or the new one, never
a half-written ``step_N``. The data position is the step itself (:mod:`engine.data`).
Multi-node runs need ``out_dir`` on a filesystem every node sees.
"""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                     get_optimizer_state_dict,
                                                     set_model_state_dict,
                                                     set_optimizer_state_dict)

from autoplan.errors import PlanError

_STEP_DIR = re.compile(r"^step_(\d{8})$")
_OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)


def _state(chunks: list[nn.Module], optimizers: list[torch.optim.Optimizer]
           ) -> tuple[dict[str, Any], list[tuple[set[str], set[str]]]]:
    model_sd: dict[str, Any] = {}
    optim_sd: dict[str, Any] = {}
    keys = []
    for chunk, opt in zip(chunks, optimizers):
        m = get_model_state_dict(chunk, options=_OPTIONS)
        o = get_optimizer_state_dict(chunk, opt, options=_OPTIONS)
        keys.append((set(m), set(o)))
        model_sd.update(m)
        optim_sd.update(o)
    return {"model": model_sd, "optim": optim_sd}, keys


class Checkpointer:
    def __init__(self, root: Path, *, keep: int, rank: int):
        self.root, self.keep, self.rank = Path(root), keep, rank

    def complete(self) -> list[tuple[int, Path]]:
        if not self.root.is_dir():
            return []
        found = []
        for entry in self.root.iterdir():
            m = _STEP_DIR.match(entry.name)
            if m and entry.is_dir() and (entry / ".metadata").is_file():
                found.append((int(m.group(1)), entry))
        return sorted(found)

    def latest(self) -> tuple[int, Path] | None:
        found = self.complete()
        return found[-1] if found else None

    def save(self, step: int, chunks: list[nn.Module],
             optimizers: list[torch.optim.Optimizer], train_state: dict[str, Any], *,
             after_shards: Callable[[], None] | None = None) -> Path:
        """Write step ``step``'s checkpoint atomically. ``after_shards`` (testing: fault
        injection) runs on this rank between the DCP write and the train state/rename."""
        final = self.root / f"step_{step:08d}"
        tmp = self.root / f".step_{step:08d}.tmp"
        if self.rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
            (tmp / "train_state").mkdir(parents=True)
        dist.barrier()
        state, _ = _state(chunks, optimizers)
        dcp.save(state, checkpoint_id=str(tmp))
        if after_shards is not None:
            after_shards()
        torch.save(train_state, tmp / "train_state" / f"rank{self.rank:05d}.pt")
        dist.barrier()
        if self.rank == 0:
            if final.exists():
                shutil.rmtree(final)
            os.replace(tmp, final)
            _fsync_dir(self.root)
            if self.keep:
                for _, old in self.complete()[:-self.keep]:
                    shutil.rmtree(old, ignore_errors=True)
        dist.barrier()
        return final

    def load(self, path: Path, chunks: list[nn.Module],
             optimizers: list[torch.optim.Optimizer]) -> dict[str, Any]:
        """Restore model and optimizer in place; returns this rank's train state."""
        state, keys = _state(chunks, optimizers)
        dcp.load(state, checkpoint_id=str(path))
        for chunk, opt, (mkeys, okeys) in zip(chunks, optimizers, keys):
            set_model_state_dict(chunk, {k: state["model"][k] for k in mkeys},
                                 options=_OPTIONS)
            set_optimizer_state_dict(chunk, opt, {k: state["optim"][k] for k in okeys},
                                     options=_OPTIONS)
        rank_file = path / "train_state" / f"rank{self.rank:05d}.pt"
        if not rank_file.is_file():
            raise PlanError(f"checkpoint {path} has no train state for rank {self.rank} "
                            "(saved by a run with another world size?)")
        return torch.load(rank_file, weights_only=False)


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
