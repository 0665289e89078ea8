"""Per-stage forward / backward times of a plan, per micro-batch: what the timeline draws.

A version-3 plan carries them (``prediction.stage_times``, from the one step composition,
:mod:`autoplan.cost.step`): they are read, nothing is re-traced. Plans written before
(versions 1 and 2) do not: a search plan's ``stages[i].predicted`` gives compute and
communication per stage (backward taken as twice the forward); a uniform plan is re-priced
with the grid's :class:`~autoplan.planner.grid.estimate.Estimator`, re-tracing the plan's model on
the meta device (:func:`autoplan.api.prepare`; a few seconds) unless the caller passes the
traced :class:`~autoplan.api.Problem`. If the model cannot be rebuilt here (an ``import:``
model whose package is missing, say), it falls back to an approximation from the
prediction's breakdown: every chunk equal, backward twice the forward (Narayanan et al.
2021, sec. 3.2), and says so in :attr:`StageTiming.note`.
"""

from __future__ import annotations

from dataclasses import dataclass

from autoplan.errors import AutoplanError
from autoplan.plan import Plan, StageTime
from autoplan.precision import priced_as

#: Relative difference between the re-estimated and the recorded step time worth a note.
DRIFT_NOTE = 0.01


@dataclass(frozen=True)
class ChunkTime:
    """Seconds per micro-batch of one model chunk (pipeline stage) on each of its devices."""

    forward: float              # forward compute
    backward: float             # backward compute
    recompute: float = 0.0      # forward recomputed in backward (activation checkpointing)
    tp_forward: float = 0.0     # tensor-parallel collectives of the forward
    tp_backward: float = 0.0    # ... of the backward
    tp_recompute: float = 0.0   # ... of the recomputed forward
    send: float = 0.0           # the boundary to the next stage: output out, its gradient in

    @property
    def forward_block(self) -> float:
        """A forward in the timeline: compute, TP collectives, the send."""
        return self.forward + self.tp_forward + self.send

    @property
    def backward_block(self) -> float:
        """A backward in the timeline, the recomputed forward included, with the output
        boundary's transfer (the step's layout swaps it for the input's, s(c - 1))."""
        return (self.backward + self.recompute + self.tp_backward + self.tp_recompute
                + self.send)


@dataclass(frozen=True)
class StageTiming:
    chunks: tuple[ChunkTime, ...]      # one per plan stage (model chunk), in stage order
    source: str                        # "plan", "search", "estimator" or "approximate"
    note: str = ""                     # how the figures were obtained, or a caveat


class ReportError(AutoplanError):
    """A report cannot be made from this plan; the message says why."""


def stage_timing(plan: Plan, problem=None) -> StageTiming:
    """Per-chunk times of ``plan``: from the Estimator, or approximated (see module doc).

    ``problem``: the plan's model already traced for its cluster
    (:func:`autoplan.api.prepare`), to skip re-tracing.
    """
    recorded = _from_plan(plan)
    if recorded is not None:
        return recorded
    searched = _from_search(plan)
    if searched is not None:
        return searched
    try:
        problem = problem or _retrace(plan)
    except (AutoplanError, ImportError, RuntimeError) as exc:
        if plan.prediction is None:
            raise ReportError(f"the plan has no prediction and its model cannot be traced "
                              f"here to estimate one ({exc})") from None
        return _approximate(plan, f"model not re-traced ({exc}); per-stage times "
                                  "approximated from the plan's time breakdown")
    return _from_estimator(plan, problem)


def _chunk(t: StageTime) -> ChunkTime:
    return ChunkTime(forward=t.forward, backward=t.backward, recompute=t.recompute,
                     tp_forward=t.tp_forward, tp_backward=t.tp_backward,
                     tp_recompute=t.tp_recompute, send=t.send)


def _from_plan(plan: Plan) -> StageTiming | None:
    """The plan's own per-stage times (version 3), or None when it has none."""
    pred = plan.prediction
    if pred is None or len(pred.stage_times) != len(plan.stages):
        return None
    return StageTiming(tuple(_chunk(t) for t in pred.stage_times), "plan",
                       "per-stage times recorded in the plan by its planner")


def _from_search(plan: Plan) -> StageTiming | None:
    """A search plan's own per-stage figures (``stages[i].predicted``: compute, in-layer
    communication, recomputation, send per micro-batch; backward twice the forward), or None
    when the plan has none (a uniform plan)."""
    if plan.planner.name != "auto":
        return None
    chunks = []
    for st in plan.stages:
        pr = st.predicted or {}
        if not all(k in pr for k in ("compute_s", "layer_comm_s", "send_s")):
            return None
        compute, comm = float(pr["compute_s"]), float(pr["layer_comm_s"])
        recompute = float(pr.get("recompute_s", 0.0))
        chunks.append(ChunkTime(forward=compute / 3, backward=2 * compute / 3,
                                recompute=recompute, tp_forward=comm / 3,
                                tp_backward=2 * comm / 3, send=float(pr["send_s"]) / 2))
    return StageTiming(tuple(chunks), "search",
                       "per-stage times from the search's own stage predictions "
                       "(backward = 2 x forward)")


def _retrace(plan: Plan):
    from autoplan.api import prepare
    from autoplan.cluster import Cluster
    from autoplan.models.registry import ModelSpec

    spec = ModelSpec.from_dict(plan.model)
    cluster = Cluster.from_dict(plan.cluster)
    precision = priced_as(plan.precision or {}).name
    pricing = plan.pricing.to_dict() if plan.pricing is not None else {}
    return prepare(spec, cluster, global_batch=plan.global_batch, seq_len=plan.seq_len,
                   precision=precision, **pricing)    # re-priced as it was priced


def _from_estimator(plan: Plan, problem) -> StageTiming:
    p = plan.parallel
    est = problem.estimator()
    chunks = tuple(_chunk(c.stage_time()) for c in est.chunks(p))
    note = "per-stage times from the planner's Estimator (model re-traced on the meta device)"
    if plan.prediction is not None:
        again = est.predict(p).step_time_s
        drift = abs(again - plan.prediction.step_time_s) / plan.prediction.step_time_s
        if drift > DRIFT_NOTE:
            note += (f"; re-estimated step time {again:.4g} s differs from the plan's "
                     f"{plan.prediction.step_time_s:.4g} s by {100 * drift:.1f}% (cost model "
                     "or profiles changed since planning)")
    return StageTiming(chunks, "estimator", note)


def _approximate(plan: Plan, note: str) -> StageTiming:
    p = plan.parallel
    t = plan.prediction.time
    m, v = p.num_micro_batches, p.virtual_stages
    per = m * v                                # chunk-micro-batches on the slowest rank
    compute = t.compute / per
    tp = t.tp_comm / per
    recompute = t.recompute / per
    tp_share = tp / (3 if recompute else 2)
    chunk = ChunkTime(forward=compute / 3, backward=2 * compute / 3, recompute=recompute,
                      tp_forward=tp_share, tp_backward=tp_share,
                      tp_recompute=tp_share if recompute else 0.0,
                      send=t.pp_comm / per / 2)
    return StageTiming(tuple(chunk for _ in plan.stages), "approximate", note)
