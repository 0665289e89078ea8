"""Checkpoint manifests: what a complete checkpoint holds, so resume can verify it first.

``step_N/manifest.json`` is written last (after every rank's files, before the directory is
renamed into place), atomically::

    {"format": "autoplan.checkpoint", "version": 1, "step": N, "world_size": W,
     "plan_fingerprint": "...", "model_fingerprint": "...",
     "files": {"__0_0.distcp": {"size": 1234, "sha256": "..."}, ".metadata": {...},
               "train_state/rank00000.pt": {...}, ...}}

:func:`verify` re-hashes every listed file (SHA-256, FIPS 180-4) and compares sizes, so a
flipped bit, a truncated or deleted shard, a missing ``.metadata`` or train state is found
before ``torch.distributed.checkpoint`` reads anything. A checkpoint of another model or
another plan layout (:func:`autoplan.fingerprints.plan_fingerprint`) is a :class:`CheckpointMismatch` naming both
fingerprints: resume refuses it instead of falling back, since every older checkpoint in
that directory is of the same other run.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

from autoplan.errors import AutoplanError
from autoplan.fingerprints import plan_fingerprint  # noqa: F401 - re-exported for checkpoint
from autoplan.user_files import check_regular, read_text

MANIFEST = "manifest.json"
FORMAT = "autoplan.checkpoint"
VERSION = 1
_CHUNK = 1 << 20

class CheckpointError(AutoplanError):
    """A checkpoint fails verification; the message says which file and how."""


class CheckpointMismatch(CheckpointError):
    """A checkpoint of another model, plan or world size: never resumed, never skipped."""


def file_digest(path: Path) -> tuple[int, str]:
    """(size in bytes, SHA-256 hex) of regular file ``path`` (OSError for a pipe or a
    device, which could block or never end)."""
    h = hashlib.sha256()
    size = 0
    check_regular(path)
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
            size += len(chunk)
    return size, h.hexdigest()


def write_manifest(step_dir: Path, *, step: int, world_size: int, plan_fp: str,
                   model_fp: str) -> Path:
    """Hash every file under ``step_dir`` and write the manifest atomically (temp file,
    fsync, ``os.replace``). Call once every rank's files are written."""
    step_dir = Path(step_dir)
    files = {}
    for path in sorted(step_dir.rglob("*")):
        if path.is_file() and path.name != MANIFEST and not path.name.endswith(".tmp"):
            size, digest = file_digest(path)
            files[path.relative_to(step_dir).as_posix()] = {"size": size, "sha256": digest}
    doc = {"format": FORMAT, "version": VERSION, "step": step, "world_size": world_size,
           "plan_fingerprint": plan_fp, "model_fingerprint": model_fp, "files": files}
    doc["checksum"] = _checksum(doc)
    final = step_dir / MANIFEST
    tmp = step_dir / f".{MANIFEST}.tmp"
    with open(tmp, "w") as f:
        f.write(json.dumps(doc, indent=1, sort_keys=True) + "\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, final)
    return final


def _checksum(doc: dict[str, Any]) -> str:
    """SHA-256 of the manifest's canonical JSON without this field: damage to the manifest
    itself (a fingerprint's digit) is damage, not another run."""
    body = {k: v for k, v in doc.items() if k != "checksum"}
    return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()


def read_manifest(step_dir: Path) -> dict[str, Any]:
    """The manifest of ``step_dir``, its shape checked; CheckpointError naming what is
    wrong."""
    path = Path(step_dir) / MANIFEST
    try:
        doc = json.loads(read_text(path))
    except FileNotFoundError:
        raise CheckpointError(f"{path}: missing (not a complete checkpoint, or written by an "
                              "autoplan without manifests)") from None
    except (OSError, ValueError, RecursionError) as exc:
        raise CheckpointError(f"{path}: unreadable ({type(exc).__name__})") from None
    if not isinstance(doc, dict) or doc.get("format") != FORMAT or doc.get("version") != VERSION:
        raise CheckpointError(f"{path}: not an autoplan checkpoint manifest (version "
                              f"{VERSION})")
    if doc.get("checksum") != _checksum(doc):
        raise CheckpointError(f"{path}: its checksum does not match its content (damaged)")
    for key, kind in (("step", int), ("world_size", int), ("plan_fingerprint", str),
                      ("model_fingerprint", str), ("files", dict)):
        if not isinstance(doc.get(key), kind) or isinstance(doc.get(key), bool):
            raise CheckpointError(f"{path}: field '{key}' must be {kind.__name__}")
    for name, entry in doc["files"].items():
        if (not isinstance(entry, dict) or not isinstance(entry.get("size"), int)
                or not isinstance(entry.get("sha256"), str)
                or Path(name).is_absolute() or ".." in Path(name).parts):
            raise CheckpointError(f"{path}: field 'files.{name}' is malformed"[:300])
    return doc


def verify(step_dir: Path, *, step: int, world_size: int, plan_fp: str,
           model_fp: str) -> dict[str, Any]:
    """Check ``step_dir`` against its manifest and this run; returns the manifest.

    Raises :class:`CheckpointMismatch` for another model, plan or world size (both values
    named), :class:`CheckpointError` for damage (the file and what differs)."""
    step_dir = Path(step_dir)
    doc = read_manifest(step_dir)
    where = step_dir.name
    if doc["model_fingerprint"] != model_fp:
        raise CheckpointMismatch(
            f"checkpoint {step_dir} is of model fingerprint {doc['model_fingerprint']}, this "
            f"run's model is {model_fp}; use another --out, or start without --resume")
    if doc["plan_fingerprint"] != plan_fp:
        raise CheckpointMismatch(
            f"checkpoint {step_dir} was written by a plan of fingerprint "
            f"{doc['plan_fingerprint']}, this run's plan is {plan_fp}; use another --out, or "
            "start without --resume")
    if doc["world_size"] != world_size:
        raise CheckpointMismatch(f"checkpoint {step_dir} was written by {doc['world_size']} "
                                 f"ranks, this run has {world_size}")
    if doc["step"] != step:
        raise CheckpointError(f"{where}: manifest says step {doc['step']}")
    files = doc["files"]
    for need in [".metadata"] + [f"train_state/rank{r:05d}.pt" for r in range(world_size)]:
        if need not in files:
            raise CheckpointError(f"{where}: manifest lists no {need}")
    for name, entry in sorted(files.items()):
        path = step_dir / name
        try:
            size, digest = file_digest(path)
        except FileNotFoundError:
            raise CheckpointError(f"{where}/{name}: missing") from None
        except OSError as exc:
            raise CheckpointError(f"{where}/{name}: unreadable ({exc.strerror})") from None
        if size != entry["size"]:
            raise CheckpointError(f"{where}/{name}: {size} bytes, the manifest says "
                                  f"{entry['size']} (truncated or appended to)")
        if digest != entry["sha256"]:
            raise CheckpointError(f"{where}/{name}: SHA-256 differs from the manifest "
                                  "(the file was changed or damaged)")
    return doc


def choose(candidates: list[tuple[int, Path]], *, world_size: int, plan_fp: str,
           model_fp: str) -> tuple[tuple[int, Path] | None, list[str]]:
    """The newest of ``candidates`` (``(step, dir)``, any order) that verifies, and a note
    per newer one skipped with its reason. A mismatch (another model/plan/world size)
    raises: it is not damage, and falling back would silently mix runs."""
    notes = []
    for step, path in sorted(candidates, reverse=True):
        try:
            verify(path, step=step, world_size=world_size, plan_fp=plan_fp,
                   model_fp=model_fp)
        except CheckpointMismatch:
            raise
        except CheckpointError as exc:
            notes.append(f"skipped checkpoint {path.name}: {exc}")
            continue
        return (step, path), notes
    return None, notes
