"""The same engine on GPUs (NCCL, allocator statistics, bf16): runs only where CUDA is."""

from __future__ import annotations

import json

import pytest
import torch

from engine.launch import run_local
from engine_helpers import losses, make_plan

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

BF16 = {"params": "float32", "compute": "bfloat16", "reduce": "float32"}


def test_one_gpu_bf16_run_reports_allocator_memory(tmp_path):
    plan = make_plan(device_type="cuda", precision=BF16).save(tmp_path / "gpu.json")
    assert run_local(plan, steps=10, out_dir=tmp_path / "run",
                     extra_args=["--lr", "0.003", "--warmup-steps", "2"]) == 0
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    (mem,) = summary["memory_per_rank"]
    assert mem["method"] == "allocator" and mem["peak_bytes"] > 0
    assert summary["device"] == "cuda" and summary["timed_steps"] == 8
    got = losses(tmp_path / "run")
    assert got[10] < got[1]


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices")
def test_two_gpu_tensor_parallel_matches_one_gpu(tmp_path):
    fp32 = {"params": "float32", "compute": "float32", "reduce": "float32"}
    one = make_plan(device_type="cuda", precision=fp32).save(tmp_path / "one.json")
    two = make_plan(device_type="cuda", precision=fp32, tp=2, sp=True).save(tmp_path / "tp.json")
    for path, name in ((one, "one"), (two, "tp")):
        assert run_local(path, steps=10, out_dir=tmp_path / name,
                         extra_args=["--lr", "0.003"]) == 0
    a, b = losses(tmp_path / "one"), losses(tmp_path / "tp")
    assert max(abs(a[k] - b[k]) / a[k] for k in a) < 1e-3     # TF32/cuBLAS reduction order
