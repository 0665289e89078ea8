"""RunConfig: how to run a plan (what the plan does not say: steps, optimiser, data, I/O).

The plan fixes *how the model is split*; this fixes *what the training run does*. Typed,
keyword-only and frozen; :meth:`RunConfig.from_dict` rejects unknown keys with the key's
name, so a misspelt option is an error, never silently ignored.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from typing import Any

from autoplan.errors import ConfigError

#: Test-only fault kinds of ``RunConfig.fault`` ("" is none).
FAULTS = ("", "kill", "hang", "save_crash")


@dataclass(frozen=True, kw_only=True)
class RunConfig:
    # training
    steps: int = 20                    # optimiser steps to reach (counted from 1, across resumes)
    warmup_steps: int = 2              # steps excluded from timing medians
    lr: float = 1e-3                   # AdamW learning rate (constant after lr_warmup)
    lr_warmup: int = 0                 # linear warm-up steps: lr * min(1, step / lr_warmup)
    weight_decay: float = 0.0
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    seed: int = 0                      # init, data and dropout seeds derive from it
    # data
    data: str = "synthetic"            # "synthetic" or a path to a uint16 token file (.bin/.npy)
    # output
    out_dir: str = "runs/engine"       # metrics.jsonl, summary.json, checkpoints/
    log_every: int = 1                 # print a line every N steps (rank 0)
    memory: str = "auto"               # "auto": allocator stats (GPU) / live tensors (CPU); "off"
    # checkpointing
    checkpoint_every: int = 0          # save every K steps (0: never)
    checkpoint_keep: int = 2           # keep the newest K checkpoints
    resume: bool = False               # continue from the newest checkpoint in out_dir
    # robustness
    timeout_s: float = 300.0           # every collective fails after this long (a dead rank)
    kill_after_step: int = 0           # testing: SIGKILL every rank after this step (0: never)
    # fault injection -- TEST-ONLY (tests/test_engine_faults.py); never set in a real run.
    # Fires only on torchrun's first attempt (TORCHELASTIC_RESTART_COUNT unset or 0), so a
    # run relaunched by ``torchrun --max-restarts`` goes on cleanly.
    fault: str = ""                    # "": none; "kill": SIGKILL after step fault_step;
    #                                    "hang": sleep (no collectives) before step fault_step;
    #                                    "save_crash": SIGKILL inside step fault_step's
    #                                    checkpoint save (DCP shards written, train state and
    #                                    rename not yet)
    fault_step: int = 0                # the step the fault is tied to (>= 1 when fault is set)
    fault_rank: int = -1               # the global rank that faults (-1: every rank)

    def __post_init__(self) -> None:
        for name in ("steps", "log_every"):
            if getattr(self, name) < 1:
                raise ConfigError(f"must be >= 1, got {getattr(self, name)}", field=name)
        for name in ("warmup_steps", "lr_warmup", "checkpoint_every", "kill_after_step",
                     "checkpoint_keep"):
            if getattr(self, name) < 0:
                raise ConfigError(f"must be >= 0, got {getattr(self, name)}", field=name)
        if self.lr <= 0 or self.timeout_s <= 0:
            raise ConfigError("lr and timeout_s must be positive", field="lr")
        if self.fault not in FAULTS:
            raise ConfigError(f"must be one of {sorted(FAULTS)}, got {self.fault!r}",
                              field="fault")
        if self.fault and self.fault_step < 1:
            raise ConfigError(f"must be >= 1 with fault={self.fault!r}, got "
                              f"{self.fault_step}", field="fault_step")
        if self.fault_rank < -1:
            raise ConfigError(f"must be >= -1, got {self.fault_rank}", field="fault_rank")
        if self.memory not in ("auto", "off"):
            raise ConfigError(f"must be 'auto' or 'off', got {self.memory!r}", field="memory")

    def lr_at(self, step: int) -> float:
        """Learning rate of optimiser step ``step`` (1-based): linear warm-up, then constant."""
        if self.lr_warmup and step < self.lr_warmup:
            return self.lr * step / self.lr_warmup
        return self.lr

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "RunConfig":
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ConfigError(f"unknown run option(s) {unknown}; known: {sorted(known)}",
                              field=unknown[0])
        return cls(**d)
