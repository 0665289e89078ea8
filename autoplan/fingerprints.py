"""Fingerprints that tie files to what made them: a run directory to its plan, a checkpoint to
its plan and model, a calibration to its cluster. Each is the first 16 hex digits of the
SHA-256 of a canonical JSON form (sorted keys), as :meth:`ModelSpec.fingerprint` is.

* plan: the plan without predictions and provenance (``prediction``, ``alternatives``,
  ``comparison``, ``created_by``, ``planner``): two plans with one fingerprint lay the
  same model out the same way on the same cluster;
* cluster: the plan's embedded cluster section.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

#: Plan fields that do not change what a run computes or a checkpoint holds.
NOT_LAYOUT = ("prediction", "alternatives", "comparison", "created_by", "planner")


def digest(obj: Any) -> str:
    blob = json.dumps(obj, sort_keys=True, default=str).encode()
    return hashlib.sha256(blob).hexdigest()[:16]


def plan_fingerprint(plan: Any) -> str:
    return digest({k: v for k, v in plan.to_dict().items() if k not in NOT_LAYOUT})


def cluster_fingerprint(plan: Any) -> str:
    return digest(plan.cluster)


def run_identity(plan: Any) -> dict[str, str]:
    """What a run's summary records of its plan, for :mod:`autoplan.calibrate` to check."""
    return {"plan_fingerprint": plan_fingerprint(plan),
            "model_fingerprint": plan.model_fingerprint,
            "cluster_fingerprint": cluster_fingerprint(plan),
            "cluster": str(plan.cluster.get("name", ""))}
