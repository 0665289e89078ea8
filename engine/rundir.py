"""One run per output directory: an exclusive ``fcntl.flock`` on ``<out>/.lock``.

Global rank 0 takes the lock for the whole run (:func:`hold`, released when the process
exits, even on SIGKILL, since the kernel drops flock locks with the file); a second run on
the same ``--out`` — whose metrics would interleave and whose checkpoints would overwrite
the first's — is refused with the holder's pid. :func:`check_unlocked` is the launcher's
pre-launch test (take and release at once).
"""

from __future__ import annotations

import fcntl
import os
from pathlib import Path
from typing import IO

from autoplan.errors import ConfigError

LOCK = ".lock"


def _try_lock(out_dir: Path) -> IO[str]:
    out_dir.mkdir(parents=True, exist_ok=True)
    f = open(out_dir / LOCK, "a+")
    try:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        f.seek(0)
        holder = f.read().strip() or "?"
        f.close()
        raise ConfigError(f"{out_dir} is in use by another run (pid {holder}); wait for it, "
                          "or give this run another --out", field="--out") from None
    return f


def hold(out_dir: str | os.PathLike) -> IO[str]:
    """Lock ``out_dir`` for this process's lifetime (keep the returned file open); writes
    this pid into the lock file."""
    f = _try_lock(Path(out_dir))
    f.seek(0)
    f.truncate()
    f.write(f"{os.getpid()}\n")
    f.flush()
    return f


def check_unlocked(out_dir: str | os.PathLike) -> None:
    """ConfigError if another run holds ``out_dir``."""
    _try_lock(Path(out_dir)).close()
