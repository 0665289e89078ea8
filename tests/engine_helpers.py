"""Plans and launches for the engine tests.

``make_plan`` asks the planner's builder for a plan (``(pp, dp, tp)`` row-major mesh, blocks
split evenly over the stages with ``<pre>``/``<post>`` on the first/last, Megatron placements
from the tracer's tensor-parallel roles), so the engine runs what the planner writes.

``torchrun ... tests/engine_helpers.py OUT [options] -- PLAN...`` trains several plans of one
world size in a single launch (one process group; each plan gets its own mesh and writes
``OUT/<plan stem>/``), which keeps the multi-process tests fast on a small machine.
``torchrun ... tests/engine_helpers.py parallelize OUT STEPS PLAN...`` is a user's own
training script around :func:`autoplan.parallelize` instead.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import torch
import torch.nn as nn

from autoplan.models.registry import ModelSpec
from autoplan.plan import ParallelConfig, Plan, Prediction
from autoplan.planner.build import build_plan
from autoplan.trace import trace

REPO = Path(__file__).resolve().parent.parent


@contextlib.contextmanager
def deadline(seconds: int):
    """TimeoutError if the block runs longer than ``seconds`` (SIGALRM; the main thread
    only): a test of something that must not block fails instead of hanging the suite."""
    def expire(*_):
        raise TimeoutError(f"still running after {seconds} s")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)

#: A GPT small enough for 20-step parity runs on 4 CPU ranks sharing 2 cores.
TINY = dict(vocab_size=128, seq_len=32, hidden=32, layers=4, heads=4, attention="sdpa",
            dropout=0.0)
#: The same size in Llama style (RMSNorm, SwiGLU, rotary, grouped-query attention).
TINY_LLAMA = dict(TINY, style="llama", kv_heads=2, ffn_hidden=64)
TINY_LLAMA_FUSED = dict(TINY_LLAMA, fused_qkv=True)      # Megatron-LM's linear_qkv layout
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
    # the tests name these models themselves (an import: one is the suite's own module)
    spec = dataclasses.replace(ModelSpec.from_dict(json.loads(spec_json)), trusted=True)
    return trace(spec, batch_size=1, seq_len=seq_len)


def make_plan(*, dp: int = 1, tp: int = 1, pp: int = 1, zero: int = 0, sp: bool = False,
              schedule: str = "1f1b", virtual_stages: int = 1, global_batch: int = 8,
              num_micro_batches: int = 1, seq_len: int = 32, model: dict | None = None,
              checkpoint: bool | str = False, precision: dict | None = None,
              prediction: Prediction | None = None, device_type: str = "cpu",
              spec: ModelSpec | None = None, ep: int = 1, cp: int = 1) -> Plan:
    """A plan from the planner's own builder (``autoplan.planner.build.build_plan``) over the
    tracer's graph: the engine is tested on what the planner writes. The model is the
    built-in GPT of config ``model`` (default ``TINY``), or ``spec`` (e.g. a Hugging Face
    one)."""
    spec = spec or ModelSpec("builtin", "gpt", dict(model or TINY))
    parallel = ParallelConfig(dp=dp, tp=tp, pp=pp, zero=zero, sequence_parallel=sp,
                              micro_batch=global_batch // (dp * num_micro_batches),
                              num_micro_batches=num_micro_batches, schedule=schedule,
                              virtual_stages=virtual_stages,
                              checkpoint=checkpoint if isinstance(checkpoint, str) else
                              "full" if checkpoint else "none", ep=ep, cp=cp)
    graph = _graph(json.dumps(spec.to_dict(), sort_keys=True), seq_len)
    plan = build_plan(graph, spec, CLUSTER if device_type == "cpu" else CLUSTER_GPU, parallel,
                      global_batch=global_batch, seq_len=seq_len,
                      precision=precision or {"params": "float32", "compute": "float32",
                                              "reduce": "float32"},
                      prediction=prediction, planner={"name": "tests.engine_helpers"})
    assert plan.mesh.device_type == device_type
    return plan


class HFLoss(nn.Module):
    """A Hugging Face model of any task as a user would bring it (``import:``):
    ``forward(input_ids, labels) -> loss`` and ``example_batch``, nothing else."""

    def __init__(self, model: nn.Module, vocab_size: int):
        super().__init__()
        self.model, self.vocab_size = model, vocab_size

    def forward(self, input_ids, labels):
        return self.model(input_ids=input_ids, labels=labels, use_cache=False).loss \
            if self.model.config.is_encoder_decoder else \
            self.model(input_ids=input_ids, labels=labels).loss

    def example_batch(self, batch_size, seq_len, device):
        ids = torch.randint(0, self.vocab_size, (batch_size, seq_len or 16), device=device)
        return ids, ids


_HF_SIZES = dict(hidden_size=32, num_attention_heads=4, intermediate_size=64, vocab_size=128,
                 max_position_embeddings=64)


def bert_mlm(layers: int = 2, tied: bool = True) -> nn.Module:
    """A tiny ``BertForMaskedLM`` (masked LM: every position a target; dropout off; the
    decoder tied to the word embeddings as BERT ships, or not)."""
    import transformers

    cfg = transformers.BertConfig(num_hidden_layers=layers, hidden_dropout_prob=0.0,
                                  tie_word_embeddings=tied,
                                  attention_probs_dropout_prob=0.0, **_HF_SIZES)
    return HFLoss(transformers.BertForMaskedLM(cfg), cfg.vocab_size)


def t5_seq2seq(layers: int = 2) -> nn.Module:
    """A tiny ``T5ForConditionalGeneration`` (encoder-decoder; labels are the inputs)."""
    import transformers

    cfg = transformers.T5Config(num_layers=layers, num_decoder_layers=layers, d_model=32,
                                d_kv=8, num_heads=4, d_ff=64, vocab_size=128, dropout_rate=0.0,
                                decoder_start_token_id=0, pad_token_id=0)
    return HFLoss(transformers.T5ForConditionalGeneration(cfg), cfg.vocab_size)


def engine_env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH", "")) if p)
    env.setdefault("OMP_NUM_THREADS", "1")
    return env


def torchrun(nproc: int, args: list[str], *, timeout: float = 300, trust: bool = False
             ) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc_per_node={nproc}", *args]
    env = engine_env()
    if trust:
        from autoplan.trust import TRUST_ENV

        env[TRUST_ENV] = "1"
    return subprocess.run(cmd, env=env, cwd=REPO, capture_output=True, text=True,
                          timeout=timeout)


def run_plans(nproc: int, out: Path, plans: dict[str, Plan], *, steps: int = 20,
              extra: list[str] = (), timeout: float = 300) -> subprocess.CompletedProcess:
    """Save ``plans`` under ``out`` and train them all in one torchrun launch. The plans are
    the tests' own (an ``import:`` model in them is the suite's module), so the launch
    trusts the model code they name (``--trust-model-code``)."""
    paths = []
    for name, plan in plans.items():
        paths.append(str(plan.save(out / f"{name}.json")))
    return torchrun(nproc, [str(Path(__file__).resolve()), str(out), "--steps", str(steps),
                            *extra, "--", *paths], timeout=timeout, trust=True)


def losses(run_dir: Path) -> dict[int, float]:
    path = run_dir / "metrics.jsonl"
    return {r["step"]: r["loss"] for r in map(json.loads, path.read_text().splitlines())}


def max_rel_diff(a: dict[int, float], b: dict[int, float]) -> float:
    assert a.keys() == b.keys(), (sorted(a), sorted(b))
    return max(abs(a[k] - b[k]) / abs(b[k]) for k in a)


def user_batches(global_batch: int, steps: int) -> list[tuple]:
    """The batches of the ``parallelize`` runs and their one-process reference."""
    out = []
    for t in range(steps):
        gen = torch.Generator().manual_seed(1000 + t)
        out.append((torch.randn(global_batch, 16, generator=gen),
                    torch.randn(global_batch, generator=gen)))
    return out


def user_module() -> nn.Module:
    """The user's own module of the ``parallelize`` tests, with its own initial weights."""
    from user_model import build

    torch.manual_seed(0)
    return build(width=32, depth=4)


def _parallelize_main(argv: list[str]) -> int:
    """torchrun entry: ``parallelize OUT STEPS PLAN...`` -- a user's training loop around
    ``autoplan.parallelize``; rank 0 writes each plan's losses to ``OUT/<stem>.json``."""
    import autoplan
    import torch.distributed as dist

    out, steps, plan_paths = Path(argv[0]), int(argv[1]), argv[2:]
    try:
        for path in plan_paths:
            plan = Plan.load(path)
            batches = user_batches(plan.global_batch, steps)
            model, optimizer = autoplan.parallelize(
                user_module(), plan, lambda params: torch.optim.AdamW(params, lr=1e-3),
                example_batch=batches[0])
            losses = []
            for batch in batches:
                losses.append(model.step(batch))
                optimizer.step()
                optimizer.zero_grad()
            if dist.get_rank() == 0:
                (out / f"{Path(path).stem}.json").write_text(json.dumps(losses))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    return 0


def _main(argv: list[str]) -> int:
    """torchrun entry: ``OUT [engine options] -- PLAN...``."""
    if argv and argv[0] == "parallelize":
        return _parallelize_main(argv[1:])
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
    from engine.run import run_and_exit

    run_and_exit(lambda: _main(sys.argv[1:]))


def recompute_backward_ops(model: dict, modes) -> tuple[dict, dict]:
    """One process, the built-in GPT of config ``model`` with every block wrapped as each
    of ``modes`` says (None: not wrapped, ``engine.recompute.wrap``): per mode its
    parameters' gradients after one backward and the count of each aten op that backward
    ran (the recomputed forward ops among them)."""
    import copy
    from collections import Counter

    from torch.utils._python_dispatch import TorchDispatchMode

    from engine import model as model_lib
    from engine.recompute import wrap

    class Ops(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.count: Counter = Counter()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.count[func.__name__.split(".")[0]] += 1
            return func(*args, **(kwargs or {}))

    spec = ModelSpec("builtin", "gpt", dict(model))
    base = model_lib.build_chunk(spec, model_lib.model_info(spec).layer_names())
    model_lib.materialize(base, model_lib.initializer(spec), torch.device("cpu"), 0)
    tokens = torch.randint(0, model["vocab_size"], (2, model["seq_len"]))
    grads, ran = {}, {}
    for mode in modes:
        m = copy.deepcopy(base)
        if mode:
            for k in list(m.blocks.keys()):
                m.blocks[k] = wrap(m.blocks[k], mode)
        loss = m(tokens, tokens)
        with Ops() as ops:
            loss.backward()
        ran[mode] = ops.count
        grads[mode] = [p.grad for p in m.parameters()]
    return grads, ran
