"""The ``plan`` command pauses the cyclic collector while planning and restores it
(issue #18): the collector is off inside, back on after (also after an error), and left
off where the caller had it off."""

from __future__ import annotations

import gc

import pytest

from autoplan import cli, process


def test_cycles_paused_while_planning_and_restored():
    assert gc.isenabled()
    with process.CyclesPaused():
        assert not gc.isenabled()
    assert gc.isenabled()
    with pytest.raises(RuntimeError):
        with process.CyclesPaused():
            raise RuntimeError("planning failed")
    assert gc.isenabled()
    gc.disable()
    try:
        with process.CyclesPaused():
            assert not gc.isenabled()
        assert not gc.isenabled()
    finally:
        gc.enable()


def test_plan_command_runs_with_the_collector_paused(monkeypatch, tmp_path):
    seen = []
    monkeypatch.setattr(cli, "_plan_command", lambda args: seen.append(gc.isenabled()) or 0)
    assert cli.main(["plan", "gpt-tiny", "--cluster", "dgx-a100", "--nodes", "1",
                     "--global-batch", "16", "-o", str(tmp_path / "p.json")]) == 0
    assert seen == [False] and gc.isenabled()
