"""The training loop: build the plan's model chunks, train with AdamW, measure, checkpoint.

One step (``t`` counted from 1 across resumes):

1. learning rate ``RunConfig.lr_at(t)`` on every optimizer;
2. this data-parallel rank's rows of the global batch of step ``t`` (:mod:`engine.data`);
3. forward/backward over ``num_micro_batches`` micro-batches — by the pipeline schedule when
   ``pp > 1``, else a plain accumulation loop with the ZeRO switches of
   :func:`engine.data_parallel.set_microbatch`; gradients are those of the mean loss;
   (expert weights under expert parallelism: reduced over their own group,
   :func:`engine.expert_parallel.reduce_expert_grads`; context parallelism: each rank takes
   its chunks of every sequence, :func:`engine.expert_parallel.shard_batch`);
4. ``AdamW.step`` (one optimizer per chunk, over its sharded DTensor parameters);
5. the loss, averaged over the ranks that computed one (the last stage) by one all-reduce —
   which also lines the ranks up, so the step time is the slowest rank's.

Seeds: weights from ``seed`` per parameter name (:mod:`engine.model`); data from
``(seed, step)``; dropout from ``(seed, pp rank, dp rank)`` — the same on every rank of a
tensor-parallel group, so activations it replicates stay identical.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from autoplan.fingerprints import run_identity
from autoplan.models.gpt import GPT
from autoplan.models.registry import ModelSpec
from autoplan.plan import Plan, atomic_write_text
from engine.checkpoint import Checkpointer
from engine.config import RunConfig
from engine.data import local_batch, make_source
from engine.data_parallel import set_microbatch
from engine.expert_parallel import reduce_expert_grads, shard_batch
from engine.mesh import ParallelMesh
from engine.metrics import (MemoryProbe, MetricsWriter, StepRecord, flops_per_token,
                            format_table, peak_flops, summarize, truncate_metrics)
from engine.model import model_info
from engine.parallelize import parallelize_stage, resolve_precision
from engine.pipeline import build_schedule, has_first_stage, has_last_stage, scatter_gather


def _seed(*parts: Any) -> int:
    digest = hashlib.sha256(":".join(map(str, parts)).encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


class Trainer:
    """Everything one rank holds for a plan: chunks, optimizers, schedule, data, metrics."""

    def __init__(self, plan: Plan, spec: ModelSpec, cfg: RunConfig, pm: ParallelMesh, *,
                 source: str = "<plan>"):
        self.plan, self.spec, self.cfg, self.pm, self.source = plan, spec, cfg, pm, source
        self.precision, note = resolve_precision(plan, pm.device)
        if note:
            self.log(note)
        self.out_dir = Path(cfg.out_dir)
        self._workload()
        self._build()
        self.optimizers = [torch.optim.AdamW(c.parameters(), lr=cfg.lr,
                                             betas=(cfg.beta1, cfg.beta2), eps=cfg.eps,
                                             weight_decay=cfg.weight_decay)
                           for c in self.chunks]
        dtype_name = str(self.precision.compute).removeprefix("torch.")
        self.peak = peak_flops(plan.cluster, dtype_name)
        self.checkpointer = Checkpointer(self.out_dir / "checkpoints",
                                         keep=cfg.checkpoint_keep, rank=pm.rank, plan=plan)
        torch.manual_seed(_seed(cfg.seed, "dropout", pm.pp_rank, pm.dp_rank))

    def _workload(self) -> None:
        """The data source and the sizes the metrics need (``seq_len``, ``tokens_per_step``,
        ``flops_per_step``)."""
        plan, cfg = self.plan, self.cfg
        self.info = model_info(self.spec)
        self.seq_len = plan.seq_len or self.info.max_seq_len
        self.data = make_source(cfg.data, vocab_size=self.info.vocab_size,
                                seq_len=self.seq_len, global_batch=plan.global_batch,
                                seed=cfg.seed)
        self.tokens_per_step = plan.global_batch * self.seq_len
        self.flops_per_step = flops_per_token(
            matmul_params=self.info.matmul_params, layers=self.info.layers,
            attention_width=self.info.attention_width, seq_len=self.seq_len) \
            * self.tokens_per_step

    def _build(self) -> None:
        """This rank's model chunks (``self.chunks``), the pipeline schedule and whether it
        computes the loss (``self.has_loss``)."""
        plan, pm = self.plan, self.pm
        self.chunks = [parallelize_stage(plan, self.spec, s, pm, self.precision,
                                         seed=self.cfg.seed) for s in pm.stages]
        p = plan.parallel
        self.schedule = None
        if p.pp > 1:
            scatter_gather(dict(zip(pm.stages, self.chunks)), pm, tp=p.tp,
                           sequence_parallel=p.sequence_parallel, seq_len=self.seq_len)
            self.schedule = build_schedule(dict(zip(pm.stages, self.chunks)), pm,
                                           schedule=p.schedule,
                                           num_micro_batches=p.num_micro_batches,
                                           loss_fn=GPT.loss)
        self.has_loss = has_last_stage(pm)

    # ---- logging ---------------------------------------------------------------------------
    def log(self, message: str) -> None:
        if self.pm.rank == 0:
            print(message, flush=True)

    # ---- one step --------------------------------------------------------------------------
    def train_step(self, step: int) -> float:
        """Run optimiser step ``step``; returns the global mean loss (every rank)."""
        lr = self.cfg.lr_at(step)
        for opt in self.optimizers:
            for group in opt.param_groups:
                group["lr"] = lr
        local = self._forward_backward(step)
        if self.pm.ep > 1:
            reduce_expert_grads(self.chunks, self.pm)
        for opt in self.optimizers:
            opt.step()
            opt.zero_grad(set_to_none=True)
        pair = torch.stack([local, torch.tensor(float(self.has_loss), device=local.device)])
        dist.all_reduce(pair)
        return (pair[0] / pair[1]).item()

    def _forward_backward(self, step: int) -> torch.Tensor:
        """Every micro-batch of step ``step``, gradients ready for the optimizers; returns
        this rank's mean loss (zero where it computes none)."""
        p = self.plan.parallel
        inputs, targets = shard_batch(*local_batch(self.data, step, dp=self.pm.dp,
                                                   dp_rank=self.pm.dp_rank,
                                                   device=self.pm.device), self.pm)
        if self.schedule is not None:
            losses: list[torch.Tensor] = []
            args = (inputs,) if has_first_stage(self.pm) else ()
            self.schedule.step(*args, target=targets if self.has_loss else None,
                               losses=losses)
            local = torch.stack([l.detach().float() for l in losses]).mean() \
                if self.has_loss else torch.zeros((), device=self.pm.device)
        else:
            (chunk,) = self.chunks
            n = p.num_micro_batches
            local = torch.zeros((), device=self.pm.device)
            for i, (x, y) in enumerate(zip(inputs.chunk(n), targets.chunk(n))):
                set_microbatch(chunk, zero=p.zero, last=i == n - 1)
                loss = chunk(x, y)
                (loss / n).backward()
                local += loss.detach().float() / n
        return local

    # ---- fault injection (testing only) ----------------------------------------------------
    def _fault(self, kind: str, step: int) -> bool:
        """Whether the test-only fault ``kind`` fires on this rank at ``step`` (first torchrun
        attempt only: a relaunch after ``--max-restarts`` runs clean)."""
        cfg = self.cfg
        return (cfg.fault == kind and step == cfg.fault_step
                and cfg.fault_rank in (-1, self.pm.rank)
                and int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0) == 0)

    # ---- the run ---------------------------------------------------------------------------
    def resume(self) -> int:
        """Load the newest checkpoint if ``--resume``; returns the step it ended (0: fresh)."""
        if not self.cfg.resume:
            return 0
        found = self.checkpointer.resume_point(self.log)       # verified (engine.manifest)
        if found is None:
            self.log(f"--resume: no checkpoint in {self.checkpointer.root}; starting fresh")
            return 0
        step, path = found
        state = self.checkpointer.load(path, self.chunks, self.optimizers)
        torch.set_rng_state(state["rng_cpu"])
        if state.get("rng_device") is not None and self.pm.device.type != "cpu":
            torch.get_device_module(self.pm.device.type).set_rng_state(state["rng_device"],
                                                                      self.pm.device)
        self.log(f"resumed from {path} (step {step})")
        return step

    def _train_state(self, step: int) -> dict[str, Any]:
        device_rng = None
        if self.pm.device.type != "cpu":
            device_rng = torch.get_device_module(self.pm.device.type).get_rng_state(
                self.pm.device)
        return {"step": step, "rng_cpu": torch.get_rng_state(), "rng_device": device_rng}

    def run(self) -> dict[str, Any] | None:
        """Train to ``cfg.steps``; returns the summary on rank 0 (None elsewhere)."""
        cfg, pm = self.cfg, self.pm
        start = self.resume()
        writer = MetricsWriter(self.out_dir / "metrics.jsonl", enabled=pm.rank == 0)
        if pm.rank == 0:
            note = truncate_metrics(writer.path, keep_until=start)
            if note:
                self.log(note)
        probe = MemoryProbe(pm.device, enabled=cfg.memory != "off")
        # CPU memory is tracked on one step: the last warm-up step, and at least the second
        # (the first creates the optimizer states, so it is not the steady state).
        tracked_step = min(cfg.steps, start + max(2, cfg.warmup_steps))
        records: list[StepRecord] = []
        self.log(f"{self.source}: {self.plan.parallel.label()} | {pm.describe()} | "
                 f"steps {start + 1}..{cfg.steps}")
        for step in range(start + 1, cfg.steps + 1):
            if self._fault("hang", step):
                print(f"fault injection: rank {pm.rank} hangs before step {step}",
                      file=sys.stderr, flush=True)
                time.sleep(max(600.0, 10 * cfg.timeout_s))
            track = step == tracked_step and not probe.tracks_every_step
            t0 = time.perf_counter()
            if track:
                with probe.track(self.chunks, self.optimizers):
                    loss = self.train_step(step)
            else:
                loss = self.train_step(step)
            if pm.device.type != "cpu":
                torch.get_device_module(pm.device.type).synchronize()
            dt = time.perf_counter() - t0
            flops = self.flops_per_step / dt / self.plan.world_size
            rec = StepRecord(step=step, loss=loss, step_time_s=dt, tokens=self.tokens_per_step,
                             tokens_per_s=self.tokens_per_step / dt,
                             tflops_per_device=flops / 1e12,
                             mfu=flops / self.peak if self.peak else None,
                             lr=cfg.lr_at(step), memory_tracked=track)
            records.append(rec)
            writer.write(rec)
            if step % cfg.log_every == 0 or step == cfg.steps:
                self.log(f"step {step:5d} | loss {loss:.5f} | {dt * 1e3:8.1f} ms | "
                         f"{rec.tokens_per_s:10.0f} tok/s")
            if cfg.checkpoint_every and step % cfg.checkpoint_every == 0:
                crash = self._fault("save_crash", step)
                self.checkpointer.save(step, self.chunks, self.optimizers,
                                       self._train_state(step),
                                       after_shards=_sigkill if crash else None)
            if cfg.kill_after_step and step == cfg.kill_after_step:
                _sigkill()
            if self._fault("kill", step):
                _sigkill()
        probe.finish()
        memory = [None] * dist.get_world_size()
        dist.all_gather_object(memory, {"rank": pm.rank, **probe.to_dict()})
        if pm.rank != 0 or not records:
            return None
        prediction = self.plan.prediction.to_dict() if self.plan.prediction else None
        summary = summarize(records, warmup_steps=start + cfg.warmup_steps,
                            world_size=self.plan.world_size, peak=self.peak,
                            memory_per_rank=memory, prediction=prediction,
                            plan_label=self.plan.parallel.label(), plan_source=self.source,
                            device=pm.device.type)
        summary["run_config"] = cfg.to_dict()
        summary.update(run_identity(self.plan))      # checked by autoplan.calibrate
        atomic_write_text(self.out_dir / "summary.json",
                          json.dumps(summary, indent=2, sort_keys=True) + "\n")
        print(format_table(summary), flush=True)
        return summary


def _sigkill() -> None:
    """Die at once, as a crashed or OOM-killed process would (no cleanup, no exit code)."""
    os.kill(os.getpid(), signal.SIGKILL)
