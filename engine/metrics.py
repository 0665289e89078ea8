"""What a run measures: step time, throughput, model FLOP/s and MFU, peak memory, loss.

Model FLOPs per token (PaLM, Chowdhery et al. 2022, appendix B)::

    F_token = 6·N + 12·L·H·Q·T

with N the parameters that multiply activations (all but the input embedding tables; the LM
head counts, once, even when tied), L layers, H·Q = heads × head_dim the attention width and
T the sequence length; the second term is the attention score and value matmuls (forward +
backward, causal masking not discounted). Recomputation is not counted: this is *model*
FLOPs. Then::

    achieved TFLOP/s per device = F_token · tokens per step / step time / world size
    MFU = achieved FLOP/s per device / peak FLOP/s of the plan's device at the compute dtype

Peak memory per rank: on an accelerator the caching allocator's ``max_memory_allocated``
over every measured step; on CPU, :class:`engine.memory.LiveTensorMemory` (a
TorchDispatchMode counting live tensor storages) over one step — the last warm-up step, and
at least step 2 (step 1 creates the optimizer states) — kept out of the timing medians
because the tracker slows it down. Both count tensor memory only (not the allocator's cache
or communication libraries' own buffers).
"""

from __future__ import annotations

import contextlib
import json
import statistics
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Iterator

import torch
import torch.nn as nn

from autoplan.models.gpt_config import GPTConfig


def flops_per_token(*, matmul_params: int, layers: int, attention_width: int,
                    seq_len: int) -> float:
    """PaLM appendix B: 6·N + 12·L·H·Q·T (see module docstring)."""
    return 6.0 * matmul_params + 12.0 * layers * attention_width * seq_len


def gpt_matmul_params(cfg: GPTConfig) -> int:
    """N of the built-in GPT: all parameters but the embedding lookups (a tied head once);
    of a mixture of experts, the active ones (``top_k`` of the routed experts: the 6 N T
    rule applied to the parameters a token uses, :mod:`autoplan.models.moe`)."""
    n = cfg.num_params(active=True)
    n -= cfg.vocab_size * cfg.hidden                      # token embedding lookup
    if cfg.style == "gpt":
        n -= cfg.seq_len * cfg.hidden                     # position embedding lookup
    if cfg.tie_embeddings:
        n += cfg.vocab_size * cfg.hidden                  # the head's matmul still happens
    return n


def model_flops_per_token(cfg: GPTConfig, seq_len: int) -> float:
    """PaLM appendix B for the built-in GPT."""
    return flops_per_token(matmul_params=gpt_matmul_params(cfg), layers=cfg.layers,
                           attention_width=cfg.heads * cfg.head_dim, seq_len=seq_len)


def peak_flops(cluster: dict, compute_dtype: str) -> float | None:
    """Dense peak FLOP/s of one device of the plan's cluster (``device.peak_tflops``)."""
    device = cluster.get("device", {}) if isinstance(cluster, dict) else {}
    peaks = device.get("peak_tflops", {}) if isinstance(device, dict) else {}
    value = peaks.get(compute_dtype)
    return float(value) * 1e12 if value else None


@dataclass(frozen=True, kw_only=True)
class StepRecord:
    step: int
    loss: float
    step_time_s: float
    tokens: int
    tokens_per_s: float
    tflops_per_device: float
    mfu: float | None
    lr: float
    memory_tracked: bool = False


class MemoryProbe:
    """Peak memory of this rank: allocator statistics on accelerators, live tensor storages
    on CPU."""

    def __init__(self, device: torch.device, *, enabled: bool):
        self.device, self.enabled = device, enabled
        self.peak_bytes: int | None = None
        self.breakdown: dict[str, int] = {}
        self._module = None if device.type == "cpu" else torch.get_device_module(device.type)
        if enabled and self._module is not None:
            self._module.reset_peak_memory_stats(device)

    @property
    def tracks_every_step(self) -> bool:
        return self._module is not None

    @contextlib.contextmanager
    def track(self, modules: list[nn.Module], optimizers: list[torch.optim.Optimizer],
              ) -> Iterator[None]:
        """Context for the step to measure (CPU); a no-op on accelerators."""
        if not self.enabled or self._module is not None:
            yield
            return
        from engine.memory import LiveTensorMemory, state_tensors

        with LiveTensorMemory(state_tensors(modules, optimizers)) as tracker:
            yield
        self.peak_bytes = tracker.peak
        self.breakdown = {"Total": tracker.peak, "at_step_start": tracker.start,
                          "step_increase": tracker.peak - tracker.start}

    def finish(self) -> None:
        if self.enabled and self._module is not None:
            self.peak_bytes = int(self._module.max_memory_allocated(self.device))
            stats = self._module.memory_stats(self.device)
            self.breakdown = {"Total": self.peak_bytes,
                              "reserved": int(stats.get("reserved_bytes.all.peak", 0))}

    def to_dict(self) -> dict[str, Any]:
        return {"peak_bytes": self.peak_bytes, "breakdown": self.breakdown,
                "method": ("allocator" if self._module is not None else "LiveTensorMemory")
                if self.enabled else "off"}


class MetricsWriter:
    """``metrics.jsonl`` (one line per step, appended across resumes) on rank 0."""

    def __init__(self, path: Path, *, enabled: bool):
        self.path, self.enabled = path, enabled
        if enabled:
            path.parent.mkdir(parents=True, exist_ok=True)

    def write(self, record: StepRecord) -> None:
        if self.enabled:
            with self.path.open("a") as f:
                f.write(json.dumps(asdict(record), sort_keys=True) + "\n")


def read_metrics(path: Path) -> tuple[list[dict[str, Any]], str | None]:
    """The records of a ``metrics.jsonl`` and a note on what was dropped (None: nothing).

    A crash mid-append leaves a torn last line (no newline, or not JSON): it is dropped
    with a note, since the step it recorded is re-run on resume. A bad line anywhere else
    is damage, not a crash: a ConfigError naming the file and line."""
    from autoplan.errors import ConfigError
    from autoplan.user_files import check_regular

    try:                  # a pipe or device in the run directory would block or never end
        check_regular(path)
        text = path.read_bytes().decode("utf-8", errors="replace")
    except OSError as exc:
        raise ConfigError(f"cannot read ({exc.strerror})", source=str(path)) from None
    lines = text.split("\n")
    records, note = [], None
    for i, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
            if not isinstance(rec, dict) or not isinstance(rec.get("step"), int):
                raise ValueError("no integer 'step'")
        except ValueError as exc:
            last = all(not rest.strip() for rest in lines[i:])
            if last:
                note = f"{path}: dropped a torn last line {i} (a crash mid-write)"
                break
            raise ConfigError(f"line {i} is not a step record ({exc})"[:200],
                              source=str(path)) from None
        records.append(rec)
    return records, note


def truncate_metrics(path: Path, *, keep_until: int) -> str | None:
    """Keep the records of steps <= ``keep_until`` (none on a fresh start), rewritten
    atomically; returns :func:`read_metrics`'s note."""
    from autoplan.plan import atomic_write_text

    if not path.exists():
        return None
    records, note = read_metrics(path)
    kept = [r for r in records if r["step"] <= keep_until]
    atomic_write_text(path, "".join(json.dumps(r, sort_keys=True) + "\n" for r in kept))
    return note


def summarize(records: list[StepRecord], *, warmup_steps: int, world_size: int,
              peak: float | None, memory_per_rank: list[dict[str, Any]],
              prediction: dict[str, Any] | None, plan_label: str, plan_source: str,
              device: str) -> dict[str, Any]:
    """The end-of-run summary: medians over the timed steps, next to the plan's prediction."""
    timed = [r for r in records if r.step > warmup_steps and not r.memory_tracked]
    if not timed:
        timed = [r for r in records if not r.memory_tracked] or records
    step_time = statistics.median(r.step_time_s for r in timed)
    tokens = timed[0].tokens
    flops_per_device = statistics.median(r.tflops_per_device for r in timed) * 1e12
    peaks = [m.get("peak_bytes") for m in memory_per_rank]
    peak_mem = max((p for p in peaks if p is not None), default=None)
    measured = {
        "step_time_s": step_time,
        "tokens_per_s": tokens / step_time,
        "tflops_per_device": flops_per_device / 1e12,
        "mfu": flops_per_device / peak if peak else None,
        "peak_memory_bytes": peak_mem,
        "final_loss": records[-1].loss if records else None,
    }
    predicted = None
    if prediction:
        predicted = {"step_time_s": prediction.get("step_time_s"),
                     "tokens_per_s": prediction.get("tokens_per_s"),
                     "tflops_per_device": prediction.get("model_tflops_per_device"),
                     "mfu": prediction.get("mfu"),
                     "peak_memory_bytes": (prediction.get("memory") or {}).get("total")}
    ratios = {}
    if predicted:
        for key in ("step_time_s", "peak_memory_bytes", "tokens_per_s"):
            if measured.get(key) and predicted.get(key):
                ratios[key] = measured[key] / predicted[key]
    return {"plan": plan_source, "label": plan_label, "device": device,
            "world_size": world_size, "steps": len(records), "timed_steps": len(timed),
            "warmup_steps": warmup_steps, "measured": measured, "predicted": predicted,
            "measured_over_predicted": ratios, "memory_per_rank": memory_per_rank,
            "losses": [r.loss for r in records]}


def format_table(summary: dict[str, Any]) -> str:
    """A plain-text table: measured vs predicted."""
    m, p = summary["measured"], summary.get("predicted") or {}
    rows = [("step time (s, median)", m["step_time_s"], p.get("step_time_s"), "{:.4f}"),
            ("tokens/s", m["tokens_per_s"], p.get("tokens_per_s"), "{:.1f}"),
            ("TFLOP/s per device", m["tflops_per_device"], p.get("tflops_per_device"),
             "{:.4f}"),
            ("MFU", m["mfu"], p.get("mfu"), "{:.2%}"),
            ("peak memory (MB/rank)",
             m["peak_memory_bytes"] / 1e6 if m["peak_memory_bytes"] else None,
             p["peak_memory_bytes"] / 1e6 if p.get("peak_memory_bytes") else None, "{:.1f}"),
            ("final loss", m["final_loss"], None, "{:.4f}")]
    fmt = lambda v, f: "-" if v is None else f.format(v)  # noqa: E731
    lines = [f"{summary['label']}  ({summary['world_size']} ranks, {summary['device']}, "
             f"{summary['timed_steps']} timed of {summary['steps']} steps)",
             f"{'':24} {'measured':>14} {'predicted':>14}"]
    for name, meas, pred, f in rows:
        lines.append(f"{name:24} {fmt(meas, f):>14} {fmt(pred, f):>14}")
    return "\n".join(lines)
