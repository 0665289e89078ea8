"""torchrun worker for tests/test_moe_ep.py: a tiny MoE GPT trained with its experts sharded
over every rank (expert parallelism folded into data parallelism) against the same model
trained in one process on the whole batch.

    torchrun --nproc_per_node=4 tests/moe_ep_worker.py OUT.json
"""

import json
import sys

import torch
import torch.distributed as dist

from autoplan.models.moe import MoE
from autoplan.models.registry import build_model, example_batch, resolve

STEPS, BATCH, SEQ = 4, 8, 16
SPEC = resolve("gpt", vocab_size=128, seq_len=SEQ, hidden=32, layers=2, heads=4, style="llama",
               experts=4, top_k=2, shared_experts=1, capacity_factor=2.0)   # E/k: no drops


def build():
    torch.manual_seed(0)
    model = build_model(SPEC, device="cpu")
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


def main(out: str) -> None:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    tokens, targets = example_batch(SPEC, BATCH, SEQ, device="cpu")
    reference = train(build(), tokens, targets) if rank == 0 else None

    model = build()
    group = dist.new_group(list(range(world)))
    experts = set()
    for name, module in model.named_modules():
        if isinstance(module, MoE):
            module.shard_experts(group)
            experts |= {id(module.gate_up), id(module.down)}
    rows = slice(rank * BATCH // world, (rank + 1) * BATCH // world)

    def reduce(m, loss):
        # The global loss is the mean of the ranks' means. Shared weights: average their
        # gradients. Expert weights already got every rank's contribution through the
        # all-to-all's backward: divide by the ranks.
        for p in m.parameters():
            if id(p) in experts:
                p.grad /= world
            else:
                dist.all_reduce(p.grad)
                p.grad /= world
        loss = loss.detach().clone()
        dist.all_reduce(loss)
        return loss / world

    sharded = train(model, tokens[rows], targets[rows], reduce)
    if rank == 0:
        with open(out, "w") as f:
            json.dump({"reference": reference, "expert_parallel": sharded}, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
