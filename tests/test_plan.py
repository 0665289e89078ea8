"""Plan: JSON round trip, validation messages, atomic writes (pure unit tests)."""

from __future__ import annotations

import json
import os

import pytest

from autoplan.cluster import load_cluster
from autoplan.errors import PlanError
from autoplan.plan import (PLAN_VERSION, MemoryBreakdown, MeshSpec, ParallelConfig, Plan,
                           Prediction, Stage, TimeBreakdown, atomic_write_text)


def _plan(**overrides) -> Plan:
    parallel = ParallelConfig(dp=2, tp=2, pp=2, zero=1, micro_batch=2, num_micro_batches=4)
    stages = [
        Stage(index=0, layers=(0, 3), layer_names=("<pre>", "blocks.0", "blocks.1"),
              ranks=(0, 1, 2, 3), mesh_shape=(2, 2), checkpoint_layers=("blocks.1",)),
        Stage(index=1, layers=(3, 6), layer_names=("blocks.2", "blocks.3", "<post>"),
              ranks=(4, 5, 6, 7), mesh_shape=(2, 2)),
    ]
    pred = Prediction(step_time_s=1.5, tokens_per_s=100.0, samples_per_s=10.0,
                      model_tflops_per_device=100.0, hardware_tflops_per_device=120.0, mfu=0.4,
                      memory=MemoryBreakdown(params=1e9, grads=1e9, optimizer=2e9,
                                             activations=3e9),
                      memory_limit_bytes=80e9, time=TimeBreakdown(compute=1.0, bubble=0.5),
                      memory_per_stage=(MemoryBreakdown(params=1.0),))
    kw = dict(model={"source": "builtin", "name": "gpt", "config": {"layers": 4}},
              model_fingerprint="abc", num_params=1000,
              cluster=load_cluster("dgx-a100").to_dict(),
              global_batch=16, seq_len=128, mesh=MeshSpec(shape=(2, 2, 2)), parallel=parallel,
              stages=stages, param_placements={"blocks.0.attn.q.weight": {"tp": "Shard(0)",
                                                                          "dp": "Replicate()"}},
              prediction=pred)
    kw.update(overrides)
    return Plan(**kw)


def test_round_trip_is_exact(tmp_path):
    plan = _plan()
    path = plan.save(tmp_path / "p.json")
    again = Plan.load(path)
    assert again.to_json() == plan.to_json()
    assert again.parallel == plan.parallel
    assert again.stages == plan.stages
    assert again.prediction.memory.total == pytest.approx(7e9)
    assert again.world_size == 8


def test_label():
    assert _plan().parallel.label() == "dp2 tp2 pp2 z1 mb2x4 1f1b"


@pytest.mark.parametrize("mutate, message", [
    (lambda d: d.update(version=99), "field 'version'"),
    (lambda d: d.update(format="other"), "field 'format'"),
    (lambda d: d.update(bogus=1), "field 'bogus': unknown key"),
    (lambda d: d["parallel"].update(zero=5), "field 'parallel.zero'"),
    (lambda d: d["parallel"].update(dp=0), "field 'parallel.dp'"),
    (lambda d: d["parallel"].update(schedule="zigzag"), "field 'parallel.schedule'"),
    (lambda d: d["mesh"].update(shape=[2, 2]), "field 'mesh.shape'"),
    (lambda d: d.update(global_batch=17), "field 'global_batch'"),
    (lambda d: d["stages"][1].update(ranks=[4, 5, 6, 9]), "field 'stages[1].ranks'"),
    (lambda d: d["stages"][1].update(layers=[4, 6]), "field 'stages[1].layers'"),
    (lambda d: d["param_placements"].update(w={"tp": "Shard(x)"}), "param_placements.w.tp"),
    (lambda d: d["parallel"].update(wat=1), "parallel.wat"),
    (lambda d: d.pop("stages"), "field 'stages': missing"),
])
def test_validation_names_the_field(tmp_path, mutate, message):
    d = json.loads(_plan().to_json())
    mutate(d)
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(d))
    with pytest.raises(PlanError) as info:
        Plan.load(path)
    assert message in str(info.value)
    assert str(path) in str(info.value)


def test_not_json_names_file_and_line(tmp_path):
    path = tmp_path / "broken.json"
    path.write_text('{"format": \n oops}')
    with pytest.raises(PlanError, match=r"broken.json: not valid JSON \(line 2"):
        Plan.load(path)


def test_missing_file():
    with pytest.raises(PlanError, match="cannot read plan"):
        Plan.load("/nonexistent/plan.json")


def test_atomic_write_keeps_old_file_on_failure(tmp_path):
    path = tmp_path / "p.json"
    atomic_write_text(path, "old")


    with pytest.raises(TypeError):
        atomic_write_text(path, 123)            # write() of a non-str fails mid-way
    assert path.read_text() == "old"
    assert [p.name for p in tmp_path.iterdir()] == ["p.json"]   # no temp file left


def test_invalid_plan_is_not_written(tmp_path):
    plan = _plan(global_batch=99)
    with pytest.raises(PlanError):
        plan.save(tmp_path / "p.json")
    assert not os.path.exists(tmp_path / "p.json")


# ---- versions 3 and 4: typed planner metadata, runtime, per-stage times, pricing, migration --

OLD_PLANS = os.path.join(os.path.dirname(__file__), "data", "plans")


@pytest.mark.parametrize("name", sorted(os.listdir(OLD_PLANS)))
def test_plans_of_earlier_versions_load_migrated(name, tmp_path):
    """Plans written by earlier autoplans (committed files: v1 by the code before plan format
    v2, 6d5c8b2^; v2 by 44725ce; v3 by c1eaa7b) load as the current version: the free-form
    planner object typed, its runtime moved to the plan, no pricing recorded, nothing else
    changed; saved again they load identically."""
    path = os.path.join(OLD_PLANS, name)
    with open(path) as f:
        raw = json.load(f)
    assert raw["version"] in (1, 2, 3)
    plan = Plan.load(path)
    assert plan.version == PLAN_VERSION == 4
    assert plan.planner.name == raw["planner"]["name"]
    assert plan.runtime == raw.get("runtime", raw["planner"].get("runtime"))
    for key, value in raw["planner"].items():
        if key in ("name", "label", "evaluated", "feasible", "note"):
            assert getattr(plan.planner, key) == value, key
        elif key == "details":
            assert plan.planner.details == value
        elif key != "runtime":
            assert plan.planner.details[key] == value, key
    assert plan.parallel == ParallelConfig(**raw["parallel"])
    assert [s.layers for s in plan.stages] == [tuple(s["layers"]) for s in raw["stages"]]
    assert plan.prediction.step_time_s == raw["prediction"]["step_time_s"]
    if raw["version"] < 3:
        assert plan.prediction.stage_times == ()       # not recorded before version 3
    assert plan.pricing is None                        # not recorded before version 4
    again = Plan.load(plan.save(tmp_path / "p.json"))
    assert again.to_json() == plan.to_json()


def test_planner_metadata_is_typed_and_runtime_validated(tmp_path):
    plan = _plan(planner={"name": "auto", "label": "x", "evaluated": 3, "feasible": 2,
                          "runtime": "per_op", "explain": [{"op": "mm"}]})
    assert plan.planner.name == "auto" and plan.planner.evaluated == 3
    assert plan.runtime == "per_op"                    # moved out of the planner mapping
    assert plan.planner.details == {"explain": [{"op": "mm"}]}
    assert plan.planner["name"] == "auto" and plan.planner.get("explain") == [{"op": "mm"}]
    d = Plan.load(plan.save(tmp_path / "p.json")).to_dict()
    assert d["runtime"] == "per_op" and d["planner"]["details"] == {"explain": [{"op": "mm"}]}
    for bad, field in ((dict(d, runtime="fast"), "field 'runtime'"),
                       (dict(d, planner={**d["planner"], "evaluated": -1}),
                        "field 'planner.evaluated'"),
                       (dict(d, planner={**d["planner"], "name": 3}), "field 'planner.name'")):
        with pytest.raises(PlanError, match=field):
            Plan.from_dict(bad, source="x.json")


def test_label_follows_the_placements():
    """``Plan.label`` does not call an axis with no sharded weight tensor parallelism."""
    sharded = _plan()
    assert "tp2 " in sharded.label() + " " and "(repl)" not in sharded.label()
    replicated = _plan(param_placements={"blocks.0.attn.q.weight": {"tp": "Replicate()",
                                                                    "dp": "Replicate()"}})
    assert "tp2(repl)" in replicated.label()
    assert replicated.parallel.label() == sharded.parallel.label()


def test_stage_times_round_trip(tmp_path):
    from dataclasses import replace

    from autoplan.plan import StageTime

    plan = _plan()
    times = (StageTime(forward=1.0, backward=2.0, send=0.1),
             StageTime(forward=1.5, backward=3.0, tp_forward=0.2))
    plan = replace(plan, prediction=replace(plan.prediction, stage_times=times))
    again = Plan.load(plan.save(tmp_path / "p.json"))
    assert again.prediction.stage_times == times
    d = again.to_dict()
    d["prediction"]["stage_times"][0]["forward"] = "fast"
    with pytest.raises(PlanError, match=r"field 'prediction.stage_times\[0\].forward'"):
        Plan.from_dict(d, source="x.json")


def test_atomic_write_writes_through_devices_and_refuses_directories(tmp_path):
    """``-o /dev/null`` must not replace the device with a regular file (as root it would);
    a directory in the way is refused with an error naming it."""
    import stat

    atomic_write_text("/dev/null", "{}")
    assert stat.S_ISCHR(os.stat("/dev/null").st_mode)
    link = tmp_path / "null-link"
    link.symlink_to("/dev/null")
    atomic_write_text(link, "{}")
    assert link.is_symlink() and stat.S_ISCHR(os.stat("/dev/null").st_mode)
    (tmp_path / "d").mkdir()
    with pytest.raises(OSError, match="not a regular file.*d"):
        atomic_write_text(tmp_path / "d", "{}")
