"""Hugging Face transformers causal LMs, built offline from a config (no network, no weights).

    spec = resolve("llama", num_hidden_layers=2, hidden_size=64, num_attention_heads=4)
    spec = resolve("gpt2", n_layer=2, n_embd=64, n_head=4, attn_implementation="eager")
    spec = resolve("path/to/config.json")            # or a directory holding config.json

A name is a transformers ``model_type``; its default config (``AutoConfig.for_model``) is
updated with the overrides, which must be fields of that config (or their aliases from the
config's ``attribute_map``, e.g. ``num_hidden_layers`` for GPT-2's ``n_layer``) — an unknown
key is an error, not silently stored. ``attn_implementation`` ("eager" or "sdpa", default
"sdpa") picks the attention code. The spec keeps the config's differences from the
transformers defaults (``to_diff_dict``), so it is small and stable in a plan file.

:func:`build` returns the transformers model class for the config (from
``AutoModelForCausalLM``'s mapping) subclassed with ``forward(input_ids, labels) -> loss``,
so parameter and module names are exactly the checkpoint's (``model.layers.3.mlp.up_proj``,
``transformer.h.5.attn.c_attn``). Labels are the input ids: transformers shifts them
inside its causal-LM loss.

Traced (on fake tensors), transformers takes its ``torch.compile`` path: it cannot rule out
packed sequences without values, so it builds a (b, 1, s, s) mask and passes it to SDPA,
which the tracer maps to the memory-efficient kernel (flash takes no mask). Each layer then
keeps a 2·b·s² byte attention bias — small next to the 5·a·s/h·sbh of eager attention.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn

from autoplan.errors import ConfigError
from autoplan.models.moe import use_capacity_experts
from autoplan.models.registry import MAX_LAYERS, MAX_SIZE, ModelSpec

_ATTN = ("eager", "sdpa")
_DROP_KEYS = ("transformers_version", "_name_or_path", "architectures", "id2label",
              "label2id", "model_type")


def _transformers():
    try:
        import transformers
    except ImportError as exc:          # pragma: no cover - transformers is a test dependency
        raise ConfigError("Hugging Face models need the 'transformers' package "
                          "(pip install 'autoplan[hf]')", field="model.source") from exc
    return transformers


#: Size fields (by their standard transformers names) that must be positive integers when
#: given, with their upper bounds; checked before construction, since transformers accepts
#: e.g. ``n_layer=-1`` or ``max_position_embeddings="x"`` and divides by others.
_SIZES = {"num_hidden_layers": MAX_LAYERS, "hidden_size": MAX_SIZE,
          "num_attention_heads": MAX_SIZE, "num_key_value_heads": MAX_SIZE,
          "vocab_size": MAX_SIZE, "max_position_embeddings": MAX_SIZE,
          "intermediate_size": MAX_SIZE}
_FIELD_IN_MESSAGE = re.compile(r"field '([^']+)'")


def _config(model_type: str, values: dict[str, Any], *, source: str = "<hf>"):
    """``AutoConfig.for_model(model_type, **values)``; an unknown model type, or a value
    transformers refuses (a wrong type, a size it divides by), is a ConfigError naming the
    field."""
    transformers = _transformers()
    if not isinstance(model_type, str) or model_type not in transformers.CONFIG_MAPPING:
        raise ConfigError(f"unknown Hugging Face model_type {model_type!r} (transformers "
                          f"{transformers.__version__}; e.g. 'gpt2', 'llama', 'mistral', "
                          "'qwen2')", source=source, field="model.name")
    _check_sizes(transformers.CONFIG_MAPPING[model_type], values, source)
    try:
        return transformers.AutoConfig.for_model(model_type, **values)
    except Exception as exc:  # noqa: BLE001 -- TypeError, ValueError, ZeroDivisionError,
        # huggingface_hub's StrictDataclassFieldValidationError: all a bad value of the user's
        found = _FIELD_IN_MESSAGE.search(str(exc))
        key = found.group(1) if found else None
        detail = " ".join(str(exc).split()) or type(exc).__name__
        raise ConfigError(f"{model_type} config refused the value"
                          f"{f' {values[key]!r}' if key in values else 's'}: {detail}"[:400],
                          source=source,
                          field=f"model.config.{key}" if key else "model.config") from None


def _check_sizes(config_class: type, values: dict[str, Any], source: str) -> None:
    """The size fields among ``values`` (under their standard names or the config's own,
    e.g. GPT-2's ``n_layer``) are positive integers within bounds."""
    own = getattr(config_class, "attribute_map", {})     # standard name -> attribute
    for name, high in _SIZES.items():
        for key in dict.fromkeys((name, own.get(name, name))):
            value = values.get(key)
            if value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= high:
                shown = repr(value)
                shown = shown if len(shown) <= 80 else shown[:77] + "..."
                raise ConfigError(f"must be an integer in [1, {high}], got {shown}",
                                  source=source, field=f"model.config.{key}")


_READ_WITH_FALLBACK = {"head_dim"}


def _check_keys(model_type: str, overrides: dict[str, Any], source: str) -> None:
    default = _config(model_type, {}, source=source)
    known = set(default.to_dict()) | set(getattr(default, "attribute_map", {}))
    # keys modelling code reads with a fallback, absent from some configs' defaults
    # (Qwen3-MoE's head_dim: getattr(config, "head_dim", hidden // heads))
    unknown = sorted(set(overrides) - known - _READ_WITH_FALLBACK)
    if unknown:
        raise ConfigError(f"unknown {model_type} config key(s) {unknown}; see "
                          f"{type(default).__name__} for the fields", source=source,
                          field=f"model.config.{unknown[0]}")


def resolve(name_or_path: str, **overrides: Any) -> ModelSpec:
    """A spec for a model type (default config + overrides) or a local config.json."""
    attn = overrides.pop("attn_implementation", "sdpa")
    if attn not in _ATTN:
        raise ConfigError(f"attn_implementation must be one of {list(_ATTN)}, got {attn!r}",
                          field="model.config.attn_implementation")
    path = Path(name_or_path)
    source = "<hf>"
    if path.suffix == ".json" or path.is_dir():
        file = path / "config.json" if path.is_dir() else path
        try:
            base = json.loads(file.read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise ConfigError(f"cannot read a config: {exc}", source=str(file)) from exc
        if "model_type" not in base:
            raise ConfigError("missing", source=str(file), field="model_type")
        model_type, source = base["model_type"], str(file)
        values = {k: v for k, v in base.items() if k not in _DROP_KEYS}
    else:
        model_type, values = name_or_path, {}
    _check_keys(model_type, overrides, source)
    config = _config(model_type, {**values, **overrides}, source=source)
    diff = {k: v for k, v in config.to_diff_dict().items() if k not in _DROP_KEYS}
    return ModelSpec("hf", model_type, {**diff, "attn_implementation": attn})


def hf_config(spec: ModelSpec):
    """The transformers config object of ``spec``."""
    values = {k: v for k, v in spec.config.items() if k != "attn_implementation"}
    config = _config(spec.name, values)
    config.loss_type = "ForCausalLM"
    use_capacity_experts(config)          # MoE: routing with static shapes (models/moe.py)
    return config


class _LossForward:
    """Mixin: ``forward(input_ids, labels)`` returns the causal-LM loss."""

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return super().forward(input_ids=input_ids, labels=labels, use_cache=False).loss


def build(spec: ModelSpec) -> nn.Module:
    """The transformers causal LM of ``spec`` (on the current default device), whose
    ``forward(input_ids, labels)`` returns the loss."""
    transformers = _transformers()
    config = hf_config(spec)
    mapping = transformers.AutoModelForCausalLM._model_mapping
    try:
        cls = mapping[type(config)]
    except KeyError as exc:
        raise ConfigError(f"model_type {spec.name!r} has no causal-LM class in transformers",
                          field="model.name") from exc
    trainable = type(f"{cls.__name__}ForTraining", (_LossForward, cls), {})
    model = trainable._from_config(config,
                                   attn_implementation=spec.config.get("attn_implementation",
                                                                       "sdpa"))
    model.train()
    return model


def default_seq_len(spec: ModelSpec) -> int:
    return int(hf_config(spec).max_position_embeddings)


def example_batch(spec: ModelSpec, batch_size: int, seq_len: int | None,
                  device: torch.device, *, seed: int = 0) -> tuple:
    """``(input_ids, labels)``, both (batch_size, seq_len); labels equal the ids."""
    config = hf_config(spec)
    s = seq_len or int(config.max_position_embeddings)
    if s > config.max_position_embeddings:
        raise ConfigError(f"sequence length {s} exceeds max_position_embeddings "
                          f"{config.max_position_embeddings}", field="batch.seq_len")
    if device.type == "meta":
        ids = torch.empty(batch_size, s, dtype=torch.long, device=device)
    else:
        gen = torch.Generator().manual_seed(seed)
        ids = torch.randint(0, config.vocab_size, (batch_size, s), generator=gen).to(device)
    return ids, ids
