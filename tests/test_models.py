"""Built-in model families (MLP, Wide-ResNet) and Hugging Face models built from configs."""

from __future__ import annotations

import json

import pytest
import torch

from autoplan.errors import ConfigError
from autoplan.models import build_model, builtin_names, default_seq_len, example_batch, resolve
from autoplan.models.mlp import MLPConfig
from autoplan.models.wide_resnet import WRNConfig

TINY_GPT2 = dict(n_layer=2, n_embd=32, n_head=4, vocab_size=128, n_positions=64)


def _train_step(spec, batch_size, seq_len=None) -> torch.Tensor:
    """One real forward and backward on the CPU; returns the loss."""
    torch.manual_seed(0)
    model = build_model(spec, device="cpu")
    loss = model(*example_batch(spec, batch_size, seq_len, device="cpu", seed=1))
    loss.backward()
    assert all(p.grad is not None for p in model.parameters() if p.requires_grad)
    return loss


def test_builtin_names_include_new_families_and_presets():
    names = builtin_names()
    for name in ("mlp", "mlp-tiny", "wide-resnet", "wrn-28-10", "gpt", "gpt3-175b"):
        assert name in names


@pytest.mark.parametrize("task", ["classification", "regression"])
def test_mlp_trains_on_cpu(task):
    spec = resolve("mlp-tiny", task=task)
    loss = _train_step(spec, 4)
    assert loss.shape == () and torch.isfinite(loss)
    model = build_model(spec, device="cpu")
    assert sum(p.numel() for p in model.parameters()) == \
        MLPConfig.from_dict(spec.config).num_params()
    x, y = example_batch(spec, 4, device="cpu", seed=3)
    assert x.shape == (4, 32) and y.shape == ((4,) if task == "classification" else (4, 4))
    assert torch.equal(x, example_batch(spec, 4, device="cpu", seed=3)[0])
    assert not torch.equal(x, example_batch(spec, 4, device="cpu", seed=4)[0])


def test_mlp_config_is_validated():
    with pytest.raises(ConfigError, match="hiden"):
        build_model(resolve("mlp", hiden=3))
    with pytest.raises(ConfigError, match="task"):
        build_model(resolve("mlp", task="ranking"))
    with pytest.raises(ConfigError, match="seq_len"):
        example_batch(resolve("mlp-tiny"), 2, 16)


@pytest.mark.parametrize("depth, width", [(10, 1), (16, 4), (28, 10), (40, 2)])
def test_wide_resnet_param_count(depth, width):
    cfg = WRNConfig(depth=depth, width=width)
    model = build_model(resolve("wide-resnet", depth=depth, width=width))
    assert sum(p.numel() for p in model.parameters()) == cfg.num_params()


def test_wide_resnet_trains_on_cpu_and_validates():
    spec = resolve("wide-resnet", depth=10, width=1, image_size=8, num_classes=3)
    loss = _train_step(spec, 2)
    assert loss.shape == () and torch.isfinite(loss)
    images, labels = example_batch(spec, 2, device="meta")
    assert images.shape == (2, 3, 8, 8) and labels.dtype == torch.long
    with pytest.raises(ConfigError, match="6N"):
        build_model(resolve("wide-resnet", depth=12))
    with pytest.raises(ConfigError, match="image_size"):
        build_model(resolve("wide-resnet", image_size=30))


def test_gpt_batch_seed_is_passed_through():
    spec = resolve("gpt-tiny")
    a = example_batch(spec, 2, device="cpu", seed=5)[0]
    assert torch.equal(a, example_batch(spec, 2, device="cpu", seed=5)[0])
    assert not torch.equal(a, example_batch(spec, 2, device="cpu", seed=6)[0])


# ---- Hugging Face ---------------------------------------------------------------------------

def test_hf_resolve_keeps_overrides_and_names():
    spec = resolve("hf:gpt2", **TINY_GPT2)
    assert spec.source == "hf" and spec.name == "gpt2"
    assert spec.config["n_layer"] == 2 and spec.config["attn_implementation"] == "sdpa"
    alias = resolve("hf:gpt2", num_hidden_layers=2, n_embd=32, n_head=4, vocab_size=128,
                    n_positions=64)
    assert alias.config["n_layer"] == 2
    assert default_seq_len(spec) == 64
    json.dumps(spec.to_dict())                       # goes into plan files
    assert spec.fingerprint() == resolve("hf:gpt2", **TINY_GPT2).fingerprint()


def test_hf_bad_input_is_a_config_error(tmp_path):
    with pytest.raises(ConfigError, match="n_layers"):
        resolve("hf:gpt2", n_layers=2)
    with pytest.raises(ConfigError, match="model_type"):
        resolve("hf:no-such-model")
    with pytest.raises(ConfigError, match="attn_implementation"):
        resolve("hf:gpt2", attn_implementation="flash")
    with pytest.raises(ConfigError, match="max_position_embeddings"):
        example_batch(resolve("hf:gpt2", **TINY_GPT2), 1, 128)
    bad = tmp_path / "config.json"
    bad.write_text("{not json")
    with pytest.raises(ConfigError, match="config.json"):
        resolve(f"hf:{bad}")



def test_hf_model_class_failing_on_its_config_is_one_config_error(monkeypatch):
    # transformers' own model code can fail on a config it ships (some default configs
    # lack a field their model reads): one line naming the class, not a traceback
    import transformers

    def broken(self, config):
        raise AttributeError("'GPT2Config' object has no attribute 'rope_theta'")

    monkeypatch.setattr(transformers.GPT2LMHeadModel, "__init__", broken)
    with pytest.raises(ConfigError, match=r"field 'model.config': building transformers' "
                                          r"GPT2LMHeadModel .* raised AttributeError: "
                                          r".*rope_theta"):
        build_model(resolve("hf:gpt2", **TINY_GPT2))

def test_hf_composite_config_takes_its_language_models_sizes():
    # Gemma 3 / Llama 4 configs hold the language model in text_config: a size their top
    # level lacks goes there, and per-layer fields derive again from the new layer count
    spec = resolve("hf:gemma3", num_hidden_layers=2, hidden_size=64, intermediate_size=128,
                   num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                   vocab_size=256)
    text = spec.config["text_config"]
    assert text["num_hidden_layers"] == 2 and text["vocab_size"] == 256
    assert text["head_dim"] == 16 and "head_dim" not in spec.config
    assert "num_hidden_layers" not in spec.config
    from autoplan.models.hf import hf_config, text_config
    config = text_config(hf_config(spec))
    assert len(config.layer_types) == 2
    with pytest.raises(ConfigError, match=r"unknown gemma3 config key\(s\) \['n_layers'\]; "
                                          r"see Gemma3Config or its text_config "
                                          r"\(Gemma3TextConfig\)"):
        resolve("hf:gemma3", n_layers=2)
    with pytest.raises(ConfigError, match=r"model.config.num_hidden_layers"):
        resolve("hf:gemma3", num_hidden_layers=0)


def test_hf_sub_config_sizes_and_nesting_are_checked(tmp_path):
    # a composite's text_config builds as many layers as it says: bounded like the top level;
    # a config nested past any real one is refused before transformers copies it recursively
    with pytest.raises(ConfigError, match=r"model.config.text_config.num_hidden_layers': "
                                          r"must be an integer in \[1, "):
        resolve("hf:gemma3", text_config={"num_hidden_layers": 10 ** 9})
    with pytest.raises(ConfigError, match=r"model.config.vision_config.hidden_size"):
        resolve("hf:gemma3", vision_config={"hidden_size": -1})
    deep = tmp_path / "config.json"
    deep.write_text('{"model_type": "gemma3", "text_config": ' + '{"a": ' * 5000 + "1"
                    + "}" * 5000 + "}")
    with pytest.raises(ConfigError, match="nested deeper than 16 levels"):
        resolve(f"hf:{deep}")
    deep.write_text('{"model_type": "gemma3", "text_config": ' + '{"a": ' * 40 + "1"
                    + "}" * 40 + "}")
    with pytest.raises(ConfigError, match=r"field 'model.config.text_config.a.a.*nested"):
        resolve(f"hf:{deep}")


def test_hf_per_layer_lists_follow_a_new_layer_count():
    # Zamba's default config derives one block type per layer from its period and offset: a
    # new layer count gets transformers' own derivation, as for_model at that count would
    import transformers

    grown = resolve("hf:zamba", num_hidden_layers=80).config["layers_block_type"]
    assert grown == transformers.AutoConfig.for_model(
        "zamba", num_hidden_layers=80).layers_block_type
    # ... and where transformers refuses its own derivation (Zamba at 2 layers), the
    # default's pattern, cut
    default = transformers.CONFIG_MAPPING["zamba"]().layers_block_type
    assert resolve("hf:zamba", num_hidden_layers=2).config["layers_block_type"] == default[:2]
    mine = [default[2], default[0], default[2]]          # a pattern of the user's own
    assert resolve("hf:zamba", num_hidden_layers=3,
                   layers_block_type=mine).config["layers_block_type"] == mine
    # Qwen2's layer kinds follow the overrides they derive from, not the default's pattern
    qwen = resolve("hf:qwen2", num_hidden_layers=3, use_sliding_window=True,
                   sliding_window=16, max_window_layers=1).config["layer_types"]
    assert qwen == ["full_attention", "sliding_attention", "sliding_attention"]


def test_hf_per_layer_lists_of_a_config_file_are_cycled(tmp_path):
    # a list the file sets is the user's pattern: cut or cycled to the new count
    import json

    import transformers

    base = transformers.AutoConfig.for_model("qwen2", num_hidden_layers=2).to_dict()
    base["layer_types"] = ["sliding_attention", "full_attention"]
    base.update(use_sliding_window=True, sliding_window=16)
    path = tmp_path / "config.json"
    path.write_text(json.dumps(base))
    spec = resolve(f"hf:{path}", num_hidden_layers=3)
    assert spec.config["layer_types"] == ["sliding_attention", "full_attention",
                                          "sliding_attention"]


def test_hf_composite_type_whose_causal_lm_is_the_language_model_alone():
    # llama4's causal-LM class (Llama4ForCausalLM) takes the text config, not the composite
    spec = resolve("hf:llama4", num_hidden_layers=2, hidden_size=64, intermediate_size=128,
                   intermediate_size_mlp=128, num_attention_heads=4, num_key_value_heads=2,
                   head_dim=16, vocab_size=256, num_local_experts=2)
    model = build_model(spec)
    assert type(model).__name__ == "Llama4ForCausalLMForTraining"
    assert "model.layers.1.self_attn.q_proj.weight" in dict(model.named_parameters())
    ids, labels = example_batch(spec, 2, 16, device="meta")
    assert ids.shape == (2, 16)


def test_hf_gpt2_builds_with_checkpoint_names_and_trains():
    spec = resolve("hf:gpt2", **TINY_GPT2, attn_implementation="eager")
    model = build_model(spec)
    names = dict(model.named_parameters())
    assert "transformer.h.1.attn.c_attn.weight" in names and "lm_head.weight" not in names
    assert next(iter(names.values())).is_meta
    loss = _train_step(spec, 2, 16)
    assert torch.isfinite(loss) and 3.0 < loss.item() < 7.0      # ~ln(128) at init


def test_hf_llama_from_config_json(tmp_path):
    config = dict(model_type="llama", hidden_size=32, intermediate_size=64,
                  num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  vocab_size=128, max_position_embeddings=64)
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    spec = resolve(f"hf:{tmp_path}")
    assert spec.name == "llama" and spec.config["num_key_value_heads"] == 2
    assert resolve(f"hf:{path}", num_hidden_layers=3).config["num_hidden_layers"] == 3
    model = build_model(spec)
    assert "model.layers.1.mlp.gate_proj.weight" in dict(model.named_parameters())
    loss = _train_step(spec, 2, 16)
    assert torch.isfinite(loss)


def test_hf_heads_that_do_not_divide_hidden_build_as_transformers_builds_them():
    # GLM-4.5's config: hidden 4096, 96 heads; its attention derives head_dim = 4096 // 96
    # and projects 4096 -> 96 * 42. transformers builds and trains that, so autoplan does:
    # a model whose own code needs divisibility says so itself, named, in one line
    spec = resolve("hf:mistral", num_hidden_layers=2, hidden_size=40, intermediate_size=64,
                   num_attention_heads=6, num_key_value_heads=2, vocab_size=128,
                   max_position_embeddings=64)
    model = build_model(spec)
    assert dict(model.named_parameters())["model.layers.0.self_attn.q_proj.weight"].shape \
        == (36, 40)
    assert torch.isfinite(_train_step(spec, 2, 16))
    with pytest.raises(ConfigError, match=r"GPT2LMHeadModel .* divisible by num_heads"):
        build_model(resolve("hf:gpt2", **{**TINY_GPT2, "n_embd": 30}))


def test_hf_weights_from_legacy_constructors_land_on_the_build_device():
    # XLNet makes its attention weights with torch.FloatTensor(...), which ignores the
    # default device: on the CPU beside a meta model, the trace mixed devices
    spec = resolve("hf:xlnet", n_layer=2, d_model=32, n_head=4, d_inner=64, vocab_size=128)
    assert all(p.is_meta for p in build_model(spec).parameters())
