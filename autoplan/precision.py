"""Training precisions: the one table of what each name means. Torch-free.

A precision name (``--precision``, ``Problem.precision``, the cost model) stands for the
dtypes a step uses; a plan records the dtypes themselves (``plan.precision``: ``params``,
``compute``, ``reduce``). Everything translating between the two goes through here.

==============  ========  ========  ========  =========================  ===================
name            compute   params    reduce    bytes / parameter          loss scaling
                                              (weights, grads, Adam)
==============  ========  ========  ========  =========================  ===================
``mixed``       bfloat16  float32   float32   2 + 2 + 12 = 16            no
``mixed-fp8``   bfloat16  float32   float32   2 + 2 + 12 = 16            no (per-tensor scales)
``mixed-fp16``  float16   float32   float32   2 + 2 + 12 = 16            yes (dynamic)
``fp32``        float32   float32   float32   4 + 4 + 8 = 16             no
==============  ========  ========  ========  =========================  ===================

Mixed precision keeps a low-precision copy of the weights for compute, low-precision
gradients, and fp32 master weights plus Adam's two moments as optimizer state: 2 + 2 + 12
bytes per parameter (ZeRO, Rajbhandari et al. 2019, sec. 3.1, K = 12). fp16 needs dynamic loss
scaling (Micikevicius et al. 2018, "Mixed Precision Training") and is what devices without
bfloat16 (V100) train in.

``mixed-fp8`` is ``mixed`` with the GEMMs of the transformer blocks' linear layers in float8
(``matmul``: the plan records ``precision.matmul = float8``): each such layer casts its
input and weight (e4m3) and, in backward, its output gradient (e5m2) to float8 with one
dynamic per-tensor scale each (amax / the format's largest value) and multiplies them on
float8 tensor cores (Micikevicius et al. 2022, "FP8 Formats for Deep Learning", sec. 3-4;
torchao's float8 training, ``Float8Linear`` with tensorwise scaling, which autoplan's engine
runs; NVIDIA Transformer Engine's recipe is the same with delayed scaling). Everything else
-- attention, normalisation, the embedding and the output projection -- stays in bfloat16,
as do the weights, gradients and optimizer states, so the bytes per parameter are those of
``mixed``. It needs float8 tensor cores (Hopper and later); :mod:`autoplan.cost.compute`
prices it.
"""

from __future__ import annotations

from dataclasses import dataclass

from autoplan.errors import one_of

DTYPE_BYTES = {"float64": 8, "float32": 4, "bfloat16": 2, "float16": 2, "float8": 1}
#: The keys of a plan's ``precision`` field (:meth:`Precision.plan_dict`).
PLAN_KEYS = ("params", "compute", "reduce", "matmul")


@dataclass(frozen=True)
class Precision:
    name: str
    compute: str                   # dtype of matmuls and activations
    params: str = "float32"        # master weights
    reduce: str = "float32"        # gradient reduction
    loss_scaling: bool = False
    matmul: str | None = None      # dtype of the blocks' linear-layer GEMMs (None: compute)

    @property
    def compute_bytes(self) -> int:
        return DTYPE_BYTES[self.compute]

    @property
    def state_bytes(self) -> tuple[int, int, int]:
        """Bytes per parameter of (weights as computed with, gradients, optimizer states)."""
        if self.compute == "float32":
            return 4, 4, 8            # fp32 weights and grads, Adam's two moments
        return 2, 2, 12              # + fp32 master copy in the optimizer state

    @property
    def mixed(self) -> bool:
        return self.compute != "float32"

    def plan_dict(self) -> dict[str, str]:
        """What a plan's ``precision`` field records."""
        out = {"params": self.params, "compute": self.compute, "reduce": self.reduce}
        if self.matmul is not None:
            out["matmul"] = self.matmul
        return out


PRECISIONS = {p.name: p for p in (
    Precision("mixed", "bfloat16"),
    Precision("mixed-fp8", "bfloat16", matmul="float8"),
    Precision("mixed-fp16", "float16", loss_scaling=True),
    Precision("fp32", "float32"),
)}


def precision(name: str, where: str = "precision") -> Precision:
    """The precision called ``name``; ValueError naming ``where`` otherwise."""
    if not isinstance(name, str) or name not in PRECISIONS:
        raise ValueError(f"{where}: must be one of {', '.join(PRECISIONS)}, got {name!r}")
    return PRECISIONS[name]


def from_dtype(compute: str) -> Precision:
    """The precision whose compute dtype is ``compute`` ('torch.bfloat16' or 'bfloat16')."""
    dtype = str(compute).removeprefix("torch.")
    for p in PRECISIONS.values():
        if p.compute == dtype and p.matmul is None:
            return p
    raise ValueError(f"no training precision computes in {compute!r}")


def from_plan(d: dict) -> Precision:
    """A plan's ``precision`` dict -> its :class:`Precision` (by the compute dtype, and the
    linear layers' GEMM dtype where the plan names one)."""
    matmul = d.get("matmul")
    if matmul is None or matmul == d.get("compute"):
        return from_dtype(d.get("compute", "float32"))
    compute = str(d.get("compute", "float32")).removeprefix("torch.")
    for p in PRECISIONS.values():
        if p.compute == compute and p.matmul == matmul:
            return p
    raise ValueError(f"no training precision computes in {compute!r} with {matmul!r} GEMMs")


def float8_gemms(d: dict) -> bool:
    """Whether a plan's ``precision`` dict runs the blocks' linear layers in float8
    (``mixed-fp8``)."""
    return (d or {}).get("matmul") == "float8"


def priced_as(d: dict) -> Precision:
    """The precision a plan's ``precision`` dict is priced with: its own (every tabled
    precision, ``mixed-fp16`` included, is priced by the cost model)."""
    return from_plan(d)


def default_for(device_name: str, *, bf16: bool = True) -> Precision:
    """fp32 on CPU ranks; bf16 mixed precision on GPUs that have bf16, fp16 otherwise."""
    if device_name.lower().startswith("cpu"):
        return PRECISIONS["fp32"]
    return PRECISIONS["mixed" if bf16 else "mixed-fp16"]


#: Whose float8 casts a ``mixed-fp8`` step is priced with (:mod:`autoplan.cost.float8`):
#: torchao's tensorwise ``Float8Linear`` (autoplan's engine, torchtitan; the default) or NVIDIA
#: Transformer Engine's (Megatron-LM, NeMo). A pricing assumption about the runtime, like
#: ``fused``; the plan does not record it.
FLOAT8_RECIPES = ("torchao", "transformer-engine")


def check_float8_recipe(recipe: object) -> str:
    """``recipe`` if it is one of :data:`FLOAT8_RECIPES`; ValueError otherwise."""
    return one_of(recipe, FLOAT8_RECIPES, "float8 recipe")


#: torchao's float8 GEMMs (``torch._scaled_mm``) need both dimensions of a weight to be
#: multiples of 16; a linear layer that is not stays in the compute dtype.
FLOAT8_DIM_MULTIPLE = 16


def float8_layer(layer_name: str, weight_shape: tuple[int, ...]) -> bool:
    """Whether ``mixed-fp8`` runs a linear layer with this weight in float8: a 2-D weight
    with both dimensions multiples of :data:`FLOAT8_DIM_MULTIPLE`, in a transformer block
    (``layer_name`` a block's name, not ``<pre>`` / ``<post>``: the embedding and the output
    projection stay in the compute dtype, as torchtitan's float8 converter leaves ``output``
    and Transformer Engine its layers outside the blocks). One rule for the cost model
    (:mod:`autoplan.cost.float8`) and the engine (:mod:`engine.float8`)."""
    return (not layer_name.startswith("<") and len(weight_shape) == 2
            and all(d > 0 and d % FLOAT8_DIM_MULTIPLE == 0 for d in weight_shape))
