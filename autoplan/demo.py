"""``autoplan demo``: the whole flow on this machine, in about a minute.

1. trace the built-in ``gpt-small`` (8 layers, hidden 256) on the meta device;
2. plan it for ``nproc`` CPU ranks of this machine (cluster preset ``local-cpu``, gloo);
3. write and print the plan;
4. run it for ``steps`` steps under torchrun through the engine;
5. print measured against predicted step time and memory (from the run's summary.json),
   with how busy the machine was meanwhile (:mod:`autoplan.hostload`, also written to the
   run directory as ``host_load.json``): on a shared machine other processes take cores the
   prediction assumes the run has.
"""

from __future__ import annotations

import dataclasses
import json
import sys
import time
from pathlib import Path

from autoplan.errors import AutoplanError

DEMO_MODEL = "gpt-small"
DEMO_CLUSTER = "local-cpu"
DEMO_GLOBAL_BATCH = 8


def demo_cluster(nproc: int):
    """The local-cpu preset with ``nproc`` ranks on one node."""
    from autoplan.cluster import load_cluster

    base = load_cluster(DEMO_CLUSTER)
    return dataclasses.replace(base, nodes=1, devices_per_node=nproc)


def run_demo(*, nproc: int = 2, steps: int = 30, out_dir: str = "runs/demo",
             as_json: bool = False) -> int:
    from rich.console import Console

    from autoplan import hostload
    from autoplan.api import plan_problem, prepare
    from autoplan.display import fit_table, nbytes, print_plan
    from engine.launch import run_local

    if nproc < 1:
        raise AutoplanError(f"--nproc must be >= 1, got {nproc}")
    console = Console(stderr=as_json)
    out = Path(out_dir)
    problem = prepare(DEMO_MODEL, demo_cluster(nproc), global_batch=DEMO_GLOBAL_BATCH,
                      precision="fp32")
    t0 = time.perf_counter()
    plan, _ = plan_problem(problem, top_k=3, planner="auto")
    plan_path = plan.save(out / "plan.json")
    print_plan(plan, console, title=f"demo plan for {nproc} CPU ranks", top_k=3)
    console.print(f"searched (intra-op ILP + stage DP, the uniform grid beside it) in "
                  f"{time.perf_counter() - t0:.2f} s; plan written to {plan_path}")
    console.print(f"running {steps} steps: torchrun --standalone --nproc_per_node={nproc} "
                  f"-m engine.run {plan_path} --steps {steps} --out {out}")
    sys.stdout.flush()
    status, load = hostload.measured_run(
        out, lambda: run_local(plan_path, nproc=nproc, steps=steps, out_dir=out))
    if status != 0:
        console.print(f"[bold red]the engine run failed with status {status}[/bold red]")
        return status
    summary = json.loads((out / "summary.json").read_text())
    if as_json:
        print(json.dumps({"plan": str(plan_path), "parallel": plan.parallel.label(),
                          "summary": summary, "host_load": load.to_dict()},
                         indent=2, default=str))
        return 0
    meas, pred = summary["measured"], summary.get("predicted") or {}
    ratios = summary.get("measured_over_predicted", {})
    nan = float("nan")
    rows = [["step time (median)", f"{pred.get('step_time_s', nan):.4f} s",
             f"{meas['step_time_s']:.4f} s", f"{ratios.get('step_time_s', nan):.2f}x"],
            ["peak memory per rank", nbytes(pred.get("peak_memory_bytes") or 0),
             nbytes(meas.get("peak_memory_bytes") or 0),
             f"{ratios.get('peak_memory_bytes', nan):.2f}x"]]
    console.print(fit_table(console, ["", ("predicted", "right"), ("measured", "right"),
                                      ("measured / predicted", "right")], rows,
                            title=f"predicted vs measured ({plan.parallel.label()}, final loss "
                                  f"{meas['final_loss']:.3f})"))
    console.print(hostload.describe(load, nproc), highlight=False)
    return 0
