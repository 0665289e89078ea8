"""What the engine can run for a model: the parallelisms a planner may propose.

    caps = capabilities(spec)
    if not caps.tensor_parallel: only consider tp == 1      (caps.reason says why)

:class:`ModelCapabilities` fields:

* ``tensor_parallel`` — Megatron column/row sharding of the blocks' linears (``tp > 1``);
* ``sequence_parallel`` — sequence sharding of the residual stream between them (needs TP);
* ``pipeline`` — splitting the blocks over pipeline stages (``pp > 1``);
* ``reason`` — one clause per refused parallelism, ``""`` when all are allowed;
* ``runs`` — the engine runs this model at all. When False (a family the planner models but
  the engine does not execute: ``mlp``, ``wide-resnet``, imported modules, Hugging Face types
  without a stage adapter) no plan of it can run, so the three flags above put no limit on
  planning (they are True) and ``reason`` says it is plan-only.

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
any of them with tied    no      no      no          one weight in two places: the
embeddings                                           head's shard and the embedding's,
                                                     or two pipeline stages
=======================  ======  ======  ==========  ================================
"""

from __future__ import annotations

from dataclasses import dataclass

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

    def allows_tp(self, tp: int) -> bool:
        """Can the engine run tensor-parallel degree ``tp`` (1 always)?"""
        return tp == 1 or (self.tensor_parallel
                           and all(n % tp == 0 for _, n in self.tp_divisors))


def _caps(*, tp: bool, pp: bool, why: list[str],
          divisors: tuple[tuple[str, int], ...]) -> ModelCapabilities:
    return ModelCapabilities(tensor_parallel=tp, sequence_parallel=tp, pipeline=pp,
                             reason="; ".join(why), tp_divisors=divisors)


def capabilities(spec: ModelSpec) -> ModelCapabilities:
    """What the engine can run for ``spec`` (see the module docstring)."""
    if spec.source == "builtin" and spec.name == "gpt":
        from autoplan.models.gpt import GPTConfig

        cfg = GPTConfig.from_dict(spec.config)
        tied = cfg.tie_embeddings
        return _caps(tp=not tied, pp=not tied, why=[_TIED_TP, _TIED_PP] if tied else [],
                     divisors=(("heads", cfg.heads), ("kv_heads", cfg.kv_heads or cfg.heads),
                               ("ffn", cfg.ffn), ("hidden", cfg.hidden)))
    if spec.source == "hf":
        from engine.hf_arch import ARCHITECTURES

        adapter = ARCHITECTURES.get(spec.name)
        if adapter is not None:
            from autoplan.models.hf import hf_config

            config = hf_config(spec)
            tied = bool(getattr(config, "tie_word_embeddings", False))
            why = []
            if adapter.tp_layout is None:
                why.append(f"tensor parallelism: {adapter.no_tp_reason}")
            elif tied:
                why.append(_TIED_TP)
            if tied:
                why.append(_TIED_PP)
            return _caps(tp=adapter.tp_layout is not None and not tied, pp=not tied, why=why,
                         divisors=adapter.tp_divisors(config))
        supported = f"Hugging Face {sorted(ARCHITECTURES)}"
    else:
        supported = "Hugging Face models with a stage adapter"
    return ModelCapabilities(
        tensor_parallel=True, sequence_parallel=True, pipeline=True, runs=False,
        reason=f"plan-only: the engine runs the built-in 'gpt' family and {supported}, not "
               f"source={spec.source!r} name={spec.name!r}")
