"""Float8 linear layers for ``mixed-fp8`` plans (``precision.matmul = float8``).

torchao's float8 training (``torchao.float8.convert_to_float8_training``) swaps a model's
``nn.Linear`` modules for ``Float8Linear``: each forward casts the input and the weight to
float8 e4m3 with one dynamic per-tensor scale (amax / the format's largest value), each
backward the output gradient to e5m2, and the three GEMMs run in ``torch._scaled_mm``
(Micikevicius et al. 2022, "FP8 Formats for Deep Learning"). Weights, gradients and
optimizer states keep the plan's other dtypes, and the swap composes with the engine's
DTensor tensor parallelism (the weights become DTensors as before) and FSDP2.

Which layers: :func:`autoplan.precision.float8_layer`, the rule the cost model prices
(:mod:`autoplan.cost.float8`) -- the linear layers of the transformer blocks whose weight
dimensions are multiples of 16; the embedding and the output projection stay in the compute
dtype. The swap is made on the module tree before tensor parallelism, checkpointing and
FSDP wrap it (torchtitan's order: converters run before parallelisation).

On a GPU float8 GEMMs need compute capability 8.9 or later (Ada, Hopper); on a CPU
``torch._scaled_mm`` computes them in a wider type, so a CPU run exercises the same casts and
scales -- what the engine's tests check -- without the speed.
"""

from __future__ import annotations

from typing import Iterable

import torch
import torch.nn as nn

from autoplan.errors import PlanError
from autoplan.precision import float8_layer

#: Compute capability float8 tensor cores need (Ada / Hopper).
MIN_CAPABILITY = (8, 9)


def check_float8_device(device: torch.device) -> None:
    """PlanError naming the plan's field where this rank cannot run float8 GEMMs."""
    if device.type == "cuda" and torch.cuda.get_device_capability(device) < MIN_CAPABILITY:
        cap = ".".join(map(str, torch.cuda.get_device_capability(device)))
        raise PlanError(f"plan field 'precision.matmul': float8 GEMMs need compute "
                        f"capability 8.9 or later (Ada, Hopper); this GPU has {cap}")
    try:
        _converter()
    except ImportError as exc:
        raise PlanError(f"plan field 'precision.matmul': float8 training needs torchao "
                        f"(pip install 'autoplan[fp8]'): {exc}") from None


def _converter():
    """torchao's ``convert_to_float8_training``, imported quietly: torchao logs that its
    optional CUDA extensions are absent on a CPU build, and torch that it registers an enum
    the old way; neither is the user's concern."""
    import logging
    import warnings

    loggers = [logging.getLogger(n) for n in ("torchao", "torch.utils._pytree")]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            from torchao.float8 import convert_to_float8_training
    finally:
        for lg, level in zip(loggers, levels):
            lg.setLevel(level)
    return convert_to_float8_training


def _owner(fqn: str, layers: Iterable[str]) -> str | None:
    for layer in layers:
        if fqn == layer or fqn.startswith(layer + "."):
            return layer
    return None


def convert_float8(root: nn.Module, layers: Iterable[str]) -> int:
    """Swap the linear layers of ``root`` that lie under one of ``layers`` (module names,
    e.g. ``blocks.3`` or ``model.layers.3``) and that :func:`float8_layer` admits for float8
    ones; returns how many were swapped."""
    layers = tuple(layers)
    swapped: list[str] = []

    def wanted(module: nn.Module, fqn: str) -> bool:
        if not isinstance(module, nn.Linear):
            return False
        layer = _owner(fqn, layers)
        ok = layer is not None and float8_layer(layer, tuple(module.weight.shape))
        if ok:
            swapped.append(fqn)
        return ok

    _converter()(root, module_filter_fn=wanted)
    return len(swapped)
