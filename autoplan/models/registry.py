"""Model specs: how a plan names a model so the planner and the engine build the same one.

A :class:`ModelSpec` is plain data (it goes into the plan JSON):

* ``source="builtin"``: a model shipped here (``gpt``, ``mlp``, ``wide-resnet``) or a named
  preset of one (``gpt-1.7b``, ``llama3-8b``, ...); ``config`` holds the constructor kwargs.
* ``source="hf"``: a Hugging Face transformers causal LM built offline from its config;
  ``config`` is the config dict (``name`` the model type, e.g. ``gpt2``).
* ``source="import"``: a user's ``package.module:factory`` returning an ``nn.Module``;
  ``config`` holds the factory's kwargs.
* ``source="module"``: an ``nn.Module`` instance the user passed in (:func:`module_spec`);
  ``name`` is its class, ``config`` its fingerprint and example input shapes. The live
  module travels in the :class:`ModuleSpec` (never in the plan file): a plan read back from
  a file describes the module but cannot rebuild it.

Every model built through :func:`build_model` has ``forward(*batch) -> loss`` when given the
training batch from :func:`example_batch`, so tracing and training see the same graph.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable

if TYPE_CHECKING:          # torch is imported where a model is built, not to resolve a name
    import torch
    import torch.nn as nn

from autoplan.errors import ConfigError, UnknownNameError


#: Where a model spec's model comes from (module docstring).
SOURCES = ("builtin", "hf", "import", "module")

#: Bounds of a model config's integer fields (sizes, counts): far beyond any real model,
#: small enough that its weights' element counts stay within int64. Layer counts are bounded
#: lower (4x DeepNet's 1,000 layers): tracing and planning walk every layer (gpt-tiny with
#: 1,024 layers takes about a minute to estimate on 2 cores).
MAX_SIZE = 2 ** 24
MAX_LAYERS = 2 ** 12


def config_from_dict(cls: type, d: dict, label: str) -> Any:
    """The built-in config dataclass ``cls`` from ``d``; a key it lacks is a ConfigError
    naming ``model.<key>`` and listing the known ones (``label``: the model family's name)."""
    from dataclasses import fields as dc_fields

    known = {f.name for f in dc_fields(cls)}
    unknown = sorted(set(d) - known)
    if unknown:
        raise ConfigError(f"unknown {label} config key(s) {unknown}; known: {sorted(known)}",
                          field=f"model.{unknown[0]}")
    return cls(**d)


def check_config_types(cfg: Any, *, bounds: dict[str, tuple[int, int]] | None = None) -> None:
    """Check a built-in config dataclass's field values against their annotations, so a
    wrong-typed value (``--set layers='"2"'``, ``hidden=1e3``, ``seq_len=null``) is a
    ConfigError naming ``model.<field>``, not a TypeError deep in the model or the tracer.

    ``int`` fields: integers (not booleans) in ``bounds[name]`` (default ``[1, MAX_SIZE]``),
    ``int | None`` the same or null; ``float``: finite numbers; ``bool``: booleans;
    ``Literal[...]``: strings (the config checks which).
    """
    import math
    from dataclasses import fields as dc_fields

    bounds = bounds or {}
    for f in dc_fields(cfg):
        value, kind, where = getattr(cfg, f.name), str(f.type), f"model.{f.name}"
        optional = "None" in kind
        if value is None and optional:
            continue
        shown = repr(value)
        shown = shown if len(shown) <= 80 else shown[:77] + "..."
        if kind.startswith("int"):
            if isinstance(value, bool) or not isinstance(value, int):
                raise ConfigError(f"must be an integer{' or null' if optional else ''}, got "
                                  f"{shown}", field=where)
            low, high = bounds.get(f.name, (1, MAX_SIZE))
            if not low <= value <= high:
                raise ConfigError(f"must be an integer in [{low}, {high}], got {shown}",
                                  field=where)
        elif kind.startswith("float"):
            if (isinstance(value, bool) or not isinstance(value, (int, float))
                    or not math.isfinite(value)):
                raise ConfigError(f"must be a finite number, got {shown}", field=where)
        elif kind == "bool":
            if not isinstance(value, bool):
                raise ConfigError(f"must be true or false, got {shown}", field=where)
        elif kind.startswith("Literal"):
            if not isinstance(value, str):
                raise ConfigError(f"must be a string, got {shown}", field=where)


@dataclass(frozen=True)
class ModelSpec:
    source: str                    # "builtin" | "hf" | "import"
    name: str                      # builtin family ("gpt"), hf model_type, or "pkg.mod:fn"
    config: dict[str, Any] = field(default_factory=dict)
    #: Whether an ``import`` spec's code may run without the opt-in of :mod:`autoplan.trust`:
    #: True only when the user named it (:func:`resolve`) or a caller says so
    #: (``ModelSpec(..., trusted=True)``); a spec read from a file (:meth:`from_dict`) or
    #: rebuilt from one (``ModelSpec(**plan.model)``) is not. Not part of the spec's identity:
    #: neither compared, hashed nor written.
    trusted: bool = field(default=False, compare=False, repr=False)

    def to_dict(self) -> dict:
        return {"source": self.source, "name": self.name, "config": dict(self.config)}

    @classmethod
    def from_dict(cls, d: dict, *, source_file: str = "<plan>") -> "ModelSpec":
        """Read :meth:`to_dict`'s output; a wrong shape or type is a ConfigError naming
        ``source_file`` and the field (``model.<key>``)."""
        if not isinstance(d, dict):
            raise ConfigError(f"must be an object, got {type(d).__name__}", source=source_file,
                              field="model")
        for key in ("source", "name"):
            if key not in d:
                raise ConfigError("missing", source=source_file, field=f"model.{key}")
        unknown = set(d) - {"source", "name", "config"}
        if unknown:
            raise ConfigError(f"unknown key(s) {sorted(map(str, unknown))}",
                              source=source_file, field=f"model.{sorted(map(str, unknown))[0]}")
        if d["source"] not in SOURCES:
            raise ConfigError(f"must be one of {', '.join(SOURCES)}, got {d['source']!r}"[:200],
                              source=source_file, field="model.source")
        if not isinstance(d["name"], str) or not d["name"].strip():
            raise ConfigError(f"must be a non-empty string, got {d['name']!r}"[:200],
                              source=source_file, field="model.name")
        config = d.get("config")
        if config is None:
            config = {}
        if not isinstance(config, dict) or not all(isinstance(k, str) for k in config):
            raise ConfigError(f"must be an object with string keys, got "
                              f"{type(config).__name__}", source=source_file,
                              field="model.config")
        return cls(source=d["source"], name=d["name"], config=dict(config), trusted=False)

    def fingerprint(self) -> str:
        """sha256 of the architecture description (source, name, config), 16 hex digits."""
        blob = json.dumps(self.to_dict(), sort_keys=True, default=str).encode()
        return hashlib.sha256(blob).hexdigest()[:16]


@dataclass(frozen=True)
class BuiltinFamily:
    """A model family shipped with autoplan."""

    build: Callable[[dict], nn.Module]                       # config -> module
    batch: Callable[..., tuple]    # (config, batch_size, seq_len, device, seed=0) -> forward args
    seq_len: Callable[[dict], int | None]                    # the family's sequence length


_FAMILIES: dict[str, BuiltinFamily] = {}
_PRESETS: dict[str, tuple[str, dict]] = {}


def register_family(name: str, family: BuiltinFamily) -> None:
    _FAMILIES[name] = family


def register_preset(name: str, family: str, config: dict) -> None:
    """``family``: a built-in family, or ``hf:<model_type>`` for a Hugging Face
    architecture (``config`` its config values)."""
    _PRESETS[name] = (family, dict(config))


def builtin_names() -> list[str]:
    _load_builtins()
    return sorted(set(_FAMILIES) | set(_PRESETS))


def preset_family(name: str) -> str | None:
    """The family of preset ``name`` (a built-in family or ``hf:<model_type>``), None for a
    name that is not a preset."""
    _load_builtins()
    hit = _PRESETS.get(name)
    return hit[0] if hit else None


def resolve(name: str, /, **overrides: Any) -> ModelSpec:
    """Turn what a user typed into a spec: a builtin family or preset name, ``hf:<type>``,
    ``hf:<path/to/config.json>``, or ``import:<pkg.mod:factory>``. ``overrides`` update the
    config (e.g. ``layers=4``; ``name`` is positional-only, so an ``import:`` factory may
    have a parameter called ``name``)."""
    _load_builtins()
    if name.startswith("hf:"):
        from autoplan.models import hf

        return hf.resolve(name[3:], **overrides)
    if name.startswith("import:") or (":" in name and "." in name.split(":")[0]):
        target = name.removeprefix("import:")
        return ModelSpec("import", target, dict(overrides), trusted=True)
    if name in _PRESETS:
        family, config = _PRESETS[name]
        if family.startswith("hf:"):          # a preset of a Hugging Face architecture
            from autoplan.models import hf

            return hf.resolve(family[3:], **{**config, **overrides})
        return ModelSpec("builtin", family, {**config, **overrides})
    if name in _FAMILIES:
        return ModelSpec("builtin", name, dict(overrides))
    if name.endswith(".json") or os.path.isdir(name):
        # a path given bare: say how to name a Hugging Face config rather than list presets
        raise ConfigError(f"unknown model '{name}': a Hugging Face config file or folder is "
                          f"given as hf:{name}", field="model.name")
    raise UnknownNameError("model", name, builtin_names() + ["hf:<model_type or config.json>",
                                                            "import:<pkg.module:factory>"])


def source_of(name: str) -> str:
    """Where ``name`` (as typed) comes from: ``"hf"``, ``"import"`` or ``"builtin"`` (a
    preset of a Hugging Face architecture is ``"hf"``), without resolving it."""
    _load_builtins()
    if name.startswith("hf:") or (name in _PRESETS and _PRESETS[name][0].startswith("hf:")):
        return "hf"
    if name.startswith("import:") or (":" in name and "." in name.split(":")[0]):
        return "import"
    return "builtin"


def build_model(spec: ModelSpec, *, device: str | torch.device = "meta",
                dtype: torch.dtype | None = None) -> nn.Module:
    """Build the model on ``device`` (meta by default: no weight memory)."""
    import torch

    _load_builtins()
    with torch.device(device):
        if spec.source == "builtin":
            family = _family(spec.name)
            model = family.build(spec.config)
        elif spec.source == "hf":
            from autoplan.models import hf

            model = hf.build(spec)
        elif spec.source == "import":
            model = _build_import(spec)
        elif spec.source == "module":
            model = _module_copy(spec, torch.device(device))
        else:
            raise ConfigError(f"unknown model source {spec.source!r}; use builtin, hf or import",
                              field="model.source")
    # legacy constructors (``torch.FloatTensor(n, m)``: XLNet's attention weights) ignore the
    # default device and allocate on the CPU: move such strays where the rest of the model is
    target = torch.device(device).type
    if any(t.device.type != target for t in (*model.parameters(), *model.buffers())):
        model = model.to(device)
    if dtype is not None:
        model = model.to(dtype=dtype)
    return model


def example_batch(spec: ModelSpec, batch_size: int, seq_len: int | None = None,
                  device: str | torch.device = "meta", *, seed: int = 0) -> tuple:
    """Forward args of one training micro-batch (inputs and targets): ``model(*batch)``
    returns the scalar loss. Random but deterministic for a given ``seed``."""
    import torch

    _load_builtins()
    device = torch.device(device)
    if spec.source == "builtin":
        return _family(spec.name).batch(spec.config, batch_size, seq_len, device, seed=seed)
    if spec.source == "hf":
        from autoplan.models import hf

        return hf.example_batch(spec, batch_size, seq_len, device, seed=seed)
    if spec.source == "module":
        return _module_batch(spec, batch_size, device, seed)
    module = build_model(spec, device="meta")
    make = getattr(module, "example_batch", None)
    if make is None:
        raise ConfigError(f"model {spec.name} has no example_batch(batch_size, seq_len, device) "
                          "method; autoplan needs one to know the input shapes",
                          field="model.name")
    return make(batch_size, seq_len, device)


def default_seq_len(spec: ModelSpec) -> int | None:
    _load_builtins()
    if spec.source == "builtin":
        return _family(spec.name).seq_len(spec.config)
    if spec.source == "hf":
        from autoplan.models import hf

        return hf.default_seq_len(spec)
    return spec.config.get("seq_len")


@dataclass(frozen=True)
class ModuleSpec(ModelSpec):
    """A :class:`ModelSpec` of ``source="module"`` carrying the user's live module and
    example inputs (neither is compared, hashed or written to a plan)."""

    module: nn.Module | None = field(default=None, compare=False, repr=False)
    inputs: tuple = field(default=(), compare=False, repr=False)


def module_spec(module: nn.Module, example_inputs: Any) -> ModuleSpec:
    """The spec of an in-memory ``module`` (on any device, meta included) whose
    ``module(*example_inputs)`` returns the scalar training loss. The inputs' dim 0 is the
    batch: :func:`example_batch` resizes every input whose dim 0 equals the first input's to
    the batch asked for (batch-first inputs, as :mod:`autoplan.cost.batch_scale` assumes)."""
    import torch
    import torch.nn as nn

    from autoplan.trace.tracer import module_fingerprint

    if not isinstance(module, nn.Module):
        raise ConfigError(f"must be an nn.Module, got {type(module).__name__}", field="model")
    inputs = example_inputs if isinstance(example_inputs, (tuple, list)) else (example_inputs,)
    if not inputs or not all(isinstance(t, torch.Tensor) and t.dim() >= 1 for t in inputs):
        raise ConfigError("example_inputs must be a tensor or a tuple of tensors with a batch "
                          "dim (model(*example_inputs) returns the loss)",
                          field="example_inputs")
    cls = type(module)
    shapes = [[list(t.shape), str(t.dtype).removeprefix("torch.")] for t in inputs]
    config: dict[str, Any] = {"fingerprint": module_fingerprint(module), "inputs": shapes}
    first = inputs[0]
    if first.dim() == 2 and not first.is_floating_point():
        config["seq_len"] = int(first.shape[1])              # (batch, tokens)
    return ModuleSpec("module", f"{cls.__module__}.{cls.__qualname__}", config,
                      module=module, inputs=tuple(inputs))


def _module_copy(spec: ModelSpec, device: torch.device) -> nn.Module:
    """A copy of the spec's live module: on the meta device its parameters and buffers are
    new empty meta tensors (no weight is copied; the user's module is never changed)."""
    import torch
    import torch.nn as nn

    import copy

    module = getattr(spec, "module", None)
    if module is None:
        raise ConfigError(f"the plan is of an in-memory module ({spec.name}); pass that "
                          "module itself (autoplan.optimize / autoplan.parallelize), it cannot "
                          "be rebuilt from a plan file", field="model.source")
    if device.type != "meta":
        return copy.deepcopy(module).to(device)
    memo: dict[int, Any] = {}
    for p in module.parameters():
        memo[id(p)] = nn.Parameter(torch.empty_like(p, device="meta"),
                                   requires_grad=p.requires_grad)
    for b in module.buffers():
        memo[id(b)] = torch.empty_like(b, device="meta")
    return copy.deepcopy(module, memo)


def _module_batch(spec: ModelSpec, batch_size: int, device: torch.device,
                  seed: int) -> tuple:
    """The module's example inputs with dim 0 resized to ``batch_size`` (module_spec)."""
    import torch

    live = getattr(spec, "inputs", ())
    shapes = [(tuple(t.shape), t.dtype) for t in live] or [
        (tuple(shape), getattr(torch, dtype)) for shape, dtype in spec.config.get("inputs", [])]
    if not shapes:
        raise ConfigError("has no example inputs", field="model.config.inputs")
    b0 = shapes[0][0][0]
    gen = torch.Generator().manual_seed(seed)
    out = []
    for k, (shape, dtype) in enumerate(shapes):
        shape = (batch_size, *shape[1:]) if shape[0] == b0 else shape
        if device.type == "meta":
            out.append(torch.empty(shape, dtype=dtype, device=device))
        elif k < len(live) and tuple(live[k].shape) == shape:
            out.append(live[k].to(device))
        elif dtype.is_floating_point:
            out.append(torch.randn(shape, generator=gen).to(device=device, dtype=dtype))
        else:       # integer inputs (tokens, class ids): below the example's largest value
            high = int(live[k].max()) + 1 if k < len(live) and live[k].device.type != "meta" \
                else 2
            out.append(torch.randint(0, max(high, 1), shape, generator=gen).to(device))
    return tuple(out)


def _family(name: str) -> BuiltinFamily:
    if name not in _FAMILIES:
        raise UnknownNameError("model family", name, list(_FAMILIES))
    return _FAMILIES[name]


def _build_import(spec: ModelSpec) -> nn.Module:
    """Import ``package.module`` and call ``factory(**config)`` — only for a spec the user
    named, or with the opt-in of :mod:`autoplan.trust` (the gate every re-build passes).
    Whatever the import or the factory raises (``sys.exit`` included) is a one-line
    ConfigError naming the import path."""
    import torch.nn as nn

    import importlib

    from autoplan.trust import trust_enabled, untrusted_code_message

    if not spec.trusted and not trust_enabled():
        raise ConfigError(untrusted_code_message(spec.name), field="model.name")
    mod_name, _, attr = spec.name.partition(":")
    if not attr or not all(p.isidentifier() for p in mod_name.split(".")) \
            or not all(p.isidentifier() for p in attr.split(".")):
        raise ConfigError(f"import path {spec.name!r} must look like 'package.module:factory'"
                          [:300], field="model.name")
    # as ``python -m`` and ``torchrun`` do, a module in the current directory resolves too
    # (the ``autoplan`` console script does not put it on sys.path by itself)
    import os
    import sys

    if os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.append(os.getcwd())
    try:
        module = importlib.import_module(mod_name)
    except ModuleNotFoundError as exc:
        raise ConfigError(f"cannot import {mod_name!r}: {exc}"[:400], field="model.name") \
            from None
    except BaseException as exc:  # noqa: BLE001 -- the module's own error, or sys.exit
        if isinstance(exc, KeyboardInterrupt):
            raise
        guarded(f"importing {mod_name!r}", _reraise, exc)
    factory = module
    for part in attr.split("."):
        factory = getattr(factory, part, None)
    if factory is None or not callable(factory):
        raise ConfigError(f"module {mod_name!r} has no attribute {attr!r} to call",
                          field="model.name")
    model = guarded(f"calling {spec.name}", factory, **spec.config)
    if not isinstance(model, nn.Module):
        raise ConfigError(f"{spec.name} returned {type(model).__name__}, not an nn.Module",
                          field="model.name")
    return model


def _reraise(exc: BaseException) -> None:
    raise exc


def guarded(what: str, fn: Callable, *args: Any, field: str = "model.name",
            **kwargs: Any) -> Any:
    """``fn(*args, **kwargs)``; an exception or ``sys.exit`` in code autoplan does not own
    (a user's module, a library's model class) becomes a one-line ConfigError saying what
    raised, naming ``field``."""
    try:
        return fn(*args, **kwargs)
    except SystemExit as exc:
        raise ConfigError(f"{what} called sys.exit({exc.code!r}); a model module must not "
                          "exit", field=field) from None
    except ImportError as exc:
        raise ConfigError(f"{what} failed: {' '.join(str(exc).split())}"[:400],
                          field=field) from None
    except Exception as exc:  # noqa: BLE001 -- any error of the user's module, one line
        detail = " ".join(str(exc).split())
        raise ConfigError(f"{what} raised {type(exc).__name__}"
                          + (f": {detail}" if detail else "")[:400], field=field) from None


# ---- built-in families ----------------------------------------------------------------------

def _gpt_build(config: dict) -> nn.Module:
    from autoplan.models.gpt import GPT
    from autoplan.models.gpt_config import GPTConfig

    return GPT(GPTConfig.from_dict(config))


def _gpt_batch(config: dict, batch_size: int, seq_len: int | None, device: torch.device,
               seed: int = 0) -> tuple:
    from autoplan.models.gpt_config import GPTConfig

    cfg = GPTConfig.from_dict(config)
    s = seq_len or cfg.seq_len
    if s > cfg.seq_len:
        raise ConfigError(f"sequence length {s} exceeds the model's seq_len {cfg.seq_len}",
                          field="batch.seq_len")
    return _token_batch(cfg.vocab_size, batch_size, s, device, seed)


def _token_batch(vocab: int, batch_size: int, seq_len: int, device: torch.device,
                 seed: int = 0) -> tuple:
    import torch

    if device.type == "meta":
        tokens = torch.empty(batch_size, seq_len + 1, dtype=torch.long, device=device)
    else:
        gen = torch.Generator().manual_seed(seed)
        tokens = torch.randint(0, vocab, (batch_size, seq_len + 1), generator=gen).to(device)
    return tokens[:, :-1], tokens[:, 1:]


def _gpt_seq_len(config: dict) -> int:
    from autoplan.models.gpt_config import GPTConfig

    return GPTConfig.from_dict(config).seq_len


_LOADED = False


def _load_builtins() -> None:
    """Register the shipped families and presets (idempotent, no import-time side effects
    beyond this module's own tables)."""
    global _LOADED
    if _LOADED:
        return
    _LOADED = True
    register_family("gpt", BuiltinFamily(_gpt_build, _gpt_batch, _gpt_seq_len))
    for family, module in (("mlp", "mlp"), ("wide-resnet", "wide_resnet")):
        register_family(family, _lazy_family(f"autoplan.models.{module}"))
    from autoplan.models import presets

    presets.register_all()


def _lazy_family(module: str) -> BuiltinFamily:
    """The family whose ``build`` / ``example_batch`` / ``seq_len`` live in ``module``,
    imported (with torch) when first called, not to resolve a name."""
    import importlib

    def call(attr: str) -> Callable:
        return lambda *args, **kwargs: getattr(importlib.import_module(module), attr)(
            *args, **kwargs)

    return BuiltinFamily(call("build"), call("example_batch"), call("seq_len"))
