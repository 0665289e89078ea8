"""What a prediction assumed about the runtime's kernels: the pricing a plan records.

A plan says what runs where (meshes, degrees, placements, stages). Its predicted step time
also depends on *how* the runtime that executes it runs some of that work -- choices the plan
does not make and autoplan cannot see, so the user states them when planning and the plan
records them under ``pricing`` (:class:`Pricing`):

* ``fused`` -- the runtime fuses element-wise kernels (torch.compile, Megatron-LM's fused
  kernels); False: eager PyTorch (``--eager``, ``prepare(fused=False)``;
  :mod:`autoplan.cost.compute`, ``fusion``);
* ``fused_loss`` -- the loss's backward fused as well; None: as ``fused``;
* ``float8_recipe`` -- whose float8 casts a ``mixed-fp8`` plan pays: torchao's or Transformer
  Engine's (:mod:`autoplan.cost.float8`);
* ``attention_kernel`` -- which fused attention runs: FlashAttention-2 (``flash2``) or cuDNN's
  (``cudnn``, what Transformer Engine runs on Hopper; :mod:`autoplan.cost.kernel_shape`);
* ``cp_comm`` -- how context-parallel ranks exchange keys and values: one all-gather per layer
  (``all-gather``: autoplan's engine, torchtitan's ``allgather``) or blocks passed around a
  ring (``ring``: Transformer Engine's ``p2p``, torchtitan's ``alltoall``;
  :mod:`autoplan.cost.parallel_dims`).

Recording them makes a prediction reproducible and checkable: ``autoplan show`` states them,
and the exports set the runtime's own switches to match (Megatron-LM ``--attention-backend``
and ``--cp-comm-type``, torchtitan ``context_parallel_rotate_method``) instead of leaving the
runtime's defaults to differ silently from what was priced. A plan written before this field
existed has ``pricing`` null: unknown, and the exports say so.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from typing import Any

from autoplan import plan_fields as pf
from autoplan.errors import PlanError, one_of
from autoplan.precision import FLOAT8_RECIPES

#: Fused attention kernels autoplan can price (:mod:`autoplan.cost.kernel_shape`).
ATTENTION_KERNELS = ("flash2", "cudnn")
#: How context-parallel ranks exchange keys and values (:mod:`autoplan.cost.parallel_dims`).
CP_COMMS = ("all-gather", "ring")

_CHOICES = {"float8_recipe": (FLOAT8_RECIPES, "float8 recipe"),
            "attention_kernel": (ATTENTION_KERNELS, "attention kernel"),
            "cp_comm": (CP_COMMS, "context-parallel exchange")}
_KERNEL_NAMES = {"flash2": "FlashAttention-2", "cudnn": "cuDNN fused attention"}


@dataclass(frozen=True)
class Pricing:
    """The runtime assumptions a prediction was priced under (module docstring)."""

    fused: bool = True
    fused_loss: bool | None = None
    float8_recipe: str = "torchao"
    attention_kernel: str = "flash2"
    cp_comm: str = "all-gather"

    def __post_init__(self) -> None:
        if not isinstance(self.fused, bool):
            raise ValueError(f"must be True or False, got {self.fused!r}"[:200])
        if self.fused_loss is not None and not isinstance(self.fused_loss, bool):
            raise ValueError(f"must be True, False or None, got {self.fused_loss!r}"[:200])
        for key, (choices, what) in _CHOICES.items():
            one_of(getattr(self, key), choices, what)

    @classmethod
    def first_error(cls, values: dict[str, Any]) -> tuple[str, str] | None:
        """(field, message) of the first of ``values`` (field -> value) that is not a valid
        assumption, or None: what :func:`autoplan.api.prepare` and :meth:`from_dict`
        report, naming the field."""
        for key, value in values.items():
            try:
                cls(**{key: value})
            except ValueError as exc:
                return key, str(exc)
        return None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, value: Any, where: str = "pricing") -> "Pricing":
        """Read :meth:`to_dict`'s output; a :class:`PlanError` naming the field otherwise."""
        d = pf.as_object(value, where)
        known = {f.name for f in fields(cls)}
        for key in d:
            if key not in known:
                raise PlanError(f"field '{where}.{key}': unknown key; known: "
                                f"{', '.join(sorted(known))}")
        bad = cls.first_error(d)
        if bad is not None:
            raise PlanError(f"field '{where}.{bad[0]}': {bad[1]}")
        return cls(**d)

    def describe(self, *, cp: bool = True, float8: bool = True) -> str:
        """One line for people: ``fused element-wise kernels, FlashAttention-2, ...``; the
        context-parallel exchange only where ``cp`` and the float8 recipe where ``float8``
        (the plan uses them)."""
        parts = ["fused element-wise kernels" if self.fused else "eager (unfused) kernels"]
        if self.fused_loss is not None and self.fused_loss != self.fused:
            parts.append("fused loss" if self.fused_loss else "unfused loss")
        parts.append(_KERNEL_NAMES[self.attention_kernel])
        if cp:
            parts.append(f"context-parallel {self.cp_comm}")
        if float8:
            parts.append(f"{self.float8_recipe} float8 casts")
        return ", ".join(parts)


#: What each assumption's values mean, for notes.
_MEANING = {
    "fused": {True: "fused element-wise kernels", False: "eager (unfused) element-wise kernels"},
    "attention_kernel": {"flash2": "FlashAttention-2 (torch's scaled_dot_product_attention)",
                         "cudnn": "cuDNN's fused attention",
                         "matmul": "attention as explicit matmuls (its context-parallel ring)"},
    "cp_comm": {"all-gather": "an all-gather of keys and values per layer",
                "ring": "a context-parallel ring"},
    "float8_recipe": {"torchao": "torchao's float8 casts",
                      "transformer-engine": "Transformer Engine's float8 casts"},
}


def differences(pricing: Pricing, runtime: str, runs: dict[str, Any], *, cp: bool,
                float8: bool) -> list[str]:
    """Notes where ``runtime``, which runs ``runs`` (assumption -> what it runs), executes a
    plan otherwise than ``pricing`` priced it -- so the measured step will differ from the
    prediction. The context-parallel exchange counts only where the plan has ``cp`` > 1,
    the float8 recipe only where it runs ``float8`` GEMMs."""
    out = []
    for key, value in runs.items():
        priced = getattr(pricing, key)
        if priced == value or (key == "cp_comm" and not cp) or \
                (key == "float8_recipe" and not float8):
            continue
        meaning = _MEANING[key]
        out.append(f"the prediction assumed {meaning[priced]}; {runtime} runs {meaning[value]}")
    return out
