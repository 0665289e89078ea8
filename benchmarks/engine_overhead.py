"""Engine overhead: the engine's step time vs the same configuration written by hand.

For each configuration the planner writes a plan (trace + ``build_plan``); one torchrun
launch then builds, in the same processes, (a) the engine's trainer for the plan and (b) a
hand-written training loop of the same model on the same PyTorch primitives —
``fully_shard`` per block, ``parallelize_module`` with Megatron styles, ``PipelineStage`` +
``Schedule1F1B`` — with AdamW. The two are stepped in alternating blocks (side by side, so
load from other processes hits both alike); the result is the ratio of median step times.
The engine's step is what it reports: ``Trainer.train_step`` (data, forward/backward,
optimizer, loss all-reduce); the hand loop reads its loss with ``.item()``.

    python benchmarks/engine_overhead.py     # writes benchmarks/results/engine_overhead.json

Target: engine / hand-written median step time <= 1.10 for every configuration.
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

MODEL = dict(vocab_size=1024, seq_len=128, hidden=128, layers=4, heads=4, attention="sdpa",
             dropout=0.0)
GLOBAL_BATCH, SEQ = 8, 128
CONFIGS = {
    "dp2_zero3": dict(dp=2, zero=3),
    "tp2_sp": dict(tp=2, sequence_parallel=True),
    "pp2_1f1b": dict(pp=2, num_micro_batches=4, schedule="1f1b"),
}
TARGET_RATIO = 1.10
LR = 1e-3


# ---- driver -------------------------------------------------------------------------------

def make_plans(out: Path) -> dict[str, Path]:
    import dataclasses

    from autoplan.cluster import load_cluster
    from autoplan.models.registry import ModelSpec
    from autoplan.plan import ParallelConfig
    from autoplan.planner.build import build_plan
    from autoplan.trace import trace

    spec = ModelSpec("builtin", "gpt", dict(MODEL))
    graph = trace(spec, batch_size=1, seq_len=SEQ)
    # a plan stores its whole cluster: this machine's preset, cut to the 2 ranks run here
    cluster = dataclasses.replace(load_cluster("local-cpu"), devices_per_node=2)
    paths = {}
    for name, kw in CONFIGS.items():
        dp, nmb = kw.get("dp", 1), kw.get("num_micro_batches", 1)
        parallel = ParallelConfig(**kw, micro_batch=GLOBAL_BATCH // (dp * nmb))
        plan = build_plan(graph, spec, cluster, parallel, global_batch=GLOBAL_BATCH,
                          seq_len=SEQ)
        paths[name] = plan.save(out / f"{name}.json")
    return paths


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=20, help="alternating blocks per side")
    parser.add_argument("--block", type=int, default=2, help="steps per block")
    parser.add_argument("--configs", nargs="+", choices=sorted(CONFIGS), default=list(CONFIGS))
    parser.add_argument("--worker", nargs=2, metavar=("PLAN", "OUT"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return worker(Path(args.worker[0]), Path(args.worker[1]), args.rounds, args.block)

    from benchmarks.common import print_table, run_torchrun, target, write_results

    measurements, targets, rows = {}, [], []
    with tempfile.TemporaryDirectory() as tmp:
        for name, plan in make_plans(Path(tmp)).items():
            if name not in args.configs:
                continue
            out = Path(tmp) / f"{name}.out.json"
            rc = run_torchrun(__file__, 2, ["--rounds", str(args.rounds), "--block",
                                            str(args.block), "--worker", str(plan), str(out)])
            if rc:
                return rc
            m = json.loads(out.read_text())
            eng, hand = statistics.median(m["engine_s"]), statistics.median(m["hand_s"])
            ratio = eng / hand
            measurements[name] = {"config": CONFIGS[name], "median_engine_s": eng,
                                  "median_hand_s": hand, "ratio": ratio, **m}
            targets.append(target(f"{name}: engine / hand-written step time",
                                  f"<= {TARGET_RATIO}", round(ratio, 4), ratio <= TARGET_RATIO))
            rows.append([name, f"{eng * 1e3:.1f}", f"{hand * 1e3:.1f}", f"{ratio:.3f}",
                         len(m["engine_s"])])
    print_table("engine overhead (2 gloo ranks, median step time)",
                ["config", "engine ms", "hand-written ms", "ratio", "steps each"], rows)
    write_results("engine_overhead", measurements, targets,
                  extra={"model": MODEL, "global_batch": GLOBAL_BATCH, "seq_len": SEQ,
                         "ranks": 2, "backend": "gloo (CPU)",
                         "method": "alternating blocks of --block steps, --rounds per side, "
                                   "first block of each side discarded; medians; ratio"})
    return 0 if all(t["met"] for t in targets) else 1


# ---- worker (under torchrun) ---------------------------------------------------------------

def worker(plan_path: Path, out: Path, rounds: int, block: int) -> int:
    import torch
    import torch.distributed as dist

    from autoplan.plan import Plan
    from benchmarks.common import alternating_blocks
    from engine.config import RunConfig
    from engine.mesh import build_mesh, init_distributed
    from engine.train import Trainer
    from engine.runtime import check_all

    plan = Plan.load(plan_path)
    spec = check_all(plan, str(plan_path), world_size=int(os.environ["WORLD_SIZE"]))
    cfg = RunConfig(steps=10**6, lr=LR, memory="off", out_dir=str(out.parent / "run"))
    device = init_distributed("cpu", cfg.timeout_s)
    pm = build_mesh(plan, device, cfg.timeout_s)
    trainer = Trainer(plan, spec, cfg, pm, source=str(plan_path))
    hand_step = hand_written(plan, pm.mesh)

    # one step count across both sides; a step is as slow as its slowest rank
    result, _ = alternating_blocks({"engine": trainer.train_step, "hand": hand_step},
                                   rounds, block, one_count=True)
    if dist.get_rank() == 0:
        out.write_text(json.dumps({"engine_s": result["engine"], "hand_s": result["hand"],
                                   "torch": torch.__version__}))
    dist.destroy_process_group()
    return 0


def hand_written(plan, mesh):
    """The plan's configuration written directly against PyTorch (no engine code)."""
    import torch
    import torch.nn.functional as F
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput,
                                                   RowwiseParallel, SequenceParallel,
                                                   parallelize_module)

    from autoplan.models.gpt import GPT, GPTConfig

    torch.manual_seed(0)
    model = GPT(GPTConfig(**MODEL))
    p = plan.parallel
    gen = torch.Generator().manual_seed(1234 + mesh.get_coordinate()[1])   # per dp rank

    def batch(rows):
        tokens = torch.randint(0, MODEL["vocab_size"], (rows, SEQ + 1), generator=gen)
        return tokens[:, :-1], tokens[:, 1:]

    if p.dp > 1:
        for block in model.blocks.values():
            fully_shard(block, mesh=mesh["dp"], reshard_after_forward=True)
        fully_shard(model, mesh=mesh["dp"], reshard_after_forward=False)
    if p.tp > 1:
        tp_plan = {"tok_emb": RowwiseParallel(input_layouts=Replicate(),
                                              output_layouts=Replicate()),
                   "blocks.0": PrepareModuleInput(input_layouts=(Replicate(),),
                                                  desired_input_layouts=(Shard(1),),
                                                  use_local_output=True),
                   "norm": SequenceParallel(),
                   "head": ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate())}
        for i in model.blocks.keys():
            tp_plan.update({
                f"blocks.{i}.norm1": SequenceParallel(), f"blocks.{i}.norm2": SequenceParallel(),
                f"blocks.{i}.attn": PrepareModuleInput(input_layouts=(Shard(1),),
                                                       desired_input_layouts=(Replicate(),)),
                f"blocks.{i}.mlp": PrepareModuleInput(input_layouts=(Shard(1),),
                                                      desired_input_layouts=(Replicate(),)),
                f"blocks.{i}.attn.q": ColwiseParallel(), f"blocks.{i}.attn.k": ColwiseParallel(),
                f"blocks.{i}.attn.v": ColwiseParallel(),
                f"blocks.{i}.attn.o": RowwiseParallel(output_layouts=Shard(1)),
                f"blocks.{i}.mlp.fc1": ColwiseParallel(),
                f"blocks.{i}.mlp.fc2": RowwiseParallel(output_layouts=Shard(1))})
        if plan.param_placements.get("tok_emb.weight", {}).get("tp") != "Shard(0)":
            del tp_plan["tok_emb"]
        parallelize_module(model, mesh["tp"], tp_plan)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, betas=(0.9, 0.95))

    if p.pp > 1:
        pp_rank = mesh.get_coordinate()[0]
        half = MODEL["layers"] // 2
        for i in list(model.blocks.keys()):
            if (int(i) < half) != (pp_rank == 0):
                del model.blocks[i]
        if pp_rank == 0:
            model.norm = model.head = None
        else:
            model.tok_emb = model.pos_emb = None
        stage = PipelineStage(model, pp_rank, 2, torch.device("cpu"),
                              group=mesh["pp"].get_group())
        loss_fn = lambda logits, y: F.cross_entropy(logits.flatten(0, 1).float(),  # noqa: E731
                                                   y.flatten(0, 1))
        schedule = Schedule1F1B(stage, n_microbatches=p.num_micro_batches, loss_fn=loss_fn)

        def step(_):
            x, y = batch(plan.global_batch)
            losses = []
            if pp_rank == 0:
                schedule.step(x)
            else:
                schedule.step(target=y, losses=losses)
            opt.step()
            opt.zero_grad(set_to_none=True)
            if losses:
                torch.stack(losses).mean().item()
        return step

    def step(_):
        x, y = batch(plan.global_batch // p.dp)
        loss = model(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        loss.item()
    return step


if __name__ == "__main__":
    sys.exit(main())
