"""Plans and launches for the engine tests.

``make_plan`` asks the planner's builder for a plan (``(pp, dp, tp)`` row-major mesh, blocks
split evenly over the stages with ``<pre>``/``<post>`` on the first/last, Megatron placements
from the tracer's tensor-parallel roles), so the engine runs what the planner writes.

``torchrun ... tests/engine_helpers.py OUT [options] -- PLAN...`` trains several plans of one
world size in a single launch (one process group; each plan gets its own mesh and writes
``OUT/<plan stem>/``), which keeps the multi-process tests fast on a small machine.
"""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
from pathlib import Path

from autoplan.models.registry import ModelSpec
from autoplan.plan import ParallelConfig, Plan, Prediction
from autoplan.planner.build import build_plan
from autoplan.trace import trace

REPO = Path(__file__).resolve().parent.parent

#: A GPT small enough for 20-step parity runs on 4 CPU ranks sharing 2 cores.
TINY = dict(vocab_size=128, seq_len=32, hidden=32, layers=4, heads=4, attention="sdpa",
            dropout=0.0)
#: The same size in Llama style (RMSNorm, SwiGLU, rotary, grouped-query attention).
TINY_LLAMA = dict(TINY, style="llama", kv_heads=2, ffn_hidden=64)
_SOURCES = {k: "test fixture, not a real device" for k in ("peak_tflops", "memory_gb",
                                                             "memory_bandwidth_gbps")}
_LINK = {"kind": "loopback", "bandwidth_gbps": 0.7, "latency_us": 140.0, "nics": 1}
CLUSTER = {"name": "test-cpu", "nodes": 1, "devices_per_node": 4,
           "device": {"name": "cpu-test", "family": "cpu", "memory_gb": 6.0,
                      "memory_bandwidth_gbps": 15.0, "sources": _SOURCES,
                      "peak_tflops": {"float32": 0.08, "bfloat16": 0.16}},
           "intra_node": _LINK, "inter_node": dict(_LINK, kind="ethernet")}

CLUSTER_GPU = {"name": "test-gpu", "nodes": 1, "devices_per_node": 8,
               "device": {"name": "gpu-test", "family": "gpu", "memory_gb": 80.0,
                          "memory_bandwidth_gbps": 2000.0, "sources": _SOURCES,
                          "peak_tflops": {"float32": 60.0, "bfloat16": 900.0}},
               "intra_node": {"kind": "nvlink", "bandwidth_gbps": 300.0, "latency_us": 5.0,
                              "nics": 1},
               "inter_node": {"kind": "infiniband", "bandwidth_gbps": 25.0,
                              "latency_us": 10.0, "nics": 8}}


@functools.lru_cache(maxsize=None)
def _graph(spec_json: str, seq_len: int):
    """The tracer's OpGraph of a model (cached: the tests plan many layouts of few models)."""
    spec = ModelSpec.from_dict(json.loads(spec_json))
    return trace(spec, batch_size=1, seq_len=seq_len)


def make_plan(*, dp: int = 1, tp: int = 1, pp: int = 1, zero: int = 0, sp: bool = False,
              schedule: str = "1f1b", virtual_stages: int = 1, global_batch: int = 8,
              num_micro_batches: int = 1, seq_len: int = 32, model: dict | None = None,
              checkpoint: bool = False, precision: dict | None = None,
              prediction: Prediction | None = None, device_type: str = "cpu",
              spec: ModelSpec | None = None) -> Plan:
    """A plan from the planner's own builder (``autoplan.planner.build.build_plan``) over the
    tracer's graph: the engine is tested on what the planner writes. The model is the
    built-in GPT of config ``model`` (default ``TINY``), or ``spec`` (e.g. a Hugging Face
    one)."""
    spec = spec or ModelSpec("builtin", "gpt", dict(model or TINY))
    parallel = ParallelConfig(dp=dp, tp=tp, pp=pp, zero=zero, sequence_parallel=sp,
                              micro_batch=global_batch // (dp * num_micro_batches),
                              num_micro_batches=num_micro_batches, schedule=schedule,
                              virtual_stages=virtual_stages,
                              checkpoint="full" if checkpoint else "none")
    graph = _graph(json.dumps(spec.to_dict(), sort_keys=True), seq_len)
    plan = build_plan(graph, spec, CLUSTER if device_type == "cpu" else CLUSTER_GPU, parallel,
                      global_batch=global_batch, seq_len=seq_len,
                      precision=precision or {"params": "float32", "compute": "float32",
                                              "reduce": "float32"},
                      prediction=prediction, planner={"name": "tests.engine_helpers"})
    assert plan.mesh.device_type == device_type
    return plan


def engine_env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH", "")) if p)
    env.setdefault("OMP_NUM_THREADS", "1")
    return env


def torchrun(nproc: int, args: list[str], *, timeout: float = 300) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc_per_node={nproc}", *args]
    return subprocess.run(cmd, env=engine_env(), cwd=REPO, capture_output=True, text=True,
                          timeout=timeout)


def run_plans(nproc: int, out: Path, plans: dict[str, Plan], *, steps: int = 20,
              extra: list[str] = (), timeout: float = 300) -> subprocess.CompletedProcess:
    """Save ``plans`` under ``out`` and train them all in one torchrun launch."""
    paths = []
    for name, plan in plans.items():
        paths.append(str(plan.save(out / f"{name}.json")))
    return torchrun(nproc, [str(Path(__file__).resolve()), str(out), "--steps", str(steps),
                            *extra, "--", *paths], timeout=timeout)


def losses(run_dir: Path) -> dict[int, float]:
    path = run_dir / "metrics.jsonl"
    return {r["step"]: r["loss"] for r in map(json.loads, path.read_text().splitlines())}


def max_rel_diff(a: dict[int, float], b: dict[int, float]) -> float:
    assert a.keys() == b.keys(), (sorted(a), sorted(b))
    return max(abs(a[k] - b[k]) / abs(b[k]) for k in a)


def _main(argv: list[str]) -> int:
    """torchrun entry: ``OUT [engine options] -- PLAN...``."""
    from engine.config import RunConfig
    from engine.run import build_parser, execute

    import torch.distributed as dist

    split = argv.index("--")
    out, options, plan_paths = Path(argv[0]), argv[1:split], argv[split + 1:]
    try:
        for path in plan_paths:
            args = vars(build_parser().parse_args([path, *options]))
            args.pop("plan")
            args["out_dir"] = str(out / Path(path).stem)
            execute(Plan.load(path), path, RunConfig.from_dict(args))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
