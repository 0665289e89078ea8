"""Hugging Face transformers models of every task family, built offline from a config
(no network, no weights).

    spec = resolve("llama", num_hidden_layers=2, hidden_size=64, num_attention_heads=4)
    spec = resolve("bert")                           # masked LM: BertForMaskedLM
    spec = resolve("t5", num_layers=2)               # encoder-decoder: T5ForConditionalGeneration
    spec = resolve("vit")                            # ViTForImageClassification
    spec = resolve("bert", task="causal-lm")         # an explicit task
    spec = resolve("path/to/config.json")            # or a directory holding config.json

A name is a transformers ``model_type``; its default config (``AutoConfig.for_model``) is
updated with the overrides, which must be fields of that config (or their aliases from the
config's ``attribute_map``, e.g. ``num_hidden_layers`` for GPT-2's ``n_layer``) — an unknown
key is an error, not silently stored. The task (:data:`TASKS`) comes from ``task=``, else the
config's ``architectures``, else the model type's family (:func:`_task_of`).
``attn_implementation`` ("eager" or "sdpa") picks the attention code; its default is "sdpa"
where the class supports it. The spec keeps the config's differences from the transformers
defaults (``to_diff_dict``), so it is small and stable in a plan file.

:func:`build` returns the task's transformers class subclassed with
``forward(*batch) -> loss``, so parameter and module names are exactly the checkpoint's
(``model.layers.3.mlp.up_proj``, ``transformer.h.5.attn.c_attn``). The batch
(:func:`example_batch`): token models get ``(input_ids, labels)`` with labels equal to the ids
(transformers shifts them inside its causal-LM loss and into the decoder's inputs for
encoder-decoders); image classifiers get ``(pixel_values, labels)``. The default sequence
length is a training length (:func:`default_seq_len`), not the model's maximum.

Traced (on fake tensors), transformers cannot read the position ids to rule out packed
sequences; the tracer answers for it as a GPU run with these rows does
(:mod:`autoplan.trace.cuda_semantics`), so a causal layer calls SDPA with ``is_causal=True``
and no mask: the flash kernel. A sliding-window layer builds its (b, 1, s, s) mask, as it
does on the GPU, and runs the memory-efficient kernel with it.
"""

from __future__ import annotations

import functools
import json
import math
import re
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn

from autoplan.errors import ConfigError
from autoplan.models.hf_fields import (DROP_KEYS, MAX_NESTING, check_nesting,
                                       follow_layer_count, known_keys, sub_defaults,
                                       text_config, text_key)
from autoplan.models.moe import config_value, use_capacity_experts
from autoplan.models.registry import MAX_LAYERS, MAX_SIZE, ModelSpec, guarded
from autoplan.user_files import read_text

_ATTN = ("eager", "sdpa")
_DROP_KEYS = DROP_KEYS


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


def _check_sizes(config_class: type, values: dict[str, Any], source: str,
                 where: str = "model.config") -> None:
    """The size fields among ``values`` (under their standard names or the config's own,
    e.g. GPT-2's ``n_layer``) are positive integers within bounds; so are those of a
    sub-config given as a mapping (a composite config's ``text_config``: its layer count
    builds that many layers)."""
    subs = getattr(config_class, "sub_configs", {}) or {}
    for key, value in values.items():
        if isinstance(value, dict):
            sub = subs.get(key)
            _check_sizes(sub if isinstance(sub, type) else type(None), value, source,
                         f"{where}.{key}")
    own = getattr(config_class, "attribute_map", {})     # standard name -> attribute
    for name, high in _SIZES.items():
        for key in dict.fromkeys((name, own.get(name, name))):
            value = values.get(key)
            if value is None:
                continue
            # a per-layer list (Gemma 3n's intermediate_size) holds one size per layer
            sizes = value if isinstance(value, (list, tuple)) and value else [value]
            if any(isinstance(v, bool) or not isinstance(v, int) or not 1 <= v <= high
                   for v in sizes):
                shown = repr(value)
                shown = shown if len(shown) <= 80 else shown[:77] + "..."
                raise ConfigError(f"must be an integer in [1, {high}] (or a list of them, one "
                                  f"per layer), got {shown}",
                                  source=source, field=f"{where}.{key}")


def _modeling_reads(model_type: str, key: str) -> bool:
    """Does transformers' modelling code of ``model_type`` read ``config.<key>`` (some read
    keys their config's defaults lack, e.g. ``getattr(config, "head_dim", h // heads)``)?"""
    import importlib
    import inspect

    try:
        module = importlib.import_module(f"transformers.models.{model_type}.modeling_{model_type}")
        source = inspect.getsource(module)
    except (ImportError, OSError, TypeError):
        return False
    return f'getattr(config, "{key}"' in source or f"config.{key}" in source


def _layer_count(overrides: dict[str, Any], model_type: str) -> int | None:
    """The layer count ``overrides`` set, under its standard name or the config's alias."""
    own = getattr(_transformers().CONFIG_MAPPING[model_type], "attribute_map", {})
    for key in ("num_hidden_layers", own.get("num_hidden_layers")):
        value = overrides.get(key) if key else None
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    return None


def _split_overrides(model_type: str, default, overrides: dict[str, Any], source: str
                     ) -> tuple[dict[str, Any], str | None, dict[str, Any]]:
    """(top-level overrides, text sub-config key, overrides for it), against ``default``,
    the model type's default config. A key that config lacks but its language model's config
    has (``num_hidden_layers`` of ``gemma3``, whose layers live in ``text_config``) goes to
    that sub-config; a key neither has is an error naming the config class."""
    known = known_keys(default)
    unknown = sorted(set(overrides) - known)
    key = text_key(default) if unknown else None
    inner_known = known_keys(getattr(default, key)) if key else set()
    routed = {k: overrides[k] for k in unknown if k in inner_known}
    unknown = [k for k in unknown if k not in routed]
    if "head_dim" in unknown and _modeling_reads(model_type, "head_dim"):
        unknown.remove("head_dim")       # read with a fallback (Qwen3-MoE): a real setting
    if "head_dim" in unknown:
        raise ConfigError(f"{model_type} has no head_dim field: it derives the head size as "
                          "hidden_size / num_attention_heads; set those instead",
                          source=source, field="model.config.head_dim")
    if unknown:
        inner = f" or its {key} ({type(getattr(default, key)).__name__})" if key else ""
        raise ConfigError(f"unknown {model_type} config key(s) {unknown}; see "
                          f"{type(default).__name__}{inner} for the fields", source=source,
                          field=f"model.config.{unknown[0]}")
    if routed:
        _check_sizes(type(getattr(default, key)), routed, source)
    top = {k: v for k, v in overrides.items() if k not in routed}
    return top, key, routed


#: Task families (``--task`` / ``task=``): the transformers auto class whose mapping gives
#: the model class, the forward arguments of a training batch, and the loss the model returns.
TASKS = {
    "causal-lm": "AutoModelForCausalLM",           # (input_ids, labels): next-token loss
    "masked-lm": "AutoModelForMaskedLM",           # (input_ids, labels): token loss
    "seq2seq-lm": "AutoModelForSeq2SeqLM",         # (input_ids, labels): decoder loss
    "image-classification": "AutoModelForImageClassification",   # (pixel_values, labels)
}
#: Class-name suffixes of a config's ``architectures`` entry -> task.
_ARCH_SUFFIX = (("ForCausalLM", "causal-lm"), ("LMHeadModel", "causal-lm"),
                ("ForMaskedLM", "masked-lm"), ("ForConditionalGeneration", "seq2seq-lm"),
                ("ForSeq2SeqLM", "seq2seq-lm"), ("ForImageClassification",
                                                 "image-classification"))
#: The default training sequence length: a model's maximum (Mistral's 131,072 positions) is
#: what it can attend over, not what it is trained on per step; 2,048 is GPT-3's and
#: LLaMA-1's pre-training context (Brown et al. 2020, table 2.1; Touvron et al. 2023, 2.2),
#: capped by the model's own maximum.
TRAIN_SEQ_LEN = 2048
#: spec keys that are not config fields (``capacity_factor``: a mixture of experts' token
#: slots per expert, :func:`autoplan.models.moe.capacity`; default 1)
_SPEC_ONLY = ("attn_implementation", "task", "capacity_factor")


def _mapping(transformers, task: str):
    return getattr(transformers, TASKS[task])._model_mapping


def _task_of(config, architectures: list | None, explicit: str | None, source: str) -> str:
    """The task: ``explicit``, else the config's ``architectures``, else the model type's
    family — encoder-decoder -> seq2seq-lm; a type with a masked-LM class -> masked-lm (BERT
    and RoBERTa also have a causal ``...LMHeadModel``, a decoder variant that is not the
    pre-training objective); a causal LM; an image classifier."""
    transformers = _transformers()
    kind = type(config)
    if explicit is not None:
        if explicit not in TASKS:
            raise ConfigError(f"must be one of {', '.join(TASKS)}, got {explicit!r}"[:200],
                              source=source, field="model.task")
        if kind not in _mapping(transformers, explicit):
            have = [t for t in TASKS if kind in _mapping(transformers, t)]
            raise ConfigError(f"{config.model_type} has no {explicit} class in transformers "
                              f"{transformers.__version__}; it has: {have or 'none'}",
                              source=source, field="model.task")
        return explicit
    for arch in architectures or []:
        for suffix, task in _ARCH_SUFFIX:
            if isinstance(arch, str) and arch.endswith(suffix) and \
                    kind in _mapping(transformers, task):
                return task
    order = ("seq2seq-lm",) if config.is_encoder_decoder else ()
    for task in order + ("masked-lm", "causal-lm", "image-classification"):
        if kind in _mapping(transformers, task):
            return task
    raise ConfigError(f"{config.model_type} has no class for any task autoplan trains "
                      f"({', '.join(TASKS)})", source=source, field="model.name")


def _check_config(config, task: str, source: str) -> None:
    """What transformers would only fail on deep inside the model: heads vs KV heads, token
    ids outside the vocabulary (Phi-3's pad id 32,000 with a small ``vocab_size``); of a
    composite config, its language model's."""
    config = text_config(config)
    heads = config_value(config, "num_attention_heads")
    kv = config_value(config, "num_key_value_heads")
    if isinstance(heads, int) and isinstance(kv, int) and kv > 0 and \
            (kv > heads or heads % kv):
        raise ConfigError(f"num_key_value_heads = {kv} must divide num_attention_heads = "
                          f"{heads} (each KV head serves a group of query heads)",
                          source=source, field="model.config.num_key_value_heads")
    vocab = config_value(config, "vocab_size")
    if task != "image-classification" and isinstance(vocab, int):
        for key in ("pad_token_id", "decoder_start_token_id"):
            value = config_value(config, key)
            if isinstance(value, int) and not 0 <= value < vocab:
                raise ConfigError(f"{key} = {value} is outside the vocabulary (vocab_size = "
                                  f"{vocab}); set {key} below it", source=source,
                                  field=f"model.config.{key}")


def _model_class(config, task: str):
    """The task's transformers class for ``config``. transformers imports it lazily, and that
    import fails when a package it probes is broken — a CUDA-built torchvision beside a CPU
    torch ("operator torchvision::nms does not exist"): a ConfigError naming the cause."""
    try:
        cls = _mapping(_transformers(), task)[type(config)]
        # a few types map to several classes, the trainable one first (DeiT: the
        # classifier, then its distillation variant ...WithTeacher, which is inference-only)
        return cls[0] if isinstance(cls, tuple) else cls
    except (ImportError, RuntimeError) as exc:
        causes, cause = [], exc
        while cause is not None and len(causes) < 8:
            causes.append(f"{type(cause).__name__}: {cause}")
            cause = cause.__cause__ or cause.__context__
        text = " <- ".join(" ".join(c.split()) for c in causes)
        hint = ("; the installed torchvision does not match torch (e.g. a CUDA build beside "
                "a CPU torch): uninstall it or install the torchvision built for this torch"
                if "torchvision" in text else "")
        raise ConfigError(f"transformers could not import the {config.model_type} {task} "
                          f"class{hint} ({text})"[:600], field="model.name") from None


def resolve(name_or_path: str, /, **overrides: Any) -> ModelSpec:
    """A spec for a model type (default config + overrides) or a local config.json.

    Three keys are autoplan's, not the config's: ``task`` (:data:`TASKS`; default from the
    config's ``architectures`` or the model type, :func:`_task_of`),
    ``attn_implementation`` ("sdpa" or "eager"; default "sdpa" where the model class
    supports it, else "eager": BLOOM, Gemma-2) and, for a mixture of experts,
    ``capacity_factor`` (default 1: :mod:`autoplan.models.moe`)."""
    attn = overrides.pop("attn_implementation", None)
    capacity_factor = overrides.pop("capacity_factor", None)
    explicit_task = overrides.pop("task", None)
    if attn is not None and attn not in _ATTN:
        raise ConfigError(f"attn_implementation must be one of {list(_ATTN)}, got {attn!r}",
                          field="model.config.attn_implementation")
    path = Path(name_or_path)
    source = "<hf>"
    architectures = None
    if path.suffix == ".json" or path.is_dir():
        file = path / "config.json" if path.is_dir() else path
        try:
            base = json.loads(read_text(file))
        except (OSError, ValueError) as exc:      # unreadable, not UTF-8, not JSON
            raise ConfigError(f"cannot read a config: {' '.join(str(exc).split())}"[:300],
                              source=str(file)) from None
        except RecursionError:                    # nested deeper than the parser recurses
            raise ConfigError(f"cannot read a config: nested deeper than {MAX_NESTING} "
                              "levels", source=str(file)) from None
        check_nesting(base, str(file))
        if not isinstance(base, dict):
            raise ConfigError(f"must be a JSON object, got {type(base).__name__}",
                              source=str(file))
        if "model_type" not in base:
            raise ConfigError("missing", source=str(file), field="model_type")
        model_type, source = base["model_type"], str(file)
        architectures = base.get("architectures")
        values = {k: v for k, v in base.items() if k not in _DROP_KEYS}
    else:
        model_type, values = name_or_path, {}
    check_nesting(overrides, source)
    default = _config(model_type, {}, source=source)
    top, sub_key, routed = _split_overrides(model_type, default, overrides, source)
    layers = _layer_count(top, model_type)
    # the config the overrides change: the type's default, or the file's
    base = default if not values or not (routed or layers) else \
        _config(model_type, values, source=source)
    merged = {**values, **top}
    if routed:                      # a composite config: the text model's sizes
        inner = merged.get(sub_key)
        if not isinstance(inner, dict):
            inner = sub_defaults(getattr(base, sub_key),
                                 relayered="num_hidden_layers" in routed)
        merged[sub_key] = {**inner, **routed}
    if layers is not None:
        merged = _with_layer_count(model_type, base, merged, layers, set(top), set(values),
                                   source)
    config = _config(model_type, merged, source=source)
    task = _task_of(config, architectures, explicit_task, source)
    _check_config(config, task, source)
    diff = {k: v for k, v in config.to_diff_dict().items() if k not in _DROP_KEYS}
    if task == "seq2seq-lm" and getattr(config, "decoder_start_token_id", None) is None:
        # T5 starts decoding from the pad token (its checkpoints set
        # decoder_start_token_id = pad_token_id = 0); the default config leaves it unset
        diff["decoder_start_token_id"] = config.pad_token_id or 0
    supports_sdpa = bool(getattr(_model_class(config, task), "_supports_sdpa", False))
    if attn is None:
        attn = "sdpa" if supports_sdpa else "eager"
    elif attn == "sdpa" and not supports_sdpa:
        raise ConfigError(f"{model_type}'s transformers class does not support "
                          "attn_implementation='sdpa'; use 'eager'",
                          source=source, field="model.config.attn_implementation")
    extra = {}
    if capacity_factor is not None:
        extra["capacity_factor"] = _capacity_factor(capacity_factor, config)
    return ModelSpec("hf", model_type, {**diff, "attn_implementation": attn, "task": task,
                                        **extra})


def _with_layer_count(model_type: str, base, merged: dict[str, Any], layers: int,
                      given: set[str], from_file: set[str], source: str) -> dict[str, Any]:
    """``merged`` for a new layer count: the per-layer lists of ``base`` that neither the
    overrides (``given``) nor the file (``from_file``) set are first left for transformers
    to derive again from the new values (Qwen2's ``layer_types`` from ``use_sliding_window``
    and ``max_window_layers``: cycling the default's pattern would keep every layer full
    whatever they say); where it does not derive them at the new count, or refuses, they
    are cycled as :func:`~autoplan.models.hf_fields.follow_layer_count` does, as are the
    file's lists."""
    old = config_value(base, "num_hidden_layers")
    derived = {k for k, v in base.to_dict().items() if isinstance(v, list) and
               len(v) == old} - given - from_file if isinstance(old, int) else set()
    if derived:
        attempt = follow_layer_count(base, merged, layers, given | derived)
        try:
            built = _config(model_type, attempt, source=source).to_dict()
        except ConfigError:
            built = None
        if built is not None and all(isinstance(built.get(k), list) and
                                     len(built[k]) == layers for k in derived):
            return attempt
    return follow_layer_count(base, merged, layers, given)


def _capacity_factor(value: Any, config) -> float:
    """``capacity_factor`` of a mixture-of-experts spec: a positive finite number."""
    from autoplan.models.moe import hf_routing

    if hf_routing(text_config(config)) is None:
        raise ConfigError(f"{config.model_type} is not a mixture of experts",
                          field="model.config.capacity_factor")
    if isinstance(value, bool) or not isinstance(value, (int, float)) \
            or not math.isfinite(value) or value <= 0:
        raise ConfigError(f"must be a positive number, got {value!r}",
                          field="model.config.capacity_factor")
    return float(value)


def task_of(spec: ModelSpec) -> str:
    """The spec's task (a plan written before tasks existed is a causal LM)."""
    return spec.config.get("task", "causal-lm")


def hf_config(spec: ModelSpec):
    """The transformers config object of ``spec``."""
    values = {k: v for k, v in spec.config.items() if k not in _SPEC_ONLY}
    config = _config(spec.name, values)
    inner = text_config(config)
    if task_of(spec) == "causal-lm":
        config.loss_type = inner.loss_type = "ForCausalLM"
    factor = spec.config.get("capacity_factor")
    # MoE: routing with static shapes (models/moe.py), in the language model's config
    use_capacity_experts(inner, 1.0 if factor is None else _capacity_factor(factor, inner))
    return config


class _LossForward:
    """Mixin: ``forward(input_ids, labels)`` returns the language-model loss (causal,
    masked or encoder-decoder: transformers shifts the labels where the task needs it)."""

    _takes_use_cache = True           # set per class by build(): BERT's forward has no cache

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        kwargs = {"use_cache": False} if self._takes_use_cache else {}
        return super().forward(input_ids=input_ids, labels=labels, **kwargs).loss


class _ImageLossForward:
    """Mixin: ``forward(pixel_values, labels)`` returns the classification loss."""

    def forward(self, pixel_values: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return super().forward(pixel_values=pixel_values, labels=labels).loss


def build(spec: ModelSpec) -> nn.Module:
    """The transformers model of ``spec``'s task (on the current default device), whose
    ``forward(*example_batch(...))`` returns the loss."""
    import inspect

    config = hf_config(spec)
    task = task_of(spec)
    try:
        cls = _model_class(config, task)
    except KeyError as exc:
        raise ConfigError(f"model_type {spec.name!r} has no {task} class in transformers",
                          field="model.name") from exc
    own = getattr(cls, "config_class", None)
    if isinstance(own, type) and not isinstance(config, own) and \
            isinstance(text_config(config), own):
        # a composite type whose causal-LM class is its language model alone (Llama 4's
        # Llama4ForCausalLM takes Llama4TextConfig): build that from the text config
        config = text_config(config)
    for part in {id(c): c for c in (config, text_config(config))}.values():
        if getattr(part, "use_cache", None):
            # training keeps no KV cache; a forward that takes use_cache only through
            # **kwargs (Granite MoE hybrid) reads the config's default
            part.use_cache = False
    mixin = _ImageLossForward if task == "image-classification" else _LossForward
    body = {} if mixin is _ImageLossForward else {
        "_takes_use_cache": "use_cache" in inspect.signature(cls.forward).parameters}
    trainable = type(f"{cls.__name__}ForTraining", (mixin, cls), body)
    # transformers' own model code may fail on a config it ships (a default config whose
    # sub-configs lack a field the model reads): one line naming the class, not a traceback
    model = guarded(f"building transformers' {cls.__name__} from the {spec.name} config",
                    trainable._from_config, config, field="model.config",
                    attn_implementation=spec.config.get("attn_implementation", "sdpa"))
    model.train()
    return model


def max_seq_len(spec: ModelSpec) -> int | None:
    """The longest sequence the model's positions allow (None: no limit in the config —
    ALiBi, relative position buckets — or no sequence at all).

    RoBERTa and its kin number positions from ``pad_token_id + 1`` into a learned table of
    ``max_position_embeddings`` rows (transformers' ``create_position_ids_from_input_ids``:
    "position numbers begin at padding_idx+1"), so they take ``max_position_embeddings -
    pad_token_id - 1`` tokens: 514 - 2 = 512 for RoBERTa-base."""
    if task_of(spec) == "image-classification":
        return None
    config = text_config(hf_config(spec))
    for key in ("max_position_embeddings", "n_positions", "max_sequence_length"):
        value = config_value(config, key)
        if isinstance(value, int) and value > 0:
            pad = config_value(config, "pad_token_id")
            if key == "max_position_embeddings" and isinstance(pad, int) and pad >= 0 \
                    and _positions_after_padding(config.model_type):
                return max(value - pad - 1, 0) or None
            return value
    return None


#: a learned position table of max_position_embeddings rows with a padding row
_PADDED_POSITIONS = re.compile(r"position_embeddings\s*=\s*nn\.Embedding\(\s*"
                               r"config\.max_position_embeddings\s*,[^)]*padding_idx", re.S)


@functools.lru_cache(maxsize=None)
def _positions_after_padding(model_type: str) -> bool:
    """Does ``model_type``'s modelling code offset positions past the padding index into a
    learned table (``max_seq_len``'s docstring)? Read from its source, as
    :func:`_modeling_reads` does; False when the source cannot be read."""
    import importlib
    import inspect

    from transformers.models.auto.configuration_auto import model_type_to_module_name

    name = model_type_to_module_name(model_type)
    try:
        module = importlib.import_module(f"transformers.models.{name}.modeling_{name}")
        source = inspect.getsource(module)
    except (ImportError, OSError, TypeError):
        return False
    return "create_position_ids_from_input_ids" in source and \
        _PADDED_POSITIONS.search(source) is not None


def default_seq_len(spec: ModelSpec) -> int | None:
    """:data:`TRAIN_SEQ_LEN` capped by :func:`max_seq_len` (T5, whose relative positions
    have no maximum, trains at 512: Raffel et al. 2020, 3.1.2); None for an image model."""
    if task_of(spec) == "image-classification":
        return None
    if spec.name in ("t5", "mt5", "umt5", "longt5"):
        return 512
    most = max_seq_len(spec)
    return min(TRAIN_SEQ_LEN, most) if most else TRAIN_SEQ_LEN


def seq_len_note(spec: ModelSpec, seq_len: int | None) -> str:
    """One line saying which sequence length was chosen and why (printed by the CLI)."""
    most = max_seq_len(spec)
    if seq_len is None:
        return f"{spec.name}: image model, no sequence length"
    limit = f"the model allows {most:,}" if most else "the config sets no maximum"
    return (f"{spec.name}: sequence length {seq_len:,} (a training default; {limit}; "
            "--seq-len to change)")


def example_batch(spec: ModelSpec, batch_size: int, seq_len: int | None,
                  device: torch.device, *, seed: int = 0) -> tuple:
    """The task's training batch: ``(input_ids, labels)``, both (batch_size, seq_len) and
    equal (transformers shifts them where the task needs it), or for an image model
    ``(pixel_values, labels)``: (batch_size, channels, size, size) float32 and
    (batch_size,) class ids (cast the pixels to the compute dtype under mixed precision)."""
    config = hf_config(spec)
    gen = torch.Generator().manual_seed(seed)
    if task_of(spec) == "image-classification":
        if seq_len is not None:
            raise ConfigError(f"{spec.name} is an image model: it has no sequence length "
                              "(set image_size instead)", field="batch.seq_len")
        size, channels = int(config.image_size), int(config.num_channels)
        shape = (batch_size, channels, size, size)
        if device.type == "meta":
            return (torch.empty(shape, device=device),
                    torch.empty(batch_size, dtype=torch.long, device=device))
        return (torch.randn(shape, generator=gen).to(device),
                torch.randint(0, config.num_labels, (batch_size,), generator=gen).to(device))
    s = seq_len or default_seq_len(spec)
    most = max_seq_len(spec)
    if most is not None and s > most:
        raise ConfigError(f"sequence length {s} exceeds the model's maximum of {most} "
                          "positions (max_position_embeddings)", field="batch.seq_len")
    if device.type == "meta":
        ids = torch.empty(batch_size, s, dtype=torch.long, device=device)
    else:
        vocab = int(text_config(config).vocab_size)
        ids = torch.randint(0, vocab, (batch_size, s), generator=gen).to(device)
    return ids, ids
