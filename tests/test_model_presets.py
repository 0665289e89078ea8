"""Named presets of well-known architectures: sizes against the published parameter counts,
and finding a preset's name again from a plan's model spec."""

from __future__ import annotations

import pytest

from autoplan.models.gpt_config import GPTConfig
from autoplan.models.names import describe, preset_of
from autoplan.models.registry import resolve


@pytest.mark.parametrize("name, billions", [
    ("llama2-7b", 6.74), ("llama2-13b", 13.02), ("llama2-70b", 68.98),   # HF model cards
    ("mistral-7b", 7.24),                                                # Jiang et al. 2023
    ("llama3-8b", 8.03), ("llama3-70b", 70.55),                          # Dubey et al. 2024
])
def test_preset_parameter_counts(name, billions):
    cfg = GPTConfig.from_dict(resolve(name).config)
    assert cfg.num_params() / 1e9 == pytest.approx(billions, abs=0.01)


def test_preset_names_are_found_again():
    assert preset_of(resolve("mistral-7b")) == "mistral-7b"
    assert preset_of(resolve("llama2-70b").to_dict()) == "llama2-70b"
    assert preset_of(resolve("gpt", layers=3)) is None
    assert describe(resolve("gpt", layers=3, hidden=64, heads=4)) == \
        "gpt (layers=3, hidden=64, heads=4)"
    assert describe({"source": "hf", "name": "gpt2", "config": {}}) == "hf:gpt2"
