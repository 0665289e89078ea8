"""Test tiers: every test carries exactly one tier marker, so ``pytest -m <tier>`` selects it.

==============  ==========================================================================
tier            what its tests do
==============  ==========================================================================
``unit``        one process, no process group: parsers, cost formulas, the grid planner,
                plan files, the CLI, reports, single-process engine pieces
``fakepg``      one process on torch's fake process group (``FakeStore``, backend
                ``"fake"``): the search (DTensor's strategy registry asked on a probe
                mesh), DeviceMeshes of any world size, planning whole model zoos
``multiproc``   several gloo processes under torchrun: engine runs, loss parity against
                one process, checkpoints, launch failures (marked ``multiproc`` in the file)
``gpu``         needs a CUDA device; skipped with the reason without one (marked ``gpu``)
``fuzz``        hypothesis fuzzing of the CLI, plan files, inputs and the engine
                (``tests/test_fuzz_*.py``)
==============  ==========================================================================

The tier is decided per file (:data:`FAKEPG_FILES`, the ``test_fuzz_`` prefix); within a
file, a test marked ``multiproc`` or ``gpu`` is in that tier. ``slow`` is orthogonal (a test
of any tier taking more than ~20 s on a 2-core machine).
"""

from __future__ import annotations

import pathlib

import pytest

TIERS = ("unit", "fakepg", "multiproc", "gpu", "fuzz")
#: Files whose tests run on the fake process group: the search (every ``optimize`` with the
#: default planner probes DTensor's registry on a fake 2 x 2 mesh) or meshes of large worlds.
FAKEPG_FILES = frozenset({"test_planner.py", "test_search.py", "test_cost_equivalence.py",
                          "test_speed_bounds.py", "test_zoo_models.py", "test_zoo_guard.py"})


def tier_of(item: pytest.Item) -> str:
    """The one tier of ``item`` (module docstring)."""
    for marker in ("gpu", "multiproc"):
        if item.get_closest_marker(marker) is not None:
            return marker
    name = pathlib.Path(str(item.fspath)).name
    if name.startswith("test_fuzz_"):
        return "fuzz"
    return "fakepg" if name in FAKEPG_FILES else "unit"


@pytest.hookimpl(tryfirst=True)         # before ``-m`` selects by marker
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        item.add_marker(getattr(pytest.mark, tier_of(item)))
