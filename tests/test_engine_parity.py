"""Loss parity: every parallel layout trains like one process (fp32, 10 steps, dropout 0).

Each layout's per-step losses must match the single-process run's to 1e-4 relative at every
step. The references (one per model) run in one single-process launch; the layouts of
one world size share one torchrun launch (``tests/engine_helpers.py``) to keep the suite fast
on a 2-core machine. The reference loss must also fall clearly, so matching it means matching
real learning, not noise.
"""

from __future__ import annotations

import json

import pytest

from autoplan.plan import MemoryBreakdown, Prediction, TimeBreakdown
from engine_helpers import TINY_LLAMA, TINY_LLAMA_FUSED, losses, make_plan, max_rel_diff, run_plans

pytestmark = pytest.mark.multiproc

STEPS = 10
OPTIONS = ["--lr", "0.003", "--warmup-steps", "1", "--log-every", "10"]
TOL = 1e-4

WORLD2 = {
    "dp2": dict(dp=2),
    "dp2_zero1": dict(dp=2, zero=1, num_micro_batches=2),
    "dp2_zero2": dict(dp=2, zero=2, num_micro_batches=2),
    "dp2_zero3": dict(dp=2, zero=3),
    "tp2_sp": dict(tp=2, sp=True),
    "pp2_gpipe": dict(pp=2, schedule="gpipe", num_micro_batches=4),
    "pp2_1f1b": dict(pp=2, schedule="1f1b", num_micro_batches=4),
    "pp2_interleaved": dict(pp=2, schedule="interleaved_1f1b", virtual_stages=2,
                            num_micro_batches=4),
    "dp2_zero3_ckpt": dict(dp=2, zero=3, checkpoint=True),
    "tp2_sp_llama": dict(tp=2, sp=True, model=TINY_LLAMA),
    # one q/k/v GEMM, column-parallel over whole key/value groups
    "tp2_sp_llama_fused": dict(tp=2, sp=True, model=TINY_LLAMA_FUSED),
}
WORLD4 = {
    "dp2_tp2": dict(dp=2, tp=2, sp=True),
    "pp2_tp2": dict(pp=2, tp=2, sp=True, num_micro_batches=2),
    # without SP: each TP rank sends its sequence slice, the next stage all-gathers them
    "pp2_tp2_scatter_gather": dict(pp=2, tp=2, num_micro_batches=2),
    "pp2_dp2_zero2": dict(pp=2, dp=2, zero=2, num_micro_batches=2),
    # fewer micro-batches than stages: GPipe runs it (1F1B refuses), as the planners write it
    "pp4_gpipe_m2": dict(pp=4, schedule="gpipe", num_micro_batches=2),
}
BF16 = {"params": "float32", "compute": "bfloat16", "reduce": "float32"}
PREDICTION = Prediction(step_time_s=0.05, tokens_per_s=5120.0, samples_per_s=160.0,
                        model_tflops_per_device=0.001, hardware_tflops_per_device=0.001,
                        mfu=0.0125, memory=MemoryBreakdown(params=1e5, activations=1e6),
                        memory_limit_bytes=6e9, time=TimeBreakdown(compute=0.05))


def _launch(nproc, out, plans):
    proc = run_plans(nproc, out, plans, steps=STEPS, extra=OPTIONS)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-8000:]
    return out


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """Single-process runs: the built-in GPT, its Llama-style twin and that twin with a fused
    q/k/v projection."""
    out = tmp_path_factory.mktemp("reference")
    singles = {"gpt": make_plan(), "llama": make_plan(model=TINY_LLAMA),
               "llama_fused": make_plan(model=TINY_LLAMA_FUSED)}
    done = run_plans(1, out, singles, steps=STEPS, extra=OPTIONS)          # one launch
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-8000:]
    refs = {name: losses(out / name) for name in singles}
    for ref in refs.values():
        assert sorted(ref) == list(range(1, STEPS + 1))
        assert ref[STEPS] < ref[1] - 0.1          # it learns: parity is not trivial
    return refs


@pytest.fixture(scope="module")
def world2(tmp_path_factory):
    plans = {name: make_plan(**kw) for name, kw in WORLD2.items()}
    plans["dp2_zero3_bf16"] = make_plan(dp=2, zero=3, precision=BF16, prediction=PREDICTION)
    return _launch(2, tmp_path_factory.mktemp("world2"), plans)


@pytest.fixture(scope="module")
def world4(tmp_path_factory):
    return _launch(4, tmp_path_factory.mktemp("world4"),
                   {name: make_plan(**kw) for name, kw in WORLD4.items()})


def _check(run_dir, ref, name):
    got = losses(run_dir / name)
    diff = max_rel_diff(got, ref)
    print(f"parity {name}: max relative loss difference {diff:.2e}")
    assert diff <= TOL, {k: (got[k], ref[k]) for k in ref}


@pytest.mark.parametrize("name", sorted(WORLD2))
def test_parity_two_ranks(world2, reference, name):
    model = "llama_fused" if "fused" in name else "llama" if "llama" in name else "gpt"
    _check(world2, reference[model], name)


@pytest.mark.parametrize("name", sorted(WORLD4))
def test_parity_four_ranks(world4, reference, name):
    _check(world4, reference["gpt"], name)


def test_bf16_mixed_precision_tracks_fp32(world2, reference):
    """bf16 compute with fp32 master weights: close to fp32, but not bit-equal."""
    got = losses(world2 / "dp2_zero3_bf16")
    diff = max_rel_diff(got, reference["gpt"])
    assert 0 < diff < 2e-2


def test_summary_has_measurements_and_prediction(world2):
    summary = json.loads((world2 / "dp2_zero3_bf16" / "summary.json").read_text())
    measured, predicted = summary["measured"], summary["predicted"]
    assert summary["world_size"] == 2 and summary["steps"] == STEPS
    assert summary["timed_steps"] == STEPS - 2          # step 1: warm-up, 2: memory-tracked
    assert measured["step_time_s"] > 0 and measured["tokens_per_s"] > 0
    assert measured["tflops_per_device"] > 0 and 0 < measured["mfu"] < 1
    assert predicted["step_time_s"] == PREDICTION.step_time_s
    assert predicted["peak_memory_bytes"] == PREDICTION.memory.total
    assert set(summary["measured_over_predicted"]) == {"step_time_s", "peak_memory_bytes",
                                                       "tokens_per_s"}
    ranks = summary["memory_per_rank"]
    assert [m["rank"] for m in ranks] == [0, 1]
    assert all(m["method"] == "LiveTensorMemory" and m["peak_bytes"] > 0 for m in ranks)
    # each rank holds half of the fp32 parameters and their AdamW states between steps
    params = make_plan().num_params * 4
    start = ranks[0]["breakdown"]["at_step_start"]
    assert 1.5 * params * 0.9 <= start <= 1.5 * params * 1.2
    lines = (world2 / "dp2_zero3_bf16" / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in lines] == list(range(1, STEPS + 1))
