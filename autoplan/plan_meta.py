"""What made a plan, as typed data: :class:`PlannerInfo`, and the runtimes a plan can ask for.

Version 3 of the plan format (:mod:`autoplan.plan`) replaces the free-form ``planner`` object
of versions 1 and 2 by typed fields: which planner wrote the plan (``name``), its label of the
configuration, how many configurations it evaluated and found feasible, a note; everything
else it records (solver statistics, ILP sizes, explanations, cost-model provenance) is
``details``, shown to people and never read to decide anything. Which runtime executes the
plan is ``Plan.runtime`` (:data:`RUNTIMES`, None: the engine chooses from the plan),
validated when the plan loads.

``PlannerInfo`` also reads like the mapping it replaces (``info["name"]``,
``info.get("explain")``, ``{**info, "note": ...}``): a flat view of the typed fields and the
details, so code written against version 2 keeps working while it moves to the fields.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Iterator

from autoplan import plan_fields as pf
from autoplan.errors import PlanError

#: Runtimes a plan may name: the uniform (DP x TP x PP) runtime or the per-op one.
RUNTIMES = ("uniform", "per_op")
#: The typed fields (everything else in a version-2 ``planner`` object goes to ``details``).
TYPED = ("name", "label", "evaluated", "feasible", "note")


@dataclass(frozen=True)
class PlannerInfo(Mapping):
    """Which planner wrote a plan and what it found (module docstring)."""

    name: str = ""                      # "uniform", "auto", "estimate", or a tool's own name
    label: str = ""                     # the planner's label of the chosen configuration
    evaluated: int | None = None        # configurations priced
    feasible: int | None = None         # of which fit in memory
    note: str = ""                      # why this plan (the grid's kept over the search's)
    details: dict[str, Any] = field(default_factory=dict)   # shown, never drives control flow

    def __post_init__(self) -> None:
        for key in ("name", "label", "note"):
            if not isinstance(getattr(self, key), str):
                raise PlanError(f"field 'planner.{key}': must be a string, got "
                                f"{pf.show.repr(getattr(self, key))}")
        for key in ("evaluated", "feasible"):
            value = getattr(self, key)
            if value is not None:
                pf.count(value, f"planner.{key}", low=0)
        pf.as_object(self.details, "planner.details")

    @classmethod
    def of(cls, value: "PlannerInfo | Mapping[str, Any] | None") -> "PlannerInfo":
        """``value`` as a PlannerInfo: a flat mapping's typed keys become fields, the rest
        details (``runtime`` belongs to the plan, not here: see :func:`split_runtime`)."""
        if value is None:
            return cls()
        if isinstance(value, PlannerInfo):
            return value
        pf.as_object(value, "planner")
        flat = dict(value)
        details = dict(pf.as_object(flat.pop("details", None) or {}, "planner.details"))
        typed = {k: flat.pop(k) for k in TYPED if k in flat}
        typed = {k: v for k, v in typed.items() if v is not None}
        details.update(flat)
        return cls(**typed, details=details)

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "label": self.label, "evaluated": self.evaluated,
                "feasible": self.feasible, "note": self.note, "details": dict(self.details)}

    # ---- the mapping view (module docstring) ----------------------------------------------
    def _flat(self) -> dict[str, Any]:
        out = {k: getattr(self, k) for k in TYPED
               if getattr(self, k) not in (None, "")}
        out.update(self.details)
        return out

    def __getitem__(self, key: str) -> Any:
        return self._flat()[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._flat())

    def __len__(self) -> int:
        return len(self._flat())


def split_runtime(planner: Mapping[str, Any] | None) -> tuple[dict[str, Any], str | None]:
    """A version-2 ``planner`` object without its ``runtime`` key, and that key's value."""
    if planner is None or isinstance(planner, PlannerInfo):
        return planner, None
    flat = dict(planner)
    return flat, flat.pop("runtime", None)


def check_runtime(value: Any) -> str | None:
    if value is not None and (not isinstance(value, str) or value not in RUNTIMES):
        raise PlanError(f"field 'runtime': must be one of {RUNTIMES} or null, got "
                        f"{pf.show.repr(value)}")
    return value
