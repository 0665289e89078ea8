"""The search's pruning of micro-batch counts (autoplan/planner/search/prune.py) is exact:
its bound lies below every latency the tables give at that count, and the pruned search
prices the same candidates, and so returns the same plan, as the search over every count
(issue #18). Planning only: no engine runs."""

from __future__ import annotations

import pytest

import autoplan.planner.search.search as search_mod
from autoplan.api import prepare
from autoplan.models import resolve
from autoplan.planner.search.search import SearchOptions, search

#: (model, nodes of DGX A100, global batch): small GPTs on one node whose one-micro-batch
#: pipelines must recompute (their bound prunes m = 1), and GPT-39B on 64 GPUs (m <= 6)
CASES = [(dict(vocab_size=8192, hidden=2048, layers=8, heads=16, seq_len=2048), 1, 1024),
         (dict(vocab_size=8192, hidden=4096, layers=8, heads=32, seq_len=2048), 1, 512),
         ("gpt-39b", 8, 1536)]


def _problem(case):
    model, nodes, batch = case
    spec = resolve("gpt", **model) if isinstance(model, dict) else resolve(model)
    return prepare(spec, "dgx-a100", global_batch=batch, nodes=nodes)


def _search(p, prune: bool):
    return search(p.spec, p.graph, p.cluster, global_batch=p.global_batch,
                  precision=p.precision, options=SearchOptions(prune_micro_batches=prune))


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[1]}nodes-{c[2]}")
def test_pruned_search_prices_the_same_candidates(case):
    p = _problem(case)
    pruned, full = _search(p, True), _search(p, False)
    assert pruned.stats["pruned_micro_batch_counts"]          # the pruning ran
    assert not full.stats["pruned_micro_batch_counts"]
    assert pruned.best == full.best
    assert pruned.prediction.step_time_s == full.prediction.step_time_s
    assert [(c.choice, c.estimate, c.origin, c.prediction.step_time_s)
            for c in pruned.ranked] == \
        [(c.choice, c.estimate, c.origin, c.prediction.step_time_s) for c in full.ranked]


def test_bound_lies_below_every_latency_of_its_count(monkeypatch):
    """Every count's bound (computed, never acted on) against the table latency of every
    candidate the search finds at that count."""
    p = _problem(CASES[0])
    bounds: dict[int, float] = {}
    found: list = []

    def bound(ev, tables, m, devices, memory, **kw):
        bounds[m] = search_mod.latency_lower_bound.__wrapped__(ev, tables, m, devices,
                                                               memory, **kw)
        return bounds[m]

    class Recorded(search_mod.Candidate):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            found.append(self)

    bound.__wrapped__ = search_mod.latency_lower_bound
    monkeypatch.setattr(search_mod, "latency_lower_bound", bound)
    monkeypatch.setattr(search_mod, "Candidate", Recorded)
    monkeypatch.setattr(search_mod.Ranked, "beaten", lambda self, b: False)
    _search(p, True)
    assert len(bounds) >= 5                  # every count but the first (7 counts)
    checked = 0
    for c in found:
        m = c.choice.num_micro_batches
        if m in bounds:
            assert bounds[m] <= c.estimate, (m, c.origin, c.choice.schedule)
            checked += 1
    assert checked >= 10
    assert max(bounds[m] / min(c.estimate for c in found if c.choice.num_micro_batches == m)
               for m in bounds) > 0.9                         # and it is not vacuous
