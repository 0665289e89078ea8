"""Collectives as NCCL prices them, and the overlap/ZeRO-3 message pattern.

Published figures (../shared/reference/published.md, nccl-tests "bus bandwidth"): 8x A100
NVSwitch all-reduce ~230 GB/s; 8x H100 ring ~370 GB/s, NVLink SHARP ~480 GB/s; multi-node
DGX A100 (8 HDR per node) ~192 GB/s.
"""

from __future__ import annotations

import pytest

from autoplan.cluster import load_cluster
from autoplan.cost.comm import CommModel, Group, bus_factor, nccl_lines, nccl_time
from autoplan.cost.overlap import (INTERFERENCE, bucketed_reduction, exposed,
                                   zero3_micro_batch)

GB = 1e9


def busbw(comm: CommModel, collective: str, nbytes: float, group: Group) -> float:
    """nccl-tests' bus bandwidth of the model's time."""
    return nbytes * bus_factor(collective, group.size) / comm.time(collective, nbytes, group)


@pytest.fixture(scope="module")
def selene() -> CommModel:
    return CommModel(load_cluster("dgx-a100", nodes=64))


@pytest.fixture(scope="module")
def hopper() -> CommModel:
    return CommModel(load_cluster("dgx-h100", nodes=16))


def test_large_all_reduce_reaches_published_busbw(selene, hopper):
    assert busbw(selene, "all_reduce", 4 * GB, Group(8, 8)) == pytest.approx(230e9, rel=0.02)
    # H100 inside a node: NVLink SHARP (NVLS) beats the 370 GB/s ring, as nccl-tests show
    assert busbw(hopper, "all_reduce", 4 * GB, Group(8, 8)) == pytest.approx(480e9, rel=0.03)
    assert hopper.algorithm("all_reduce", 4 * GB, Group(8, 8))[0] == "nvls"
    # across 16 DGX A100 (8 HDR each): within 10% of the published ~192 GB/s
    assert busbw(selene, "all_reduce", 4 * GB, Group(128, 8)) == pytest.approx(192e9, rel=0.10)


def test_bandwidth_efficiency_grows_with_message_size(selene):
    g = Group(64, 8)
    bws = [busbw(selene, "all_reduce", s, g) for s in (1e4, 1e5, 1e6, 1e7, 1e8, 1e9)]
    assert bws == sorted(bws)
    assert bws[0] < 0.05 * bws[-1]                     # latency-bound below ~100 KB


def test_small_messages_pick_ll_and_tree_like_nccl(selene):
    assert selene.algorithm("all_reduce", 8, Group(8, 8)) == ("ring", "LL")
    assert selene.algorithm("all_reduce", 8, Group(512, 8))[0] == "tree"
    assert selene.algorithm("all_reduce", 4 * GB, Group(8, 8)) == ("ring", "Simple")


def test_latency_grows_with_ranks(selene):
    """A ring's latency is linear in its ranks (all-gather: n-1 steps); a tree all-reduce's
    in log2(nodes)."""
    ag = [selene.alpha("all_gather", Group(8 * k, 8)) for k in (2, 4, 8, 16, 32, 64)]
    steps = [(8 * k - 1) for k in (2, 4, 8, 16, 32, 64)]
    per_step = [(b - a) / (s2 - s1) for a, b, s1, s2 in zip(ag, ag[1:], steps, steps[1:])]
    assert min(per_step) > 0.4e-6                       # >= one NVLink LL step per rank
    ar = [selene.time("all_reduce", 8, Group(8 * k, 8)) for k in (2, 4, 8, 16, 32, 64)]
    inc = [b - a for a, b in zip(ar, ar[1:])]
    assert max(inc) - min(inc) < 1e-6                   # tree: + 2 network steps per doubling
    assert ar[-1] < ag[-1]


def test_nccl_lines_match_the_tuning_model():
    """NCCL's ring Simple all-reduce over 2 nodes x 8: 8.4 us + 28 NVLink steps of 3.4 us + 2
    network steps of 9.6 us; LL128's bandwidth is 0.92 of the ring's."""
    lines = {(a, p): (lat, bw) for a, p, lat, bw, _ in nccl_lines("all_reduce", 16, 8, 100e9)}
    assert lines[("ring", "Simple")][0] == pytest.approx((8.4 + 28 * 3.4 + 2 * 9.6) * 1e-6)
    assert lines[("ring", "LL128")][1] == pytest.approx(92e9)
    assert lines[("ring", "LL")][1] == pytest.approx(25e9)
    assert ("tree", "Simple") in lines
    t, algo, proto = nccl_time("all_reduce", 1e9, 16, tuple(
        (a, p, lat, bw, float("inf")) for (a, p), (lat, bw) in lines.items()))
    assert t == pytest.approx(min(lat + 1e9 * 2 * 15 / 16 / bw for lat, bw in lines.values()))


# ---- overlap and the ZeRO-3 pattern --------------------------------------------------------

def test_exposed_is_bounded_by_the_window():
    assert exposed(1.0, 3.0) == pytest.approx(INTERFERENCE)          # hidden, interference
    assert exposed(3.0, 1.0) == pytest.approx(2.0 + INTERFERENCE)    # only 1 s can hide
    assert exposed(0.0, 1.0) == 0.0
    with pytest.raises(ValueError, match="window"):
        exposed(1.0, -1.0)


def test_last_gradient_bucket_never_hides():
    assert bucketed_reduction(1.0, 10.0, 0.1) == pytest.approx(0.1 + INTERFERENCE * 0.9)
    assert bucketed_reduction(1.0, 0.0, 0.1) == pytest.approx(1.0)
    assert bucketed_reduction(0.05, 10.0, 0.1) == pytest.approx(0.05)   # one bucket in all


def test_zero3_compute_bound_pays_first_gather_and_last_scatter():
    """Compute longer than every unit's collectives: only the first gather of each pass and
    the last reduce-scatter stall; the rest is hidden (interference only)."""
    U, g, r, f, b = 10, 0.01, 0.02, 0.1, 0.2
    stall = g + g + r
    traffic = U * (2 * g + r)
    assert zero3_micro_batch(U, g, r, f, b) == pytest.approx(
        stall + INTERFERENCE * (traffic - stall))


def test_zero3_comm_bound_exposes_every_unit():
    """Collectives longer than the compute: every unit waits for its gather (forward) and
    for gather + reduce-scatter (backward)."""
    U, g, r, f, b = 10, 0.3, 0.3, 0.1, 0.2
    forward = g + (U - 1) * g + f
    backward = g + (U - 1) * (g + r) + b + r
    stall = forward + backward - U * (f + b)
    traffic = U * (2 * g + r)
    assert zero3_micro_batch(U, g, r, f, b) == pytest.approx(
        stall + INTERFERENCE * (traffic - stall))
    assert stall <= zero3_micro_batch(U, g, r, f, b) <= traffic


def test_zero3_without_resharding_gathers_once():
    full = zero3_micro_batch(8, 0.2, 0.1, 0.1, 0.1)
    once = zero3_micro_batch(8, 0.2, 0.1, 0.1, 0.1, reshard_after_forward=False)
    assert once < full
    with pytest.raises(ValueError, match="units"):
        zero3_micro_batch(0, 0.1, 0.1, 0.1, 0.1)


def test_zero3_throughput_falls_as_a_fixed_batch_spreads():
    """A 175B model's per-unit gathers over 384 -> 1536 A100 (micro-batch 4 -> 1, the same
    global batch): compute per unit falls 4x, the ring's latency grows with the ranks, so
    the exposed share of the step grows (the trend issue 13 measured)."""
    selene = CommModel(load_cluster("dgx-a100", nodes=192))
    psi_unit = 175e9 / 96
    shares = []
    for gpus, mb in ((384, 4), (768, 2), (1536, 1)):
        g = Group(gpus, 8)
        gather = selene.time("all_gather", psi_unit * 2, g)
        scatter = selene.time("reduce_scatter", psi_unit * 4, g)
        f = 24 * mb * 2048 * 12288 ** 2 / (312e12 * 0.7)
        e = zero3_micro_batch(96, gather, scatter, f, 3 * f)
        shares.append(e / (e + 96 * 4 * f))
    assert shares == sorted(shares) and shares[-1] > 2 * shares[0]



def test_pipeline_boundaries_are_sliced_over_tp_where_the_sequence_divides():
    """autoplan.cost.pipeline_comm.boundary_shards, the rule engine.pipeline.scatter_gather
    runs (Narayanan et al. 2021 sec. 4.1)."""
    from autoplan.cost.pipeline_comm import boundary_shards

    assert boundary_shards(1, False, 2048) == 1
    assert boundary_shards(8, False, 2048) == 8 and boundary_shards(8, True, 2048) == 8
    assert boundary_shards(8, False, 2047) == 1 and boundary_shards(8, False, None) == 1
