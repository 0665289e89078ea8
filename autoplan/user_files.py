"""Reading a file a user passed in (a plan, a cluster or device YAML, a profile, a model
config, a nodes file), before any parsing: one function, so every reader refuses the same
things the same way.

A path that is not a regular file is refused before it is opened: opening a FIFO blocks
until a writer appears (a hang), and ``/dev/zero`` or ``/dev/urandom`` never end (reading
one fills memory). A regular file is read up to :data:`MAX_BYTES`; a larger one is refused,
since no file autoplan reads comes near it (a per-op plan of a trillion-parameter model is
a few MB). Both are raised as :class:`OSError` with a readable ``strerror``, so each
reader's existing ``except OSError`` turns them into its own one-line error naming the file.
"""

from __future__ import annotations

import errno
import os
import stat

#: Largest file read (bytes): 256 MiB.
MAX_BYTES = 256 * 2 ** 20

_KINDS = ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a named pipe"),
          (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
          (stat.S_ISSOCK, "a socket"))


def check_regular(path: str | os.PathLike) -> None:
    """OSError unless ``path`` (symbolic links followed) is a regular file: called before
    opening a file a user can have replaced (a checkpoint's shards as well)."""
    mode = os.stat(path).st_mode
    if not stat.S_ISREG(mode):
        kind = next((name for test, name in _KINDS if test(mode)), "not a regular file")
        raise OSError(errno.EINVAL, f"{kind}, not a regular file", str(path))


def read_bytes(path: str | os.PathLike, limit: int | None = None) -> bytes:
    """The bytes of regular file ``path`` (symbolic links followed), at most ``limit``
    (default :data:`MAX_BYTES`); OSError for anything else (module docstring)."""
    limit = MAX_BYTES if limit is None else limit
    check_regular(path)
    with open(path, "rb") as fh:
        data = fh.read(limit + 1)
    if len(data) > limit:
        raise OSError(errno.EFBIG, f"larger than {limit:,} bytes, the most autoplan reads",
                      str(path))
    return data


def read_text(path: str | os.PathLike, limit: int | None = None) -> str:
    """:func:`read_bytes` decoded as UTF-8 (UnicodeDecodeError, a ValueError, if not)."""
    return read_bytes(path, limit).decode("utf-8")
