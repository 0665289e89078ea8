"""Measure the CPU time the engine's TP and DP wrappers add beyond compute and collectives.

    torchrun --standalone --nproc_per_node=2 -m autoplan.cost.framework_overhead

The engine shards matmuls with DTensor (``parallelize_module`` with ``ColwiseParallel`` /
``RowwiseParallel``). Each sharded matmul then pays, per forward + backward, Python-level
work the op profile does not see: wrapping and unwrapping DTensors, sharding propagation,
redistributing a partial result, and issuing and waiting for one all-reduce. On a GPU that
work overlaps the kernels; on a CPU it is CPU time on the same cores as the compute. This
measures it on a two-layer MLP (column- then row-parallel, tiny shapes so arithmetic is
negligible), as CPU seconds per rank (``time.process_time``, all threads of the process)::

    overhead = (CPU(TP step) - CPU(plain step)) / n_matmuls - CPU(one all-reduce)

where the all-reduce is timed alone on the same tensor; the statistic is the median over
``--repeats`` steps (after warm-up). The collective itself is priced from the link profile;
this is the rest.

Data parallelism likewise: the engine wraps every block and the chunk root with FSDP2
(``replicate`` for ZeRO-0, ``fully_shard`` for ZeRO-1/2/3), whose pre/post forward and backward
hooks run for each wrapped module and micro-batch. Measured on 9 one-layer blocks (8 + root,
as gpt-small) with gradient synchronisation off, so no collective runs::

    dp_module_overhead_s = (CPU(fully_shard step) - CPU(plain step)) / modules

Both figures go into ``profiles/ops/index.yaml`` under the device, and
:mod:`autoplan.cost.shared_cores` adds them, at the core share: per TP-sharded matmul in the TP
term, per wrapped module and micro-batch in the DP term.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from typing import Callable


def _cpu_per_call(fn: Callable[[], object], repeats: int, warmup: int = 20) -> float:
    import torch.distributed as dist

    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        dist.barrier()
        c0 = time.process_time()
        fn()
        times.append(time.process_time() - c0)
    return statistics.median(times)


def measure(repeats: int = 300) -> dict[str, float]:
    """Run under torchrun (gloo); every rank returns the same dict (rank 0's figures)."""
    import torch
    import torch.distributed as dist
    import torch.nn as nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel,
                                                   parallelize_module)

    torch.set_num_threads(1)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))

    class MLP(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = nn.Linear(16, 16)
            self.b = nn.Linear(16, 16)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.b(torch.relu(self.a(x)))

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(16, 16)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.relu(self.lin(x))

    class Stack(nn.Module):
        def __init__(self, n: int = 8) -> None:
            super().__init__()
            self.blocks = nn.ModuleList([Block() for _ in range(n)])

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            for block in self.blocks:
                x = block(x)
            return x

    x = torch.randn(4, 16)
    plain = MLP()
    sharded = parallelize_module(MLP(), mesh, {"a": ColwiseParallel(), "b": RowwiseParallel()})
    buf = torch.randn(4, 16)
    cpu_plain = _cpu_per_call(lambda: plain(x).sum().backward(), repeats)
    cpu_tp = _cpu_per_call(lambda: sharded(x).sum().backward(), repeats)
    cpu_ar = _cpu_per_call(lambda: dist.all_reduce(buf), repeats)
    per_matmul = (cpu_tp - cpu_plain) / 2 - cpu_ar

    from torch.distributed.fsdp import fully_shard

    stack, wrapped = Stack(), Stack()
    for block in wrapped.blocks:
        fully_shard(block, mesh=mesh, reshard_after_forward=False)
    fully_shard(wrapped, mesh=mesh, reshard_after_forward=False)
    wrapped.set_requires_gradient_sync(False)
    modules = len(wrapped.blocks) + 1
    cpu_stack = _cpu_per_call(lambda: stack(x).sum().backward(), repeats)
    cpu_fsdp = _cpu_per_call(lambda: wrapped(x).sum().backward(), repeats)
    return {"ranks": dist.get_world_size(), "cpu_plain_step_s": cpu_plain,
            "cpu_tp_step_s": cpu_tp, "cpu_all_reduce_s": cpu_ar,
            "tp_matmul_overhead_s": max(0.0, per_matmul),
            "cpu_stack_step_s": cpu_stack, "cpu_fsdp_step_s": cpu_fsdp,
            "dp_module_overhead_s": max(0.0, (cpu_fsdp - cpu_stack) / modules),
            "load_avg": os.getloadavg()[0]}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=300)
    args = ap.parse_args(argv)
    if "RANK" not in os.environ:
        print("error: run under torchrun, e.g. torchrun --standalone --nproc_per_node=2 "
              "-m autoplan.cost.framework_overhead", file=sys.stderr)
        return 2
    import torch.distributed as dist

    dist.init_process_group("gloo")
    try:
        result = measure(args.repeats)
        if dist.get_rank() == 0:
            print("  ".join(f"{k} {v:.3g}" if isinstance(v, float) else f"{k} {v}"
                            for k, v in result.items()))
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
