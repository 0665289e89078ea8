"""How autoplan's input surfaces answer fuzzed input (issue #7): inputs tried, accepted,
rejected (by error type) and unexpected exceptions, per surface.

The generators and checks are the tests' (tests/fuzz_helpers.py; tests/test_fuzz_*.py run
them and fail on the first unexpected exception); here every input runs to the end and the
outcomes are counted, unexpected ones included, with the first few of each type. Target: no
unexpected exception on any surface.

    python benchmarks/fuzz_counts.py [--examples 1000] [--traced 25] [--seed 0]
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
from fuzz_helpers import (Tally, make_cli_env, plan_seeds, run_cli_fuzz,  # noqa: E402
                          run_cluster_fuzz, run_plan_fuzz, run_profile_fuzz, scratch_dir)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--examples", type=int, default=1000, help="inputs per surface")
    ap.add_argument("--traced", type=int, default=25,
                    help="command lines that trace a model (0.1-0.5 s each)")
    ap.add_argument("--seed", type=int, default=0, help="hypothesis seed (reproducible counts)")
    args = ap.parse_args()

    rows = []
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
        ]
        for name, run, n in surfaces:
            tally = Tally(name)
            t0 = time.perf_counter()
            run(tally, n, args.seed)
            rows.append({**tally.as_dict(), "seconds": round(time.perf_counter() - t0, 1)})
            print(tally.line(), flush=True)

    print_table("fuzzed inputs per surface",
                ["surface", "tried", "accepted", "rejected", "unexpected", "seconds"],
                [[r["surface"], r["tried"], r["accepted"],
                  ", ".join(f"{k} {v}" for k, v in r["rejected_by_type"].items()),
                  ", ".join(f"{k} {v}" for k, v in r["unexpected_by_type"].items()) or "0",
                  r["seconds"]] for r in rows])
    targets = [target(f"{r['surface']}: unexpected exceptions", "0", r["unexpected"],
                      r["unexpected"] == 0) for r in rows]
    write_results("fuzz_counts", rows, targets, extra={
        "settings": {"examples": args.examples, "traced": args.traced, "seed": args.seed},
        "note": "unexpected: an exception other than the project's own error type, a message "
                "without the file or field, an accepted input that does not round-trip, or "
                "an input taking over 20 s; what the fuzzers once found is pinned by tests in "
                "tests/test_fuzz_plan.py and tests/test_fuzz_cli.py"})
    return 0


if __name__ == "__main__":
    sys.exit(main())
