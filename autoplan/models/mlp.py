"""A residual MLP: the smallest model with repeated blocks.

``in_proj`` (in_dim -> hidden), ``depth`` pre-norm residual blocks
``x + fc2(gelu(fc1(norm(x))))`` (hidden -> expansion·hidden -> hidden) in the ModuleList
``blocks``, then ``norm`` and ``head`` (hidden -> out_dim). The batch is ``(x, y)``:
``x`` (batch, in_dim) float; ``y`` (batch, out_dim) float for ``task="regression"`` (mean
squared error) or (batch,) class indices for ``task="classification"`` (cross-entropy).
The loss is computed in float32 whatever the parameter dtype.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Literal

import torch
import torch.nn as nn
import torch.nn.functional as F

from autoplan.errors import ConfigError


@dataclass(frozen=True, kw_only=True)
class MLPConfig:
    in_dim: int = 784
    hidden: int = 1024
    out_dim: int = 10
    depth: int = 4
    expansion: int = 4
    task: Literal["regression", "classification"] = "classification"
    dropout: float = 0.0

    def __post_init__(self) -> None:
        from autoplan.models.registry import MAX_LAYERS, check_config_types

        check_config_types(self, bounds={"depth": (1, MAX_LAYERS), "expansion": (1, 1024)})
        if self.task not in ("regression", "classification"):
            raise ConfigError(f"task must be 'regression' or 'classification', got "
                              f"{self.task!r}", field="model.task")
        if not 0.0 <= self.dropout < 1.0:
            raise ConfigError(f"dropout must be in [0, 1), got {self.dropout}",
                              field="model.dropout")

    @classmethod
    def from_dict(cls, d: dict) -> "MLPConfig":
        from autoplan.models.registry import config_from_dict

        return config_from_dict(cls, d, "MLP")

    def to_dict(self) -> dict:
        return asdict(self)

    def num_params(self) -> int:
        h, f = self.hidden, self.expansion * self.hidden
        block = 2 * h + (h * f + f) + (f * h + h)
        return (self.in_dim * h + h) + self.depth * block + 2 * h + (h * self.out_dim
                                                                       + self.out_dim)


class MLPBlock(nn.Module):
    def __init__(self, cfg: MLPConfig):
        super().__init__()
        self.norm = nn.LayerNorm(cfg.hidden)
        self.fc1 = nn.Linear(cfg.hidden, cfg.expansion * cfg.hidden)
        self.fc2 = nn.Linear(cfg.expansion * cfg.hidden, cfg.hidden)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.drop(self.fc2(F.gelu(self.fc1(self.norm(x)))))


class MLP(nn.Module):
    """``forward(x, y=None)``: the outputs, or the loss when ``y`` is given."""

    def __init__(self, cfg: MLPConfig):
        super().__init__()
        self.cfg = cfg
        self.in_proj = nn.Linear(cfg.in_dim, cfg.hidden)
        self.blocks = nn.ModuleList(MLPBlock(cfg) for _ in range(cfg.depth))
        self.norm = nn.LayerNorm(cfg.hidden)
        self.head = nn.Linear(cfg.hidden, cfg.out_dim)

    def forward(self, x: torch.Tensor, y: torch.Tensor | None = None) -> torch.Tensor:
        x = self.in_proj(x.to(self.in_proj.weight.dtype))
        for block in self.blocks:
            x = block(x)
        out = self.head(self.norm(x))
        if y is None:
            return out
        if self.cfg.task == "classification":
            return F.cross_entropy(out.float(), y)
        return F.mse_loss(out.float(), y.float())


def build(config: dict) -> nn.Module:
    return MLP(MLPConfig.from_dict(config))


def example_batch(config: dict, batch_size: int, seq_len: int | None, device: torch.device,
                  seed: int = 0) -> tuple:
    """``(x, y)`` of ``batch_size`` rows; ``seq_len`` does not apply and must be None."""
    cfg = MLPConfig.from_dict(config)
    if seq_len is not None:
        raise ConfigError("the mlp family has no sequence dimension; leave seq_len unset",
                          field="batch.seq_len")
    y_shape = (batch_size,) if cfg.task == "classification" else (batch_size, cfg.out_dim)
    y_dtype = torch.long if cfg.task == "classification" else torch.float32
    if device.type == "meta":
        return (torch.empty(batch_size, cfg.in_dim, device=device),
                torch.empty(y_shape, dtype=y_dtype, device=device))
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(batch_size, cfg.in_dim, generator=gen)
    if cfg.task == "classification":
        y = torch.randint(0, cfg.out_dim, y_shape, generator=gen)
    else:
        y = torch.randn(y_shape, generator=gen)
    return x.to(device), y.to(device)


def seq_len(config: dict) -> None:
    return None
