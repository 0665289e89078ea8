"""The project's own error types.

Every error a user can cause (a bad YAML field, a plan for another world size, a model that
does not fit, an unknown model name) is raised as an :class:`AutoplanError` subclass with a
message that names the file, field or op. The CLI prints ``error: <message>`` and exits 2;
it never shows a bare traceback for these.
"""

from __future__ import annotations


class AutoplanError(Exception):
    """Base class of every error autoplan raises on purpose."""


class ConfigError(AutoplanError, ValueError):
    """A configuration file or value is wrong.

    ``source`` is the file (or "<dict>" for in-memory input) and ``field`` the dotted path
    of the offending key, e.g. ``links.inter_node.bandwidth_gbps``.
    """

    def __init__(self, message: str, *, source: str | None = None, field: str | None = None):
        self.source = source
        self.field = field
        where = ""
        if source and field:
            where = f"{source}: field '{field}': "
        elif source:
            where = f"{source}: "
        elif field:
            where = f"field '{field}': "
        super().__init__(where + message)


class UnknownNameError(AutoplanError, KeyError):
    """A preset / model / device name that does not exist. Lists what does."""

    def __init__(self, kind: str, name: str, known: list[str] | tuple[str, ...]):
        self.kind, self.name, self.known = kind, name, list(known)
        shown = ", ".join(sorted(self.known)) or "(none)"
        super().__init__(f"unknown {kind} '{name}'; known: {shown}")

    def __str__(self) -> str:  # KeyError would repr() the message
        return self.args[0]


class TraceError(AutoplanError):
    """The model could not be traced; the message names the module and/or op."""


class InfeasibleError(AutoplanError):
    """No configuration fits; the message gives needed vs available memory per device."""


class OutOfTime(InfeasibleError):
    """A solve found no solution within its time limit (not a proof that none exists)."""


class PlanError(AutoplanError, ValueError):
    """A plan file is malformed, of another version, or does not match the run."""


def one_of(value: object, choices: tuple[str, ...], what: str) -> str:
    """``value`` if it is one of ``choices``; a one-line ValueError naming ``what``
    otherwise (the callers turn it into a ConfigError naming their field)."""
    if not isinstance(value, str) or value not in choices:
        raise ValueError(f"{what} must be one of {', '.join(choices)}, got {value!r}"[:200])
    return value
