"""Exact pruning of micro-batch counts: skip pricing a count m whose every pipeline provably
ranks below the candidates the search already holds.

The search keeps, over all m, the ``limit`` distinct candidates of smallest table latency
and prices those exactly (:func:`autoplan.planner.search.search.search`). If a lower bound
``LB(m)`` of every latency m's tables can give already exceeds the latency of ``limit``
distinct candidates found at other counts, none of m's candidates can reach the exact
pricing, and m's stage tables, stage DP and balanced pipelines need not be built: the
priced candidates, and so the plan, are the same.

The bound (a Lagrangian relaxation of the stages' memory constraints). Every latency the
tables give for m micro-batches -- the stage DP's ``sum_s t_s + (m - 1) max_s t_s`` (Alpa,
Zheng et al. 2022, eq. 2) and the balanced pipelines' ``m slow + ...`` -- is at least
``m max_s t_s``, and ``max_s t_s >= sum_s n_s t_s / N`` for stages of ``n_s`` devices out
of ``N``. A stage's time per micro-batch is at least the sum of its layers' ``f + b + cf +
cb`` (compute and layer communication, forward and backward; plus ``f + cf`` recomputed
under full recomputation, the attention core's forward ``sf`` under selective, ``of + oc``
under op-level, each only where the search tries that mode: the
transitions, sends, gradient sync and optimizer terms are >= 0 and dropped), and a stage
that fits holds, per device, at least one micro-batch's activations and its states at
ZeRO-3 (every state sharded: the least any ZeRO stage keeps; weighted as the tables weigh
them, :func:`~autoplan.cost.memory.solver_state_weight`) within the budget ``M``; so
``sum_l n_l mem_l <= N M``. For any ``mu >= 0``::

    latency >= (m / N) sum_l min_c n_c (t_c + mu mem_c)  -  m mu M

with ``c`` over every (submesh, layout, recomputation) the kind tables of m price for
layer l's kind. The maximum over a grid of ``mu`` is ``LB(m)``. Checked against every
candidate's latency, and the pruned search against the unpruned one plan for plan, in
tests/test_search_prune.py.
"""

from __future__ import annotations

import numpy as np

from autoplan.cost.memory import solver_state_weight
from autoplan.planner.search.costs import BUCKETS

#: the Lagrange multipliers tried (seconds per byte per device): 0, and a log grid wide
#: enough for a layer's seconds against its gigabytes; any mu >= 0 gives a valid bound
MULTIPLIERS = np.concatenate([[0.0], np.logspace(-16, -7, 91)])
#: relative slack on the bound: the tables sum the same terms in another order
SLACK = 1e-9


def latency_lower_bound(ev, tables: dict, m: int, devices: int, memory: float,
                        modes=(True, "selective")) -> float:
    """``LB(m)`` (module docstring) from the kind tables ``tables`` ((kind, mesh) ->
    :class:`~autoplan.planner.search.kind_tables.KindTable` or None) of every mesh m's
    pipelines may use, on a cluster of ``devices`` devices with a budget of ``memory``
    bytes per device; ``modes``: the recomputation modes searched besides none (True:
    full). 0 when some layer kind has no table (no bound)."""
    ms = ev.ms
    p_b, g_b, o_b = ev.cm.state_bytes
    weight = solver_state_weight(ev.step.gpu)   # as the tables weigh the states
    best: dict[str, np.ndarray] = {}
    for (kind, mesh), t in tables.items():
        if t is None:
            continue
        div = np.array([max(1, mesh.group(axes).size) for axes in BUCKETS], dtype=float)
        states = weight * (t.psi * ((p_b + g_b + o_b) / div)).sum(axis=1)
        base = t.f + t.b + t.cf + t.cb
        times, mems = [base], [states + t.act]
        if ms.is_block[ms.kinds[kind].layer]:
            if True in modes:                                    # full recomputation
                times.append(base + t.f + t.cf)
                mems.append(states + t.kept)
            if "selective" in modes and t.sf is not None and t.sact is not None:
                times.append(base + t.sf)
                mems.append(states + t.act - t.sact)
            if "op" in modes and t.of is not None:              # op-level
                times.append(base + t.of + t.oc)
                mems.append(states + t.kept + t.oact)
        time = np.concatenate(times) * mesh.size
        mem = np.concatenate(mems) * mesh.size
        if not time.size:
            continue
        value = (time[None, :] + MULTIPLIERS[:, None] * mem[None, :]).min(axis=1)
        best[kind] = np.minimum(best[kind], value) if kind in best else value
    counts: dict[str, int] = {}
    for kind in ms.layer_kind:
        counts[kind] = counts.get(kind, 0) + 1
    if any(kind not in best for kind in counts):
        return 0.0
    total = sum(n * best[kind] for kind, n in counts.items())
    dual = m / devices * total - m * MULTIPLIERS * memory
    return max(0.0, float(dual.max()) * (1 - SLACK))


class Ranked:
    """The distinct candidates the exact pricing would take: the search's selection (the
    first ``limit`` distinct choices, fastest table latency first, skipping those it never
    writes) is decided by the ``limit`` smallest latencies among distinct choices."""

    def __init__(self, limit: int, skip):
        self.limit = limit
        self.skip = skip                     # choice -> True: never priced
        self.best: dict = {}                 # choice -> its smallest latency

    def add(self, candidates) -> None:
        for c in candidates:
            if self.skip(c.choice):
                continue
            old = self.best.get(c.choice)
            if old is None or c.estimate < old:
                self.best[c.choice] = c.estimate

    def beaten(self, bound: float) -> bool:
        """True when ``limit`` distinct choices are already faster than ``bound``: no
        candidate of latency >= ``bound`` would be priced."""
        return sum(1 for e in self.best.values() if e < bound) >= self.limit
