"""torchrun worker for tests/test_moe_cp.py: the engine's ring attention
(:func:`autoplan.models.context_parallel.ring_attention`) against attention over the whole
sequence in one process, in float64, on every rank's load-balanced chunks.

* without dropout: outputs and the gradients of queries, keys and values (grouped-query
  heads, so key/value gradients are folded back) against autograd's through
  ``scaled_dot_product_attention(is_causal=True)``;
* in bfloat16: within bfloat16's rounding of the float64 answer, outputs and gradients in
  bfloat16;
* with dropout: the ring's own gradient against a central finite difference of its output
  along a random direction, the dropout masks drawn again from the same random state;
* under a sliding window shorter than a chunk pair's span (Mistral's layers): the ring and
  the all-gather (:func:`~autoplan.models.context_parallel.attend`), outputs and gradients,
  against whole-sequence attention under transformers' sliding-window mask.

    torchrun --nproc_per_node=4 tests/ring_worker.py OUT.json
"""

import json
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F

from dataclasses import replace

from autoplan.models.context_parallel import (ContextParallel, attend, chunk_positions,
                                               ring_attention)

B, HEADS, KV_HEADS, SEQ, HD = 2, 4, 2, 64, 8
WINDOW = 20     # keys a query sees under the sliding window: less than the sequence


def main(out: str) -> None:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    cp = ContextParallel(dist.group.WORLD, world, rank, SEQ, "ring")
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(B, HEADS, SEQ, HD, dtype=torch.float64, generator=gen, requires_grad=True)
    k, v = (torch.randn(B, KV_HEADS, SEQ, HD, dtype=torch.float64, generator=gen,
                        requires_grad=True) for _ in range(2))
    weight = torch.randn(B, HEADS, SEQ, HD, dtype=torch.float64, generator=gen)
    rep = HEADS // KV_HEADS
    whole = F.scaled_dot_product_attention(q, k.repeat_interleave(rep, 1),
                                           v.repeat_interleave(rep, 1), is_causal=True)
    (whole * weight).sum().backward()

    mine = chunk_positions(SEQ, world, rank)
    ql, kl, vl = (t.detach()[:, :, mine].clone().requires_grad_() for t in (q, k, v))
    got = ring_attention(ql, kl, vl, cp)
    (got * weight[:, :, mine]).sum().backward()
    errors = {"out": (got - whole.detach()[:, :, mine]).abs().max().item()}
    for name, local, full in (("dq", ql, q), ("dk", kl, k), ("dv", vl, v)):
        errors[name] = (local.grad - full.grad[:, :, mine]).abs().max().item()

    # bfloat16 inputs (the engine's mixed precision): statistics kept in float32, so the
    # output and gradients stay within bfloat16's rounding of the float64 answer
    qb, kb, vb = (t.detach().to(torch.bfloat16).requires_grad_() for t in (ql, kl, vl))
    low = ring_attention(qb, kb, vb, cp)
    (low.float() * weight[:, :, mine]).sum().backward()
    scale = whole.detach().abs().max().item()
    errors["bf16_out"] = (low.double() - whole.detach()[:, :, mine]).abs().max().item() / scale
    errors["bf16_dq"] = ((qb.grad.double() - q.grad[:, :, mine]).abs().max()
                         / q.grad.abs().max()).item()
    errors["bf16_dtypes"] = float(low.dtype != torch.bfloat16 or kb.grad.dtype != torch.bfloat16)

    # dropout: d/de f(x + e u) at e = 0 against the gradient, masks replayed
    torch.manual_seed(1 + rank)
    direction = [torch.randn_like(t) for t in (ql, kl, vl)]
    state = torch.get_rng_state()

    def f(eps: float, grad: bool = False) -> torch.Tensor:
        torch.set_rng_state(state)
        xs = [(t.detach() + eps * u).requires_grad_(grad) for t, u in zip((ql, kl, vl),
                                                                           direction)]
        y = (ring_attention(*xs, cp, dropout_p=0.3) * weight[:, :, mine]).sum()
        return y, xs

    y, xs = f(0.0, grad=True)
    y.backward()
    analytic = sum((x.grad * u).sum() for x, u in zip(xs, direction))
    numeric = (f(1e-6)[0] - f(-1e-6)[0]) / 2e-6
    total = torch.stack([analytic.detach(), numeric.detach()])
    dist.all_reduce(total)                      # the whole objective: every rank's part
    errors["dropout_directional"] = (abs(total[0] - total[1]) / abs(total[1])).item()
    errors["dropout_changes_output"] = (f(0.0)[0] - (got * weight[:, :, mine]).sum()
                                        ).abs().item()
    # a sliding window: the ring and the all-gather against the whole sequence's attention
    pos = torch.arange(SEQ)
    band = (pos[:, None] >= pos[None, :]) & (pos[None, :] > pos[:, None] - WINDOW)
    for t in (q, k, v):
        t.grad = None
    whole = F.scaled_dot_product_attention(q, k.repeat_interleave(rep, 1),
                                           v.repeat_interleave(rep, 1), attn_mask=band)
    (whole * weight).sum().backward()
    for method in ("ring", "all-gather"):
        windowed = replace(cp, method=method, window=WINDOW)
        ql, kl, vl = (t.detach()[:, :, mine].clone().requires_grad_() for t in (q, k, v))
        got = attend(ql, kl, vl, windowed)
        (got * weight[:, :, mine]).sum().backward()
        errors[f"window_{method}_out"] = (got - whole.detach()[:, :, mine]).abs().max().item()
        for name, local, full in (("dq", ql, q), ("dk", kl, k), ("dv", vl, v)):
            errors[f"window_{method}_{name}"] = (local.grad - full.grad[:, :, mine]
                                                 ).abs().max().item()
    worst = torch.tensor([errors[k] for k in sorted(errors)])
    gathered = [torch.zeros_like(worst) for _ in range(world)]
    dist.all_gather(gathered, worst)
    if rank == 0:
        names = sorted(errors)
        result = {n: max(g[i].item() for g in gathered) for i, n in enumerate(names)}
        result["dropout_changes_output"] = min(g[names.index("dropout_changes_output")].item()
                                               for g in gathered)
        with open(out, "w") as fh:
            json.dump(result, fh)
    dist.destroy_process_group()


if __name__ == "__main__":
    from engine.run import run_and_exit

    run_and_exit(lambda: main(sys.argv[1]) or 0)
