"""Communication of expert and context parallelism, per layer and micro-batch.

Pure functions of sizes and a :class:`~autoplan.cost.comm.CommModel`; the step composition
(:mod:`autoplan.cost.step`) adds them to a chunk's in-layer communication and the planners
choose the degrees. The runtimes they price are :mod:`autoplan.models.moe` (expert
parallelism) and :mod:`autoplan.models.context_parallel`.

**Expert parallelism** (GShard, Lepikhin et al. 2020; Megatron-LM and torchtitan fold the
expert-parallel group into the data-parallel one). Each MoE layer exchanges its capacity
buffer twice in forward (dispatch, then combine) and twice in backward, each an all-to-all
over the ``ep`` ranks of::

    V_a2a = k · c_f · T · h · b   bytes per rank        (T tokens of the rank, h hidden,
                                                         k experts per token, c_f capacity
                                                         factor, b bytes per element)

of which ``(ep - 1) / ep`` leaves the rank (the all-to-all's bus factor). The expert
weights are split ``ep`` ways; their gradients are reduced over the ``dp / ep`` ranks that
hold the same experts, the other weights' over all ``dp``. The expert matmuls' FLOPs per
rank do not change (``E / ep`` experts on ``ep`` times the slots); routing imbalance is the
capacity factor (the most loaded expert sets the pace).

**Context parallelism** (``cp`` ranks per sequence; Llama 3, Dubey et al. 2024, sec. 3.3.2;
Liu et al. 2023 for the ring): every op's work per rank is ``1 / cp`` of the sequence's
(load-balanced causal chunks give each rank the same attention work), and attention needs
the whole sequence's keys and values::

    V_kv = 2 · B · s · h_kv · b   bytes (full sequence, B sequences of the micro-batch)

* ``all-gather`` (autoplan's engine, :mod:`autoplan.models.context_parallel`): one
  all-gather of ``V_kv`` before attention, a reduce-scatter of its gradient in backward;
  exposed (Llama 3 notes it is small under grouped-query attention). The gathered keys and
  values are saved for the backward: ``V_kv (cp - 1) / cp`` more activation bytes per
  attention layer than the rank's own share.
* ``ring`` (Transformer Engine's point-to-point context parallelism in Megatron-Core and
  NeMo, ``cp_comm_type="p2p"``; torch's ring attention in torchtitan): ``cp - 1`` steps each
  sending a ``V_kv / cp`` block to the next rank while the attention of the block in hand
  runs (``t_attn / cp``); exposed only where a send outlasts its block,
  ``(cp - 1) · max(0, t_send - t_attn / cp)`` per direction. Backward runs the ring again,
  sending each block with its gradient (``2 V_kv / cp``) beside the blocks' backward. Only
  the rank's own keys and values are saved (the backward's ring brings the others again):
  no extra activation bytes.

Which one a runtime uses is a pricing assumption (:data:`CP_COMMS`), like the attention
kernel; the plan does not record it.
"""

from __future__ import annotations

from autoplan.cost.comm import CommModel, Group
from autoplan.errors import one_of
from autoplan.pricing import CP_COMMS    # the names a plan's pricing records


def check_cp_comm(method: object) -> str:
    """``method`` if it is one of :data:`CP_COMMS`; ValueError otherwise."""
    return one_of(method, CP_COMMS, "context-parallel exchange")


def expert_a2a_bytes(tokens: float, hidden: int, top_k: int, capacity_factor: float,
                     elem_bytes: int) -> float:
    """``V_a2a``: the capacity buffer one rank sends in one all-to-all."""
    return top_k * capacity_factor * tokens * hidden * elem_bytes


def expert_parallel_time(comm: CommModel, group: Group, *, tokens: float, hidden: int,
                         top_k: int, capacity_factor: float, elem_bytes: int
                         ) -> tuple[float, float]:
    """(forward, backward) seconds of one MoE layer's all-to-alls per micro-batch: two each
    way (dispatch and combine), exposed (the tokens wait for them)."""
    if group.size <= 1:
        return 0.0, 0.0
    one = comm.time("all_to_all", expert_a2a_bytes(tokens, hidden, top_k, capacity_factor,
                                                   elem_bytes), group)
    return 2 * one, 2 * one


def kv_bytes(sequences: float, seq_len: int, kv_hidden: int, elem_bytes: int) -> float:
    """``V_kv``: keys and values of the whole sequences of a micro-batch."""
    return 2 * sequences * seq_len * kv_hidden * elem_bytes


def context_parallel_time(comm: CommModel, group: Group, volume: float, *,
                          attention_fwd: float, attention_bwd: float,
                          method: str = "all-gather") -> tuple[float, float]:
    """(forward, backward) exposed seconds of one attention layer's key/value exchange per
    micro-batch: ``volume`` is ``V_kv`` (:func:`kv_bytes`, on this rank's share of the
    heads), ``attention_fwd``/``_bwd`` the rank's attention-core seconds (what a ring's
    sends hide behind)."""
    cp = group.size
    if cp <= 1:
        return 0.0, 0.0
    if check_cp_comm(method) == "all-gather":
        return (comm.time("all_gather", volume, group),
                comm.time("reduce_scatter", volume, group))
    pair = Group(2, 1) if group.nodes > 1 else Group(2, 2)   # the ring's slowest hop
    send = comm.time("send_recv", volume / cp, pair)
    send_bwd = comm.time("send_recv", 2 * volume / cp, pair)
    return ((cp - 1) * max(0.0, send - attention_fwd / cp),
            (cp - 1) * max(0.0, send_bwd - attention_bwd / cp))


def context_parallel_extra_activation(volume: float, cp: int,
                                      method: str = "all-gather") -> float:
    """Bytes of keys and values an attention layer saves for backward beyond the rank's own
    share: the gathered ones under ``all-gather``, none under ``ring``."""
    if cp <= 1 or check_cp_comm(method) == "ring":
        return 0.0
    return volume * (cp - 1) / cp
