"""Profiles: measured op times and link timings, stored as data under ``profiles/``.

* :mod:`~autoplan.profile.store` — the two file formats (``profiles/ops/<device>.json``,
  ``profiles/links/<cluster>.json``), validated loading, locked atomic merging.
* :mod:`~autoplan.profile.ops` — time every op signature of an OpGraph on a device
  (``autoplan profile ops gpt-small --tp 1,2,4``), resumable.
* :mod:`~autoplan.profile.lookup` — :class:`OpTimeTable`: exact / interpolated / roofline
  op times for the cost model.
* :mod:`~autoplan.profile.links` — nccl-tests style collective benchmark under torchrun
  (``torchrun --nproc_per_node=4 -m autoplan.profile.links --out profiles/links/X.json``).
* :mod:`~autoplan.profile.fit` — bus-bandwidth factors and the alpha-beta fit.
* :mod:`~autoplan.profile.reference` — link profiles of A100 / H100 clusters from published
  figures.
* :mod:`~autoplan.profile.cli` — ``add_profile_commands(subparsers)`` for the CLI.
"""

from __future__ import annotations

from typing import Any

_LAZY = {
    "OpProfile": ("autoplan.profile.store", "OpProfile"),
    "LinkProfile": ("autoplan.profile.store", "LinkProfile"),
    "ProfileError": ("autoplan.profile.store", "ProfileError"),
    "OpTimeTable": ("autoplan.profile.lookup", "OpTimeTable"),
    "profile_ops": ("autoplan.profile.ops", "profile_ops"),
    "fit_alpha_beta": ("autoplan.profile.fit", "fit_alpha_beta"),
    "bus_factor": ("autoplan.profile.fit", "bus_factor"),
}

__all__ = list(_LAZY)


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        module, attr = _LAZY[name]
        return getattr(importlib.import_module(module), attr)
    raise AttributeError(f"module 'autoplan.profile' has no attribute {name!r}")
