"""The search's plan vs the best uniform plan, measured through the engine on 4 CPU ranks.

For each model the planner writes two plans for this machine's 4-rank cluster
(``profiles/clusters/local-cpu.yaml``): ``planner="auto"`` (the Alpa-style search, run by
the engine's per-op runtime, :mod:`engine.staged`) and ``planner="uniform"`` (the grid's
best, run by the uniform runtime). One torchrun launch builds both trainers in the same four
processes and steps them in alternating blocks — side by side, so load from other processes
hits both alike — and reports median step times, their ratio, and each plan's prediction
error. A third row runs the *same* data-parallel configuration through both runtimes, to
show what the per-op runtime itself costs.

    python benchmarks/search_measured.py          # writes benchmarks/results/search_measured.json

Target (issue #5): on a model whose layers are not alike, the search's plan is measured
faster than the best uniform plan (median ratio auto / uniform < 1).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

CLUSTER = "local-cpu"
RANKS = 4
#: name -> (model config overrides of the built-in GPT, global batch)
MODELS = {
    # a vocabulary 512x the hidden size: the embedding and head hold 96% of the weights;
    # the search shards both along the data axis (no gradient all-reduce for them)
    "gpt-vocab64k-h128": (dict(vocab_size=65536, seq_len=64, hidden=128, layers=4, heads=4,
                               attention="sdpa", dropout=0.0), 8),
    # a vocabulary 128x the hidden size, 8 layers: the search picks interleaved 1F1B
    "gpt-vocab32k-h256": (dict(vocab_size=32768, seq_len=128, hidden=256, layers=8, heads=8,
                               attention="sdpa", dropout=0.0), 16),
}
#: the same configuration through both runtimes (the per-op runtime's own cost)
SAME_CONFIG = ("runtimes-gpt-small-dp4", dict(vocab_size=4096, seq_len=128, hidden=256,
                                             layers=8, heads=8, attention="sdpa",
                                             dropout=0.0), 16)
LR = 1e-3


def make_plans(out: Path, names: list[str], runtime_row: bool
               ) -> dict[str, dict[str, Path]]:
    from autoplan.api import optimize
    from autoplan.models.registry import ModelSpec

    plans = {}
    for name in names:
        cfg, batch = MODELS[name]
        spec = ModelSpec("builtin", "gpt", cfg)
        pair = {}
        for planner in ("auto", "uniform"):
            plan = optimize(spec, CLUSTER, global_batch=batch, planner=planner)
            pair[planner] = plan.save(out / f"{name}.{planner}.json")
        plans[name] = pair
    if not runtime_row:
        return plans
    # the uniform grid's dp4 ZeRO-1 plan, and the same plan handed to the per-op runtime
    import dataclasses

    from autoplan.api import estimate

    name, cfg, batch = SAME_CONFIG
    uniform = estimate(ModelSpec("builtin", "gpt", cfg), CLUSTER, global_batch=batch, dp=4,
                       zero=1, micro_batch=2)
    per_op = dataclasses.replace(
        uniform, planner={"name": "auto", "runtime": "per_op",
                          "label": uniform.parallel.label()},
        stages=[dataclasses.replace(st, data_axes=("dp",)) for st in uniform.stages])
    plans[name] = {"auto": per_op.save(out / f"{name}.per_op.json"),
                   "uniform": uniform.save(out / f"{name}.uniform.json")}
    return plans


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=8, help="alternating blocks per side")
    parser.add_argument("--block", type=int, default=2, help="steps per block")
    parser.add_argument("--models", nargs="+", choices=sorted(MODELS), default=list(MODELS))
    parser.add_argument("--no-runtime-row", action="store_true",
                        help="skip the same-configuration row")
    parser.add_argument("--worker", nargs=3, metavar=("AUTO", "UNIFORM", "OUT"),
                        help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return worker(*map(Path, args.worker), args.rounds, args.block)

    from autoplan.plan import Plan
    from benchmarks.common import print_table, run_torchrun, target, write_results
    from engine.staged import runs_per_op

    measurements, targets, rows = {}, [], []
    with tempfile.TemporaryDirectory() as tmp:
        for name, pair in make_plans(Path(tmp), args.models,
                                     not args.no_runtime_row).items():
            out = Path(tmp) / f"{name}.out.json"
            rc = run_torchrun(__file__, RANKS, ["--rounds", str(args.rounds), "--block",
                                                str(args.block), "--worker", str(pair["auto"]),
                                                str(pair["uniform"]), str(out)])
            if rc:
                return rc
            m = json.loads(out.read_text())
            auto_p, uni_p = Plan.load(pair["auto"]), Plan.load(pair["uniform"])
            med = {side: statistics.median(v) for side, v in m["times"].items()}
            pred = {"auto": auto_p.prediction.step_time_s,
                    "uniform": uni_p.prediction.step_time_s}
            ratio = med["auto"] / med["uniform"]
            measurements[name] = {
                "model": auto_p.model["config"], "global_batch": auto_p.global_batch,
                "auto_plan": auto_p.planner.get("label"), "auto_layout": auto_p.layout,
                "auto_runtime": "per_op" if runs_per_op(auto_p) else "uniform",
                "uniform_plan": uni_p.parallel.label(),
                "measured_median_s": med, "predicted_s": pred,
                "measured_ratio_auto_over_uniform": ratio,
                "predicted_ratio_auto_over_uniform": pred["auto"] / pred["uniform"],
                "prediction_error": {s: pred[s] / med[s] - 1 for s in pred},
                "losses_equal": m["losses_equal"], "times": m["times"]}
            if name == SAME_CONFIG[0]:
                targets.append(target(f"{name}: per-op / uniform runtime, same plan",
                                      "<= 1.25", round(ratio, 4), ratio <= 1.25))
            else:
                targets.append(target(f"{name}: measured auto / best uniform step time",
                                      "< 1.0", round(ratio, 4), ratio < 1.0))
            runtime = "per-op" if runs_per_op(auto_p) else "uniform"
            for side, label in (("auto", f"{auto_p.planner.get('label')} ({runtime} runtime)"),
                                ("uniform", uni_p.parallel.label())):
                rows.append([name, side, label, f"{med[side]:.3f}", f"{pred[side]:.3f}",
                             f"{pred[side] / med[side] - 1:+.0%}"])
            rows.append([name, "ratio", "auto / uniform", f"{ratio:.3f}",
                         f"{pred['auto'] / pred['uniform']:.3f}", ""])
    print_table(f"search vs uniform, measured ({RANKS} gloo ranks on this machine, medians)",
                ["model", "planner", "plan", "measured s", "predicted s", "pred. error"], rows)
    write_results("search_measured", measurements, targets,
                  extra={"cluster": CLUSTER, "ranks": RANKS, "backend": "gloo (CPU)",
                         "method": "both plans' trainers in the same 4 processes, alternating "
                                   "blocks of --block steps, --rounds per side, round 0 "
                                   "discarded; a step is its slowest rank's; medians"})
    return 0 if all(t["met"] for t in targets) else 1


# ---- worker (under torchrun) ---------------------------------------------------------------

def worker(auto_path: Path, uniform_path: Path, out: Path, rounds: int, block: int) -> int:
    import torch.distributed as dist

    from autoplan.plan import Plan
    from benchmarks.common import alternating_blocks
    from engine.config import RunConfig
    from engine.mesh import init_distributed
    from engine.run import make_trainer
    from engine.runtime import check_all

    cfg = RunConfig(steps=10**6, lr=LR, memory="off", out_dir=str(out.parent / "run"))
    device = init_distributed("cpu", cfg.timeout_s)
    trainers = {}
    for side, path in (("auto", auto_path), ("uniform", uniform_path)):
        plan = Plan.load(path)
        spec = check_all(plan, str(path), world_size=int(os.environ["WORLD_SIZE"]))
        trainers[side] = make_trainer(plan, spec, cfg, device, source=str(path))
    slowest, losses = alternating_blocks(
        {side: trainer.train_step for side, trainer in trainers.items()}, rounds, block)
    if dist.get_rank() == 0:
        same = all(abs(losses["auto"][k] - losses["uniform"][k]) <= 1e-4 * abs(losses["uniform"][k])
                   for k in losses["auto"])
        out.write_text(json.dumps({"times": slowest, "losses_equal": same,
                                   "losses": losses}))
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
