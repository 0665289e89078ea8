"""Every rank's failure reaches the user: the first failing rank's own message, once.

When one rank fails (``no train state for rank 1``), the others see only what it causes —
a collective that fails with "Connection closed by peer" — and torchrun reports every
rank. Here each failing rank records its error in ``<errors dir>/rank<R>.json`` (atomic)
*before* it exits, so by causality the cause is on disk before any peer sees the broken
connection:

* a rank with an error of its own prints ``error: rank R: <message>`` if it is the first to
  record one (an ``O_EXCL`` marker decides), and nothing otherwise;
* a rank whose collective failed stays quiet when a rank has recorded an error of its own,
  and prints the collective failure otherwise (a rank that died without a word: SIGKILL,
  OOM);
* :func:`earliest` gives the launcher (``autoplan run``) the first recorded error, which
  it prints as its last line.

The directory is ``$AUTOPLAN_ERRORS_DIR`` (set by the launcher, fresh per launch), else
``<out>/.rank_errors/<torchrun run id>-<restart>``.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

ENV = "AUTOPLAN_ERRORS_DIR"


def errors_dir(out_dir: str | os.PathLike) -> Path:
    """This launch's error directory (module docstring)."""
    if os.environ.get(ENV):
        return Path(os.environ[ENV])
    run_id = os.environ.get("TORCHELASTIC_RUN_ID", "local")
    restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in f"{run_id}-{restart}")
    return Path(out_dir) / ".rank_errors" / safe


def record(directory: Path, rank: int, message: str, *, collective: bool) -> bool:
    """Write this rank's error; True when this rank should print it (module docstring)."""
    try:
        directory.mkdir(parents=True, exist_ok=True)
        body = json.dumps({"rank": rank, "time": time.time(), "message": message,
                           "collective": collective})
        tmp = directory / f".rank{rank:05d}.json.tmp"
        tmp.write_text(body + "\n")
        os.replace(tmp, directory / f"rank{rank:05d}.json")
    except OSError:
        return True                     # cannot record: say it here rather than not at all
    if collective:
        return not any(not e["collective"] for e in _read_all(directory))
    try:
        os.close(os.open(directory / "first", os.O_CREAT | os.O_EXCL | os.O_WRONLY))
        return True
    except FileExistsError:
        return False
    except OSError:
        return True


def _read_all(directory: Path) -> list[dict[str, Any]]:
    out = []
    for path in sorted(directory.glob("rank*.json")):
        try:
            doc = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        if isinstance(doc, dict) and {"rank", "time", "message", "collective"} <= set(doc):
            out.append(doc)
    return out


def earliest(directory: Path) -> dict[str, Any] | None:
    """The first recorded error of its own (else the first collective failure), or None."""
    errors = _read_all(directory)
    if not errors:
        return None
    return min(errors, key=lambda e: (e["collective"], e["time"], e["rank"]))
