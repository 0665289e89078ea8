"""Pricing of expert- and context-parallel communication (autoplan.cost.parallel_dims)."""

import pytest

from autoplan.cluster import load_cluster
from autoplan.cost.comm import CommModel, Group
from autoplan.cost.parallel_dims import (context_parallel_extra_activation,
                                         context_parallel_time, expert_a2a_bytes,
                                         expert_parallel_time, kv_bytes)


@pytest.fixture(scope="module")
def comm():
    return CommModel(load_cluster("dgx-h100", nodes=4))


def test_volumes():
    # Mixtral 8x7B, 4096 tokens on the rank, top-2, bf16: 2 x 4096 x 4096 x 2 bytes = 64 MiB
    assert expert_a2a_bytes(4096, 4096, 2, 1.0, 2) == 2 * 4096 * 4096 * 2
    # Llama 3 405B, one 131,072-token sequence, 8 KV heads of 128, bf16
    assert kv_bytes(1, 131072, 8 * 128, 2) == 2 * 131072 * 1024 * 2


def test_expert_parallel_is_four_all_to_alls_and_free_on_one_rank(comm):
    g = Group(8, 8)
    f, b = expert_parallel_time(comm, g, tokens=4096, hidden=4096, top_k=2,
                                capacity_factor=1.0, elem_bytes=2)
    one = comm.time("all_to_all", 2 * 4096 * 4096 * 2, g)
    assert f == b == pytest.approx(2 * one)
    assert expert_parallel_time(comm, Group(1, 1), tokens=4096, hidden=4096, top_k=2,
                                capacity_factor=1.0, elem_bytes=2) == (0.0, 0.0)
    # across nodes the same exchange is slower than inside one
    f2, _ = expert_parallel_time(comm, Group(16, 8), tokens=4096, hidden=4096, top_k=2,
                                 capacity_factor=1.0, elem_bytes=2)
    assert f2 > f


def test_ring_hides_behind_attention_and_all_gather_does_not(comm):
    g = Group(16, 8)
    volume = kv_bytes(1, 131072, 1024, 2)
    gather = context_parallel_time(comm, g, volume, attention_fwd=1.0, attention_bwd=2.0)
    assert gather[0] == pytest.approx(comm.time("all_gather", volume, g))
    assert gather[1] == pytest.approx(comm.time("reduce_scatter", volume, g))
    hidden = context_parallel_time(comm, g, volume, attention_fwd=1.0, attention_bwd=2.0,
                                   method="ring")
    assert hidden == (0.0, 0.0)                       # a block's attention outlasts its send
    exposed = context_parallel_time(comm, g, volume, attention_fwd=0.0, attention_bwd=0.0,
                                    method="ring")
    # nothing to hide behind: cp - 1 sends of a block forward, of a block and its gradient
    # backward, over the ring's slowest (inter-node) hop
    one = comm.time("send_recv", volume / 16, Group(2, 1))
    assert exposed[0] == pytest.approx(15 * one)
    assert exposed[1] == pytest.approx(15 * comm.time("send_recv", 2 * volume / 16, Group(2, 1)))
    assert exposed[1] > exposed[0]
    assert context_parallel_time(comm, Group(1, 1), volume, attention_fwd=0,
                                 attention_bwd=0) == (0.0, 0.0)
    with pytest.raises(ValueError, match="context-parallel exchange"):
        context_parallel_time(comm, g, volume, attention_fwd=0, attention_bwd=0, method="p2p")


def test_saved_kv_memory():
    volume = 2 * 1024 * 128 * 2
    assert context_parallel_extra_activation(volume, 1) == 0
    assert context_parallel_extra_activation(volume, 4) == volume * 3 / 4      # gathered
    assert context_parallel_extra_activation(volume, 4, "ring") == 0           # own share
