"""Third-party model definitions as ``import:`` factories for ``benchmarks/model_zoo.py``:
torchvision's and timm's classifiers and ``torch.nn.Transformer``, each wrapped so that
``forward(*batch)`` returns the training loss and ``example_batch(b, seq_len, device)`` makes
the batch (what autoplan asks of an ``import:`` model). The model code is the package's own,
imported, never copied; the wrapper only adds the loss.

    autoplan plan import:benchmarks.zoo_models:torchvision_model --set arch=resnet50 ...

torchvision and timm are optional (``pip install 'autoplan[zoo]'``, README): the PyPI
torchvision wheels built for torch 2.13 link CUDA and fail to import beside the CPU torch;
torchvision 0.16.0's pure-Python model code imports with its C ops unavailable
(``pip install --no-deps torchvision==0.16.0 timm``). :func:`available` says which is missing.
"""

from __future__ import annotations

import importlib

import torch
import torch.nn as nn
import torch.nn.functional as F


def available(package: str) -> str | None:
    """None if ``package`` imports, else the reason it does not (one line)."""
    try:
        importlib.import_module(package)
    except Exception as exc:  # noqa: BLE001 -- ImportError, or a broken build's RuntimeError
        return f"{package} not importable here: {type(exc).__name__}: " + \
            " ".join(str(exc).split())[:200]
    return None


class ImageClassifier(nn.Module):
    """``net(images)`` logits -> cross-entropy loss against integer labels."""

    def __init__(self, net: nn.Module, image_size: int, num_classes: int, channels: int = 3):
        super().__init__()
        self.net = net
        self.image_size, self.num_classes, self.channels = image_size, num_classes, channels

    def forward(self, images: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(self.net(images), labels)

    def example_batch(self, batch_size: int, seq_len: int | None, device) -> tuple:
        shape = (batch_size, self.channels, self.image_size, self.image_size)
        device = torch.device(device)
        if device.type == "meta":
            return (torch.empty(shape, device=device),
                    torch.empty(batch_size, dtype=torch.long, device=device))
        gen = torch.Generator().manual_seed(0)
        return (torch.randn(shape, generator=gen).to(device),
                torch.randint(0, self.num_classes, (batch_size,), generator=gen).to(device))


def torchvision_model(arch: str = "resnet50", image_size: int = 224,
                      num_classes: int = 1000, **kwargs) -> ImageClassifier:
    """``torchvision.models.<arch>(num_classes=..., **kwargs)`` with a cross-entropy loss."""
    import torchvision.models as tvm

    if arch.startswith("vit") and _VIT_SIZES & kwargs.keys():
        # a smaller ViT: ``vit_b_16`` and friends fix these sizes, and each builds this class
        return ImageClassifier(tvm.VisionTransformer(image_size=image_size,
                                                     num_classes=num_classes, **kwargs),
                               image_size, num_classes)
    if arch.startswith("vit"):
        kwargs.setdefault("image_size", image_size)
    return ImageClassifier(getattr(tvm, arch)(num_classes=num_classes, **kwargs), image_size,
                           num_classes)


#: the sizes torchvision's ``vit_*`` builders fix (``torchvision.models.VisionTransformer``)
_VIT_SIZES = {"patch_size", "num_layers", "num_heads", "hidden_dim", "mlp_dim"}


def timm_model(arch: str = "convnext_tiny", image_size: int = 224, num_classes: int = 1000,
               **kwargs) -> ImageClassifier:
    """``timm.create_model(arch, num_classes=..., **kwargs)`` with a cross-entropy loss."""
    import timm

    if "vit" in arch:
        kwargs.setdefault("img_size", image_size)
    return ImageClassifier(timm.create_model(arch, num_classes=num_classes, pretrained=False,
                                             **kwargs), image_size, num_classes)


class Seq2Seq(nn.Module):
    """``torch.nn.Transformer`` (or a ``TransformerEncoder``) on embeddings; the loss is the
    mean squared output (a regression stand-in: the FLOPs are the model's)."""

    def __init__(self, d_model: int = 512, nhead: int = 8, layers: int = 6,
                 ffn: int = 2048, seq_len: int = 512, encoder_only: bool = False,
                 dropout: float = 0.1):
        super().__init__()
        self.d_model, self.seq_len, self.encoder_only = d_model, seq_len, encoder_only
        if encoder_only:
            layer = nn.TransformerEncoderLayer(d_model, nhead, ffn, dropout, batch_first=True)
            self.net = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        else:
            self.net = nn.Transformer(d_model, nhead, layers, layers, ffn, dropout,
                                      batch_first=True)

    def forward(self, src: torch.Tensor, tgt: torch.Tensor) -> torch.Tensor:
        out = self.net(src) if self.encoder_only else self.net(src, tgt)
        return (out.float() - tgt.float()).pow(2).mean()

    def example_batch(self, batch_size: int, seq_len: int | None, device) -> tuple:
        shape = (batch_size, seq_len or self.seq_len, self.d_model)
        device = torch.device(device)
        if device.type == "meta":
            return torch.empty(shape, device=device), torch.empty(shape, device=device)
        gen = torch.Generator().manual_seed(0)
        return torch.randn(shape, generator=gen).to(device), \
            torch.randn(shape, generator=gen).to(device)


def nn_transformer(**kwargs) -> Seq2Seq:
    return Seq2Seq(**kwargs)
