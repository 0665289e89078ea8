"""Expert and context parallelism on 4 gloo ranks: loss parity with one process (fp32), and
the ring attention against attention over the whole sequence (float64)."""

import json

import pytest

from engine_helpers import torchrun

pytestmark = pytest.mark.multiproc


MODES = ["ep", "cp", "cp-gpt"]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """Every mode's one-process and sharded losses, from one 4-rank launch."""
    out = tmp_path_factory.mktemp("moe_cp") / "losses.json"
    proc = torchrun(4, ["tests/parallel_worker.py", ",".join(MODES), str(out)], timeout=400)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(out.read_text())


@pytest.mark.parametrize("mode", MODES)
def test_sharded_training_matches_one_process(trained, mode):
    r = trained[mode]
    assert len(r["reference"]) == 4
    worst = max(abs(a - b) / abs(a) for a, b in zip(r["reference"], r["sharded"]))
    assert worst <= 1e-5, r
    assert r["reference"][-1] < r["reference"][0]            # it trained


def test_ring_attention_matches_whole_sequence_attention(tmp_path):
    """The engine's ring on 4 ranks, float64: outputs and q/k/v gradients (grouped-query
    heads) equal one process's causal attention; in bfloat16 within its rounding; with
    dropout the backward is the derivative of the forward it replays; under a sliding
    window, the ring and the all-gather alike (tests/ring_worker.py)."""
    out = tmp_path / "ring.json"
    proc = torchrun(4, ["tests/ring_worker.py", str(out)], timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    r = json.loads(out.read_text())
    for name in ("out", "dq", "dk", "dv"):
        assert r[name] < 1e-12, (name, r)
        for method in ("ring", "all-gather"):        # under a sliding window of 20 keys
            assert r[f"window_{method}_{name}"] < 1e-12, (method, name, r)
    assert r["bf16_out"] < 2e-2 and r["bf16_dq"] < 5e-2 and r["bf16_dtypes"] == 0, r
    assert r["dropout_directional"] < 1e-6, r
    assert r["dropout_changes_output"] > 1e-3, r            # the dropout path ran
