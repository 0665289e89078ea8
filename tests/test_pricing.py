"""A plan records the runtime assumptions its prediction was priced under (autoplan.pricing,
plan format 4): saved, loaded and validated as data, shown, re-priced with, and turned into
the runtimes' own switches by the exports."""

import json

import pytest

from autoplan.api import estimate, prepare
from autoplan.errors import PlanError
from autoplan.export import export_plan
from autoplan.models import resolve
from autoplan.plan import Plan
from autoplan.pricing import Pricing

SEQ = 4096


@pytest.fixture(scope="module")
def llama():
    return resolve("llama3-8b", layers=2, seq_len=SEQ)


def _plan(spec, zero=1, **pricing):
    problem = prepare(spec, "dgx-h100", nodes=1, global_batch=8, seq_len=SEQ, **pricing)
    return estimate(None, None, problem=problem, global_batch=8, tp=2, cp=2, zero=zero,
                    micro_batch=1)


@pytest.fixture(scope="module")
def ring_cudnn(llama):
    return _plan(llama, attention_kernel="cudnn", cp_comm="ring",
                 float8_recipe="transformer-engine")


@pytest.fixture(scope="module")
def defaults(llama):
    return _plan(llama)


def test_the_plan_records_what_it_was_priced_under(ring_cudnn, defaults, tmp_path):
    assert ring_cudnn.pricing == Pricing(attention_kernel="cudnn", cp_comm="ring",
                                         float8_recipe="transformer-engine")
    assert defaults.pricing == Pricing()
    assert ring_cudnn.prediction.step_time_s < defaults.prediction.step_time_s
    again = Plan.load(ring_cudnn.save(tmp_path / "p.json"))
    assert again.pricing == ring_cudnn.pricing
    assert again.to_json() == ring_cudnn.to_json()
    assert json.loads(again.to_json())["pricing"]["cp_comm"] == "ring"
    assert "cuDNN fused attention, context-parallel ring" in ring_cudnn.pricing.describe()


def test_re_pricing_a_saved_plan_uses_its_assumptions(ring_cudnn):
    from autoplan.report.timing import _retrace

    problem = _retrace(ring_cudnn)
    assert problem.pricing == ring_cudnn.pricing
    again = problem.estimator().predict(ring_cudnn.parallel).step_time_s
    assert again == pytest.approx(ring_cudnn.prediction.step_time_s, rel=1e-9)


@pytest.mark.parametrize("value, field", [
    ({"attention_kernel": "fa3"}, "pricing.attention_kernel"),
    ({"cp_comm": "alltoall"}, "pricing.cp_comm"),
    ({"float8_recipe": 7}, "pricing.float8_recipe"),
    ({"fused": "yes"}, "pricing.fused"),
    ({"fused_loss": 1}, "pricing.fused_loss"),
    ({"kernel": "flash2"}, "pricing.kernel"),
    ("flash2", "pricing"),
    ([1, 2], "pricing"),
])
def test_a_bad_pricing_in_a_plan_file_is_refused_naming_the_field(defaults, tmp_path, value,
                                                                   field):
    doc = json.loads(defaults.to_json())
    doc["pricing"] = value if not isinstance(value, dict) else {**doc["pricing"], **value}
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(doc))
    with pytest.raises(PlanError) as exc:
        Plan.load(path)
    message = str(exc.value)
    assert str(path) in message and f"field '{field}'" in message
    assert "\n" not in message


def test_megatron_export_sets_the_priced_attention_backend_and_cp_exchange(ring_cudnn,
                                                                           defaults):
    ring = export_plan(ring_cudnn, "megatron")
    assert "--cp-comm-type p2p" in ring.text and "--attention-backend fused" in ring.text
    assert not any("torchao" in n for n in ring.notes)    # priced with TE's casts
    gather = export_plan(defaults, "megatron")
    assert "--cp-comm-type allgather" in gather.text
    assert "--attention-backend flash" in gather.text


def test_torchtitan_export_sets_the_rotate_method_and_notes_what_it_cannot_run(llama):
    ring = export_plan(_plan(llama, zero=3, attention_kernel="cudnn", cp_comm="ring",
                             float8_recipe="transformer-engine"), "torchtitan")
    assert 'context_parallel_rotate_method = "alltoall"' in ring.text
    assert any("cuDNN" in n for n in ring.notes)
    gather = export_plan(_plan(llama, zero=3), "torchtitan")
    assert 'context_parallel_rotate_method = "allgather"' in gather.text
    assert not any("cuDNN" in n for n in gather.notes)


def test_an_older_plan_without_pricing_exports_with_the_defaults_and_says_so(defaults):
    from dataclasses import replace

    old = replace(defaults, pricing=None)
    out = export_plan(old, "megatron")
    assert "--cp-comm-type allgather" in out.text
    assert any("does not record the runtime assumptions" in n for n in out.notes)


def test_show_states_the_assumptions(ring_cudnn, tmp_path, capsys):
    from autoplan.cli import main

    path = ring_cudnn.save(tmp_path / "p.json")
    assert main(["show", str(path)]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "priced for: fused element-wise kernels, cuDNN fused attention" in out
    assert main(["show", str(path), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["pricing"]["attention_kernel"] == "cudnn"


def test_the_engine_names_where_it_runs_the_plan_otherwise_than_priced(ring_cudnn, defaults):
    from dataclasses import replace

    from engine.preflight import pricing_gaps

    gaps = pricing_gaps(ring_cudnn)
    assert any("cuDNN" in g for g in gaps)
    assert not any("assumed a context-parallel ring" in g for g in gaps)  # runs the ring
    assert any("explicit matmuls" in g for g in gaps)  # ... on matmuls, not a fused kernel
    assert any("eager" in g for g in gaps)            # priced fused; the engine runs eager
    assert not any("ring" in g or "cuDNN" in g for g in pricing_gaps(defaults))
    assert pricing_gaps(replace(defaults, pricing=None)) == []


def test_fused_loss_is_a_command_line_choice_recorded_in_the_plan(capsys):
    """``--no-fused-loss`` prices the loss's two fp32 gradients (more memory, recorded as
    ``fused_loss: false``); without the flag the loss follows ``--eager``."""
    from autoplan.cli import main

    docs = {}
    for flag in ("--fused-loss", "--no-fused-loss", None):
        argv = ["estimate", "gpt-small", "--cluster", "dgx-h100", "--global-batch", "64",
                "--json", *([flag] if flag else [])]
        assert main(argv) == 0
        docs[flag] = json.loads(capsys.readouterr().out)
    assert docs["--fused-loss"]["pricing"]["fused_loss"] is True
    assert docs["--no-fused-loss"]["pricing"]["fused_loss"] is False
    assert docs[None]["pricing"]["fused_loss"] is None
    memory = {f: d["prediction"]["memory_per_device_bytes"]["total"] for f, d in docs.items()}
    assert memory["--no-fused-loss"] > memory["--fused-loss"] == memory[None]
