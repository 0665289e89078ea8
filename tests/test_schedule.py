"""The one pipeline-schedule generator (autoplan.schedule): orders, deadlock freedom, and the
in-flight counts the memory model uses."""

import itertools

import pytest

from autoplan.schedule import SCHEDULES, order, peak_in_flight, round_size, warmup


def _runs_to_completion(schedule, pp, v, m):
    """Every rank executes its order; an action waits for its dependency (forward of the
    previous global chunk, backward of the next one). True when no rank is ever stuck."""
    lists = {r: [(a.kind, a.chunk * pp + r, a.micro_batch) for a in order(schedule, pp, v, m, r)]
             for r in range(pp)}
    done, pos, last = set(), dict.fromkeys(range(pp), 0), pp * v - 1
    while any(pos[r] < len(lists[r]) for r in range(pp)):
        moved = False
        for r in range(pp):
            if pos[r] == len(lists[r]):
                continue
            kind, c, i = lists[r][pos[r]]
            need = (("F", c - 1, i) if c else None) if kind == "F" else \
                (("B", c + 1, i) if c < last else ("F", c, i))
            if need is None or need in done:
                done.add((kind, c, i))
                pos[r] += 1
                moved = True
        if not moved:
            return False
    return True


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_every_order_is_complete_and_deadlock_free(schedule):
    for pp, v, m in itertools.product(range(1, 5), (1, 2, 3), range(1, 10)):
        if v > 1 and schedule != "interleaved_1f1b":
            continue
        for r in range(pp):
            acts = order(schedule, pp, v, m, r)
            assert sorted(acts) == sorted((k, j, i) for k in "BF" for j in range(v)
                                          for i in range(m))
        assert _runs_to_completion(schedule, pp, v, m), (schedule, pp, v, m)


def test_known_orders():
    assert order("1f1b", 1, 1, 2, 0) == [("F", 0, 0), ("B", 0, 0), ("F", 0, 1), ("B", 0, 1)]
    assert order("gpipe", 1, 1, 2, 0) == order("1f1b", 1, 1, 2, 0)   # one stage alternates
    assert order("gpipe", 2, 1, 2, 1) == [("F", 0, 0), ("F", 0, 1), ("B", 0, 0), ("B", 0, 1)]
    assert order("1f1b", 3, 1, 4, 0)[:3] == [("F", 0, 0), ("F", 0, 1), ("F", 0, 2)]
    assert order("1f1b", 3, 1, 4, 2)[:2] == [("F", 0, 0), ("B", 0, 0)]
    # interleaved, pp=2 v=2 m=4, rank 0: 2(pp-1) + (v-1)pp = 4 warm-up forwards, chunk
    # round-robin in rounds of pp micro-batches
    assert order("interleaved_1f1b", 2, 2, 4, 0)[:5] == [
        ("F", 0, 0), ("F", 0, 1), ("F", 1, 0), ("F", 1, 1), ("F", 0, 2)]
    assert warmup("interleaved_1f1b", 2, 2, 4, 1) == 2
    assert round_size(4, 6) == 6 and round_size(4, 8) == 4


def test_peak_in_flight_closed_forms():
    assert peak_in_flight("gpipe", 4, 0, 16) == 16
    assert peak_in_flight("gpipe", 1, 0, 16) == 1                 # one stage: accumulation
    assert [peak_in_flight("1f1b", 4, r, 16) for r in range(4)] == [4, 3, 2, 1]
    assert peak_in_flight("1f1b", 8, 0, 3) == 3                     # capped by m
    p, v, m = 4, 2, 16
    # Korthikanti et al. 2022 sec. 4.2.3: the first rank holds p (1 + (p-1)/(p v))
    assert peak_in_flight("interleaved_1f1b", p, 0, m, v) == pytest.approx(p * (1 + (p - 1) / (p * v)))
    assert peak_in_flight("interleaved_1f1b", p, p - 1, m, v) == pytest.approx((v - 1) * p / v + 1 / v)


@pytest.mark.parametrize("bad", [("zb", 2, 1, 4, 0), ("1f1b", 0, 1, 4, 0), ("1f1b", 2, 2, 4, 0),
                                 ("1f1b", 2, 1, 4, 2), ("gpipe", 2, 1, True, 0)])
def test_bad_arguments_are_named(bad):
    with pytest.raises(ValueError):
        order(*bad)


def test_memory_models_closed_form_is_the_orders_count():
    """cost.memory.in_flight_micro_batches (closed form, cheap in the planners' loops) equals
    the count on the order the engine runs, also where pp does not divide m (torch's
    interleaved rounds are then longer than pp, and so is the warm-up)."""
    from autoplan.cost.memory import in_flight_micro_batches

    for schedule in SCHEDULES:
        for pp, v, m in itertools.product(range(1, 6), (1, 2, 3), range(1, 13)):
            if v > 1 and schedule != "interleaved_1f1b":
                continue
            for r in range(pp):
                assert in_flight_micro_batches(schedule, pp, r, m, v) == pytest.approx(
                    peak_in_flight(schedule, pp, r, m, v)), (schedule, pp, v, m, r)


def test_unequal_chunks_are_held_as_the_order_holds_them():
    """cost.memory.in_flight_weighted: the peak of sum_c live_c a_c over the order, checked
    against walking the order with random chunk activations; equal chunks give the closed
    form; the first rank of pp 16, v 8, m 32 with an embedding-only first chunk holds 112
    layers, not the 143 x 7/8 = 125 of equal chunks."""
    import random

    from autoplan.cost.memory import in_flight_micro_batches, in_flight_weighted
    from autoplan.schedule import FORWARD, live_chunks

    rng = random.Random(0)
    for pp, v, m in itertools.product(range(2, 6), (2, 3, 4), (2, 5, 8, 12)):
        for r in range(pp):
            acts = [rng.uniform(0.1, 3.0) for _ in range(v)]
            live, best = [0] * v, 0.0
            for a in order("interleaved_1f1b", pp, v, m, r):
                live[a.chunk] += 1 if a.kind == FORWARD else -1
                best = max(best, sum(n * x for n, x in zip(live, acts)))
            assert in_flight_weighted("interleaved_1f1b", pp, r, m, v, acts) == \
                pytest.approx(best / sum(acts)), (pp, v, m, r)
            assert in_flight_weighted("interleaved_1f1b", pp, r, m, v, [2.0] * v) == \
                in_flight_micro_batches("interleaved_1f1b", pp, r, m, v)
    assert (31, 16, 16, 16, 16, 16, 16, 16) in live_chunks("interleaved_1f1b", 16, 0, 32, 8)
    held = in_flight_weighted("interleaved_1f1b", 16, 0, 32, 8, [1e-9] + [1.0] * 7) * 7
    assert held == pytest.approx(112, rel=1e-6)
