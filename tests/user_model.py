"""A user's own model, planned through an import path (``import:tests.user_model:build``)."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F


class Residual(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.up = nn.Linear(width, 4 * width)
        self.down = nn.Linear(4 * width, width)

    def forward(self, x):
        return x + self.down(F.relu(self.up(self.norm(x))))


class Regressor(nn.Module):
    def __init__(self, width: int, depth: int):
        super().__init__()
        self.width = width
        self.inp = nn.Linear(16, width)
        self.layers = nn.ModuleList(Residual(width) for _ in range(depth))
        self.out = nn.Linear(width, 1)

    def forward(self, x, y):
        h = self.inp(x)
        for layer in self.layers:
            h = layer(h)
        return F.mse_loss(self.out(h).squeeze(-1), y)

    def example_batch(self, batch_size: int, seq_len, device):
        return (torch.randn(batch_size, 16, device=device),
                torch.randn(batch_size, device=device))


def build(width: int = 64, depth: int = 3) -> nn.Module:
    return Regressor(width, depth)


class TinyConvClassifier(nn.Module):
    """A strided convolution and a linear head over 4x4 images, 4 classes: the smallest
    model with a convolution (tests of convolution-specific planning)."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 4, stride=4)
        self.head = nn.Linear(8, 4)

    def forward(self, x, y):
        return F.cross_entropy(self.head(self.conv(x).flatten(1)), y)

    @staticmethod
    def example_inputs(batch_size: int = 4) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.randn(batch_size, 3, 4, 4), torch.randint(0, 4, (batch_size,))
