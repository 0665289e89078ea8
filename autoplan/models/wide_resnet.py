"""Wide residual networks (Zagoruyko & Komodakis 2016, arXiv 1605.07146).

WRN-d-k: a 3x3 stem convolution to 16 channels, then three groups of
N = (d - 4) / 6 pre-activation basic blocks B(3,3) with 16k, 32k and 64k channels (strides
1, 2, 2), then BN-ReLU, global average pooling and a linear classifier (paper, Table 1).
A block is BN-ReLU-conv3x3-BN-ReLU-dropout-conv3x3 plus a shortcut: the identity, or a 1x1
convolution of the activated input when the block changes width or stride (the first
block of each group). Convolutions have no bias. WRN-28-10 has 36.5M parameters (paper,
Table 2), checked by :meth:`WRNConfig.num_params`.

The groups are ``nn.Sequential`` s in the ``nn.ModuleList`` ``groups``; the tracer flattens
them into one sequence of blocks, so every residual block is a layer: the first block of
each group is its own kind, the other N - 1 of a group share one.

The batch is ``(images, labels)``: images (b, in_channels, image_size, image_size), labels
(b,) class indices; the loss is cross-entropy in float32.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from autoplan.errors import ConfigError


@dataclass(frozen=True, kw_only=True)
class WRNConfig:
    depth: int = 28
    width: int = 10
    num_classes: int = 10
    image_size: int = 32
    in_channels: int = 3
    dropout: float = 0.0

    def __post_init__(self) -> None:
        from autoplan.models.registry import MAX_LAYERS, MAX_SIZE, check_config_types

        check_config_types(self, bounds={"depth": (1, MAX_LAYERS), "width": (1, 1024),
                                         "image_size": (1, MAX_SIZE)})
        if self.depth < 10 or (self.depth - 4) % 6:
            raise ConfigError(f"depth must be 6N + 4 with N >= 1, got {self.depth}",
                              field="model.depth")
        for name in ("width", "num_classes", "in_channels"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"must be positive, got {getattr(self, name)}",
                                  field=f"model.{name}")
        if self.image_size < 4 or self.image_size % 4:
            raise ConfigError(f"image_size must be a positive multiple of 4 (two stride-2 "
                              f"groups), got {self.image_size}", field="model.image_size")
        if not 0.0 <= self.dropout < 1.0:
            raise ConfigError(f"dropout must be in [0, 1), got {self.dropout}",
                              field="model.dropout")

    @property
    def blocks_per_group(self) -> int:
        return (self.depth - 4) // 6

    @property
    def widths(self) -> tuple[int, int, int]:
        return 16 * self.width, 32 * self.width, 64 * self.width

    @classmethod
    def from_dict(cls, d: dict) -> "WRNConfig":
        from autoplan.models.registry import config_from_dict

        return config_from_dict(cls, d, "Wide-ResNet")

    def to_dict(self) -> dict:
        return asdict(self)

    def num_params(self) -> int:
        """Closed form: convolutions, BN scale and shift, classifier."""
        total = 9 * self.in_channels * 16
        c_in = 16
        for g, c in enumerate(self.widths):
            for j in range(self.blocks_per_group):
                stride = 2 if g > 0 and j == 0 else 1
                total += 2 * c_in + 9 * c_in * c + 2 * c + 9 * c * c    # bn1, conv1, bn2, conv2
                if c_in != c or stride != 1:
                    total += c_in * c                                   # 1x1 shortcut
                c_in = c
        last = self.widths[-1]
        return total + 2 * last + last * self.num_classes + self.num_classes


class WideBasicBlock(nn.Module):
    def __init__(self, c_in: int, c_out: int, stride: int, dropout: float):
        super().__init__()
        self.bn1 = nn.BatchNorm2d(c_in)
        self.conv1 = nn.Conv2d(c_in, c_out, 3, stride=stride, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(c_out)
        self.drop = nn.Dropout(dropout)
        self.conv2 = nn.Conv2d(c_out, c_out, 3, stride=1, padding=1, bias=False)
        self.shortcut = (nn.Conv2d(c_in, c_out, 1, stride=stride, bias=False)
                         if c_in != c_out or stride != 1 else None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a = F.relu(self.bn1(x))
        y = self.conv2(self.drop(F.relu(self.bn2(self.conv1(a)))))
        return y + (self.shortcut(a) if self.shortcut is not None else x)


class WideResNet(nn.Module):
    """``forward(images, labels=None)``: logits, or the cross-entropy loss."""

    def __init__(self, cfg: WRNConfig):
        super().__init__()
        self.cfg = cfg
        self.stem = nn.Conv2d(cfg.in_channels, 16, 3, padding=1, bias=False)
        groups = []
        c_in = 16
        for g, c in enumerate(cfg.widths):
            blocks = []
            for j in range(cfg.blocks_per_group):
                stride = 2 if g > 0 and j == 0 else 1
                blocks.append(WideBasicBlock(c_in, c, stride, cfg.dropout))
                c_in = c
            groups.append(nn.Sequential(*blocks))
        self.groups = nn.ModuleList(groups)
        self.bn = nn.BatchNorm2d(c_in)
        self.fc = nn.Linear(c_in, cfg.num_classes)

    def forward(self, images: torch.Tensor, labels: torch.Tensor | None = None
                ) -> torch.Tensor:
        x = self.stem(images.to(self.stem.weight.dtype))
        for group in self.groups:
            x = group(x)
        x = F.adaptive_avg_pool2d(F.relu(self.bn(x)), 1).flatten(1)
        logits = self.fc(x)
        if labels is None:
            return logits
        return F.cross_entropy(logits.float(), labels)


def build(config: dict) -> nn.Module:
    return WideResNet(WRNConfig.from_dict(config))


def example_batch(config: dict, batch_size: int, seq_len: int | None, device: torch.device,
                  seed: int = 0) -> tuple:
    """``(images, labels)``; ``seq_len`` does not apply and must be None."""
    cfg = WRNConfig.from_dict(config)
    if seq_len is not None:
        raise ConfigError("the wide-resnet family has no sequence dimension; leave seq_len "
                          "unset", field="batch.seq_len")
    shape = (batch_size, cfg.in_channels, cfg.image_size, cfg.image_size)
    if device.type == "meta":
        return (torch.empty(shape, device=device),
                torch.empty(batch_size, dtype=torch.long, device=device))
    gen = torch.Generator().manual_seed(seed)
    images = torch.randn(shape, generator=gen)
    labels = torch.randint(0, cfg.num_classes, (batch_size,), generator=gen)
    return images.to(device), labels.to(device)


def seq_len(config: dict) -> None:
    return None
