"""The ``autoplan`` command line.

    autoplan demo                                    # plan + run a tiny GPT on this machine
    autoplan plan gpt-7.5b --cluster dgx-a100 --nodes 16 --global-batch 512 -o plan.json
    autoplan plan gpt-7.5b --cluster dgx-a100 --nodes 16 --global-batch 512 --planner uniform
    autoplan plan gpt --layers 24 --hidden 2048 --heads 16 --vocab 51200 --seq-len 2048 \\
        --cluster dgx-h100 --nodes 4 --global-batch 256
    autoplan show plan.json
    autoplan estimate gpt-7.5b --cluster dgx-a100 --nodes 16 --global-batch 512 --tp 4 \\
        --micro-batch 2 --checkpoint full
    autoplan trace llama3-8b --seq-len 8192
    autoplan run plan.json --steps 20
    autoplan profile ops gpt-small --tp 1,2 | autoplan profile links --nproc 4
    autoplan calibrate runs/x [runs/y ...]          # measured vs predicted -> profiles/calibration/
    autoplan report plan.json -o report.html
    autoplan export plan.json --to torchtitan|megatron|deepspeed
    autoplan launch plan.json --master-addr HOST [--slurm -o job.sbatch]
    autoplan models | autoplan clusters

Every command takes ``--json`` for machine-readable output. Errors a user can cause (an
AutoplanError, or a file that cannot be written) print one line, ``error: ...``, and exit
with status 2.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any, Sequence

from autoplan.errors import AutoplanError
from autoplan.precision import FLOAT8_RECIPES, PRECISIONS
from autoplan.pricing import ATTENTION_KERNELS, CP_COMMS
from autoplan.run_command import cmd_run, split_engine_args

EXIT_USER_ERROR = 2


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command ``argv`` and return its exit status. Without ``argv`` -- the program
    itself: the console script, ``python -m autoplan.cli`` -- the arguments are sys.argv's,
    and the process ends here (:func:`autoplan.process.as_program`)."""
    from autoplan.trust import take_trust_flag, trusting

    if argv is None:
        from autoplan.process import as_program

        return as_program(lambda: main(sys.argv[1:]))
    argv, trust = take_trust_flag(argv)
    with trusting(trust):
        return _main(argv)


def _main(argv: Sequence[str]) -> int:
    parser = build_parser()
    argv, tail = split_engine_args(argv)
    args = parser.parse_args(argv)
    if tail is not None:
        args.engine_args = [*args.engine_args, "--", *tail]
    if not getattr(args, "func", None):
        parser.print_help()
        return EXIT_USER_ERROR
    try:
        return int(args.func(args) or 0)
    except AutoplanError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_USER_ERROR
    except OSError as exc:            # a file a user named cannot be written (a directory, ...)
        name = exc.filename2 if exc.filename2 is not None else exc.filename
        print(f"error: {f'{name}: ' if name is not None else ''}{exc.strerror or exc}",
              file=sys.stderr)
        return EXIT_USER_ERROR
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


# ---- argument groups ---------------------------------------------------------------------

#: The largest global batch (samples) the planner takes: it enumerates the divisors of the
#: batch per data-parallel rank, and an absurd batch would keep it busy for hours.
MAX_GLOBAL_BATCH = 2 ** 31


def _count(minimum: int, maximum: int | None = None):
    """An argparse type: an integer in [minimum, maximum] (a usage error otherwise)."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be an integer, got {text!r}") from None
        if value < minimum or (maximum is not None and value > maximum):
            bound = f">= {minimum}" if maximum is None else f"in [{minimum}, {maximum}]"
            raise argparse.ArgumentTypeError(f"must be an integer {bound}, got {text!r}")
        return value

    parse.__name__ = "integer"        # what argparse names in its own messages
    return parse


def _model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", help="built-in name or preset (see `autoplan models`), "
                   "hf:<model_type or path/config.json>, or import:<pkg.module:factory>")
    g = p.add_argument_group("model size (built-in GPT)")
    g.add_argument("--layers", type=int)
    g.add_argument("--hidden", type=int)
    g.add_argument("--heads", type=int)
    g.add_argument("--vocab", type=int, dest="vocab_size")
    g.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="any other model config key (repeatable), e.g. --set kv_heads=8")
    p.add_argument("--seq-len", type=int, help="sequence length (default: the model's; for "
                   "hf: a training length of at most 2048, printed)")
    p.add_argument("--task", choices=("causal-lm", "masked-lm", "seq2seq-lm",
                                      "image-classification"),
                   help="hf: task family (default: the config's architectures, else the "
                   "model type's: bert masked-lm, t5 seq2seq-lm, vit image-classification)")


def _fraction(text: str) -> float:
    """A float in [0, 1) for argparse."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not 0 <= value < 1:
        raise argparse.ArgumentTypeError(f"must be in [0, 1), got {value}")
    return value


def _cluster_args(p: argparse.ArgumentParser, *, required: bool = True) -> None:
    p.add_argument("--cluster", required=required,
                   help="cluster preset (see `autoplan clusters`) or a YAML file")
    p.add_argument("--nodes", type=_count(1), help="override the cluster's node count")
    p.add_argument("--global-batch", type=_count(1, MAX_GLOBAL_BATCH), required=required,
                   help="global batch (samples)")
    p.add_argument("--precision", choices=tuple(PRECISIONS),
                   help="mixed: bf16 compute, fp32 master weights (default on GPUs with "
                        "bf16); mixed-fp8: mixed with the blocks' linear layers in float8 "
                        "(Hopper); mixed-fp16: fp16 compute with loss scaling (default on "
                        "V100); fp32")
    p.add_argument("--memory-headroom", type=_fraction, default=None, metavar="FRACTION",
                   help="fraction of device memory a plan leaves free beyond the modelled "
                        "overheads (CUDA context, NCCL buffers, allocator reserve, "
                        "temporaries); default 0.02")
    p.add_argument("--eager", action="store_true",
                   help="price element-wise ops as traced, unfused (eager PyTorch: "
                        "autoplan's own engine, torchtitan without torch.compile); default: "
                        "fused, as Megatron-LM's kernels or torch.compile run them")
    p.add_argument("--fused-loss", action=argparse.BooleanOptionalAction, default=None,
                   help="price the loss's backward fused (a fused cross-entropy kernel) or "
                        "with eager PyTorch's two fp32 gradients; default: as --eager says")
    p.add_argument("--float8-recipe", choices=FLOAT8_RECIPES,
                   default="torchao",
                   help="whose float8 casts a mixed-fp8 step pays: torchao's (autoplan's "
                        "engine, torchtitan; default) or Transformer Engine's (Megatron-LM, "
                        "NeMo: fused into the norm and activation kernels)")
    p.add_argument("--attention-kernel", choices=ATTENTION_KERNELS, default="flash2",
                   help="which fused attention the runtime runs: FlashAttention-2 (torch's "
                        "SDPA: autoplan's engine, torchtitan; default) or cuDNN's "
                        "(Transformer Engine on H100: Megatron-LM, NeMo)")
    p.add_argument("--cp-comm", choices=CP_COMMS, default="all-gather",
                   help="how context-parallel ranks exchange keys and values: one all-gather "
                        "(Llama 3; default) or a ring overlapped with attention (Transformer "
                        "Engine: Megatron-LM, NeMo; torchtitan); autoplan's engine runs both")


def _config_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("configuration")
    g.add_argument("--tp", type=_count(1), default=1)
    g.add_argument("--pp", type=_count(1), default=1)
    g.add_argument("--dp", type=_count(1), help="default: devices / (tp * pp)")
    g.add_argument("--zero", type=int, default=0, choices=(0, 1, 2, 3))
    g.add_argument("--micro-batch", type=_count(1), default=1)
    g.add_argument("--checkpoint", choices=("none", "selective", "op", "full"), default="none",
                   help="activation recomputation (selective: the attention core only; op: "
                        "torchtitan's op-level policy, every other matmul saved)")
    g.add_argument("--schedule", choices=("gpipe", "1f1b", "interleaved_1f1b"), default="1f1b")
    g.add_argument("--virtual-stages", type=_count(1), default=1)
    g.add_argument("--sp", action="store_true", help="sequence parallelism (needs tp > 1)")
    g.add_argument("--tp-comm-overlap", nargs="?", const=True, default=False,
                   type=_backward_only, metavar="backward",
                   help="overlap TP collectives with their GEMMs (needs --sp); 'backward': "
                   "only the input gradients' beside the weight-gradient GEMMs, as "
                   "Megatron-LM runs by default")
    g.add_argument("--ep", type=_count(1), default=1,
                   help="expert parallelism: experts split over ep of the dp ranks (MoE)")
    g.add_argument("--cp", type=_count(1), default=1,
                   help="context parallelism: each sequence split over cp ranks")


def _backward_only(text: str) -> str:
    """``--tp-comm-overlap``'s optional value: only ``backward``."""
    if text != "backward":
        raise argparse.ArgumentTypeError(f"expected 'backward' or no value, got {text!r}")
    return text


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="autoplan", description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trust-model-code", action="store_true",
                        help="let a plan's import: model be imported (anywhere on the line; "
                             "plans are data otherwise: README, Security model)")
    sub = parser.add_subparsers(title="commands", metavar="COMMAND")

    p = sub.add_parser("plan", help="search the best plan and write it")
    _model_args(p)
    _cluster_args(p)
    p.add_argument("--planner", choices=("auto", "uniform"), default="auto",
                   help="auto (default): the Alpa-style search (intra-op ILP over per-op "
                   "placements + inter-op stage DP over submeshes), with the uniform grid's "
                   "best kept as a comparison and floor; uniform: the grid of uniform "
                   "DP/TP/PP/ZeRO configurations alone (what the exporters express)")
    p.add_argument("-o", "--output", default="plan.json", help="plan file (default plan.json)")
    p.add_argument("--top-k", type=int, default=5, help="alternatives to keep and show")
    p.add_argument("--tp-comm-overlap", action="store_true",
                   help="also consider TP collectives overlapped with their GEMMs (Megatron-LM "
                   "--tp-comm-overlap, torchtitan async TP): for plans you export; the "
                   "engine does not run them")
    p.add_argument("--op-recompute", action="store_true",
                   help="also consider torchtitan's op-level recomputation (attention outputs "
                   "and every other matmul saved, the rest recomputed) in the uniform grid "
                   "and, per stage, in the search: the engine runs it and torchtitan exports "
                   "it; Megatron-LM and DeepSpeed cannot express it")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_plan)

    p = sub.add_parser("estimate", help="predict one configuration you give")
    _model_args(p)
    _cluster_args(p)
    _config_args(p)
    p.add_argument("--no-compare", action="store_true",
                   help="skip the search for what autoplan would do instead")
    p.add_argument("-o", "--output", help="also write the configuration as a plan file")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_estimate)

    p = sub.add_parser("show", help="summarise a plan file")
    p.add_argument("plan")
    p.add_argument("--top-k", type=int, default=5)
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_show)

    p = sub.add_parser("trace", help="trace a model and summarise its graph")
    _model_args(p)
    p.add_argument("--batch-size", type=int, default=1)
    p.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default="bfloat16")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_trace)

    p = sub.add_parser("run", help="run a plan on this machine under torchrun (the engine)")
    p.add_argument("plan")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--out", help="run directory (metrics, checkpoints, host load; default "
                   "runs/<plan file name>)")
    p.add_argument("engine_args", nargs=argparse.REMAINDER,
                   help="further arguments for `python -m engine.run` (after --)")
    p.set_defaults(func=cmd_run)

    p = sub.add_parser("demo", help="plan a tiny GPT for this machine and run it")
    p.add_argument("--nproc", type=int, default=2, help="CPU ranks (default 2)")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--out", default="runs/demo")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_demo)

    from autoplan.profile.cli import add_profile_commands
    from autoplan.calibrate import add_calibrate_command
    from autoplan.workflow_cli import add_workflow_commands

    add_profile_commands(sub)
    add_calibrate_command(sub)
    add_workflow_commands(sub)

    p = sub.add_parser("models", help="list built-in models and presets")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_models)

    p = sub.add_parser("clusters", help="list cluster presets and devices")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_clusters)
    return parser


# ---- helpers -----------------------------------------------------------------------------

def _overrides(args: argparse.Namespace) -> dict[str, Any]:
    from autoplan.errors import ConfigError
    from autoplan.models.registry import source_of

    out: dict[str, Any] = {}
    for key in ("layers", "hidden", "heads", "vocab_size"):
        if getattr(args, key, None) is not None:
            out[key] = getattr(args, key)
    if getattr(args, "seq_len", None) is not None and source_of(args.model) == "builtin":
        out.setdefault("seq_len", args.seq_len)
    if getattr(args, "task", None) is not None:
        if args.model.split(":")[0] != "hf":
            raise ConfigError("--task is for hf: models", field="--task")
        out["task"] = args.task
    for item in getattr(args, "set", []) or []:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"expected KEY=VALUE, got {item!r}", field="--set")
        out[key] = _parse_value(value, field=f"model.{key}")
    return out


def _parse_value(text: str, *, field: str = "--set") -> Any:
    from autoplan.errors import ConfigError

    def no_constant(name: str) -> Any:
        raise ConfigError(f"{name} is not a value a plan can hold (JSON has no {name}; "
                          "from --set)", field=field)

    try:
        return json.loads(text, parse_constant=no_constant)
    except (json.JSONDecodeError, RecursionError):
        return text


def _spec(args: argparse.Namespace):
    from autoplan.models.registry import resolve

    return resolve(args.model, **_overrides(args))


def _console():
    from rich.console import Console

    return Console(stderr=False)


def _emit_json(obj: Any) -> None:
    print(json.dumps(obj, indent=2, sort_keys=True, default=str))


def _progress_search(problem, space=None, top_k: int = 5, quiet: bool = False):
    """Run the uniform search with a progress bar (on stderr) when it takes a while."""
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TimeElapsedColumn

    from autoplan.api import head_counts, plan_problem, runnable_space
    from autoplan.planner.grid.uniform import SearchSpace, enumerate_configs

    space = space or SearchSpace()
    total = sum(1 for _ in enumerate_configs(problem.graph, problem.cluster,
                                             problem.global_batch,
                                             runnable_space(problem.spec, space,
                                                            problem.graph),
                                             head_counts(problem.spec)))
    console = Console(stderr=True)
    with Progress("[progress.description]{task.description}", BarColumn(),
                  MofNCompleteColumn(), TimeElapsedColumn(), console=console, transient=True,
                  disable=quiet or not console.is_terminal) as bar:   # nothing in logs / pipes
        task = bar.add_task("searching configurations", total=total)
        return plan_problem(problem, space=space, top_k=top_k,
                            progress=lambda n: bar.update(task, completed=n)
                            if n % 256 == 0 or n == total else None)


def _prepare(args: argparse.Namespace, check_fits: bool = False):
    from rich.console import Console

    from autoplan.api import prepare

    console = Console(stderr=True)
    spec = _spec(args)
    with console.status(f"tracing {args.model} on the meta device ...", spinner="dots"):
        problem = prepare(spec, args.cluster, global_batch=args.global_batch,
                          nodes=args.nodes, seq_len=args.seq_len, precision=args.precision,
                          check_fits=check_fits, fused=not getattr(args, "eager", False),
                          fused_loss=getattr(args, "fused_loss", None),
                          float8_recipe=getattr(args, "float8_recipe", "torchao"),
                          attention_kernel=getattr(args, "attention_kernel", "flash2"),
                          cp_comm=getattr(args, "cp_comm", "all-gather"),
                          **({"memory_headroom": args.memory_headroom}
                             if getattr(args, "memory_headroom", None) is not None else {}))
    if spec.source == "hf" and args.seq_len is None:
        # said once the inputs are known good: an error stays the one line it is
        from autoplan.models.hf import seq_len_note

        console.print(seq_len_note(spec, problem.seq_len))
    return problem


# ---- commands ----------------------------------------------------------------------------

def cmd_plan(args: argparse.Namespace) -> int:
    from autoplan.process import CyclesPaused

    with CyclesPaused():
        return _plan_command(args)


def _plan_command(args: argparse.Namespace) -> int:
    import time

    from autoplan.display import plan_dict, print_plan

    t0 = time.perf_counter()
    problem = _prepare(args, check_fits=True)
    t_trace = time.perf_counter() - t0
    from autoplan.planner.grid.uniform import SearchSpace

    space = SearchSpace(tp_comm_overlap=(False, True) if args.tp_comm_overlap else (False,),
                        checkpoint=SearchSpace.checkpoint + (("op",) if args.op_recompute
                                                             else ()))
    if args.planner == "uniform":
        plan, result = _progress_search(problem, space, top_k=args.top_k, quiet=args.json)
        search_s = result.seconds
        bounded = result.priced is not None and result.priced < result.evaluated
        how = (f"searched {result.evaluated} configurations ("
               + (f"{result.priced} priced exactly, the rest ruled out by a step-time bound; "
                  if bounded else "") + f"{result.feasible} fit) in {result.seconds:.1f} s")
    else:
        from rich.console import Console

        from autoplan.api import plan_problem

        with Console(stderr=True).status("searching: intra-op ILP and inter-op stage DP ...",
                                         spinner="dots"):
            t1 = time.perf_counter()
            plan, result = plan_problem(problem, space=space, top_k=args.top_k,
                                        planner="auto")
            search_s = time.perf_counter() - t1
        st = getattr(result, "stats", None)           # None: the grid alone (plan's note)
        how = (f"searched in {search_s:.1f} s ({st['ilp_solves']} intra-op ILPs, the stage DP "
               f"over {len(st['micro_batch_counts'])} micro-batch counts; "
               f"{st['candidates']} pipelines, {len(result.ranked)} priced exactly)"
               if st is not None else f"searched {result.evaluated} uniform configurations "
               f"in {search_s:.1f} s")
    path = plan.save(args.output)
    seconds = time.perf_counter() - t0
    if args.json:
        _emit_json({**plan_dict(plan), "plan_file": str(path), "seconds": {
            "trace": t_trace, "search": search_s, "total": seconds}})
        return 0
    console = _console()
    print_plan(plan, console, title="plan", top_k=args.top_k)
    console.print(f"traced {len(problem.graph)} ops in {t_trace:.1f} s, {how}; plan written to "
                  f"[bold]{path}[/bold]")
    return 0


def cmd_estimate(args: argparse.Namespace) -> int:
    from autoplan.api import estimate, plan_fits
    from autoplan.display import plan_dict, prediction_dict, print_plan, why_best

    problem = _prepare(args)
    mine = estimate(None, None, global_batch=args.global_batch, problem=problem, tp=args.tp,
                    pp=args.pp, dp=args.dp, zero=args.zero, micro_batch=args.micro_batch,
                    checkpoint=args.checkpoint, schedule=args.schedule,
                    virtual_stages=args.virtual_stages, sequence_parallel=args.sp,
                    ep=args.ep, cp=args.cp, tp_comm_overlap=args.tp_comm_overlap)
    best = None
    if not args.no_compare:
        best, _ = _progress_search(problem, top_k=0, quiet=args.json)
    if args.output:
        mine.save(args.output)
    if args.json:   # the plan output (autoplan/schema/output.schema.json) + what autoplan does
        out = {**plan_dict(mine), "autoplan": None}
        if best is not None:
            out["autoplan"] = {"parallel": best.parallel.label(),
                               "config": plan_dict(best)["config"],
                               "prediction": prediction_dict(best.prediction),
                               "speedup": mine.prediction.step_time_s
                               / best.prediction.step_time_s}
        if args.output:
            out["plan_file"] = args.output
        _emit_json(out)
        return 0
    console = _console()
    print_plan(mine, console, title="your configuration", top_k=0)
    if not plan_fits(mine):
        console.print("[bold red]does not fit in device memory[/bold red]")
    if best is not None:
        speedup = mine.prediction.step_time_s / best.prediction.step_time_s
        console.print(f"autoplan would use [bold cyan]{best.parallel.label()}[/bold cyan] "
                      f"(the uniform grid's best of {best.planner.get('evaluated')} "
                      f"configurations, {best.planner.get('feasible')} fit): "
                      f"{best.prediction.step_time_s:.4g} s per step, "
                      f"{100 * best.prediction.mfu:.1f}% MFU — {speedup:.2f}x "
                      f"{'faster' if speedup >= 1 else 'slower'} than yours"
                      + (f" ({why_best(best.prediction.time.to_dict(), mine.prediction.time.to_dict())})"
                         if speedup > 1.0 else ""))
    return 0


def cmd_show(args: argparse.Namespace) -> int:
    from autoplan.display import plan_dict, print_plan
    from autoplan.plan import Plan

    plan = Plan.load(args.plan)
    if args.json:
        _emit_json(plan_dict(plan))
        return 0
    print_plan(plan, _console(), title=Path(args.plan).name, top_k=args.top_k)
    return 0


def cmd_trace(args: argparse.Namespace) -> int:
    import torch

    from autoplan.trace.replicate import trace_replicated as trace

    spec = _spec(args)
    graph = trace(spec, args.batch_size, args.seq_len, dtype=getattr(torch, args.dtype))
    summary = graph.summary()
    if args.json:
        _emit_json({**summary, "per_layer": [
            {"name": layer.name, "kind": layer.kind, "ops": len(layer.nodes),
             "params": layer.stats.params, "fwd_flops": layer.stats.fwd_flops,
             "saved_bytes": layer.stats.saved_bytes,
             "tp_allreduce_bytes": layer.stats.tp_allreduce_fwd_bytes
             + layer.stats.tp_allreduce_bwd_bytes} for layer in graph.layers]})
        return 0
    from autoplan.display import count, fit_table

    console = _console()
    active = summary.get("active_params", summary["params"])
    shown = count(summary["params"]) + (f" ({count(active)} active)"
                                        if active != summary["params"] else "")
    console.print(f"[bold]{args.model}[/bold] ({spec.name}) {shown} params, "
                  f"{summary['ops']} aten ops, {summary['layers']} layers "
                  f"({', '.join(f'{n} x {k}' for k, n in summary['layer_kinds'].items())}), "
                  f"traced in {summary['trace_seconds']:.2f} s")
    cols = ["layer", "kind", *((c, "right") for c in (
        "ops", "params", "fwd GFLOP", "saved MB", "TP all-reduce MB"))]
    shown = graph.layers if len(graph.layers) <= 12 else graph.layers[:6] + graph.layers[-3:]
    rows = []
    for layer in shown:
        st = layer.stats
        rows.append([layer.name, layer.kind, str(len(layer.nodes)), f"{st.params:,}",
                     f"{st.fwd_flops / 1e9:.2f}", f"{st.saved_bytes / 1e6:.1f}",
                     f"{(st.tp_allreduce_fwd_bytes + st.tp_allreduce_bwd_bytes) / 1e6:.1f}"])
    if len(graph.layers) > len(shown):
        rows.insert(6, ["...", f"{len(graph.layers) - len(shown)} more", *[""] * 5])
    console.print(fit_table(console, cols, rows, drop=("kind", "TP all-reduce MB"),
                            title=f"layers (micro-batch {args.batch_size}, "
                                  f"seq {graph.batch.seq_len})"))
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    from autoplan.demo import run_demo

    return run_demo(nproc=args.nproc, steps=args.steps, out_dir=args.out, as_json=args.json)


def cmd_models(args: argparse.Namespace) -> int:
    from autoplan.models.registry import builtin_names, resolve

    rows = []
    for name in builtin_names():
        spec = resolve(name)
        rows.append({"name": name, "family": spec.name, "config": spec.config})
    if args.json:
        _emit_json(rows)
        return 0
    from autoplan.display import fit_table

    console = _console()
    console.print(fit_table(
        console, ["name", "family", "config"],
        [[r["name"], r["family"], ", ".join(f"{k}={v}" for k, v in r["config"].items())]
         for r in rows],
        title="built-in models (also: hf:<type or config.json>, import:<pkg.mod:fn>)"))
    return 0


def cmd_clusters(args: argparse.Namespace) -> int:
    from autoplan.cluster import list_cluster_presets, list_devices, load_cluster

    rows = []
    for name in list_cluster_presets():
        c = load_cluster(name)
        rows.append({"name": name, "nodes": c.nodes, "devices_per_node": c.devices_per_node,
                     "device": c.device.name, "intra_node_gbps": c.intra_node.bandwidth_gbps,
                     "inter_node_gbps": c.inter_node.bandwidth_gbps})
    if args.json:
        _emit_json({"clusters": rows, "devices": list_devices()})
        return 0
    from autoplan.display import fit_table

    console = _console()
    console.print(fit_table(
        console, ["name", *((c, "right") for c in ("nodes", "devices per node")), "device",
                  *((c, "right") for c in ("intra-node GB/s", "inter-node GB/s"))],
        [[r["name"], str(r["nodes"]), str(r["devices_per_node"]), r["device"],
          f"{r['intra_node_gbps']:g}", f"{r['inter_node_gbps']:g}"] for r in rows],
        title="cluster presets (--nodes overrides the node count)"))
    console.print("devices: " + ", ".join(list_devices()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
