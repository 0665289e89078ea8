"""Trust boundaries: what autoplan treats as data, and the small checks that keep it data.

Trusted: what the user types on the command line (a model named ``import:pkg.mod:fn`` runs
that code), and checkpoint directories (``torch.distributed.checkpoint`` unpickles their
``.metadata``). Not trusted: plan, cluster and profile files — people share them, so
reading, showing, reporting, exporting, launching or calibrating one never runs code named
in it. Re-building an ``import:`` model named inside a plan needs the explicit opt-in
``--trust-model-code`` (the environment variable :data:`TRUST_ENV` carries it to the
engine's ranks), like Hugging Face's ``trust_remote_code``. The gate itself lives where
models are built (:func:`autoplan.models.registry.build_model`), so it holds whichever code
path re-builds a model.

Also here: names in data files may not hold control characters (a newline in a model name
would become a line of a written script), a cluster name may not become a path, and files
autoplan writes get the mode the user's umask gives (``tempfile.mkstemp`` makes 0600).
"""

from __future__ import annotations

import contextlib
import os
import re
import unicodedata
from typing import Any, Iterator, Sequence

#: Set to "1" (by ``--trust-model-code``) to let plans name code to import.
TRUST_ENV = "AUTOPLAN_TRUST_MODEL_CODE"
TRUST_FLAG = "--trust-model-code"

#: Plan fields holding free text (descriptions, citations), where a newline is harmless;
#: every other string — keys, names, placements, fingerprints — may hold no control character.
FREE_TEXT_KEYS = frozenset({"description", "notes", "note", "source", "sources", "method",
                            "comment", "reason", "citation", "command"})


def trust_enabled() -> bool:
    """Whether the user opted in to importing model code named in data files."""
    return os.environ.get(TRUST_ENV, "") == "1"


@contextlib.contextmanager
def trusting(enabled: bool = True) -> Iterator[None]:
    """Within the block (and in processes it starts), model code named in plans may be
    imported when ``enabled``; the environment is restored afterwards."""
    old = os.environ.get(TRUST_ENV)
    if enabled:
        os.environ[TRUST_ENV] = "1"
    try:
        yield
    finally:
        if enabled:
            if old is None:
                os.environ.pop(TRUST_ENV, None)
            else:
                os.environ[TRUST_ENV] = old


def take_trust_flag(argv: Sequence[str]) -> tuple[list[str], bool]:
    """``argv`` without ``--trust-model-code`` (anywhere before a ``--``), and whether it
    was there."""
    argv = list(argv)
    end = argv.index("--") if "--" in argv else len(argv)
    found = TRUST_FLAG in argv[:end]
    return [a for i, a in enumerate(argv) if not (i < end and a == TRUST_FLAG)], found


def untrusted_code_message(name: str) -> str:
    return (f"names Python code to import ({name!r}); plan files are data, and autoplan "
            f"does not run code a file names. If you trust this file, pass {TRUST_FLAG} "
            f"(or set {TRUST_ENV}=1)")


# ---- names ---------------------------------------------------------------------------------

def control_char(text: str) -> str | None:
    """The first control character (Unicode category Cc: C0, DEL, C1) in ``text``, or None."""
    for ch in text:
        if unicodedata.category(ch) == "Cc":
            return ch
    return None


def key_label(key: str) -> str:
    """``key`` as a field path names it: ``""`` for the empty key, and each control
    character escaped (``\\x7f``), so that the message naming it is printable and its path
    keeps every level."""
    if key == "":
        return '""'
    return "".join(ch.encode("unicode_escape").decode("ascii")
                   if unicodedata.category(ch) == "Cc" else ch for ch in key)


def find_control_chars(value: Any, where: str = "") -> tuple[str, str] | None:
    """(field, character) of the first key or non-free-text string in ``value`` (nested
    dicts and lists) holding a control character; None when there is none."""
    stack: list[tuple[Any, str, bool]] = [(value, where, False)]
    while stack:
        item, path, free = stack.pop()
        if isinstance(item, str):
            ch = None if free else control_char(item)
            if ch is not None:
                return path or "<top level>", ch
        elif isinstance(item, dict):
            for key, sub in item.items():
                key_s = str(key)
                label = key_label(key_s)
                sub_path = f"{path}.{label}" if path else label
                ch = control_char(key_s)
                if ch is not None:
                    return sub_path, ch
                stack.append((sub, sub_path, free or key_s in FREE_TEXT_KEYS))
        elif isinstance(item, (list, tuple)):
            for i, sub in enumerate(item):
                stack.append((sub, f"{path}[{i}]", free))
    return None


def check_plan_names(data: dict) -> None:
    """Plan-load hook: no control character in any key or name of a plan document; raises
    :class:`~autoplan.errors.PlanError` naming the field."""
    from autoplan.errors import PlanError

    found = find_control_chars(data)
    if found is not None:
        where, ch = found
        raise PlanError(f"field '{where}': holds the control character {ch!r}; names in a "
                        "plan may not (a newline would become a line of a written script)")


_FILE_STEM = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.+@=-]{0,127}$")


def check_file_stem(name: str, what: str) -> str:
    """``name`` if it can be a file name under ``profiles/`` (letters, digits, ``_.+@=-``,
    not starting with a dot, no separator, at most 128 characters); else a ConfigError."""
    from autoplan.errors import ConfigError

    if not isinstance(name, str) or not _FILE_STEM.match(name) or ".." in name:
        raise ConfigError(f"{what} {name!r} cannot be a file name (letters, digits and "
                          "'_.+@=-' only, no path separators or '..'); rename it",
                          field="name")
    return name


_HOST = re.compile(r"^(\[[0-9A-Fa-f:.%a-zA-Z]+\]|[A-Za-z0-9_]([A-Za-z0-9_.-]{0,252}))$")


def check_host(name: str, what: str) -> str:
    """``name`` if it is a host name, IPv4 or bracketed IPv6 address; else a ConfigError (a
    host is written into shell commands, so ``$( )`` or a newline is refused here, and every
    word is quoted besides)."""
    from autoplan.errors import ConfigError

    if not isinstance(name, str) or not _HOST.match(name):
        raise ConfigError(f"not a host name or address: {name!r}", field=what)
    return name


# ---- file modes ----------------------------------------------------------------------------

def current_umask() -> int:
    """This process's umask, read without changing it where Linux reports it (the
    ``Umask:`` line of /proc/self/status); else by setting and restoring it."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def default_file_mode() -> int:
    """The mode ``open(path, "w")`` would give a new file: 0o666 minus the umask."""
    return 0o666 & ~current_umask()
