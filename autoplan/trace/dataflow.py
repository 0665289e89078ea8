"""Who feeds whom among the captured forward ops.

Each input tensor of an op is classified by the owner of its storage (views share their
base's storage): a *parameter* or buffer (also through a view such as ``t(weight)``), a
*batch input*, or an *activation* produced by an earlier op.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from autoplan.trace.capture import Capture, storage_key
from autoplan.trace.flops import is_matmul_like


@dataclass
class OpIO:
    activations: list[tuple[torch.Tensor, int]] = field(default_factory=list)  # (tensor, producer)
    batch_inputs: list[tuple[torch.Tensor, int]] = field(default_factory=list)  # (tensor, input i)
    params: list[tuple[torch.Tensor, str]] = field(default_factory=list)        # (tensor, FQN)
    buffers: list[tuple[torch.Tensor, str]] = field(default_factory=list)
    param_views: list[int] = field(default_factory=list)   # producers of param-view inputs


@dataclass
class Dataflow:
    io: list[OpIO]
    producers: list[list[int]]        # activation producers of each op, in argument order
    consumers: list[list[int]]        # ops consuming each op's outputs as activations
    is_weight_op: list[bool]          # a matmul/conv reading a parameter

    @classmethod
    def build(cls, cap: Capture) -> "Dataflow":
        n = len(cap.ops)
        io = [OpIO() for _ in range(n)]
        producers: list[list[int]] = [[] for _ in range(n)]
        consumers: list[list[int]] = [[] for _ in range(n)]
        weight = [False] * n
        for op in cap.ops:
            entry = io[op.index]
            for t, prod in zip(op.in_tensors, op.producers):
                owner = cap.owners.get(storage_key(t))
                kind = owner[0] if owner is not None else "op"
                if kind == "param":
                    entry.params.append((t, owner[1]))
                    if prod is not None:
                        entry.param_views.append(prod)
                elif kind == "buffer":
                    entry.buffers.append((t, owner[1]))
                elif kind == "input":
                    entry.batch_inputs.append((t, owner[1]))
                elif prod is not None:
                    entry.activations.append((t, prod))
                    if prod not in producers[op.index]:
                        producers[op.index].append(prod)
                        consumers[prod].append(op.index)
            weight[op.index] = bool(entry.params) and is_matmul_like(op.func)
        return cls(io, producers, consumers, weight)
