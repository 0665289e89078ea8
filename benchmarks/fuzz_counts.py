"""How autoplan's input surfaces answer fuzzed input (issues #7 and #14): inputs tried,
accepted, rejected (by error type) and unexpected exceptions, per surface — loading (cluster,
plan, profile files, command lines) and past loading (fuzzed plans through the engine's
pre-launch checks; fuzzed complete checkpoints through the checkpoint verifier:
tests/fuzz_engine.py).

The generators and checks are the tests' (tests/fuzz_helpers.py; tests/test_fuzz_*.py run
them and fail on the first unexpected exception); here every input runs to the end and the
outcomes are counted, unexpected ones included, with the first few of each type. Targets: no
unexpected exception, no hang (an input over 20 s) and no silent wrong result on any surface
— a damaged checkpoint that verifies, or an accepted pre-launch plan that crashes the engine
(a sample of the accepted plans that differ from their seed is run for 2 steps under
torchrun, ``--run-accepted``).

    python benchmarks/fuzz_counts.py [--examples 1000] [--traced 25] [--seed 0] [--run-accepted 8]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

from benchmarks.common import print_table, target, write_results  # noqa: E402
from fuzz_engine import (run_accepted_plans, run_checkpoint_fuzz,  # noqa: E402
                         run_prelaunch_fuzz)
from fuzz_helpers import (Tally, make_cli_env, plan_seeds, run_cli_fuzz,  # noqa: E402
                          run_cluster_fuzz, run_plan_fuzz, run_profile_fuzz, scratch_dir)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--examples", type=int, default=1000, help="inputs per surface")
    ap.add_argument("--traced", type=int, default=25,
                    help="command lines that trace a model (0.1-0.5 s each)")
    ap.add_argument("--seed", type=int, default=0, help="hypothesis seed (reproducible counts)")
    ap.add_argument("--run-accepted", type=int, default=8,
                    help="accepted-and-changed pre-launch plans to run under torchrun")
    ap.add_argument("--only", help="comma list of surfaces to run (default: all)")
    args = ap.parse_args()

    rows = []
    changed: list[dict] = []
    with scratch_dir(Path(tempfile.gettempdir())) as work:
        seeds = plan_seeds(work / "seeds")
        env = make_cli_env(work / "cli-env", work / "seeds" / "mlp-tiny.json")
        surfaces = [
            ("cluster and device YAML", lambda t, n, s: run_cluster_fuzz(
                t, work / "cluster", max_examples=n, strict=False, seed=s), args.examples),
            ("plan JSON", lambda t, n, s: run_plan_fuzz(
                t, work / "plan", max_examples=n, strict=False, seeds=seeds, seed=s),
             args.examples),
            ("op and link profiles", lambda t, n, s: run_profile_fuzz(
                t, work / "profile", max_examples=n, strict=False, seed=s), args.examples),
            ("command line", lambda t, n, s: run_cli_fuzz(
                t, work / "cli", env, max_examples=n, strict=False, seed=s), args.examples),
            ("command line, traced", lambda t, n, s: run_cli_fuzz(
                t, work / "cli-traced", env, max_examples=n, expensive=True, strict=False,
                seed=s), args.traced),
            ("plan, pre-launch checks", lambda t, n, s: run_prelaunch_fuzz(
                t, work / "prelaunch", max_examples=n, strict=False, seed=s,
                changed=changed), args.examples),
            ("checkpoint, verifier", lambda t, n, s: run_checkpoint_fuzz(
                t, work / "checkpoint", max_examples=n, strict=False, seed=s),
             args.examples),
        ]
        only = set(args.only.split(",")) if args.only else None
        for name, run, n in surfaces:
            if only and not any(o in name for o in only):
                continue
            tally = Tally(name)
            t0 = time.perf_counter()
            run(tally, n, args.seed)
            rows.append({**tally.as_dict(), "seconds": round(time.perf_counter() - t0, 1)})
            print(tally.line(), flush=True)
        accepted_runs = []
        if changed and args.run_accepted:
            t0 = time.perf_counter()
            accepted_runs = run_accepted_plans(changed, work / "accepted",
                                               limit=args.run_accepted)
            crashed = sum(r["crashed"] for r in accepted_runs)
            print(f"accepted pre-launch plans run under torchrun: {len(accepted_runs)}, "
                  f"crashed {crashed} ({time.perf_counter() - t0:.0f} s)", flush=True)

    print_table("fuzzed inputs per surface",
                ["surface", "tried", "accepted", "rejected", "unexpected", "seconds"],
                [[r["surface"], r["tried"], r["accepted"],
                  ", ".join(f"{k} {v}" for k, v in r["rejected_by_type"].items()),
                  ", ".join(f"{k} {v}" for k, v in r["unexpected_by_type"].items()) or "0",
                  r["seconds"]] for r in rows])
    def count(r, *kinds):
        return sum(v for k, v in r["unexpected_by_type"].items() if k in kinds)

    targets = []
    for r in rows:
        hangs, wrong = count(r, "Hang"), count(r, "SilentWrong")
        other = r["unexpected"] - hangs - wrong
        targets += [target(f"{r['surface']}: unexpected exceptions", "0", other, other == 0),
                    target(f"{r['surface']}: hangs (> 20 s)", "0", hangs, hangs == 0),
                    target(f"{r['surface']}: silent wrong results", "0", wrong, wrong == 0)]
        if r["surface"].startswith(("plan, pre", "checkpoint")):
            targets.append(target(f"{r['surface']}: inputs", ">= 1000", r["tried"],
                                  r["tried"] >= 1000))
    if accepted_runs:
        crashed = sum(x["crashed"] for x in accepted_runs)
        targets.append(target("accepted pre-launch plans that crash the engine (sampled)",
                              "0", crashed, crashed == 0))
    write_results("fuzz_counts", rows, targets, extra={
        "settings": {"examples": args.examples, "traced": args.traced, "seed": args.seed,
                     "run_accepted": args.run_accepted, "only": args.only},
        "accepted_plans_run": accepted_runs,
        "note": "unexpected: an exception other than the project's own error type, a message "
                "without the file or field, an accepted input that does not round-trip, or "
                "an input taking over 20 s; what the fuzzers once found is pinned by tests in "
                "tests/test_fuzz_plan.py and tests/test_fuzz_cli.py"})
    return 0


if __name__ == "__main__":
    sys.exit(main())
