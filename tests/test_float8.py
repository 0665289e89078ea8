"""mixed-fp8: the blocks' linear layers on float8 tensor cores (autoplan.precision,
autoplan.cost.float8), priced, planned, validated in plans and refused where no float8 exists."""

from __future__ import annotations

import json

import pytest

from autoplan.api import estimate, prepare
from autoplan.cost.float8 import cast_seconds, is_float8_gemm
from autoplan.cost.profiled import resolve_cost_models
from autoplan.errors import AutoplanError, ConfigError, PlanError
from autoplan.models import resolve
from autoplan.plan import Plan
from autoplan.precision import float8_layer, from_dtype, from_plan, precision

MODEL = dict(layers=4, hidden=2048, heads=16, vocab_size=32000, seq_len=2048)


@pytest.fixture(scope="module")
def problems():
    spec = resolve("gpt", **MODEL)
    return {name: prepare(spec, "dgx-h100", nodes=1, global_batch=16, precision=name)
            for name in ("mixed", "mixed-fp8")}


def test_the_precision_table_names_float8_gemms():
    fp8 = precision("mixed-fp8")
    assert fp8.plan_dict() == {"params": "float32", "compute": "bfloat16",
                               "reduce": "float32", "matmul": "float8"}
    assert fp8.state_bytes == precision("mixed").state_bytes      # weights stay bf16 / fp32
    assert from_plan(fp8.plan_dict()).name == "mixed-fp8"
    assert from_plan(precision("mixed").plan_dict()).name == "mixed"
    assert from_dtype("bfloat16").name == "mixed"                 # bf16 alone is not fp8
    with pytest.raises(ValueError, match="float8"):
        from_plan({"compute": "float32", "matmul": "float8"})


@pytest.mark.parametrize("layer, shape, fp8", [
    ("blocks.3", (2048, 8192), True),
    ("model.layers.0", (4096, 4096), True),
    ("<pre>", (2048, 2048), False),           # embedding side
    ("<post>", (32000, 2048), False),         # the output projection stays bf16
    ("blocks.0", (2048, 2050), False),        # torch._scaled_mm needs multiples of 16
    ("blocks.0", (2048,), False),             # not a matrix
])
def test_which_layers_run_in_float8(layer, shape, fp8):
    assert float8_layer(layer, shape) is fp8


def test_only_the_blocks_linear_gemms_are_priced_in_float8(problems):
    graph = problems["mixed"].graph
    fp8 = [n for n in graph if is_float8_gemm(n, graph)]
    assert fp8 and all(n.module_type == "Linear" for n in fp8)
    assert all(not graph.layers[n.layer].name.startswith("<") for n in fp8)
    # every Linear GEMM in a block is in; attention's products are not
    linears = [n for n in graph if n.module_type == "Linear" and n.params
               and not graph.layers[n.layer].name.startswith("<")]
    assert len(fp8) == len(linears) == 6 * MODEL["layers"]    # q k v o fc1 fc2


def test_a_large_gemm_is_faster_in_float8_and_a_tiny_one_is_not(problems):
    """The float8 peak is twice bf16's, but every float8 linear pays its casts: the model's
    large GEMMs gain up to 2x; a GEMM too small to be compute-bound only pays."""
    graph = problems["mixed"].graph
    bf16, _, _ = resolve_cost_models(problems["mixed"].cluster, "mixed")
    fp8, _, _ = resolve_cost_models(problems["mixed"].cluster, "mixed-fp8")
    node = next(n for n in graph if is_float8_gemm(n, graph))
    f16 = sum(bf16.op_time_at(node, graph, 1, 4.0))
    f8 = sum(fp8.op_time_at(node, graph, 1, 4.0))
    assert 0.5 * f16 < f8 < 0.9 * f16
    # ops that are not float8 GEMMs cost the same in both
    other = [n for n in graph if not is_float8_gemm(n, graph)]
    assert all(bf16.op_time_at(n, graph) == fp8.op_time_at(n, graph) for n in other)
    # casts: 2w + 1 bytes per element per cast, forward X and W, backward 2 dY + X + W
    fwd, bwd = cast_seconds((1, 4, 16, 16), width=2, bandwidth=1e12, kernel_s=0.0, phi=1.0)
    assert fwd == pytest.approx(5 * (64 + 256) / 1e12)
    assert bwd == pytest.approx(5 * (2 * 64 + 64 + 256) / 1e12)
    tiny = sum(fp8._op_time(node, 1, 1 / 4096, graph.dtype, float8=True))
    small_bf16 = sum(bf16._op_time(node, 1, 1 / 4096, graph.dtype))
    assert tiny > small_bf16


def test_a_float8_plan_is_faster_with_the_same_memory_and_says_so(problems, tmp_path):
    kw = dict(global_batch=16, tp=2, zero=1, micro_batch=2)
    a = estimate(None, None, problem=problems["mixed"], **kw)
    b = estimate(None, None, problem=problems["mixed-fp8"], **kw)
    assert b.prediction.step_time_s < a.prediction.step_time_s
    assert b.prediction.memory.total == pytest.approx(a.prediction.memory.total)
    assert b.precision["matmul"] == "float8" and "matmul" not in a.precision
    path = tmp_path / "plan.json"
    b.save(path)
    assert Plan.load(path).precision == b.precision


def test_transformer_engine_casts_are_fewer_bytes_than_torchao_s():
    """TE writes the float8 input and its transpose from the producing kernel (2 bytes per
    element) and casts the output gradient once, fused with its transpose (w + 2 bytes);
    torchao casts X, W and dY with an amax pass each (module docstring of cost.float8)."""
    dims, kw = (1, 4, 16, 16), dict(width=2, bandwidth=1e12, kernel_s=0.0, phi=1.0)
    fwd, bwd = cast_seconds(dims, recipe="transformer-engine", **kw)
    assert fwd == pytest.approx(2 * 64 / 1e12) and bwd == pytest.approx(4 * 64 / 1e12)
    ao = cast_seconds(dims, **kw)
    assert fwd < ao[0] and bwd < ao[1]
    with pytest.raises(ValueError, match="float8 recipe"):
        cast_seconds(dims, recipe="te", **kw)


def test_a_transformer_engine_step_is_faster_with_the_same_memory(problems):
    spec = resolve("gpt", **MODEL)
    te = prepare(spec, "dgx-h100", nodes=1, global_batch=16, precision="mixed-fp8",
                 float8_recipe="transformer-engine")
    kw = dict(global_batch=16, tp=2, zero=1, micro_batch=2)
    a = estimate(None, None, problem=problems["mixed-fp8"], **kw)
    b = estimate(None, None, problem=te, **kw)
    c = estimate(None, None, problem=problems["mixed"], **kw)
    assert b.prediction.step_time_s < a.prediction.step_time_s < c.prediction.step_time_s
    assert b.prediction.memory.total == pytest.approx(a.prediction.memory.total)
    # bf16 runs have no casts: the recipe changes nothing there
    bf16_te = prepare(spec, "dgx-h100", nodes=1, global_batch=16, precision="mixed",
                      float8_recipe="transformer-engine")
    assert estimate(None, None, problem=bf16_te, **kw).prediction.step_time_s == \
        pytest.approx(c.prediction.step_time_s)
    with pytest.raises(ConfigError) as e:
        prepare(spec, "dgx-h100", nodes=1, global_batch=16, precision="mixed-fp8",
                float8_recipe="te")
    assert "float8_recipe" in str(e.value) and "\n" not in str(e.value)


def test_devices_without_float8_refuse_it_in_one_line():
    spec = resolve("gpt", **MODEL)
    with pytest.raises(ConfigError, match="float8.*Hopper") as exc:
        prepare(spec, "dgx-a100", nodes=1, global_batch=16, precision="mixed-fp8")
    assert "\n" not in str(exc.value)


def test_a_plan_with_an_unknown_matmul_dtype_is_refused(problems, tmp_path):
    plan = estimate(None, None, problem=problems["mixed-fp8"], global_batch=16, tp=2)
    path = tmp_path / "plan.json"
    plan.save(path)
    for bad in ("int4", 7, "float8; rm -rf /"):
        d = json.loads(path.read_text())
        d["precision"]["matmul"] = bad
        path.write_text(json.dumps(d))
        with pytest.raises(AutoplanError, match="precision.matmul"):
            Plan.load(path)
    d["precision"]["matmul"] = "float8"
    d["precision"]["compute"] = "float32"
    path.write_text(json.dumps(d))
    with pytest.raises(PlanError, match="precision.matmul"):
        Plan.load(path)


def test_exports_carry_float8_or_refuse_it(problems):
    from autoplan.export import NotExpressibleError, export_plan

    def plans(**kw):
        return [estimate(None, None, problem=problems[name], global_batch=16, tp=2, **kw)
                for name in ("mixed-fp8", "mixed")]

    fp8, plain = plans(zero=3)                         # torchtitan: FSDP2
    titan = export_plan(fp8, "torchtitan").text
    assert 'converters = ["float8"]' in titan and 'filter_fqns = ["output"]' in titan
    assert "float8" not in export_plan(plain, "torchtitan").text
    fp8, plain = plans(zero=1)                         # Megatron-LM: distributed optimizer
    assert "--fp8-format hybrid" in export_plan(fp8, "megatron").text
    assert "fp8" not in export_plan(plain, "megatron").text
    with pytest.raises(NotExpressibleError, match="float8"):
        export_plan(fp8, "deepspeed")
