"""Fuzzing past loading (issue 14): fuzzed plans through the pre-launch checks and fuzzed
complete checkpoints through the verifier, strict (the first unexpected exception, hang or
silent wrong result fails the test). benchmarks/fuzz_counts.py runs the same generators at
1,000+ inputs each and counts the outcomes."""

from __future__ import annotations

import pytest

from fuzz_engine import build_checkpoint, run_checkpoint_fuzz, run_prelaunch_fuzz
from fuzz_helpers import Tally


def test_fuzzed_plans_are_rejected_clearly_before_launch(tmp_path):
    tally = run_prelaunch_fuzz(Tally("pre-launch"), tmp_path, max_examples=60, seed=0)
    assert tally.tried == 60 and tally.unexpected == {}
    assert sum(tally.rejected.values()) > 0


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return build_checkpoint(tmp_path_factory.mktemp("ckpt-build"))


def test_damaged_checkpoints_never_verify(tmp_path, checkpoint):
    tally = run_checkpoint_fuzz(Tally("checkpoint"), tmp_path, max_examples=200, seed=0,
                                built=checkpoint)
    assert tally.tried == 200 and tally.unexpected == {}
    assert tally.rejected["fell back to the previous checkpoint"] > 0
    assert tally.rejected["CheckpointMismatch"] > 0
