"""What the planner decides before searching (issue #18): the model-state lower bound that
rejects hopeless problems before tracing, the search skipped where the engine would drop
its plan, and the grid's refusal naming the rule that failed."""

from __future__ import annotations

import pytest

from autoplan.api import plan_problem, prepare, search_gap
from autoplan.cluster import load_cluster
from autoplan.errors import InfeasibleError
from autoplan.models import build_model
from autoplan.models.registry import resolve
from autoplan.planner.bounds import check_states_fit, parameter_counts, states_lower_bound
from autoplan.planner.grid.uniform import SearchSpace, search_uniform


@pytest.mark.parametrize("name, overrides", [("gpt-tiny", {}),
                                             ("gpt-tiny", {"style": "llama"}),
                                             ("gpt-tiny", {"tie_embeddings": True})])
def test_closed_form_parameter_count_matches_the_built_model(name, overrides):
    try:
        spec = resolve(name, **overrides)
    except Exception as exc:                      # a config key this GPT does not have
        pytest.skip(f"{overrides}: {exc}")
    model = build_model(spec, device="meta")
    assert parameter_counts(spec) == (sum(p.numel() for p in model.parameters()),) * 2


def test_states_lower_bound_is_zero_three_over_every_device():
    # mixed precision: 2 + 2 + 12 bytes per parameter (ZeRO, sec. 3.1), over 8 devices
    assert states_lower_bound(10**9, 10**9, 8, "mixed") == 16e9 / 8
    # frozen parameters keep no gradient or optimizer state
    assert states_lower_bound(10**9, 0, 8, "mixed") == 2e9 / 8


def test_llama3_405b_on_8_h100s_is_rejected_with_the_numbers():
    spec = resolve("llama3-405b")
    with pytest.raises(InfeasibleError) as info:
        check_states_fit(spec, load_cluster("dgx-h100", nodes=1), "mixed")
    msg = str(info.value)
    assert msg.startswith("model does not fit: memory per device is the binding constraint")
    assert "405.9B parameters" in msg and "6493.7 GB of model states" in msg
    assert "811.7 GB per device" in msg and "85.5 GB" in msg
    # 6493.7 GB over 85.5 GB devices (81,559 MiB): 76 devices, whole 8-device nodes: 80
    assert "at least 80 devices" in msg
    # the same model on 2048 nodes passes the bound (the planner then finds a plan)
    check_states_fit(spec, load_cluster("dgx-h100", nodes=2048), "mixed")


def test_plan_refuses_before_tracing(monkeypatch):
    import autoplan.trace

    def no_trace(*args, **kwargs):
        raise AssertionError("traced a model whose states cannot fit")

    monkeypatch.setattr(autoplan.trace, "trace", no_trace)
    with pytest.raises(InfeasibleError, match="model does not fit"):
        prepare("gpt3-175b", "dgx-a100", nodes=1, global_batch=8, check_fits=True)


def test_cli_rejects_without_importing_torch(tmp_path):
    """The rejection needs a preset's closed-form parameter count and the cluster, not
    torch: ``autoplan plan`` says no in a fraction of a second (benchmarks/plan_speed.py)."""
    import subprocess
    import sys

    code = ("import sys\nfrom autoplan.cli import main\n"
            "try:\n    main(['plan', 'llama3-405b', '--cluster', 'dgx-h100', '--nodes', '1', "
            f"'--global-batch', '1536', '--out', {str(tmp_path / 'p.json')!r}])\n"
            "except SystemExit as exc:\n    print('exit', exc.code)\n"
            "print('torch imported' if 'torch' in sys.modules else 'no torch')\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120)
    assert "model does not fit" in proc.stderr, proc.stderr[-2000:]
    assert proc.stdout.split()[-2:] == ["no", "torch"], proc.stdout + proc.stderr[-2000:]
    assert not (tmp_path / "p.json").exists()


def test_search_skipped_when_the_engine_would_drop_its_plan():
    spec = resolve("gpt-tiny", style="llama")
    assert "Llama-style" in search_gap(spec)
    assert search_gap(resolve("gpt-tiny")) is None
    problem = prepare(spec, "dgx-a100", nodes=1, global_batch=16)
    plan, result = plan_problem(problem, planner="auto", top_k=0)
    assert plan.planner["name"] == "uniform" and "search did not run" in plan.planner["note"]
    assert not hasattr(result, "stats")                # the grid's result: no search ran
    assert plan.prediction.step_time_s == result.best.prediction.step_time_s


def test_the_grid_refusal_names_micro_batches_at_least_stages():
    # 8 devices, batch 2, 4 blocks, tp 1: pp 8 > 4 blocks; pp 4 -> dp 2, 1 sample per rank
    # < 4 stages; pp 2 and 1 -> dp 4 and 8 do not divide the batch
    # (GPipe runs fewer micro-batches than stages: without it in the space)
    problem = prepare("gpt-tiny", "dgx-a100", nodes=1, global_batch=2)
    with pytest.raises(InfeasibleError) as info:
        search_uniform(problem.graph, problem.cluster, 2,
                       space=SearchSpace(tp=(1,), schedules=("1f1b", "interleaved_1f1b")))
    msg = str(info.value)
    assert "no valid configuration of 8 devices for global batch 2" in msg
    assert "1 of them: fewer micro-batches than pipeline stages" in msg
    assert "GPipe, which does not, is outside the search space" in msg
    assert "2 of them: the global batch is not divisible by the data-parallel degree" in msg
    assert "1 of them: more pipeline stages than the model's 4 blocks" in msg


def test_the_grid_plans_gpipe_with_fewer_micro_batches_than_stages():
    """The same problem with GPipe in the space: pp 4 over dp 2 with one micro-batch each
    is GPipe (torch's ScheduleGPipe runs any m; the engine's parity at pp 4 with 2
    micro-batches is tests/test_engine_parity.py's pp4_gpipe_m2); 1F1B never gets m < pp."""
    problem = prepare("gpt-tiny", "dgx-a100", nodes=1, global_batch=2)
    result = search_uniform(problem.graph, problem.cluster, 2, space=SearchSpace(tp=(1,)))
    configs = [c.parallel for c in result.ranked]
    assert any(p.pp == 4 and p.num_micro_batches == 1 and p.schedule == "gpipe"
               for p in configs)
    assert all(p.schedule == "gpipe" for p in configs if 1 < p.pp and p.num_micro_batches
               < p.pp)
