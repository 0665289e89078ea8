"""Profile files as files: provenance records, validated reading, locked atomic writes.

The formats themselves are in :mod:`autoplan.profile.store`; this module is what they share.

Concurrency: every writer goes through :func:`locked_update` — an exclusive ``fcntl.flock``
on a sidecar ``.<name>.lock`` file, read the current file, merge, validate, then write via a
temp file and ``os.replace`` (:func:`autoplan.plan.atomic_write_text`). Two processes adding
entries to one file therefore both land, and a reader never sees half a file. A writer killed
mid-write leaves the previous file whole; the kernel drops its lock, and the next writer
deletes the temp file it left.

Errors: :class:`ProfileError` (a :class:`~autoplan.errors.ConfigError`) names the file and
the dotted field, e.g. ``profiles/ops/x.json: field 'entries[...].fwd_s': must be a
non-negative finite number, got 'fast'``.
"""

from __future__ import annotations

import fcntl
import glob
import hashlib
import json
import math
import os
import platform
import socket
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator

from autoplan.errors import ConfigError
from autoplan.graph import TensorMeta
from autoplan.plan_fields import DuplicateKey, atomic_write_text, no_duplicates
from autoplan.user_files import read_bytes

PROFILE_VERSION = 1
PROVENANCE_KINDS = ("measured", "published")


class ProfileError(ConfigError):
    """A profile file is missing, not JSON, or has a bad field (named in the message)."""


# ---- provenance ----------------------------------------------------------------------------

def measured_provenance(**extra: Any) -> dict[str, Any]:
    """Where a measurement was taken: host, versions, date, the machine's load average."""
    import torch

    prov: dict[str, Any] = {
        "kind": "measured",
        "host": socket.gethostname(),
        "platform": platform.platform(),
        "processor": cpu_name(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "load_avg": [round(x, 2) for x in os.getloadavg()],
    }
    prov.update(extra)
    return prov


def source_id(prov: dict[str, Any]) -> str:
    """A stable short id for a provenance record: kind + 10 hex digits of its sha256."""
    blob = json.dumps(prov, sort_keys=True, default=str).encode()
    return f"{prov.get('kind', 'source')}-{hashlib.sha256(blob).hexdigest()[:10]}"


def cpu_name() -> str:
    """The CPU's model name from /proc/cpuinfo (Linux), else platform.processor()."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def device_slug(device: str) -> str:
    """File-name form of a device: ``cpu-amd-epyc``, ``cuda-nvidia-h100-80gb-hbm3``."""
    import torch

    dev = torch.device(device)
    name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else cpu_name()
    words = "".join(c.lower() if c.isalnum() else " " for c in name).split()
    return "-".join([dev.type, *words])


# ---- validation helpers --------------------------------------------------------------------

class Checker:
    """Reads typed fields out of parsed JSON, raising ProfileError(file, field) on mismatch."""

    def __init__(self, source: str):
        self.source = source

    def fail(self, where: str, message: str) -> ProfileError:
        return ProfileError(message, source=self.source, field=where)

    def obj(self, value: Any, where: str) -> dict:
        if not isinstance(value, dict):
            raise self.fail(where, f"must be an object, got {type(value).__name__}")
        return value

    def lst(self, value: Any, where: str) -> list:
        if not isinstance(value, list):
            raise self.fail(where, f"must be a list, got {type(value).__name__}")
        return value

    def key(self, d: dict, name: str, where: str) -> Any:
        if name not in d:
            raise self.fail(f"{where}.{name}" if where else name, "missing")
        return d[name]

    def string(self, d: dict, name: str, where: str, choices: tuple[str, ...] = ()) -> str:
        value = self.key(d, name, where)
        if not isinstance(value, str) or not value:
            raise self.fail(_join(where, name), f"must be a non-empty string, got {value!r}")
        if choices and value not in choices:
            raise self.fail(_join(where, name), f"must be one of {list(choices)}, got {value!r}")
        return value

    def number(self, d: dict, name: str, where: str, *, optional: bool = False,
               positive: bool = False) -> float | None:
        value = d.get(name) if optional else self.key(d, name, where)
        if value is None and optional:
            return None
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        try:
            ok = ok and math.isfinite(value)
        except OverflowError:                   # an integer too large for a float
            ok = False
        if not ok or value < 0 or (positive and value == 0):
            what = "a positive" if positive else "a non-negative"
            raise self.fail(_join(where, name), f"must be {what} finite number, got {value!r}")
        return float(value)

    def integer(self, d: dict, name: str, where: str, *, optional: bool = False,
                minimum: int = 0) -> int | None:
        value = d.get(name) if optional else self.key(d, name, where)
        if value is None and optional:
            return None
        if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
            raise self.fail(_join(where, name), f"must be an integer >= {minimum}, got {value!r}")
        return value

    def unknown(self, d: dict, known: set[str], where: str) -> None:
        extra = sorted(set(d) - known)
        if extra:
            raise self.fail(_join(where, extra[0] or '""'), "unknown key")  # "" shown as ""

    def header(self, d: Any, fmt: str) -> dict:
        d = self.obj(d, "<top level>")
        if d.get("format") != fmt:
            raise self.fail("format", f"expected {fmt!r}, got {d.get('format')!r}")
        if d.get("version") != PROFILE_VERSION:
            raise self.fail("version", f"this autoplan reads version {PROFILE_VERSION}, "
                                       f"the file has {d.get('version')!r}")
        from autoplan.trust import find_control_chars

        found = find_control_chars(d)                  # names: no control characters
        if found is not None:
            raise self.fail(found[0], f"holds the control character {found[1]!r}")
        return d

    def sources(self, d: dict) -> dict[str, dict]:
        out = self.obj(d.get("sources", {}), "sources")
        for sid, prov in out.items():
            self.obj(prov, f"sources.{sid}")
            self.string(prov, "kind", f"sources.{sid}", PROVENANCE_KINDS)
        return out

    def source_ref(self, d: dict, where: str, sources: dict) -> str:
        sid = self.string(d, "source", where)
        if sid not in sources:
            raise self.fail(_join(where, "source"), f"{sid!r} is not in 'sources'")
        return sid

    def tensor(self, value: Any, where: str) -> TensorMeta:
        d = self.obj(value, where)
        shape = self.lst(self.key(d, "shape", where), f"{where}.shape")
        if not all(isinstance(s, int) and not isinstance(s, bool) and s >= 0 for s in shape):
            raise self.fail(f"{where}.shape", f"must be a list of non-negative integers, "
                                              f"got {shape!r}")
        return TensorMeta(tuple(shape), self.string(d, "dtype", where))


def _join(where: str, name: str) -> str:
    return f"{where}.{name}" if where else name


# ---- files ---------------------------------------------------------------------------------

def read_json(path: str | os.PathLike) -> Any:
    """Parse a profile file; anything unreadable becomes a ProfileError naming the file.

    Duplicate keys are errors (``json`` would keep the last one silently), like unknown ones.
    """
    path = Path(path)
    try:
        raw = read_bytes(path)
    except FileNotFoundError:
        raise ProfileError("no such profile file", source=str(path)) from None
    except OSError as exc:
        raise ProfileError(f"cannot read ({exc.strerror})", source=str(path)) from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = raw.count(b"\n", 0, exc.start) + 1
        raise ProfileError(f"not UTF-8 text: byte 0x{raw[exc.start]:02x} at line {line}",
                           source=str(path)) from None
    try:
        return json.loads(text, object_pairs_hook=no_duplicates)
    except json.JSONDecodeError as exc:
        raise ProfileError(f"not valid JSON (line {exc.lineno}: {exc.msg})",
                           source=str(path)) from None
    except DuplicateKey as exc:
        raise ProfileError(f"not valid JSON: duplicate key {exc.args[0]!r}",
                           source=str(path)) from None
    except RecursionError:
        raise ProfileError("not valid JSON: nested too deeply", source=str(path)) from None
    except ValueError as exc:                   # e.g. an integer of more than 4300 digits
        raise ProfileError(f"not valid JSON: a value cannot be read ({exc})",
                           source=str(path)) from None


@contextmanager
def file_lock(path: str | os.PathLike) -> Iterator[None]:
    """Exclusive advisory lock on the sidecar ``.<name>.lock`` next to ``path``."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    lock = path.with_name(f".{path.name}.lock")
    with open(lock, "a") as f:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f.fileno(), fcntl.LOCK_UN)


def locked_update(path: str | os.PathLike, change: Callable[[Any | None], Any]) -> Any:
    """Under :func:`file_lock`: parse ``path`` (None if absent), ``new = change(old)``,
    write ``new`` atomically as sorted, indented JSON. Returns ``new``."""
    path = Path(path)
    with file_lock(path):
        _remove_stale_temps(path)
        current = read_json(path) if path.exists() else None
        new = change(current)
        atomic_write_text(path, dumps(new) + "\n")
        os.chmod(path, 0o644)           # mkstemp's 0600 would hide shared profiles
    return new


def _remove_stale_temps(path: Path) -> None:
    """Delete temp files of ``path`` (``.<name>.*.tmp``, :func:`atomic_write_text`'s) that a
    writer killed mid-write left behind: every writer holds the lock while its temp file
    exists, so under the lock any that remains is stale."""
    for tmp in path.parent.glob(f".{glob.escape(path.name)}.*.tmp"):
        tmp.unlink(missing_ok=True)


def dumps(obj: Any, depth: int = 0, inline_at: int = 2) -> str:
    """JSON with sorted keys, one line per object from ``inline_at`` levels down (one
    line per entry, point or fit), so profiles stay readable and diff well."""
    if depth >= inline_at or not isinstance(obj, (dict, list)) or not obj:
        return json.dumps(obj, sort_keys=True, separators=(", ", ": "))
    pad = " " * (depth + 1)
    if isinstance(obj, dict):
        items = [f"{pad}{json.dumps(k)}: {dumps(obj[k], depth + 1, inline_at)}"
                 for k in sorted(obj)]
        return "{\n" + ",\n".join(items) + "\n" + " " * depth + "}"
    items = [pad + dumps(v, depth + 1, inline_at) for v in obj]
    return "[\n" + ",\n".join(items) + "\n" + " " * depth + "]"
