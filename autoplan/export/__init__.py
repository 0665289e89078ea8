"""Export uniform plans to other runtimes' configurations: ``autoplan export PLAN --to ...``.

* :mod:`.torchtitan` — a torchtitan job config (TOML);
* :mod:`.megatron` — Megatron-LM command-line arguments;
* :mod:`.deepspeed` — a DeepSpeed config (JSON).

Each refuses, with :class:`~autoplan.export.common.NotExpressibleError` naming the feature,
what its runtime cannot express (:mod:`.common` holds the shared uniformity checks).
"""

from __future__ import annotations

from typing import Callable

from autoplan.export.common import Export, NotExpressibleError
from autoplan.plan import Plan

TARGETS = ("torchtitan", "megatron", "deepspeed")


def export_plan(plan: Plan, target: str, *, steps: int | None = None) -> Export:
    """``plan`` as ``target``'s configuration (see TARGETS)."""
    from autoplan.errors import UnknownNameError
    from autoplan.export.deepspeed import to_deepspeed
    from autoplan.export.megatron import to_megatron
    from autoplan.export.torchtitan import to_torchtitan

    makers: dict[str, Callable[[], Export]] = {
        "torchtitan": lambda: to_torchtitan(plan, steps=steps),
        "megatron": lambda: to_megatron(plan),
        "deepspeed": lambda: to_deepspeed(plan),
    }
    if target not in makers:
        raise UnknownNameError("export target", target, TARGETS)
    return makers[target]()


__all__ = ["Export", "NotExpressibleError", "TARGETS", "export_plan"]
