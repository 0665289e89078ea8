"""Fuzzed plan files (issue #7): ``Plan.load`` on 1,000 mutated saved plans.

The seeds are two plans the planner wrote (tests/fuzz_helpers.py: plan_seeds). Every input
must be accepted -- and then validate, hold a valid cluster and model spec and finite
predicted figures, and survive save -> load byte for byte -- or be rejected with a PlanError
naming the file and the field. The tests after the fuzz run pin what it once found in
autoplan/plan.py (non-UTF-8 text, deep nesting, huge integers, wrong types, NaN figures, an
invalid embedded cluster or model, duplicate keys). ``benchmarks/fuzz_counts.py`` counts the
outcomes per exception type.
"""

from __future__ import annotations

import json
import math
import os

import pytest

from autoplan.errors import PlanError
from autoplan.plan import Plan
from fuzz_helpers import Tally, plan_seeds, run_plan_fuzz, scratch_dir


@pytest.fixture(scope="module")
def seeds(tmp_path_factory) -> list[tuple[str, dict]]:
    return plan_seeds(tmp_path_factory.mktemp("plans"))


@pytest.fixture
def seed(seeds) -> dict:
    """The saved GPT plan (TP + SP, PP, ZeRO-1, checkpointing, per-parameter placements)."""
    return dict(seeds)["plan:gpt-tiny"]


def _load(tmp_path, doc_or_bytes) -> Plan:
    path = tmp_path / "plan.json"
    if isinstance(doc_or_bytes, bytes):
        path.write_bytes(doc_or_bytes)
    else:
        path.write_text(json.dumps(doc_or_bytes))
    return Plan.load(path)


def test_fuzz_plan_json(tmp_path, seeds):
    with scratch_dir(tmp_path) as work:
        tally = run_plan_fuzz(Tally("plan JSON"), work, max_examples=1000, shrink=False,
                              seeds=seeds)
    print("\n" + tally.line())
    assert tally.tried >= 1000 and not tally.unexpected
    assert tally.accepted >= 20 and sum(tally.rejected.values()) >= 500


def test_valid_plans_load_back_identical(tmp_path, seed):
    plan = _load(tmp_path, seed)
    assert json.loads(plan.to_json()) == seed


def test_a_failed_save_leaves_the_previous_plan_intact(tmp_path, seed, monkeypatch):
    import autoplan.plan as plan_module

    path = tmp_path / "plan.json"
    before = json.dumps(seed)
    path.write_text(before)
    plan = _load(tmp_path, seed)

    def disk_full(fd):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(plan_module.os, "fsync", disk_full)
    with pytest.raises(OSError):
        plan.save(path)
    assert path.read_text() == before
    assert not [p for p in os.listdir(tmp_path) if p.endswith(".tmp")]


# ---- what the fuzzer found in plan.py (each failed before plan.py checked it) ----------

def test_plan_file_not_utf8(tmp_path, seed):
    with pytest.raises(PlanError, match="plan.json"):
        _load(tmp_path, b"\xff\xfe" + json.dumps(seed).encode())


def test_plan_file_nested_too_deeply(tmp_path):
    with pytest.raises(PlanError, match="plan.json"):
        _load(tmp_path, b'{"format": "autoplan.plan", "x": ' + b"[" * 100_000 + b"]" * 100_000
              + b"}")


def test_plan_file_with_a_huge_integer(tmp_path, seed):
    text = json.dumps({**seed, "num_params": 0}).replace('"num_params": 0',
                                                          '"num_params": ' + "9" * 5000)
    with pytest.raises(PlanError, match="plan.json"):
        _load(tmp_path, text.encode())


def _set(doc: dict, dotted: str, value) -> dict:
    doc = json.loads(json.dumps(doc))
    *parents, last = dotted.split("/")
    node = doc
    for key in parents:
        node = node[int(key)] if isinstance(node, list) else node[key]
    node[int(last) if isinstance(node, list) else last] = value
    return doc


_PARAM = "blocks.0.attn.q.weight"


def _nested(depth: int) -> list:
    out: list = [1]
    for _ in range(depth):
        out = [out]
    return out


#: (path to change, new value, the field the PlanError must name, what plan.py checks)
WRONG_TYPES = [
    ("mesh", [], "mesh", "check mesh is an object before {**mesh}"),
    ("mesh/shape", 4, "mesh.shape", "check mesh.shape is a list before tuple()"),
    ("stages/0/layers", [[0], 3], "stages[0].layers",
     "Stage: check layers is two integers, ranks / mesh_shape integers, names strings"),
    ("stages/0", "stage", "stages[0]", "_stage_from_dict: check the stage is an object"),
    ("param_placements", [], "param_placements",
     "check param_placements is an object of objects"),
    (f"param_placements/{_PARAM}", [], f"param_placements.{_PARAM}",
     "check each parameter's placements is an object"),
    (f"param_placements/{_PARAM}/tp", {}, f"param_placements.{_PARAM}.tp",
     "check a placement is a string before the regex"),
    ("prediction/memory/params", "x", "prediction.memory.params",
     "MemoryBreakdown / TimeBreakdown / Prediction: fields must be finite numbers"),
    ("prediction/step_time_s", math.nan, "prediction.step_time_s",
     "Prediction: NaN / inf figures would be written back as non-standard JSON"),
    ("prediction/time/compute", None, "prediction.time.compute",
     "TimeBreakdown: None would make total raise TypeError in to_json"),
    ("cluster/nodes", "four", "cluster.nodes",
     "validate the embedded cluster with Cluster.from_dict (prefixing 'cluster.' to the "
     "field)"),
    ("cluster", [], "cluster", "check cluster is an object (a valid Cluster)"),
    ("model", {"source": "builtin"}, "model.name",
     "validate the embedded model with ModelSpec.from_dict"),
    ("num_params", "many", "num_params", "check num_params / seq_len are integers"),
    ("precision", [], "precision", "check precision is an object of strings"),
    ("parallel/zero", True, "parallel.zero", "a boolean is not a ZeRO stage"),
    ("parallel/sequence_parallel", "yes", "parallel.sequence_parallel", "must be a boolean"),
    ("parallel/micro_batch", 10 ** 4000, "parallel.micro_batch",
     "counts are bounded, so products of them stay printable"),
    ("mesh/shape", [2, 2 ** 40, 1], "mesh.shape", "a mesh is at most 2**24 devices"),
    ("stages/1/predicted", {"s": math.inf}, "stages[1].predicted.s", "finite figures"),
    ("alternatives", {"a": 1}, "alternatives", "alternatives are a list of objects"),
    ("planner", {"x": _nested(40)}, "planner", "free-form sections nest at most 32 levels"),
    ("model/config", [1], "model.config", "a model's config is an object"),
]


@pytest.mark.parametrize("where, value, field, fix", [
    pytest.param(*case, id=case[0]) for case in WRONG_TYPES])
def test_wrong_types_in_a_plan_name_their_field(tmp_path, seed, where, value, field, fix):
    with pytest.raises(PlanError) as info:
        plan = _load(tmp_path, _set(seed, where, value))
        plan.to_json()                 # an accepted plan must at least write itself back
    assert "plan.json" in str(info.value) and f"field '{field}'" in str(info.value)


def test_duplicate_keys_in_a_plan_are_errors(tmp_path, seed):
    text = json.dumps(seed)
    text = "{" + '"global_batch": 4096, ' + text[1:]
    with pytest.raises(PlanError, match="global_batch"):
        _load(tmp_path, text.encode())
