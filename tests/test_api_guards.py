"""Argument guards of the Python API (issue #7): ``autoplan.estimate`` / ``optimize`` with a
zero, negative or wrong-typed degree, size or batch raise a ConfigError naming the argument --
never a ZeroDivisionError, an overflow, or a divisor search that never ends -- and, where the
argument alone is wrong, before the model is traced."""

from __future__ import annotations

import time

import pytest

import autoplan
from autoplan.api import MAX_GLOBAL_BATCH, prepare
from autoplan.errors import ConfigError

TINY = dict(model="mlp-tiny", cluster="local-cpu")


@pytest.fixture(scope="module")
def problem():
    """mlp-tiny traced once for local-cpu (4 devices), global batch 8."""
    return prepare(TINY["model"], TINY["cluster"], global_batch=8)


@pytest.mark.parametrize("argument, value", [
    ("tp", 0), ("pp", 0), ("dp", 0), ("tp", -2), ("pp", -1), ("dp", -4),
    ("micro_batch", 0), ("micro_batch", -1), ("virtual_stages", 0),
    ("tp", 1.5), ("dp", "2"), ("pp", True), ("tp", None),
])
def test_estimate_refuses_bad_degrees_before_tracing(monkeypatch, argument, value):
    import autoplan.api as api

    def no_trace(*args, **kwargs):
        raise AssertionError("traced the model before checking the arguments")

    monkeypatch.setattr(api, "prepare", no_trace)
    with pytest.raises(ConfigError, match=f"field '{argument}': must be an integer"):
        autoplan.estimate(**TINY, global_batch=8, **{argument: value})


@pytest.mark.parametrize("argument, value, message", [
    ("zero", 4, "must be 0, 1, 2 or 3"), ("zero", True, "must be 0, 1, 2 or 3"),
    ("checkpoint", "some", "must be 'none', 'selective', 'op' or 'full'"), ("schedule", "zb", "must be one of"),
    ("sequence_parallel", "yes", "must be True or False"),
])
def test_estimate_refuses_bad_choices(argument, value, message):
    with pytest.raises(ConfigError, match=f"field '{argument}': {message}"):
        autoplan.estimate(**TINY, global_batch=8, **{argument: value})


@pytest.mark.parametrize("kwargs, argument, needle", [
    (dict(tp=3), "tp", "tp*pp = 3 does not divide the 4 devices"),
    (dict(tp=2, pp=3), "tp", "tp*pp = 6 does not divide the 4 devices"),
    (dict(dp=3), "dp", "dp*tp*pp = 3*1*1 = 3 but the cluster has 4 devices"),
    (dict(dp=2, tp=4), "dp", "= 8 but the cluster has 4 devices"),
    (dict(tp=10 ** 30), "tp", "does not divide the 4 devices"),
    (dict(micro_batch=3), "micro_batch", "not divisible by dp * micro_batch = 4 * 3 = 12"),
])
def test_estimate_degrees_must_fit_the_world(problem, kwargs, argument, needle):
    with pytest.raises(ConfigError) as info:
        autoplan.estimate(**TINY, global_batch=8, problem=problem, **kwargs)
    assert f"field '{argument}'" in str(info.value) and needle in str(info.value)


@pytest.mark.parametrize("entry", ["estimate", "optimize"])
@pytest.mark.parametrize("global_batch", [0, -8, 10 ** 30, MAX_GLOBAL_BATCH + 1, 2.0, True,
                                          "8", None])
def test_absurd_global_batch_is_a_clear_error_at_once(entry, global_batch):
    t0 = time.perf_counter()
    with pytest.raises(ConfigError, match="field 'global_batch': must be an integer"):
        getattr(autoplan, entry)(**TINY, global_batch=global_batch)
    assert time.perf_counter() - t0 < 5          # no trace, no divisor search


@pytest.mark.parametrize("kwargs, argument", [
    (dict(seq_len=0), "seq_len"), (dict(seq_len=-1), "seq_len"),
    (dict(seq_len=2 ** 40), "seq_len"), (dict(nodes=0), "nodes"), (dict(nodes=-3), "nodes"),
    (dict(top_k=-1), "top_k"),
])
def test_optimize_refuses_bad_sizes(kwargs, argument):
    with pytest.raises(ConfigError, match=f"field '{argument}': must be an integer"):
        autoplan.optimize(**TINY, global_batch=8, **kwargs)


def test_optimize_refuses_an_unknown_planner_before_tracing():
    with pytest.raises(ConfigError, match="field 'planner': must be one of auto, uniform"):
        autoplan.optimize(**TINY, global_batch=8, planner="alpa")


def test_valid_arguments_still_estimate(problem):
    plan = autoplan.estimate(**TINY, global_batch=8, problem=problem, tp=1, pp=1, dp=4,
                             micro_batch=2)
    assert plan.parallel.label() == "dp4 tp1 pp1 z0 mb2x1 1f1b"
    assert plan.global_batch == 8
