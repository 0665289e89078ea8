"""benchmarks/model_zoo.py's helpers (issue 15, item 9): what makes its engine column a
fair parity check. The benchmark itself is run by hand (its docstring)."""

from __future__ import annotations

import pytest

pytest.importorskip("transformers", reason="the zoo's Hugging Face rows need 'transformers'")

from benchmarks.model_zoo import _no_dropout  # noqa: E402
from benchmarks.zoo_models import available  # noqa: E402


def test_engine_configs_turn_every_dropout_off():
    """Ranks seeing part of the batch draw other dropout masks than one process: GPT-2 with
    its default 0.1 dropouts measured 1.4e-3 parity, 9.9e-8 without."""
    assert _no_dropout("hf:gpt2") == {"resid_pdrop": 0.0, "embd_pdrop": 0.0,
                                      "attn_pdrop": 0.0, "summary_first_dropout": 0.0}
    assert _no_dropout("hf:t5") == {"dropout_rate": 0.0}
    assert _no_dropout("hf:llama") == {}                    # already 0.0
    assert _no_dropout("import:benchmarks.zoo_models:nn_transformer") == {}


def test_small_torchvision_vit_is_its_own_class():
    """vit_b_16 fixes patch size, depth and widths; the engine's small config builds the
    same VisionTransformer class at its own sizes."""
    why = available("torchvision.models")
    if why:
        pytest.skip(why)
    import torch

    from benchmarks.zoo_models import torchvision_model

    model = torchvision_model(arch="vit_b_16", image_size=32, num_classes=10, patch_size=8,
                              num_layers=2, num_heads=4, hidden_dim=64, mlp_dim=128)
    assert type(model.net).__name__ == "VisionTransformer"
    assert len(model.net.encoder.layers) == 2
    loss = model(*model.example_batch(2, None, "cpu"))
    assert loss.shape == () and torch.isfinite(loss)


def test_hf_deit_builds_its_trainable_classifier():
    """transformers maps deit to two classes (the classifier, then the inference-only
    ...WithTeacher): the first is built, and its forward returns the loss."""
    from autoplan.models.registry import build_model, example_batch, resolve

    spec = resolve("hf:deit", num_hidden_layers=1, hidden_size=32, num_attention_heads=2,
                   intermediate_size=64, image_size=16, patch_size=8)
    model = build_model(spec, device="cpu")
    assert type(model).__name__ == "DeiTForImageClassificationForTraining"
    loss = model(*example_batch(spec, 2, device="cpu"))
    assert loss.shape == ()
