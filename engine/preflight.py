"""Checks before any process starts: the run's options, its output directory, and what of
the plan both runtimes need (:mod:`engine.validate` checks the rest).

``autoplan run`` (:func:`engine.launch.run_local`) calls :func:`preflight` before torchrun;
every rank calls the same checks again (:mod:`engine.run`), so a direct ``torchrun`` launch
gets the same one-line errors. Each is a :class:`~autoplan.errors.ConfigError` or
:class:`~autoplan.errors.PlanError` naming the option, directory or plan field:

* options: finite positive ``lr``, ``eps`` and ``timeout_s``, betas in [0, 1), finite
  non-negative ``weight_decay``, counts within :data:`MAX_STEPS` (``--steps 0`` and
  ``--lr inf`` are refused here, not after the ranks start);
* output directory: exists or can be created, is a writable directory, not locked by
  another run (:mod:`engine.rundir`), and has room for a checkpoint when checkpointing —
  model and AdamW state in float32, 12 bytes per parameter (weights 4, two moments 8;
  Kingma & Ba 2015, Algorithm 1), plus :data:`SPARE_BYTES`;
* the plan, for either runtime: precisions the engine supports, the sequence length within
  the model's, and a global batch the micro-batches divide — the per-op runtime is as
  strict about these as the uniform one (a tampered search plan fails here, not with an
  IndexError on every rank).
"""

from __future__ import annotations

import math
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

from autoplan.errors import ConfigError, PlanError
from autoplan.capability import ENGINE_DTYPES, precision_gap

#: Largest step counts taken (the loop is O(steps); 2**31 steps is far past any run).
MAX_STEPS = 2 ** 31
#: Largest collective timeout (a week): ``datetime.timedelta`` overflows far beyond it.
MAX_TIMEOUT_S = 7 * 24 * 3600.0
#: Bytes kept free besides a checkpoint (metrics, summary, the manifest).
SPARE_BYTES = 16 << 20
SUPPORTED_DTYPES = ENGINE_DTYPES


def check_run_options(cfg: Any) -> None:
    """The run options' values (module docstring); ConfigError naming ``--option``."""
    def fail(name: str, what: str) -> ConfigError:
        return ConfigError(f"must be {what}, got {getattr(cfg, name)!r}",
                           field="--" + name.replace("_", "-"))

    for name in ("lr", "eps", "timeout_s"):
        v = getattr(cfg, name)
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) \
                or v <= 0:
            raise fail(name, "a finite positive number")
    if cfg.timeout_s > MAX_TIMEOUT_S:
        raise fail("timeout_s", f"at most {MAX_TIMEOUT_S:.0f} s")
    for name in ("beta1", "beta2"):
        v = getattr(cfg, name)
        if not isinstance(v, (int, float)) or not 0 <= v < 1:
            raise fail(name, "a number in [0, 1)")
    if not isinstance(cfg.weight_decay, (int, float)) or not math.isfinite(cfg.weight_decay) \
            or cfg.weight_decay < 0:
        raise fail("weight_decay", "a finite number >= 0")
    if not 1 <= cfg.steps <= MAX_STEPS:
        raise fail("steps", f"an integer in [1, {MAX_STEPS}]")
    for name in ("warmup_steps", "lr_warmup", "checkpoint_every", "checkpoint_keep",
                 "kill_after_step", "log_every", "fault_step"):
        if abs(getattr(cfg, name)) > MAX_STEPS:
            raise fail(name, f"at most {MAX_STEPS}")
    if not isinstance(cfg.out_dir, str) or not cfg.out_dir.strip() or "\0" in cfg.out_dir:
        raise fail("out_dir", "a directory path")


def checkpoint_bytes(num_params: int) -> int:
    """Bytes one checkpoint takes: 12 per parameter (module docstring)."""
    return 12 * int(num_params)


def check_out_dir(out_dir: str | os.PathLike, *, need_bytes: int) -> Path:
    """``out_dir`` exists or is created, is a writable directory with ``need_bytes`` free;
    ConfigError naming it and the reason otherwise."""
    out = Path(out_dir)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except FileExistsError:
        raise ConfigError(f"{out} exists and is not a directory", field="--out") from None
    except OSError as exc:
        raise ConfigError(f"cannot create {out}: {exc.strerror}", field="--out") from None
    if not out.is_dir():
        raise ConfigError(f"{out} is not a directory", field="--out")
    try:
        with tempfile.NamedTemporaryFile(dir=out, prefix=".write-test-"):
            pass
    except OSError as exc:
        raise ConfigError(f"cannot write in {out}: {exc.strerror}", field="--out") from None
    free = shutil.disk_usage(out).free
    if free < need_bytes:
        raise ConfigError(f"{out} has {free / 2**20:.1f} MiB free; this run needs "
                          f"{need_bytes / 2**20:.1f} MiB (a checkpoint and its metrics)",
                          field="--out")
    return out


def check_plan_common(plan: Any, spec: Any, source: str) -> None:
    """What every runtime needs of ``plan`` (module docstring); PlanError naming the field."""
    from engine import model as model_lib

    gap = precision_gap(plan.precision)
    if gap:
        raise PlanError(f"plan {source}: {gap}")
    from autoplan.capability import runtime_for

    if runtime_for(spec, plan) != "generic":    # the adapted runtimes know the model's sizes
        info = model_lib.model_info(spec)
        seq = plan.seq_len or info.max_seq_len
        if seq > info.max_seq_len:
            raise PlanError(f"plan {source}: field 'seq_len' {seq} exceeds the model's "
                            f"{info.max_seq_len}")
    p = plan.parallel
    if p.num_micro_batches < 1 or plan.global_batch % p.num_micro_batches:
        raise PlanError(f"plan {source}: field 'global_batch' {plan.global_batch} is not a "
                        f"multiple of parallel.num_micro_batches {p.num_micro_batches}")


def prelaunch_check(plan: Any, source: str, *, world_size: int) -> Any:
    """The plan's checks before launch: :func:`engine.runtime.check_all` (world, device,
    model, the runtime's support) and :func:`check_plan_common`; returns the model spec."""
    from engine.runtime import check_all

    spec = check_all(plan, source, world_size=world_size)
    check_plan_common(plan, spec, source)
    return spec


def preflight(plan: Any, source: str, cfg: Any, *, world_size: int) -> Any:
    """Everything checked before torchrun starts; returns the model spec."""
    from engine.rundir import check_unlocked

    check_run_options(cfg)
    spec = prelaunch_check(plan, source, world_size=world_size)
    need = SPARE_BYTES + (checkpoint_bytes(plan.num_params) if cfg.checkpoint_every else 0)
    out = check_out_dir(cfg.out_dir, need_bytes=need)
    check_unlocked(out)
    return spec


def pricing_gaps(plan: Any) -> list[str]:
    """Where this engine runs the plan otherwise than its prediction was priced
    (``plan.pricing``, :func:`autoplan.pricing.differences`): notes for the user, not errors.
    The engine runs context parallelism as priced (all-gather or ring) and torchao's float8
    casts everywhere; on GPUs eager PyTorch and torch's scaled_dot_product_attention as well,
    or under the ring attention as explicit matmuls (on CPU ranks the cost model prices no
    fusion or fused attention rate)."""
    from autoplan.precision import float8_gemms
    from autoplan.pricing import differences

    if plan.pricing is None:
        return []
    runs = {"float8_recipe": "torchao"}
    if plan.mesh.device_type == "cuda":
        ring = plan.parallel.cp > 1 and plan.pricing.cp_comm == "ring"
        runs.update(fused=False, attention_kernel="matmul" if ring else "flash2")
    return differences(plan.pricing, "this engine", runs, cp=plan.parallel.cp > 1,
                       float8=float8_gemms(plan.precision))
