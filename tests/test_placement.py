"""The one placement parser/formatter (autoplan.placement)."""

import pytest

from autoplan.placement import (Placement, PlacementError, compact, parse, plan_text,
                                shard_dim, to_compact, to_plan_text)


@pytest.mark.parametrize("plan, short", [("Replicate()", "R"), ("Shard(0)", "S0"),
                                         ("Shard(12)", "S12"), ("Partial()", "P")])
def test_round_trip(plan, short):
    assert to_compact(plan) == short and to_plan_text(short) == plan
    assert parse(plan) == parse(short)


def test_strided_and_partial_forms():
    assert parse("S1~4") == Placement("S", 1, 4)
    assert plan_text(parse("S1~4")) == "_StridedShard(1)"
    assert parse("_StridedShard(2)").strided and shard_dim("_StridedShard(2)") == 2
    assert parse("_StridedShard(1, split_factor=4)") == Placement("S", 1, 4)
    assert parse("Partial(avg)").reduce == "avg" and plan_text(parse("Partial(avg)")) == "Partial(avg)"
    assert compact(parse("Partial(sum)")) == "P"
    assert shard_dim("Replicate()") is None


@pytest.mark.parametrize("bad", ["Shard(-1)", "Shard()", "Shard(x)", "Replicate(0)", "Partial(max)",
                                 "S", "S-1", "Shard(1, 2)", "shard(0)", "", "R ; rm -rf /", 3, None])
def test_garbage_is_refused_with_the_field_named(bad):
    with pytest.raises(PlacementError, match="param_placements.w.tp"):
        parse(bad, "param_placements.w.tp")


@pytest.mark.parametrize("bad", ["Shard(" + "9" * 5000 + ")", "S" + "9" * 5000,
                                 "_StridedShard(0, split_factor=" + "9" * 5000 + ")"])
def test_a_huge_dimension_is_refused_in_one_short_line(bad):
    """A 5,000-digit dimension is past int()'s 4,300-digit limit: refused with the field
    named, not a bare ValueError (tests/test_fuzz_plan.py's 'huge number literal' found it
    in a plan's param_placements), and the message does not repeat the 5,000 digits."""
    with pytest.raises(PlacementError, match="param_placements.w.tp") as info:
        parse(bad, "param_placements.w.tp")
    assert len(str(info.value)) < 200 and "characters" in str(info.value)


def test_kinds_can_be_refused():
    with pytest.raises(PlacementError, match="partial"):
        parse("Partial()", partial=False)
    with pytest.raises(PlacementError, match="strided"):
        parse("S0~2", strided=False)
