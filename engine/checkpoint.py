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
4. barrier; rank 0 writes ``manifest.json`` (size and SHA-256 of every file, plan and model
   fingerprints, step, world size: :mod:`engine.manifest`) last and atomically,
   ``os.replace``-s the temp dir to ``step_N`` (atomic on POSIX) and prunes old
   checkpoints; barrier.

A crash at any point leaves either the previous complete checkpoints or the new one, never
a half-written ``step_N``. The data position is the step itself (:mod:`engine.data`).
Multi-node runs need ``out_dir`` on a filesystem every node sees.

Resuming (:meth:`Checkpointer.resume_point`, collective): rank 0 verifies the checkpoints
newest first against their manifests and this run, skips damaged ones (saying which and
why) and every rank loads the one it picked; a checkpoint of another model, plan or world
size is refused with both fingerprints named. Train state is read with
``torch.load(weights_only=True)`` (tensors and numbers only). The DCP ``.metadata`` file is
unpickled by torch: checkpoint directories are trusted input (README, Security model) —
the manifest catches damage, not a forged checkpoint.
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
from engine.manifest import (CheckpointError, CheckpointMismatch, choose, plan_fingerprint,
                             write_manifest)

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
    def __init__(self, root: Path, *, keep: int, rank: int, plan=None):
        """``plan``: the run's plan, whose fingerprints and world size go into every
        manifest and are checked on resume."""
        self.root, self.keep, self.rank = Path(root), keep, rank
        self.world_size = plan.world_size if plan is not None else None
        self.model_fp = plan.model_fingerprint if plan is not None else ""
        self.plan_fp = plan_fingerprint(plan) if plan is not None else ""

    def complete(self) -> list[tuple[int, Path]]:
        """Every ``step_N`` directory (renamed into place: complete when written; verified
        only by :meth:`resume_point`)."""
        if not self.root.is_dir():
            return []
        found = []
        for entry in self.root.iterdir():
            m = _STEP_DIR.match(entry.name)
            if m and entry.is_dir():
                found.append((int(m.group(1)), entry))
        return sorted(found)

    def resume_point(self, log: Callable[[str], None]) -> tuple[int, Path] | None:
        """The newest checkpoint that verifies (collective: rank 0 decides, every rank gets
        its answer); None when there is none. Notes on skipped checkpoints go to ``log``;
        a mismatch, or checkpoints none of which verifies, raises CheckpointError."""
        answer: list[Any] = [None]
        if self.rank == 0:
            try:
                found, notes = choose(self.complete(), world_size=self._world(),
                                      plan_fp=self.plan_fp, model_fp=self.model_fp)
                if found is None and notes:
                    answer[0] = ("error", f"no checkpoint in {self.root} verifies: "
                                 + "; ".join(notes) + "; move them away or run without "
                                 "--resume")
                else:
                    answer[0] = ("ok", None if found is None else (found[0], str(found[1])),
                                 notes)
            except CheckpointMismatch as exc:
                answer[0] = ("mismatch", str(exc))
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.broadcast_object_list(answer, src=0)
        kind, *rest = answer[0]
        if kind == "mismatch":
            raise CheckpointMismatch(rest[0])
        if kind == "error":
            raise CheckpointError(rest[0])
        found, notes = rest
        for note in notes:
            log(f"--resume: {note}")
        return None if found is None else (found[0], Path(found[1]))

    def _world(self) -> int:
        if self.world_size is not None:
            return self.world_size
        return dist.get_world_size() if dist.is_initialized() else 1

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
            write_manifest(tmp, step=step, world_size=self._world(), plan_fp=self.plan_fp,
                           model_fp=self.model_fp)
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
        return torch.load(rank_file, weights_only=True)


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
