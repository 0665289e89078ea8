"""Checks that name the field, for plan files (and the other JSON files autoplan reads).

Every check raises :class:`~autoplan.errors.PlanError` with ``field '<where>': <what>``;
:mod:`autoplan.plan` builds its loader from them. Also here: JSON that refuses duplicate keys,
and atomic writes (temp file + ``os.replace``).
"""

from __future__ import annotations

import errno
import math
import os
import reprlib
import stat
import tempfile
from dataclasses import MISSING, fields
from pathlib import Path
from typing import Any

from autoplan.errors import PlanError
from autoplan.trust import default_file_mode

#: The most devices a plan may span (as :data:`autoplan.cluster.MAX_WORLD_SIZE`).
MAX_DEVICES = 2 ** 24
#: Bound of every other count in a plan (batch sizes, micro-batches, layers, parameters): far
#: beyond any real run, small enough that products of counts stay exact and printable.
MAX_COUNT = 2 ** 62
#: Bound of a predicted figure's magnitude (seconds, bytes, rates), so that sums stay finite.
MAX_FIGURE = 1e300
#: How deeply a plan's free-form sections (``planner``, ``alternatives``, ...) may nest.
MAX_DEPTH = 32
#: Short, bounded reprs of bad values in error messages.
show = reprlib.Repr()
show.maxlevel, show.maxstring, show.maxlong, show.maxother = 3, 60, 40, 60
show.maxlist = show.maxdict = show.maxtuple = 6


class DuplicateKey(ValueError):
    pass


def no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise DuplicateKey(key)
        out[key] = value
    return out


def is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def is_name(value: Any) -> bool:
    return isinstance(value, str) and bool(value)


def count(value: Any, where: str, *, low: int = 1, high: int = MAX_COUNT) -> int:
    if not is_int(value) or not low <= value <= high:
        raise PlanError(f"field '{where}': must be an integer from {low} to {high}, got "
                        f"{show.repr(value)}")
    return value


def as_object(value: Any, where: str) -> dict:
    if not isinstance(value, dict):
        raise PlanError(f"field '{where}': must be an object, got {kind(value)}")
    return value


def optional_object(d: dict, key: str) -> dict:
    """``d[key]``: an object, or {} when absent or null."""
    value = d.get(key)
    return {} if value is None else as_object(value, key)


def as_list(value: Any, where: str) -> list:
    if not isinstance(value, (list, tuple)):
        raise PlanError(f"field '{where}': must be a list, got {kind(value)}")
    return list(value)


def sequence(value: Any, where: str, ok) -> None:
    if not isinstance(value, (list, tuple)):
        raise PlanError(f"field '{where}': must be a list, got {kind(value)}")
    for i, item in enumerate(value):
        if not ok(item):
            what = "an integer" if ok is is_int else "a non-empty string"
            raise PlanError(f"field '{where}': item {i} must be {what}, got "
                            f"{show.repr(item)}")


def string_table(table: dict, where: str) -> dict[str, dict[str, str]]:
    """An object of objects of strings (name -> mesh axis -> placement)."""
    for name, row in table.items():
        as_object(row, f"{where}.{name}")
        for key, value in row.items():
            if not isinstance(value, str):
                raise PlanError(f"field '{where}.{name}.{key}': must be a string, got "
                                f"{show.repr(value)}")
    return table


def kind(value: Any) -> str:
    return {dict: "an object", list: "a list", str: "a string", bool: "a boolean",
            type(None): "null", int: "an integer", float: "a number"}.get(type(value),
                                                                       type(value).__name__)


def figure(value: Any, where: str) -> float:
    """A finite number of sane magnitude (a sum of a few stays finite)."""
    if (not isinstance(value, (int, float)) or isinstance(value, bool)
            or (isinstance(value, float) and not math.isfinite(value))
            or not -MAX_FIGURE <= value <= MAX_FIGURE):
        raise PlanError(f"field '{where}': must be a finite number, got {show.repr(value)}")
    return value


def figures(cls, d: Any, where: str):
    """A :class:`MemoryBreakdown` / :class:`TimeBreakdown` of finite numbers."""
    d = as_object(d, where)
    for key, value in d.items():
        if key in {f.name for f in fields(cls)}:
            figure(value, f"{where}.{key}")
    return from_dict(cls, d, where)


def finite_tree(value: Any, where: str) -> None:
    """Every number under ``value`` (an object / list tree) finite."""
    stack = [(value, where)]
    while stack:
        node, at = stack.pop()
        if isinstance(node, dict):
            stack.extend((v, f"{at}.{k}") for k, v in node.items())
        elif isinstance(node, (list, tuple)):
            stack.extend((v, f"{at}[{i}]") for i, v in enumerate(node))
        elif isinstance(node, float) and not math.isfinite(node):
            raise PlanError(f"field '{at}': must be a finite number, got {node!r}")


def plain(value: Any, where: str) -> None:
    """JSON data of bounded depth with finite numbers (written back as standard JSON)."""
    stack = [(value, where, 0)]
    while stack:
        node, at, depth = stack.pop()
        if isinstance(node, (dict, list)):
            if depth >= MAX_DEPTH:
                raise PlanError(f"field '{where}': nested more than {MAX_DEPTH} levels deep")
            items = node.items() if isinstance(node, dict) else enumerate(node)
            fmt = "{}.{}" if isinstance(node, dict) else "{}[{}]"
            stack.extend((v, fmt.format(at, k), depth + 1) for k, v in items)
        elif isinstance(node, float) and not math.isfinite(node):
            raise PlanError(f"field '{at}': must be a finite number, got {node!r}")


def from_dict(cls, d: dict, where: str):
    if not isinstance(d, dict):
        raise PlanError(f"field '{where}': must be an object, got {kind(d)}")
    known = {f.name for f in fields(cls)}
    extra = set(d) - known - {"total"}     # 'total' is derived, written for readers
    if extra:
        raise PlanError(f"field '{where}.{sorted(extra)[0]}': unknown key")
    missing = [f.name for f in fields(cls) if f.name not in d
               and f.default is MISSING and f.default_factory is MISSING]
    if missing:
        raise PlanError(f"field '{where}.{missing[0]}': missing")
    try:
        return cls(**{k: v for k, v in d.items() if k in known})
    except TypeError as exc:
        raise PlanError(f"field '{where}': {exc}") from None


def json_default(obj: Any) -> Any:
    if isinstance(obj, tuple):
        return list(obj)
    raise TypeError(f"cannot serialise {type(obj).__name__}")


def atomic_write_text(path: str | os.PathLike, text: str) -> Path:
    """Write ``text`` to ``path`` via a temp file in the same folder and ``os.replace``."""
    return atomic_write(path, text, "w")


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> Path:
    """Write ``data`` to ``path`` via a temp file in the same folder and ``os.replace``."""
    return atomic_write(path, data, "wb")


def _write_through(path: Path, content: str | bytes, mode: str, fifo: bool) -> None:
    """Write to a device or a pipe as it is. A named pipe nobody reads is refused (opening
    it for writing would block until a reader came: opened non-blocking, it fails with
    ENXIO instead); errors name the path."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_NONBLOCK)
        os.set_blocking(fd, True)
        with os.fdopen(fd, mode) as f:
            f.write(content)
    except OSError as exc:
        why = "a named pipe that no process reads" if fifo and exc.errno == errno.ENXIO \
            else exc.strerror
        raise OSError(exc.errno, why, str(path)) from None


def atomic_write(path: str | os.PathLike, content: str | bytes, mode: str) -> Path:
    """A regular file (or a new one) is replaced atomically. A path that names a device or
    a pipe (``-o /dev/null``, ``/dev/stdout``), directly or through a symlink, is written
    through, never replaced: replacing it would put a regular file where the device was
    (as root, ``/dev/null`` itself). Anything else that is not a regular file (a directory,
    a socket) is refused with an OSError naming it."""
    path = Path(path)
    try:
        mode_bits = os.stat(path).st_mode            # follows symlinks: what a write reaches
    except FileNotFoundError:
        mode_bits = None
    if mode_bits is not None and not stat.S_ISREG(mode_bits):
        if stat.S_ISCHR(mode_bits) or stat.S_ISFIFO(mode_bits):
            _write_through(path, content, mode, fifo=stat.S_ISFIFO(mode_bits))
            return path
        raise OSError(errno.EEXIST, "exists and is not a regular file; not replacing it",
                      str(path))
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.fchmod(fd, default_file_mode())         # mkstemp's 0600 -> what the umask gives
    try:
        with os.fdopen(fd, mode) as f:
            f.write(content)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    return path
