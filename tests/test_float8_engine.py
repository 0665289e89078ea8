"""The engine runs mixed-fp8 plans (engine.float8: torchao's float8 linear layers): the
blocks' linear layers swapped and nothing else; data- and tensor-parallel runs on two gloo
ranks train like one float8 process; float8 is really on (the losses differ from bf16's)."""

from __future__ import annotations

import pytest

from autoplan.models.registry import ModelSpec
from engine import model as model_lib
from engine.float8 import convert_float8
from engine_helpers import TINY, TINY_LLAMA, losses, make_plan, max_rel_diff, run_plans

pytest.importorskip("torchao", reason="mixed-fp8 runs need torchao (the test extra has it)")

STEPS = 12
OPTIONS = ["--lr", "0.003", "--warmup-steps", "1", "--log-every", "20"]
BF16 = {"params": "float32", "compute": "bfloat16", "reduce": "float32"}
FP8 = dict(BF16, matmul="float8")


@pytest.mark.parametrize("model, per_block", [(TINY, 6), (TINY_LLAMA, 7)])
def test_the_blocks_linear_layers_and_only_they_become_float8(model, per_block):
    from torchao.float8.float8_linear import Float8Linear

    spec = ModelSpec("builtin", "gpt", dict(model))
    names = ["<pre>"] + [f"blocks.{i}" for i in range(model["layers"])] + ["<post>"]
    chunk = model_lib.build_chunk(spec, names)
    swapped = convert_float8(chunk, [n for n in names if not n.startswith("<")])
    fp8 = [n for n, m in chunk.named_modules() if isinstance(m, Float8Linear)]
    assert swapped == len(fp8) == per_block * model["layers"]
    assert all(n.startswith("blocks.") for n in fp8)          # the head stays bf16


@pytest.mark.multiproc
def test_float8_runs_train_like_one_float8_process(tmp_path):
    refs = {"fp8": make_plan(precision=FP8), "bf16": make_plan(precision=BF16)}
    done = run_plans(1, tmp_path, refs, steps=STEPS, extra=OPTIONS)     # one launch
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-8000:]
    ref = {name: losses(tmp_path / name) for name in refs}
    assert ref["fp8"][STEPS] < ref["fp8"][1] - 0.2                # it learns
    assert 0 < max_rel_diff(ref["fp8"], ref["bf16"]) < 2e-2       # float8 is on, and close
    plans = {"dp2_zero3_fp8": make_plan(dp=2, zero=3, precision=FP8),
             "tp2_sp_fp8": make_plan(tp=2, sp=True, precision=FP8)}
    out = tmp_path / "world2"
    proc = run_plans(2, out, plans, steps=STEPS, extra=OPTIONS)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-8000:]
    for name in plans:
        # per-tensor scales are taken over each rank's own shard of the batch (data
        # parallel) or of the weight (tensor parallel): close to one process, not bit-equal
        diff = max_rel_diff(losses(out / name), ref["fp8"])
        print(f"float8 {name}: max relative loss difference {diff:.2e} against one process")
        assert diff < 1e-2, name


@pytest.mark.multiproc
def test_the_generic_runtime_runs_float8_too(tmp_path):
    """A Hugging Face OPT (the generic runtime): its decoder layers' linear layers in float8,
    data- and tensor-parallel on two ranks against one float8 process."""
    from autoplan.models.registry import resolve

    spec = resolve("hf:opt", num_hidden_layers=2, hidden_size=32, num_attention_heads=4,
                   ffn_dim=64, vocab_size=128, max_position_embeddings=64,
                   word_embed_proj_dim=32, dropout=0.0, attention_dropout=0.0)
    base = dict(spec=spec, global_batch=4, seq_len=16)
    refs = {"fp8_ref": make_plan(precision=FP8, **base),
            "bf16_ref": make_plan(precision=BF16, **base)}
    out = tmp_path / "generic"
    done = run_plans(1, out, refs, steps=4, extra=OPTIONS, timeout=400)
    assert done.returncode == 0, done.stderr[-3000:]
    ref = losses(out / "fp8_ref")
    assert 0 < max_rel_diff(ref, losses(out / "bf16_ref")) < 2e-2
    plans = {"dp2_zero3": make_plan(precision=FP8, dp=2, zero=3, **base),
             "tp2": make_plan(precision=FP8, tp=2, **base)}
    done = run_plans(2, out, plans, steps=4, extra=OPTIONS, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    for name in plans:
        assert max_rel_diff(losses(out / name), ref) < 1e-2, name
