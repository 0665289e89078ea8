"""The training loop of the generic runtime (:mod:`engine.generic`) for ``autoplan run``.

:class:`GenericTrainer` is :class:`engine.train.Trainer` (same loop, learning-rate schedule,
metrics, checkpoints) with the model built by :func:`autoplan.models.registry.build_model`
and parallelised by :class:`engine.generic.GenericModel`, and the batch of step ``t`` from
the model's own :func:`~autoplan.models.registry.example_batch` drawn with seed
``(seed, "data", t)`` — the same global batch on every rank and in every layout, each
data-parallel rank keeping its rows.

Throughput figures use the 6·N rule (PaLM, Chowdhery et al. 2022, appendix B) over all
parameters, without the attention term, since a generic model's attention shape is not
known here: tokens are ``global_batch x seq_len`` (``global_batch`` samples when the model
has no sequence length).
"""

from __future__ import annotations

import torch

from autoplan.errors import ConfigError
from autoplan.models.registry import build_model, default_seq_len, example_batch
from engine.generic import GenericModel, seed_for
from engine.train import Trainer


class GenericTrainer(Trainer):
    """:class:`engine.train.Trainer` on the generic runtime (module docstring)."""

    def _workload(self) -> None:
        plan, cfg = self.plan, self.cfg
        if cfg.data != "synthetic":
            raise ConfigError("the generic runtime trains on the model's own example batches; "
                              "a token file (--data) feeds the built-in and adapted causal LMs "
                              "only", field="data")
        self.seq_len = plan.seq_len or default_seq_len(self.spec)
        self.tokens_per_step = plan.global_batch * (self.seq_len or 1)
        self.flops_per_step = 6.0 * plan.num_params * self.tokens_per_step

    def batch(self, step: int) -> tuple[torch.Tensor, ...]:
        """Step ``step``'s global batch (the same on every rank)."""
        with torch.random.fork_rng():
            torch.manual_seed(seed_for(self.cfg.seed, "data", step))
            batch = example_batch(self.spec, self.plan.global_batch, self.seq_len, "cpu",
                                  seed=seed_for(self.cfg.seed, "data", step) % (2 ** 31))
        return tuple(batch)

    def _build(self) -> None:
        with torch.random.fork_rng():
            torch.manual_seed(seed_for(self.cfg.seed, "init"))
            model = build_model(self.spec, device="cpu")
        self.generic = GenericModel(model, self.plan, self.pm, precision=self.precision,
                                    example=self.batch(1))
        if self.generic.sharded:
            self.log(f"generic runtime: {self.generic.sharded} parameters sharded on tp")
        self.chunks = list(self.generic.modules)
        self.schedule = self.generic.schedule
        self.has_loss = self.generic.has_loss

    def _forward_backward(self, step: int) -> torch.Tensor:
        return self.generic.step(self.batch(step))
