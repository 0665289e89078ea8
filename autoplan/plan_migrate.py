"""Plan files of versions 1 to 3, read as version 4.

* Version 1 -> 2: the version-2 fields (``layout``, the stages' axes, ZeRO stage, micro-batch,
  data axes, activation placements, predictions, ``comparison``) are all optional and default
  to version 1's meaning, so a version-1 document is a version-2 one.
* Version 2 -> 3: the free-form ``planner`` object becomes typed
  (:class:`~autoplan.plan_meta.PlannerInfo`: ``name``, ``label``, ``evaluated``,
  ``feasible``, ``note``; everything else under ``details``), and its ``runtime`` key, which
  chose the engine's runtime, becomes the plan's own validated ``runtime`` field. Predictions
  gain per-stage times (``prediction.stage_times``), empty in migrated plans: readers fall
  back to re-pricing the plan (:mod:`autoplan.report.timing`).
* Version 3 -> 4: plans record the runtime assumptions their prediction was priced under
  (``pricing``, :mod:`autoplan.pricing`); a migrated plan has none (null: not recorded).

:func:`migrate` works on the JSON document before it is validated, so every error still names
the field of the file as written.
"""

from __future__ import annotations

from typing import Any

from autoplan.plan_meta import PlannerInfo, split_runtime

#: Versions :func:`migrate` reads, and the one it writes.
READABLE_VERSIONS = (1, 2, 3, 4)
PLAN_VERSION = 4


def migrate(d: dict[str, Any]) -> dict[str, Any]:
    """The version-4 form of plan document ``d`` (of a version in READABLE_VERSIONS)."""
    if d.get("version") == PLAN_VERSION:
        return d
    out = dict(d)
    if d.get("version") == 3:                  # 3 -> 4: nothing to convert
        out["version"] = PLAN_VERSION
        return out
    planner, runtime = split_runtime(out.get("planner"))
    if "runtime" not in out:
        out["runtime"] = runtime
    if planner is not None:
        out["planner"] = PlannerInfo.of(planner).to_dict()
    out["version"] = PLAN_VERSION
    return out
