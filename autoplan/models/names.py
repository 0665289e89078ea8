"""Names for model specs: which preset a spec is, and a short description of it.

A plan stores the model as a :class:`~autoplan.models.registry.ModelSpec` (family and
config), not the preset name the user typed; :func:`preset_of` finds it again so reports and
exports can say "llama3-8b" rather than "gpt".
"""

from __future__ import annotations

from autoplan.models.registry import ModelSpec, builtin_names, preset_family, resolve


def preset_of(spec: ModelSpec | dict) -> str | None:
    """The built-in preset whose spec equals ``spec`` (first by name), or None."""
    if isinstance(spec, dict):
        spec = ModelSpec.from_dict(spec)
    if spec.source != "builtin":
        return None
    for name in builtin_names():
        # a preset of another family (a Hugging Face one: resolving it imports
        # transformers, seconds) cannot equal the spec
        if preset_family(name) not in (None, spec.name):
            continue
        if name != spec.name and resolve(name) == spec:
            return name
    return None


def describe(spec: ModelSpec | dict) -> str:
    """'llama3-8b', 'gpt (layers=4, hidden=512, ...)', 'hf:gpt2' or 'import:pkg.mod:fn'."""
    if isinstance(spec, dict):
        spec = ModelSpec.from_dict(spec)
    if spec.source == "hf":
        return f"hf:{spec.name}"
    if spec.source == "import":
        return f"import:{spec.name}"
    preset = preset_of(spec)
    if preset:
        return preset
    keys = ("layers", "hidden", "heads")
    shown = ", ".join(f"{k}={spec.config[k]}" for k in keys if k in spec.config)
    return f"{spec.name} ({shown})" if shown else spec.name
