"""Infeasible is explained (issue #7): when no configuration fits, the error names the binding
constraint -- memory per device, needed vs available, for the candidate that needs the least
-- and what would make it fit: the levers that candidate does not use yet (ZeRO-3, activation
checkpointing, a smaller micro-batch) and how many devices, a count that does make it fit.

A GPT-small on the local-cpu preset (with its measured profiles) with each device's memory cut
to 40 MB: quick to trace and search (~200 configurations), and nothing fits.
"""

from __future__ import annotations

import dataclasses
import math
import re

import pytest
import yaml

from autoplan.api import head_counts, plan_problem, prepare
from autoplan.cli import main
from autoplan.cost.memory import usable_bytes
from autoplan.errors import InfeasibleError
from autoplan.planner.grid.estimate import fits
from autoplan.planner.grid.uniform import SearchSpace, size_text, enumerate_configs
from fuzz_helpers import PROFILES

MEMORY_GB = 0.04


def _cluster_file(folder, memory_gb: float) -> str:
    doc = yaml.safe_load((PROFILES / "clusters" / "local-cpu.yaml").read_text())
    # the same name: local-cpu's measured profiles and calibration apply as they would
    doc["device_overrides"] = {**doc["device_overrides"], "memory_gb": memory_gb}
    path = folder / f"small-{memory_gb}.yaml"
    path.write_text(yaml.safe_dump(doc))
    return str(path)


@pytest.fixture(scope="module")
def problem(tmp_path_factory):
    return prepare("gpt-small", _cluster_file(tmp_path_factory.mktemp("infeasible"),
                                              MEMORY_GB), global_batch=8)


def _message(problem, space: SearchSpace = SearchSpace()) -> str:
    with pytest.raises(InfeasibleError) as info:
        plan_problem(problem, space=space)
    return str(info.value)


def test_names_memory_per_device_needed_vs_available_for_the_least_hungry(problem):
    msg = _message(problem)
    est = problem.estimator()                  # what the search evaluates each candidate with
    preds = [(cfg, est.predict(cfg)) for cfg in enumerate_configs(
        problem.graph, problem.cluster, 8, divides=head_counts(problem.spec))]
    assert preds and not any(fits(p) for _, p in preds)
    cfg, least = min(preds, key=lambda cp: cp[1].memory.total)
    assert "memory per device is the binding constraint" in msg
    assert f"({cfg.label()}) needs {size_text(least.memory.total)} per device" in msg
    # available: the memory a plan may fill, the device's less the headroom left free
    # (--memory-headroom, 2% by default: 39.2 MB of the 40 MB), what "fits" compares against
    limit = least.memory_limit_bytes
    assert limit == pytest.approx(usable_bytes(MEMORY_GB * 1e9, problem.memory_headroom))
    assert f"each cpu-local has {size_text(limit)}" in msg
    for part in ("params", "grads", "optimizer", "activations", "other"):
        assert f"{part} {size_text(getattr(least.memory, part))}" in msg
    assert least.memory.total > limit


def test_the_device_count_it_suggests_makes_it_fit(problem):
    msg = _message(problem)
    found = re.search(r"at least (\d+) devices instead of 4", msg)
    assert found, msg
    devices = int(found.group(1))
    assert devices > 4
    nodes = math.ceil(devices / problem.cluster.devices_per_node)
    wider = dataclasses.replace(problem, cluster=problem.cluster.with_nodes(nodes))
    plan, _ = plan_problem(wider)
    assert plan.world_size == nodes * 4 and fits(plan.prediction)


def test_lists_the_levers_the_least_hungry_candidate_does_not_use(problem):
    # without ZeRO-3, checkpointing or micro-batch 1 in the space, each is suggested
    space = SearchSpace(tp=(1,), pp=(1,), zero=(0, 1), checkpoint=("none",),
                        micro_batch=(2,))
    msg = _message(problem, space)
    assert "dp4 tp1 pp1 z1 mb2x1" in msg
    assert "to make it fit use ZeRO-3, or activation checkpointing, or a smaller " \
           "micro-batch, or " in msg
    assert "already uses" not in msg
    # with all of them available, the least hungry candidate uses them: said, not suggested
    msg = _message(problem)
    assert "it already uses" in msg and "full activation checkpointing" in msg
    assert "micro-batch 1" in msg and "or a smaller micro-batch" not in msg


def test_says_when_more_devices_cannot_help(tmp_path):
    tiny = prepare("gpt-small", _cluster_file(tmp_path, 0.002), global_batch=8)
    msg = _message(tiny)
    assert "activations and buffers alone need" in msg and "more devices will not do" in msg
    assert "at least" not in msg


def test_no_valid_configuration_says_why(problem):
    with pytest.raises(InfeasibleError, match="no valid configuration of 4 devices for global "
                                              "batch 3.*divisible by the data-parallel"):
        plan_problem(dataclasses.replace(problem, global_batch=3),
                     space=SearchSpace(tp=(1,), pp=(1,)))


def test_cli_prints_the_explanation_on_one_line(tmp_path, capsys):
    path = _cluster_file(tmp_path, 0.0005)      # a GPT-tiny's states alone need ~4 MB
    out = tmp_path / "plan.json"
    assert main(["plan", "gpt-tiny", "--cluster", path, "--global-batch", "8",
                 "-o", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: model does not fit: memory per device") and \
        err.count("\n") == 1
    assert not out.exists()
