"""Every ``--json`` output against the one documented schema (autoplan/schema/
output.schema.json), and the README's "Output fields" table against that schema."""

from __future__ import annotations

import contextlib
import io
import json
import re
from pathlib import Path

import pytest

from autoplan.cli import main
from autoplan.schema import FILE, commands, load, schema_for

jsonschema = pytest.importorskip("jsonschema")

ROOT = Path(__file__).resolve().parent.parent
TINY = ["gpt-tiny", "--cluster", "local-cpu", "--global-batch", "8"]


def run_json(*argv: str):
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main([*argv, "--json"]) == 0
    return json.loads(out.getvalue())


def check(command: str, doc) -> None:
    jsonschema.Draft202012Validator(schema_for(command)).validate(doc)


@pytest.fixture(scope="module")
def plans(tmp_path_factory):
    d = tmp_path_factory.mktemp("plans")
    auto = run_json("plan", *TINY, "-o", str(d / "auto.json"))
    uniform = run_json("plan", *TINY, "--planner", "uniform", "-o", str(d / "uniform.json"))
    return d, auto, uniform


def test_schema_is_valid_and_shipped():
    jsonschema.Draft202012Validator.check_schema(load())
    pyproject = (ROOT / "pyproject.toml").read_text()
    assert "schema/*.json" in pyproject and FILE.is_file()
    assert set(commands()) >= {"plan", "show", "estimate", "trace", "models", "clusters",
                               "demo", "export", "launch", "report"}


def test_plan_and_show(plans):
    d, auto, uniform = plans
    check("plan", auto)
    check("plan", uniform)
    assert auto["planner"]["name"] == "auto" and uniform["planner"]["name"] == "uniform"
    for name in ("auto.json", "uniform.json"):
        shown = run_json("show", str(d / name))
        check("show", shown)
        assert shown["prediction"] == (auto if name == "auto.json" else uniform)["prediction"]


def test_schema_rejects_what_it_should(plans):
    _, auto, _ = plans
    bad = json.loads(json.dumps(auto))
    del bad["prediction"]["step_time_s"]
    with pytest.raises(jsonschema.ValidationError):
        check("plan", bad)
    with pytest.raises(jsonschema.ValidationError):
        check("plan", {**auto, "surprise": 1})


def test_estimate_has_the_documented_fields(tmp_path):
    doc = run_json("estimate", *TINY, "--tp", "2", "-o", str(tmp_path / "mine.json"))
    check("estimate", doc)
    assert doc["config"]["tp"] == 2 and doc["prediction"]["step_time_s"] > 0
    assert doc["planner"]["name"] == "estimate"
    assert doc["autoplan"]["speedup"] >= 1.0 - 1e-9
    assert doc["plan_file"] == str(tmp_path / "mine.json")
    alone = run_json("estimate", *TINY, "--tp", "2", "--no-compare")
    check("estimate", alone)
    assert alone["autoplan"] is None


def test_trace_models_clusters():
    trace = run_json("trace", "gpt-tiny")
    check("trace", trace)
    assert sum(r["params"] for r in trace["per_layer"]) >= trace["params"]
    models = run_json("models")
    check("models", models)
    llama2 = {m["name"]: m["config"] for m in models}["llama2-7b"]
    assert llama2["kv_heads"] == llama2["heads"] == 32
    check("clusters", run_json("clusters"))


def test_export_launch_report(plans, tmp_path):
    d, _, uniform = plans
    plan = str(d / "uniform.json")
    dp_only = str(tmp_path / "dp.json")       # a configuration every exporter expresses
    run_json("estimate", *TINY, "--no-compare", "-o", dp_only)
    for target in ("torchtitan", "megatron", "deepspeed"):
        check("export", run_json("export", dp_only, "--to", target))
    check("launch", run_json("launch", plan, "--master-addr", "host0"))
    check("launch", run_json("launch", plan, "--slurm", "-o", str(tmp_path / "job.sbatch")))
    check("report", run_json("report", plan, "-o", str(tmp_path / "r.html")))


def test_host_load_record():
    from autoplan.hostload import HostLoadMeter

    with HostLoadMeter() as m:
        sum(range(10000))
    check("host_load", json.loads(json.dumps(m.result.to_dict())))   # as written to disk


# ---- the README's "Output fields" table ---------------------------------------------------

def readme_fields() -> list[str]:
    """Field paths of the README's 'Output fields (`--json`)' table; a name after a comma
    without dots is relative to the previous one's parent (`prediction.tokens_per_s`,
    `samples_per_s` -> prediction.samples_per_s)."""
    text = (ROOT / "README.md").read_text()
    section = text.split("## Output fields", 1)[1].split("\n## ", 1)[0]
    paths = []
    for line in section.splitlines():
        if not line.startswith("| `"):
            continue
        first = line.split("|")[1]
        parent = ""
        for name in re.findall(r"`([^`]+)`", first):
            path = name if "." in name or not parent else f"{parent}.{name}"
            parent = path.rsplit(".", 1)[0] if "." in path else ""
            paths.append(path)
    return paths


def resolve(path: str) -> dict | None:
    """The schema node of ``path`` in the plan output (or an estimate / plan extra)."""
    defs = load()["$defs"]
    for root in ("plan_output", "plan", "estimate"):
        node = defs[root]
        for part in path.split("."):
            node = _deref(node, defs)
            props = node.get("properties", {})
            if part not in props:
                node = None
                break
            node = props[part]
        if node is not None:
            return _deref(node, defs)
    return None


def _deref(node: dict, defs: dict) -> dict:
    while "$ref" in node and "properties" not in node:
        node = defs[node["$ref"].rsplit("/", 1)[1]]
    if "oneOf" in node:
        node = next((o for o in node["oneOf"] if o.get("type") != "null"), node)
        return _deref(node, defs)
    return node


def test_readme_table_matches_the_schema():
    fields = readme_fields()
    assert "prediction.step_time_s" in fields and "prediction.samples_per_s" in fields
    missing = [f for f in fields if resolve(f) is None]
    assert not missing, f"README fields the schema does not define: {missing}"
    defs = load()["$defs"]
    top = set(defs["plan_output"]["properties"]) | set(defs["plan"]["properties"]) \
        | set(defs["estimate"]["properties"])
    undocumented = top - {f.split(".")[0] for f in fields}
    assert not undocumented, f"top-level fields the README's table leaves out: {undocumented}"
    pred = set(defs["prediction"]["properties"])
    assert pred <= {f.split(".")[1] for f in fields if f.startswith("prediction.")}


def test_profile_ops_and_calibrate(tmp_path):
    import autoplan

    doc = run_json("profile", "ops", "gpt-tiny", "--limit", "2", "--repeats", "1",
                   "--warmup", "0", "--out", str(tmp_path / "ops.json"))
    check("profile_ops", doc)
    # a finished run directory as the engine writes it: plan, per-step metrics, summary
    run = tmp_path / "run"
    run.mkdir()
    plan = autoplan.estimate("gpt-tiny", "local-cpu", global_batch=8)
    plan.save(run / "plan.json")
    (run / "metrics.jsonl").write_text("".join(
        json.dumps({"step": i, "step_time_s": 0.02 + 0.001 * i, "loss": 1.0}) + "\n"
        for i in range(1, 7)))
    (run / "summary.json").write_text(json.dumps({
        "plan": "plan.json", "label": plan.parallel.label(), "warmup_steps": 1,
        "measured": {"step_time_s": 0.024, "peak_memory_bytes": 5e6}, "predicted": None}))
    check("calibrate", run_json("calibrate", str(run), "--dry-run"))


def test_a_float8_estimate_says_so_in_its_json():
    doc = run_json("estimate", "gpt", "--layers", "2", "--hidden", "256", "--heads", "4",
                   "--vocab", "1024", "--seq-len", "128", "--cluster", "dgx-h100",
                   "--global-batch", "16", "--precision", "mixed-fp8", "--no-compare")
    check("estimate", doc)
    assert doc["precision"] == {"params": "float32", "compute": "bfloat16",
                                "reduce": "float32", "matmul": "float8"}
