"""Built-in models and the spec that names a model in a plan (see registry)."""

from autoplan.models.registry import (ModelSpec, build_model, builtin_names, default_seq_len,
                                      example_batch, resolve)

__all__ = ["ModelSpec", "build_model", "builtin_names", "default_seq_len", "example_batch",
           "resolve"]
