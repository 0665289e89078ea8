"""Pricing assumptions about the runtime's kernels: which fused attention runs
(autoplan.cost.kernel_shape: FlashAttention-2 or cuDNN's) and how context-parallel ranks
exchange keys and values (autoplan.cost.parallel_dims: one all-gather or a ring)."""

import pytest

from autoplan.api import estimate, prepare
from autoplan.cli import main
from autoplan.cost.kernel_shape import (FA3_PAPER_TFLOPS, attention_tflops,
                                        check_attention_kernel, cudnn_speedup)
from autoplan.errors import ConfigError
from autoplan.models import resolve

SEQ = 8192


def _fwd_bwd(kernel, head_dim, i):
    fwd, bwd = FA3_PAPER_TFLOPS[(head_dim, kernel)]
    return 3.5 / (1 / fwd[i] + 2.5 / bwd[i])


def test_cudnn_speedup_is_the_published_figure_ratio():
    # Shah et al. 2024 Fig. 5b/6b, head dim 128 at 16k: cuDNN 595 / 516, FA2 370 / 322 TFLOP/s
    assert cudnn_speedup(16384, 128) == pytest.approx(_fwd_bwd("cudnn", 128, 5)
                                                      / _fwd_bwd("flash2", 128, 5))
    assert cudnn_speedup(16384, 128) == pytest.approx(1.604, abs=1e-3)
    assert cudnn_speedup(4096, 64) == pytest.approx(1.430, abs=1e-3)
    # between the head dims it interpolates; past the table it keeps the end value
    assert cudnn_speedup(4096, 64) < cudnn_speedup(4096, 96) < cudnn_speedup(4096, 128)
    assert cudnn_speedup(2 ** 20, 128) == cudnn_speedup(16384, 128)


def test_cudnn_rates_apply_on_hopper_only():
    fa2 = attention_tflops("hopper", 4096, 128, True)
    assert attention_tflops("hopper", 4096, 128, True, "flash2") == fa2
    assert attention_tflops("hopper", 4096, 128, True, "cudnn") == \
        pytest.approx(fa2 * cudnn_speedup(4096, 128))
    # no published cuDNN figure for A100: FlashAttention-2's rate
    assert attention_tflops("ampere", 4096, 128, True, "cudnn") == \
        attention_tflops("ampere", 4096, 128, True)
    with pytest.raises(ValueError, match="attention kernel"):
        check_attention_kernel("fa3")


@pytest.fixture(scope="module")
def llama():
    return resolve("llama3-8b", layers=2, seq_len=SEQ)


def _problem(spec, **kw):
    return prepare(spec, "dgx-h100", nodes=1, global_batch=8, seq_len=SEQ, **kw)


def test_cudnn_attention_makes_the_step_faster_and_nothing_else(llama):
    kw = dict(global_batch=8, tp=2, zero=1, micro_batch=1)
    fa2 = estimate(None, None, problem=_problem(llama), **kw).prediction
    cudnn = estimate(None, None, problem=_problem(llama, attention_kernel="cudnn"),
                     **kw).prediction
    assert cudnn.step_time_s < fa2.step_time_s
    assert cudnn.memory.total == pytest.approx(fa2.memory.total)
    # the saving is the attention's: at most the 1 - 1/1.63 of the fastest published ratio
    assert fa2.time.compute - cudnn.time.compute < 0.39 * fa2.time.compute


def test_a_ring_hides_the_exchange_and_saves_no_gathered_keys(llama):
    kw = dict(global_batch=8, cp=4, zero=1, micro_batch=1)
    gather = estimate(None, None, problem=_problem(llama), **kw).prediction
    ring = estimate(None, None, problem=_problem(llama, cp_comm="ring"), **kw).prediction
    assert ring.time.tp_comm < gather.time.tp_comm       # the KV exchange is in layer comm
    assert ring.memory.activations < gather.memory.activations
    assert ring.time.compute == pytest.approx(gather.time.compute)
    # without context parallelism the method changes nothing
    kw1 = dict(kw, cp=1)
    assert estimate(None, None, problem=_problem(llama, cp_comm="ring"), **kw1).prediction \
        .step_time_s == pytest.approx(estimate(None, None, problem=_problem(llama), **kw1)
                                      .prediction.step_time_s)


@pytest.mark.parametrize("field, value", [("attention_kernel", "fa3"),
                                          ("cp_comm", "p2p")])
def test_unknown_runtime_assumptions_are_refused_in_one_line(llama, field, value):
    with pytest.raises(ConfigError) as e:
        _problem(llama, **{field: value})
    assert field in str(e.value) and "\n" not in str(e.value)


def test_the_cli_takes_both(capsys):
    assert main(["estimate", "llama3-8b", "--layers", "2", "--seq-len", "8192",
                 "--cluster", "dgx-h100", "--global-batch", "8", "--cp", "2",
                 "--attention-kernel", "cudnn", "--cp-comm", "ring", "--no-compare",
                 "--json"]) == 0
    with pytest.raises(SystemExit):
        main(["estimate", "gpt-tiny", "--cluster", "dgx-h100", "--global-batch", "8",
              "--cp-comm", "p2p"])
