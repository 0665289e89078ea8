"""Export to torchtitan (TOML), Megatron-LM (arguments) and DeepSpeed (JSON): a uniform plan
round-trips its degrees, micro-batching and checkpointing; what a target cannot express is
refused naming the feature."""

from __future__ import annotations

import dataclasses
import json
import shlex
import tomllib

import pytest

import autoplan
from autoplan.api import prepare
from autoplan.export import NotExpressibleError, export_plan
from autoplan.models.registry import resolve
from autoplan.plan import Plan, Stage
from tests.workflow_helpers import run_cli

SMALL = resolve("gpt", layers=8, hidden=512, heads=8, vocab_size=8192, seq_len=512)


@pytest.fixture(scope="module")
def problem():
    return prepare(SMALL, "dgx-a100", nodes=4, global_batch=256)


def make(problem, **config) -> Plan:
    return autoplan.estimate(None, None, global_batch=256, problem=problem, **config)


def megatron_flags(text: str) -> dict[str, str | bool]:
    """The bash array MEGATRON_PARALLEL_ARGS=( ... ) as {flag: value or True}."""
    body = text.split("MEGATRON_PARALLEL_ARGS=(\n", 1)[1].split("\n)", 1)[0]
    out: dict[str, str | bool] = {}
    for line in body.splitlines():
        words = shlex.split(line)
        assert words[0].startswith("--") and len(words) <= 2, line
        out[words[0]] = words[1] if len(words) == 2 else True
    return out


def test_torchtitan_round_trip(problem):
    plan = make(problem, tp=2, pp=2, zero=3, micro_batch=2, sequence_parallel=True,
                checkpoint="full")
    p = plan.parallel
    doc = tomllib.loads(export_plan(plan, "torchtitan", steps=100).text)
    par, train = doc["parallelism"], doc["training"]
    assert (par["tensor_parallel_degree"], par["pipeline_parallel_degree"]) == (2, 2)
    assert par["data_parallel_shard_degree"] == p.dp == 8
    assert par["data_parallel_replicate_degree"] == 1
    assert par["fsdp_reshard_after_forward"] == "always"
    assert par["pipeline_parallel_schedule"] == "1F1B"
    assert par["pipeline_parallel_microbatch_size"] == p.micro_batch
    assert train["local_batch_size"] // par["pipeline_parallel_microbatch_size"] \
        == p.num_micro_batches
    assert train["global_batch_size"] == plan.global_batch
    assert train["global_batch_size"] == train["local_batch_size"] * p.dp
    assert (train["seq_len"], train["steps"]) == (512, 100)
    assert train["mixed_precision_param"] == "bfloat16"
    assert doc["activation_checkpoint"]["mode"] == "full"
    parts = par["module_fqns_per_model_part"]
    assert len(parts) == 2 and parts[0][0] == "tok_embeddings" and parts[-1][-2:] == [
        "norm", "output"]
    assert sum(parts, []) == ["tok_embeddings", *(f"layers.{i}" for i in range(8)),
                              "norm", "output"]


def test_torchtitan_interleaved_and_data_parallel(problem):
    plan = make(problem, tp=2, pp=2, zero=3, micro_batch=1, schedule="interleaved_1f1b",
                virtual_stages=2)
    par = tomllib.loads(export_plan(plan, "torchtitan").text)["parallelism"]
    assert par["pipeline_parallel_schedule"] == "Interleaved1F1B"
    assert len(par["module_fqns_per_model_part"]) == 4
    dp_only = tomllib.loads(export_plan(make(problem, micro_batch=2), "torchtitan").text)
    assert dp_only["parallelism"]["data_parallel_replicate_degree"] == 32
    assert dp_only["parallelism"]["data_parallel_shard_degree"] == 1
    assert dp_only["training"]["local_batch_size"] == 2          # 4 accumulation steps
    assert dp_only["activation_checkpoint"]["mode"] == "none"
    assert "pipeline_parallel_schedule" not in dp_only["parallelism"]


def test_torchtitan_model_flavor_and_notes(problem):
    plan = make(problem, tp=2, zero=3)
    exported = export_plan(plan, "torchtitan")
    assert "[model]" in exported.text and "no torchtitan flavor" in exported.text
    assert any("sequence parallelism" in n for n in exported.notes)
    llama = Plan.from_dict({**plan.to_dict(), "model": resolve("llama3-8b").to_dict()})
    assert tomllib.loads(export_plan(llama, "torchtitan").text)["model"] == {
        "name": "llama3", "flavor": "8B"}


def test_megatron_round_trip(problem):
    plan = make(problem, tp=2, pp=2, zero=1, micro_batch=1, sequence_parallel=True,
                schedule="interleaved_1f1b", virtual_stages=2, checkpoint="full")
    p = plan.parallel
    args = megatron_flags(export_plan(plan, "megatron").text)
    assert args["--tensor-model-parallel-size"] == "2"
    assert args["--pipeline-model-parallel-size"] == "2"
    assert int(args["--num-layers-per-virtual-pipeline-stage"]) * p.pp * p.virtual_stages \
        == int(args["--num-layers"]) == 8
    assert args["--sequence-parallel"] is True and args["--use-distributed-optimizer"] is True
    assert int(args["--micro-batch-size"]) == p.micro_batch
    assert int(args["--global-batch-size"]) == plan.global_batch
    world = plan.world_size        # Megatron derives dp and the micro-batch count
    dp = world // (int(args["--tensor-model-parallel-size"])
                   * int(args["--pipeline-model-parallel-size"]))
    assert dp == p.dp
    assert int(args["--global-batch-size"]) // (dp * p.micro_batch) == p.num_micro_batches
    assert (args["--recompute-granularity"], args["--recompute-method"],
            args["--recompute-num-layers"]) == ("full", "uniform", "1")
    assert args["--bf16"] is True
    assert (args["--hidden-size"], args["--num-attention-heads"], args["--seq-length"]) == (
        "512", "8", "512")
    plain = megatron_flags(export_plan(make(problem, micro_batch=8), "megatron").text)
    for flag in ("--use-distributed-optimizer", "--sequence-parallel", "--recompute-method",
                 "--num-layers-per-virtual-pipeline-stage"):
        assert flag not in plain


def test_megatron_llama_model_arguments(problem):
    plan = make(problem, tp=2)
    llama = Plan.from_dict({**plan.to_dict(), "model": resolve("llama2-70b").to_dict()})
    args = megatron_flags(export_plan(llama, "megatron").text)
    assert args["--num-query-groups"] == "8" and args["--group-query-attention"] is True
    assert args["--swiglu"] is True and args["--normalization"] == "RMSNorm"
    assert (args["--num-layers"], args["--ffn-hidden-size"]) == ("80", "28672")


def test_deepspeed_round_trip(problem):
    plan = make(problem, zero=2, micro_batch=2, checkpoint="full")
    p = plan.parallel
    doc = json.loads(export_plan(plan, "deepspeed").text)
    assert doc["zero_optimization"] == {"stage": 2}
    assert doc["train_batch_size"] == plan.global_batch
    assert doc["train_micro_batch_size_per_gpu"] == p.micro_batch
    assert doc["gradient_accumulation_steps"] == p.num_micro_batches
    assert doc["train_batch_size"] == (doc["train_micro_batch_size_per_gpu"]
                                       * doc["gradient_accumulation_steps"] * p.dp)
    assert doc["bf16"] == {"enabled": True}
    assert "activation_checkpointing" in doc


@pytest.mark.parametrize("target, config, needles", [
    ("megatron", dict(zero=3), ["ZeRO-3", "optimizer states only"]),
    ("megatron", dict(zero=2), ["ZeRO-2"]),
    ("megatron", dict(pp=2, schedule="gpipe"), ["GPipe"]),
    ("megatron", dict(pp=2, schedule="interleaved_1f1b", virtual_stages=3),
     ["unequal blocks per stage [1, 2, 2, 1, 1, 1]"]),
    ("torchtitan", dict(zero=1), ["ZeRO-1"]),
    ("torchtitan", dict(tp=2, zero=0), ["DDP supports 1-D meshes only"]),
    ("deepspeed", dict(tp=2), ["tensor parallelism (tp = 2)"]),
    ("deepspeed", dict(pp=2, schedule="interleaved_1f1b", virtual_stages=2),
     ["pipeline parallelism (pp = 2)", "no interleaved schedule"]),
])
def test_what_a_target_cannot_express(problem, target, config, needles):
    plan = make(problem, **config)
    with pytest.raises(NotExpressibleError) as info:
        export_plan(plan, target)
    for needle in needles:
        assert needle in str(info.value)


def test_heterogeneous_stages_and_unknown_fields_are_refused(problem):
    plan = make(problem, tp=2, pp=2, zero=1)
    hetero = Plan.from_dict(plan.to_dict())
    hetero.stages[1] = dataclasses.replace(hetero.stages[1], mesh_shape=(4, 4))
    for target in ("torchtitan", "megatron", "deepspeed"):
        with pytest.raises(NotExpressibleError, match="per-stage meshes"):
            export_plan(hetero, target)

    @dataclasses.dataclass(frozen=True, kw_only=True)
    class NewStage(Stage):                 # a plan format with a field this exporter lacks
        future_knob: int | None = None

    newer = Plan.from_dict(plan.to_dict())
    newer.stages[0] = NewStage(**dataclasses.asdict(newer.stages[0]), future_knob=3)
    with pytest.raises(NotExpressibleError, match=r"stages\[0\]\.future_knob"):
        export_plan(newer, "megatron")
    newer.stages[0] = NewStage(**dataclasses.asdict(plan.stages[0]))     # default: fine
    assert "--tensor-model-parallel-size" in export_plan(newer, "megatron").text


def test_command(problem, tmp_path, capsys):
    path = make(problem, tp=2, pp=2, zero=1, micro_batch=2).save(tmp_path / "plan.json")
    out = tmp_path / "args.sh"
    assert run_cli(["export", str(path), "--to", "megatron", "-o", str(out)]) == 0
    assert "--pipeline-model-parallel-size 2" in out.read_text()
    assert str(out) in capsys.readouterr().out
    assert run_cli(["export", str(path), "--to", "megatron", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["target"] == "megatron" and doc["file"] is None and doc["notes"]
    assert run_cli(["export", str(path), "--to", "deepspeed"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: DeepSpeed cannot express this plan")
    with pytest.raises(SystemExit):
        run_cli(["export", str(path), "--to", "colossalai"])
    capsys.readouterr()
    # a model value out of range in the plan file: one line naming the file and the field
    doc = json.loads(path.read_text())
    doc["model"]["config"]["layers"] = 10 ** 9
    (tmp_path / "edited.json").write_text(json.dumps(doc))
    assert run_cli(["export", str(tmp_path / "edited.json"), "--to", "megatron"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "edited.json: field 'model.layers'" in err[0]


def test_search_plans_export_when_uniform_and_refuse_per_op_placements_by_name(tmp_path):
    """The default planner's plan exports when the uniform layout expresses it exactly;
    a plan that places ops individually is refused with the reason."""
    import dataclasses

    import autoplan
    from autoplan.export.common import NotExpressibleError, uniform_layout

    plan = autoplan.optimize("gpt-small", "dgx-a100", global_batch=64)
    assert plan.planner["name"] == "auto"
    layout = uniform_layout(plan, "test")
    assert sum(layout.blocks_per_chunk) == 8
    sharded = dataclasses.replace(plan, param_placements={
        **plan.param_placements, "head.weight": {"dp": "Shard(0)", "tp": "Replicate()"}})
    with pytest.raises(NotExpressibleError, match="places ops individually.*head.weight"):
        uniform_layout(sharded, "test")


def test_megatron_uneven_first_and_last_stages():
    """6 blocks over 4 stages run 1, 2, 2, 1 (the extra blocks in the middle): Megatron-core
    names the end stages' counts with --decoder-first/last-pipeline-num-layers."""
    six = resolve("gpt", layers=6, hidden=512, heads=8, vocab_size=8192, seq_len=512)
    problem = prepare(six, "dgx-a100", nodes=4, global_batch=256)
    plan = autoplan.estimate(None, None, global_batch=256, problem=problem, pp=4)
    args = megatron_flags(export_plan(plan, "megatron").text)
    assert (args["--decoder-first-pipeline-num-layers"],
            args["--decoder-last-pipeline-num-layers"]) == ("1", "1")
    assert args["--num-layers"] == "6" and args["--pipeline-model-parallel-size"] == "4"
