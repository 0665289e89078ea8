"""What the engine can run for a model: the parallelisms a planner may propose.

    caps = capabilities(spec)
    if not caps.tensor_parallel: only consider tp == 1      (caps.reason says why)

:class:`ModelCapabilities` fields:

* ``tensor_parallel`` — Megatron column/row sharding of the blocks' linears (``tp > 1``);
* ``sequence_parallel`` — sequence sharding of the residual stream between them (needs TP);
* ``pipeline`` — splitting the blocks over pipeline stages (``pp > 1``);
* ``context_parallel`` — the sequence split over ranks (``cp > 1``): the built-in GPT and
  the adapted Hugging Face decoders (:func:`hf_cp_gap`),
  ``cp_reason`` saying why not;
* ``reason`` — one clause per refused parallelism of the three above, ``""`` when all are
  allowed;
* ``runs`` — the engine runs this model at all: every model does, the built-in GPT and four
  Hugging Face causal LMs through their adapted runtimes, every other model (any Hugging
  Face architecture or task, ``mlp``, ``wide-resnet``, ``import:`` modules) through the
  generic runtime (:mod:`autoplan.capability`), which runs no sequence parallelism and
  tensor parallelism only without pipeline stages (checked per plan by its
  ``generic_gap``).

* ``tp_divisors`` — the sizes a tensor-parallel degree must divide (attention heads, KV
  heads, MLP width); :meth:`ModelCapabilities.allows_tp` checks a degree against them.

Data parallelism and ZeRO 0-3 are always possible for a model that runs. What depends on
the plan rather than the model is checked by :mod:`engine.validate` (sequence parallelism
needs ``tp`` to divide the sequence length; at least one block per pipeline stage).

The answers (checked against what the engine accepts by ``tests/test_engine_hf.py``):

=======================  ======  ======  ==========  ================================
model                    TP      SP      pipeline    why not
=======================  ======  ======  ==========  ================================
built-in ``gpt``         yes     yes     yes         —
Hugging Face ``llama``,  yes     yes     yes         —
``mistral``, ``qwen2``
Hugging Face ``gpt2``    no      no      yes         fused q/k/v ``Conv1D`` (c_attn)
Hugging Face MoE:        no      no      yes         3-D expert weights (expert
``mixtral``,                                         parallelism instead)
``qwen3_moe``
any of them with tied    no      no      no          one weight in two places: the
embeddings                                           head's shard and the embedding's,
                                                     or two pipeline stages
any other model          yes     no      yes         the generic runtime (TP without PP;
                                                     no PP for a model using a weight
                                                     in two places)
=======================  ======  ======  ==========  ================================

Context parallelism (``context_parallel``, :func:`hf_cp_gap`): the built-in GPT and every
adapted Hugging Face decoder above (GPT-2 with its learned positions, the rotary decoders,
their sliding-window layers masked by position); not the generic runtime.
"""

from __future__ import annotations

from dataclasses import dataclass

from autoplan.capability import adapted, generic_flags
from autoplan.models.registry import ModelSpec

_TIED_TP = ("tensor parallelism: the LM head shares its weight with the input embedding "
            "(tied embeddings), which tensor parallelism would shard two different ways")
_TIED_PP = ("pipeline: the LM head shares its weight with the input embedding (tied "
            "embeddings), so the first and last blocks' stages cannot be split; untie them "
            "(tie_word_embeddings=False / tie_embeddings=False)")


@dataclass(frozen=True, kw_only=True)
class ModelCapabilities:
    tensor_parallel: bool
    sequence_parallel: bool
    pipeline: bool
    reason: str = ""
    runs: bool = True
    #: (what, size) pairs a tensor-parallel degree must divide (heads, KV heads, MLP width)
    tp_divisors: tuple[tuple[str, int], ...] = ()
    #: the sequence split over ranks (``cp > 1``), and why not
    context_parallel: bool = False
    cp_reason: str = ""

    def allows_tp(self, tp: int) -> bool:
        """Can the engine run tensor-parallel degree ``tp`` (1 always)?"""
        return tp == 1 or (self.tensor_parallel
                           and all(n % tp == 0 for _, n in self.tp_divisors))


def _caps(*, tp: bool, pp: bool, why: list[str], divisors: tuple[tuple[str, int], ...],
          cp_gap: str | None = None) -> ModelCapabilities:
    return ModelCapabilities(tensor_parallel=tp, sequence_parallel=tp, pipeline=pp,
                             reason="; ".join(why), tp_divisors=divisors,
                             context_parallel=cp_gap is None, cp_reason=cp_gap or "")


_SHARED_PP = ("pipeline: a weight is used in two places (a tied LM head, an embedding shared "
              "by encoder and decoder, layers sharing weights), which the generic runtime's "
              "stages cannot split")
_shared: dict[str, bool] = {}


def _shares_weights(spec: ModelSpec) -> bool:
    """Does the model use one parameter in two modules (GPT-2's tied head, T5's embedding
    shared by encoder and decoder, ALBERT's shared layers)? Read from the model built on the
    meta device (no weight memory), once per spec. A model that cannot be built here (code
    not trusted to import, a missing module) answers False: the engine checks its weights
    again at launch (``engine/generic.py``)."""
    from autoplan.errors import ConfigError
    from autoplan.models.registry import build_model

    key = spec.fingerprint()
    if key not in _shared:
        try:
            model = build_model(spec)
        except ConfigError:
            return False
        _shared[key] = sum(1 for _ in model.named_parameters(remove_duplicate=False)) > \
            sum(1 for _ in model.named_parameters())
    return _shared[key]


def capabilities(spec: ModelSpec) -> ModelCapabilities:
    """What the engine can run for ``spec`` (see the module docstring)."""
    if spec.source == "builtin" and spec.name == "gpt":
        from autoplan.models.gpt_config import GPTConfig

        cfg = GPTConfig.from_dict(spec.config)
        tied = cfg.tie_embeddings
        return _caps(tp=not tied, pp=not tied, why=[_TIED_TP, _TIED_PP] if tied else [],
                     divisors=(("heads", cfg.heads), ("kv_heads", cfg.kv_heads or cfg.heads),
                               ("ffn", cfg.ffn), ("hidden", cfg.hidden)))
    if adapted(spec):                      # a Hugging Face type with a stage adapter
        from autoplan.models.hf import hf_config

        config = hf_config(spec)
        tied = bool(getattr(config, "tie_word_embeddings", False))
        why = []
        no_tp = _HF_NO_TP.get(spec.name)
        if no_tp:
            why.append(f"tensor parallelism: {no_tp}")
        elif tied:
            why.append(_TIED_TP)
        if tied:
            why.append(_TIED_PP)
        return _caps(tp=not no_tp and not tied, pp=not tied, why=why,
                     divisors=_hf_tp_divisors(spec.name, config),
                     cp_gap=hf_cp_gap(spec.name, config))
    # every other model: the generic runtime (autoplan.capability); what depends on the
    # plan (tp with pp, sequence parallelism) is generic_gap's, checked per plan
    flags = generic_flags()
    reason = ("the generic runtime: no sequence parallelism, and tensor parallelism only "
              "without pipeline stages (autoplan.capability)")
    pipeline = flags["pipeline"]
    if pipeline and _shares_weights(spec):    # its stages would split the shared weight
        pipeline, reason = False, f"{reason}; {_SHARED_PP}"
    return ModelCapabilities(
        tensor_parallel=flags["tensor_parallel"], sequence_parallel=flags["sequence_parallel"],
        pipeline=pipeline, runs=flags["runs"], reason=reason,
        cp_reason=f"the engine runs context parallelism for the built-in GPT and the "
                  f"adapted Hugging Face decoders, not {spec.source}:{spec.name} (the "
                  f"generic runtime)")


#: Hugging Face stage adapters (engine.hf_arch) that cannot shard heads, and why.
_HF_NO_TP = {"gpt2": "GPT-2 projects q, k and v with one fused Conv1D (c_attn) whose output "
                     "is split at fixed offsets, so a column shard mixes heads of q, k and v",
            **dict.fromkeys(("mixtral", "qwen3_moe"),
                            "its experts are 3-D weight tensors, which the tensor-parallel "
                            "styles do not shard; split them over ranks with expert "
                            "parallelism instead")}


def _hf_tp_divisors(model_type: str, config) -> tuple[tuple[str, int], ...]:
    """The sizes a TP degree must divide for an adapted Hugging Face type (its adapter's)."""
    if model_type == "gpt2":
        return (("heads", config.n_head),)
    return (("num_attention_heads", config.num_attention_heads),
            ("num_key_value_heads", config.num_key_value_heads or config.num_attention_heads),
            ("intermediate_size", config.intermediate_size))


def layer_kinds(config) -> list[str]:
    """Each layer's attention kind in a Hugging Face decoder (``full_attention`` /
    ``sliding_attention``), as its forward picks the layer's mask: ``config.layer_types``
    where the config has them (Qwen2), else a sliding window for every layer when
    ``config.sliding_window`` is set (Mistral), else causal."""
    kinds = list(getattr(config, "layer_types", None) or [])
    if not kinds:
        sliding = getattr(config, "sliding_window", None) is not None
        kinds = ["sliding_attention" if sliding else "full_attention"] * config.num_hidden_layers
    return kinds


#: Attention layer kinds (``config.layer_types``) the engine's context parallelism runs.
CP_LAYER_KINDS = ("full_attention", "sliding_attention")


def hf_cp_gap(model_type: str, config) -> str | None:
    """Why the engine cannot split the sequence of an adapted Hugging Face type over ranks
    (None: it can): its context-parallel attention (:func:`autoplan.models.context_parallel.
    attend`) masks by position, causal over the whole sequence or within a layer's sliding
    window (:func:`layer_kinds`); each rank's positions (rotary, or GPT-2's learned ones)
    are those of its own chunks. A layer of another kind is refused."""
    other = sorted(set(layer_kinds(config)) - set(CP_LAYER_KINDS))
    if other:
        return (f"{model_type} with {', '.join(other)} layers: the engine's context-parallel "
                f"attention masks only {' and '.join(CP_LAYER_KINDS)} layers")
    return None


def layer_window(config, index: int) -> int | None:
    """The sliding window of layer ``index`` (None: it attends over the whole sequence)."""
    if layer_kinds(config)[index] != "sliding_attention":
        return None
    return int(config.sliding_window)
