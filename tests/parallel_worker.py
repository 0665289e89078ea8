"""torchrun worker for tests/test_moe_cp.py, against the same model trained in one process on
the whole batch:

* ``ep``: a tiny MoE GPT with its experts sharded over every rank (expert parallelism folded
  into data parallelism), each rank its own rows of the batch;
* ``cp``: a tiny Llama-style GPT at sequence 256 with every sequence split over the ranks
  (context parallelism: load-balanced chunks, keys and values all-gathered);
* ``cp-gpt``: the same for a GPT-2 style GPT (learned positions, eager attention) at 128.

    torchrun --nproc_per_node=4 tests/parallel_worker.py ep,cp,cp-gpt OUT.json
"""

import json
import sys

import torch
import torch.distributed as dist

from autoplan.models.context_parallel import shard_rows
from autoplan.models.moe import MoE
from autoplan.models.registry import build_model, example_batch, resolve

STEPS = 4
EP = dict(batch=8, seq=16, spec=resolve(
    "gpt", vocab_size=128, seq_len=16, hidden=32, layers=2, heads=4, style="llama", experts=4,
    top_k=2, shared_experts=1, capacity_factor=2.0))              # E / k: nothing dropped
CP = dict(batch=2, seq=256, spec=resolve(
    "gpt", vocab_size=128, seq_len=256, hidden=32, layers=2, heads=4, kv_heads=2,
    style="llama"))
CP_GPT = dict(batch=2, seq=128, spec=resolve(
    "gpt", vocab_size=128, seq_len=128, hidden=32, layers=2, heads=4, attention="eager"))


def build(spec):
    torch.manual_seed(0)
    model = build_model(spec, device="cpu")
    model.init_weights(seed=0)
    return model


def train(model, tokens, targets, reduce=None):
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    losses = []
    for _ in range(STEPS):
        opt.zero_grad()
        loss = model(tokens, targets)
        loss.backward()
        if reduce:
            loss = reduce(model, loss)
        opt.step()
        losses.append(loss.item())
    return losses


def main(modes: str, out: str) -> None:
    """Each of ``modes`` (comma-separated) in turn, in one launch: ``out`` gets per mode the
    one-process and the sharded losses."""
    dist.init_process_group("gloo")
    results = {mode: run(mode) for mode in modes.split(",")}
    if dist.get_rank() == 0:
        with open(out, "w") as f:
            json.dump(results, f)
    dist.destroy_process_group()


def run(mode: str) -> dict | None:
    rank, world = dist.get_rank(), dist.get_world_size()
    setup = {"ep": EP, "cp": CP, "cp-gpt": CP_GPT}[mode]
    spec, batch, seq = setup["spec"], setup["batch"], setup["seq"]
    tokens, targets = example_batch(spec, batch, seq, device="cpu")
    reference = train(build(spec), tokens, targets) if rank == 0 else None

    model = build(spec)
    group = dist.new_group(list(range(world)))
    experts = set()
    if mode == "ep":
        for module in model.modules():
            if isinstance(module, MoE):
                module.shard_experts(group)
                experts |= {id(module.gate_up), id(module.down)}
        rows = slice(rank * batch // world, (rank + 1) * batch // world)
        tokens, targets = tokens[rows], targets[rows]
    else:
        model.shard_sequence(group, seq)
        tokens, targets = shard_rows(tokens, world, rank), shard_rows(targets, world, rank)

    def reduce(m, loss):
        # The global loss is the mean of the ranks' means (equal token counts). Replicated
        # weights: average their gradients. Expert weights already got every rank's
        # contribution through the all-to-all's backward: divide by the ranks.
        for p in m.parameters():
            if id(p) in experts:
                p.grad /= world
            else:
                dist.all_reduce(p.grad)
                p.grad /= world
        loss = loss.detach().clone()
        dist.all_reduce(loss)
        return loss / world

    sharded = train(model, tokens, targets, reduce)
    return {"reference": reference, "sharded": sharded} if rank == 0 else None


if __name__ == "__main__":
    from engine.run import run_and_exit

    run_and_exit(lambda: main(sys.argv[1], sys.argv[2]) or 0)
