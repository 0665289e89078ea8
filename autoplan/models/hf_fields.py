"""Reading and reshaping a transformers config object: its language model inside a
composite config, its per-layer lists under a new layer count, how deep it may nest.

Pure functions over config objects and plain dicts; :mod:`autoplan.models.hf` resolves and
builds models with them.
"""

from __future__ import annotations

from typing import Any

from autoplan.errors import ConfigError
from autoplan.models.moe import config_value

#: Keys of a config.json that describe the file, not the model.
DROP_KEYS = ("transformers_version", "_name_or_path", "architectures", "id2label",
             "label2id", "model_type")


#: How deep a config may nest mappings and lists (transformers' own configs: 3 levels, a
#: composite's sub-config holding a rope-scaling dict); deeper is refused before transformers
#: copies it recursively.
MAX_NESTING = 16


def check_nesting(value: Any, source: str) -> None:
    """``value`` nests mappings and lists at most :data:`MAX_NESTING` deep (a ConfigError
    naming the first field too deep, not a RecursionError from deep inside a copy)."""
    stack = [(value, "model.config", 0)]
    while stack:
        item, where, depth = stack.pop()
        if depth > MAX_NESTING:
            raise ConfigError(f"nested deeper than {MAX_NESTING} levels", source=source,
                              field=where[:200])
        if isinstance(item, dict):
            stack.extend((v, f"{where}.{k}", depth + 1) for k, v in item.items())
        elif isinstance(item, (list, tuple)):
            stack.extend((v, f"{where}[{i}]", depth + 1) for i, v in enumerate(item))


def known_keys(config) -> set[str]:
    """The fields a transformers config object accepts (with its ``attribute_map`` aliases)."""
    import dataclasses

    known = set(config.to_dict()) | set(getattr(config, "attribute_map", {}))
    if dataclasses.is_dataclass(config):
        known |= {f.name for f in dataclasses.fields(config)}
    return known


def text_config(config):
    """The config of the language model inside ``config``: ``config`` itself, or for a
    composite config (a vision- or audio-language model: Gemma 3, Llama 4, Mllama, Qwen3.5)
    the sub-config transformers' ``get_text_config(decoder=True)`` names."""
    getter = getattr(config, "get_text_config", None)
    if getter is None:
        return config
    try:
        return getter(decoder=True) or config
    except Exception:  # noqa: BLE001 -- a config class whose lookup fails has no text part
        return config


def text_key(config) -> str | None:
    """The attribute of a composite ``config`` that holds its text config (``text_config``
    for most, ``decoder`` for MusicGen), or None when the config is its own text config."""
    inner = text_config(config)
    if inner is config:
        return None
    for key in getattr(config, "sub_configs", {}) or {}:
        if getattr(config, key, None) is inner:
            return key
    return None


def sub_defaults(sub, relayered: bool) -> dict[str, Any]:
    """What a composite config's default sub-config sets beyond its own class's defaults
    (its ``model_type`` always). With a new layer count, fields holding one entry per layer
    (Gemma 3's ``layer_types``) are left to be derived again."""
    try:
        base = type(sub)().to_dict()
    except Exception:  # noqa: BLE001 -- a class that cannot build bare: keep everything
        base = {}
    out = {"model_type": sub.model_type}
    for key, value in sub.to_dict().items():
        if key in DROP_KEYS or base.get(key, object()) == value:
            continue
        if relayered and isinstance(value, (list, dict)):
            continue
        out[key] = value
    return out


def follow_layer_count(base, values: dict[str, Any], layers: int,
                        given: set[str]) -> dict[str, Any]:
    """``values`` with the per-layer lists of the config ``base`` (one entry per layer of its
    own count: Zamba's ``layers_block_type``, Gemma 3n's ``intermediate_size``) cut, or
    cycled, to ``layers`` entries, unless the overrides (``given``) set them: a new layer
    count keeps the pattern of the layers it keeps, and transformers refuses lists of the
    old length."""
    old = config_value(base, "num_hidden_layers")
    if not isinstance(old, int) or old < 1 or old == layers:
        return values
    out = dict(values)
    for key, value in base.to_dict().items():
        if key in given or key in DROP_KEYS or not isinstance(value, list) \
                or len(value) != old:
            continue
        out[key] = [value[i % old] for i in range(layers)]
    return out
