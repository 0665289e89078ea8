"""One training step of a plan, laid out in time: the timeline blocks and, per pipeline rank,
where its seconds go.

The pipeline part comes from :func:`autoplan.report.schedule.simulate` over the per-chunk
times of :mod:`autoplan.report.timing`; after it every rank reduces its gradients over the
data-parallel group and steps the optimizer (the parts of those that compute does not hide,
taken from the plan's prediction: the slowest rank's figures).
"""

from __future__ import annotations

from dataclasses import dataclass

from autoplan.plan import Plan
from autoplan.report.schedule import Block, makespan, simulate
from autoplan.report.timing import ReportError, StageTiming

#: Parts of a pipeline rank's step, in the order charts stack them.
PARTS = ("forward", "backward", "recompute", "TP comm", "PP comm", "DP comm", "optimizer",
         "runtime", "idle (bubble)")


@dataclass(frozen=True)
class StepModel:
    blocks: tuple[Block, ...]          # forward / backward blocks of every pipeline rank
    pipeline_s: float                  # when the last backward ends
    dp_comm_s: float                   # exposed gradient reduction after the pipeline
    optimizer_s: float                 # optimizer step
    ranks: tuple[dict[str, float], ...]  # per pipeline rank: seconds per part of PARTS
    groups: tuple[tuple[int, ...], ...]  # per pipeline rank: its global ranks
    runtime_s: float = 0.0             # GPU runtime overhead no term prices (cost/runtime.py)

    @property
    def step_s(self) -> float:
        return self.pipeline_s + self.dp_comm_s + self.optimizer_s + self.runtime_s


def pipeline_groups(plan: Plan) -> list[tuple[int, ...]]:
    """Global ranks of each pipeline rank: the distinct rank sets of the stages, in order."""
    out: list[tuple[int, ...]] = []
    for st in plan.stages:
        if tuple(st.ranks) not in out:
            out.append(tuple(st.ranks))
    return out


def step_model(plan: Plan, timing: StageTiming) -> StepModel:
    p = plan.parallel
    groups = pipeline_groups(plan)
    pp = len(groups)
    n = len(plan.stages)
    v = n // pp
    if v * pp != n:
        raise ReportError(f"{n} stages on {pp} distinct rank sets: cannot lay out a "
                          "pipeline schedule")
    m = p.num_micro_batches
    # a backward sends its input's gradient: the boundary before the chunk, s(c - 1)
    # (:func:`autoplan.cost.step.path_times`); a forward sends its output, s(c)
    received = [0.0] + [c.send for c in timing.chunks[:-1]]
    blocks = simulate(p.schedule, pp, v, m, [c.forward_block for c in timing.chunks],
                      [c.backward_block - c.send + r
                       for c, r in zip(timing.chunks, received)])
    pipeline = makespan(blocks)
    t = plan.prediction.time if plan.prediction else None
    dp = t.dp_comm if t else 0.0
    opt = t.optimizer if t else 0.0
    runtime = t.runtime if t else 0.0
    ranks = []
    for d in range(pp):
        cs = [timing.chunks[c] for c in range(d, n, pp)]
        boundaries = [received[c] for c in range(d, n, pp)]
        parts = {
            "forward": m * sum(c.forward for c in cs),
            "backward": m * sum(c.backward for c in cs),
            "recompute": m * sum(c.recompute for c in cs),
            "TP comm": m * sum(c.tp_forward + c.tp_backward + c.tp_recompute for c in cs),
            "PP comm": m * sum(c.send + r for c, r in zip(cs, boundaries)),
        }
        parts["idle (bubble)"] = max(0.0, pipeline - sum(parts.values()))
        parts["DP comm"] = dp
        parts["optimizer"] = opt
        parts["runtime"] = runtime
        ranks.append({k: parts[k] for k in PARTS})
    return StepModel(tuple(blocks), pipeline, dp, opt, tuple(ranks), tuple(groups), runtime)
