"""Fuzzed command lines (issue #7): ``autoplan.cli.main(argv)`` for plan, estimate, show,
export and report with random flags, values, junk tokens and output paths.

Every run must end in exit status 0, or 2 with either argparse's usage message or exactly one
``error: ...`` line (never a traceback), within 20 s; and leave no temp file, no partial
output, and the files it must not touch intact (tests/fuzz_helpers.py: check_cli_argv).

Two tiers, to keep this file fast on a 2-core machine:

* 1,000 command lines that fail, or finish, before a model is traced: ``plan`` / ``estimate``
  always carry one poisoned input (unknown model, bad cluster, bad batch or node count),
  ``show`` / ``export`` read the valid plan or broken ones, ``report`` broken ones;
* 25 command lines that trace a tiny model and predict a configuration (``estimate
  mlp-tiny|gpt-tiny --no-compare``: 0.1-0.5 s each) with random model-size, configuration and
  output flags; ``plan``'s search (~1 s a run) is covered by the explicit tests below.
"""

from __future__ import annotations

import contextlib
import io
import json

import pytest

from autoplan.cli import main
from fuzz_helpers import Tally, make_cli_env, plan_seeds, run_cli_fuzz, scratch_dir

CHEAP_EXAMPLES = 1000
TRACED_EXAMPLES = 25


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    root = tmp_path_factory.mktemp("cli-fuzz")
    plan_seeds(root / "seeds")
    return make_cli_env(root / "env", root / "seeds" / "mlp-tiny.json")


def _check(tally: Tally, examples: int) -> None:
    print("\n" + tally.line())
    assert tally.tried >= examples
    assert not tally.unexpected, tally.examples
    assert tally.accepted > 0 and tally.rejected["error"] > 0


def test_fuzz_cli_argv(tmp_path, env):
    with scratch_dir(tmp_path) as work:
        tally = run_cli_fuzz(Tally("command line"), work, env, max_examples=CHEAP_EXAMPLES)
    _check(tally, CHEAP_EXAMPLES)
    assert tally.rejected["usage"] > 0


def test_fuzz_cli_argv_traced(tmp_path, env):
    with scratch_dir(tmp_path) as work:
        tally = run_cli_fuzz(Tally("command line, traced"), work, env,
                             max_examples=TRACED_EXAMPLES, expensive=True)
    _check(tally, TRACED_EXAMPLES)


# ---- what the fuzzer found, pinned ---------------------------------------------------------

def _run(argv: list[str]) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            rc = main(argv)
        except SystemExit as exc:
            rc = exc.code
    return rc, out.getvalue(), err.getvalue()


TINY = ["mlp-tiny", "--cluster", "local-cpu", "--global-batch", "8"]


@pytest.mark.parametrize("flag, value", [("--tp", "0"), ("--pp", "0"), ("--micro-batch", "0"),
                                         ("--dp", "-2"), ("--virtual-stages", "x"),
                                         ("--global-batch", str(10 ** 18)),
                                         ("--nodes", "0")])
def test_configuration_flags_are_bounded(flag, value):
    """Was: ZeroDivisionError for --tp/--pp/--micro-batch 0; an endless divisor search for a
    global batch of 1e18."""
    argv = ["estimate", *TINY, "--no-compare", flag, value]
    if flag == "--global-batch":
        argv = ["estimate", "mlp-tiny", "--cluster", "local-cpu", "--no-compare", flag, value]
    rc, _, err = _run(argv)
    assert rc == 2 and f"argument {flag}: must be an integer" in err and "Traceback" not in err


@pytest.mark.parametrize("nodes, needle", [(10 ** 8, "must be at most 16777216"),
                                           (2 ** 23, "more than 16777216 devices")])
def test_absurd_node_count_is_refused_before_planning(nodes, needle):
    rc, _, err = _run(["plan", *TINY, "--nodes", str(nodes)])
    assert rc == 2 and err.startswith("error: clusters/local-cpu.yaml: field 'nodes'")
    assert needle in err


@pytest.mark.parametrize("target", ["a-dir", "a-file/plan.json"])
def test_unwritable_plan_output_is_one_error_line(tmp_path, target):
    """Was: IsADirectoryError / NotADirectoryError tracebacks from the atomic write."""
    (tmp_path / "a-dir").mkdir()
    (tmp_path / "a-file").write_text("keep\n")
    rc, _, err = _run(["estimate", *TINY, "--no-compare", "-o", str(tmp_path / target)])
    assert rc == 2 and err.count("\n") == 1 and err.startswith("error: ")
    assert str(tmp_path / target.split("/")[0]) in err
    assert (tmp_path / "a-file").read_text() == "keep\n"
    assert not list(tmp_path.rglob(".*.tmp"))


def test_report_png_folder_onto_a_file_is_one_error_line(tmp_path, env):
    """The HTML is written whole before the figures; a --png path that is a file fails with
    one error line (was: FileExistsError traceback) and leaves no partial file."""
    blocker = tmp_path / "figures"
    blocker.write_text("keep\n")
    html = tmp_path / "report.html"
    rc, _, err = _run(["report", env.valid_plan, "-o", str(html), "--png", str(blocker)])
    assert rc == 2 and err.startswith("error: ") and str(blocker) in err
    assert blocker.read_text() == "keep\n"
    assert html.read_text().rstrip().endswith("</html>")
    assert not list(tmp_path.rglob(".*.tmp"))


def test_export_to_a_directory_keeps_it_and_says_so(tmp_path, env):
    rc, _, err = _run(["export", env.valid_plan, "--to", "torchtitan", "-o", str(tmp_path)])
    assert rc == 2 and err.startswith("error: ") and "Traceback" not in err
    assert list(tmp_path.iterdir()) == []


def test_a_successful_plan_writes_a_loadable_plan_and_json(tmp_path):
    from autoplan.plan import Plan

    out = tmp_path / "plan.json"
    rc, stdout, _ = _run(["plan", *TINY, "-o", str(out), "--json"])
    assert rc == 0 and json.loads(stdout)["plan_file"] == str(out)
    assert Plan.load(out).global_batch == 8


# Model configurations take --set values of any type: a known key with a wrong-typed value
# used to crash in the config check or in the tracer (TypeError). GPTConfig / MLPConfig /
# WRNConfig check their fields' types and ranges (autoplan.models.registry.check_config_types)
# and autoplan/models/hf.py checks size fields and wraps the config constructor's errors.

@pytest.mark.parametrize("model, setting, field", [
    ("gpt-tiny", 'layers="2"', "model.layers"),
    ("gpt-tiny", "hidden=1e3", "model.hidden"),
    ("gpt-tiny", "seq_len=null", "model.seq_len"),
    ("gpt-tiny", "vocab_size=1.5", "model.vocab_size"),
    ("gpt-tiny", "dropout=[1]", "model.dropout"),
    ("gpt-tiny", "kv_heads=0", "model.kv_heads"),
    ("gpt-tiny", "tie_embeddings=1", "model.tie_embeddings"),
    ("gpt-tiny", "layers=100000", "model.layers"),
    ("gpt-tiny", "rope_theta=-1", "model.rope_theta"),
    ("mlp-tiny", 'hidden="x"', "model.hidden"),
    ("mlp-tiny", "dropout=NaN", "model.dropout"),
    ("wrn-16-8", "width=true", "model.width"),
    ("hf:gpt2", 'n_layer="x"', "n_layer"),
    ("hf:gpt2", "n_layer=-1", "model.config.n_layer"),
    ("hf:llama", "num_attention_heads=0", "model.config.num_attention_heads"),
    ("hf:gpt2", "n_embd=2.5", "model.config.n_embd"),
])
def test_wrong_typed_model_settings_are_config_errors(model, setting, field):
    rc, _, err = _run(["estimate", model, "--cluster", "local-cpu", "--global-batch", "8",
                       "--no-compare", "--set", setting])
    assert rc == 2 and err.startswith("error: ") and field in err
    assert err.count("\n") == 1 and "Traceback" not in err
