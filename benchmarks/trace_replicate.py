"""Tracing a deep GPT from three blocks: CPU time against the whole trace, and exactness
(issue #18, item 3: "one trace feeding both the graph and the layer records").

For each model, in this one process, medians of ``--repeats`` runs of ``time.process_time``:

* ``trace``: :func:`autoplan.trace.trace` of all L blocks (what ``prepare`` did before);
* ``replicated``: :func:`autoplan.trace.replicate.trace_replicated` (three blocks traced, the
  middle one replicated; what ``prepare`` does now);
* ``record whole`` / ``record 3 blocks``: :func:`autoplan.planner.search.record.record_layers`
  of the layers the search asks for (one per kind and the first of each kind pair), re-running
  the whole model or three blocks.

Targets: the replicated graph equals the whole trace (every node field, layer, parameter and
total), and the 3-block recording equals the whole-model one — for every model measured;
and each of the two 3-block paths costs less CPU than the whole-model path it replaces.

    python benchmarks/trace_replicate.py [--repeats 3]     # gpt-39b, gpt3-175b, gpt-1t, llama3-405b
    python benchmarks/trace_replicate.py --quick           # small models, one repeat
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import print_table, target, write_results  # noqa: E402

MODELS = ["gpt-39b", "gpt3-175b", "gpt-1t", "llama3-405b"]
QUICK_MODELS = [("gpt-tiny", {"layers": 8}), ("gpt-small", {})]


def _cpu(fn, repeats: int):
    """(result of the last call, median CPU seconds, all CPU seconds)."""
    times, out = [], None
    for _ in range(repeats):
        c0 = time.process_time()
        out = fn()
        times.append(time.process_time() - c0)
    return out, statistics.median(times), times


def _same(a, b) -> bool:
    """Graphs equal in every field but the trace time, in the same node and param order."""
    return (list(a.nodes) == list(b.nodes) and list(a.params) == list(b.params)
            and dataclasses.replace(a, trace_seconds=0.0) ==
            dataclasses.replace(b, trace_seconds=0.0))


def _wanted(graph) -> list[int]:
    """The layers :func:`autoplan.planner.search.compose.analyse` records."""
    first: dict = {}
    for layer in graph.layers:
        first.setdefault(layer.kind, layer.index)
    for l in range(1, len(graph.layers)):
        first.setdefault((graph.layers[l - 1].kind, graph.layers[l].kind), l)
    return sorted(set(first.values()))


def measure(name: str, spec, repeats: int) -> dict:
    import torch

    from autoplan.planner.search.record import record_layers
    from autoplan.trace import trace
    from autoplan.trace.replicate import trace_replicated

    dtype = torch.bfloat16
    full, t_full, all_full = _cpu(lambda: trace(spec, 1, None, dtype=dtype), repeats)
    built, t_rep, all_rep = _cpu(lambda: trace_replicated(spec, 1, None, dtype=dtype), repeats)
    wanted = _wanted(built)
    whole, t_rw, all_rw = _cpu(lambda: record_layers(spec, built, wanted, truncate=False),
                               repeats)
    short, t_rs, all_rs = _cpu(lambda: record_layers(spec, built, wanted), repeats)
    return {"model": name, "layers": len(full.layers) - 2, "ops": len(full),
            "trace_cpu_s": t_full, "replicated_cpu_s": t_rep,
            "record_whole_cpu_s": t_rw, "record_3_blocks_cpu_s": t_rs,
            "runs": {"trace": all_full, "replicated": all_rep, "record_whole": all_rw,
                     "record_3_blocks": all_rs},
            "graph_equal": _same(full, built),
            "recording_equal": short.ops == whole.ops and short.unmatched == whole.unmatched,
            "recorded_layers": wanted}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--quick", action="store_true", help="small models, one repeat")
    args = ap.parse_args()
    from autoplan.models import resolve

    models = [(n + "".join(f",{k}={v}" for k, v in o.items()), resolve(n, **o))
              for n, o in QUICK_MODELS] if args.quick else [(n, resolve(n)) for n in MODELS]
    repeats = 1 if args.quick else args.repeats
    from autoplan.trace import trace

    trace(resolve("gpt-tiny"), 1)           # warm-up: first-use costs of torch's fake mode
    rows = []
    for name, spec in models:
        r = measure(name, spec, repeats)
        rows.append(r)
        print(f"{r['model']}: trace {r['trace_cpu_s']:.2f} s, replicated "
              f"{r['replicated_cpu_s']:.2f} s, record {r['record_whole_cpu_s']:.2f} -> "
              f"{r['record_3_blocks_cpu_s']:.2f} s", flush=True)
    print_table(f"CPU seconds, median of {repeats}", [
        "model", "L", "ops", "trace (all L)", "replicated", "record (all L)",
        "record (3 blocks)", "graph equal", "record equal"],
        [[r["model"], r["layers"], r["ops"], r["trace_cpu_s"], r["replicated_cpu_s"],
          r["record_whole_cpu_s"], r["record_3_blocks_cpu_s"], r["graph_equal"],
          r["recording_equal"]] for r in rows])
    targets = []
    for r in rows:
        m = r["model"]
        targets += [
            target(f"{m}: replicated graph == whole trace", "equal", r["graph_equal"],
                   r["graph_equal"]),
            target(f"{m}: 3-block recording == whole-model recording", "equal",
                   r["recording_equal"], r["recording_equal"]),
            target(f"{m}: replicated trace CPU s < whole trace", f"< {r['trace_cpu_s']:.3g}",
                   round(r["replicated_cpu_s"], 3), r["replicated_cpu_s"] < r["trace_cpu_s"]),
            target(f"{m}: 3-block record CPU s < whole record",
                   f"< {r['record_whole_cpu_s']:.3g}", round(r["record_3_blocks_cpu_s"], 3),
                   r["record_3_blocks_cpu_s"] < r["record_whole_cpu_s"]),
        ]
    write_results("trace_replicate_quick" if args.quick else "trace_replicate", rows, targets,
                  {"repeats": repeats})
    return 0 if all(t["met"] for t in targets) else 1


if __name__ == "__main__":
    sys.exit(main())
