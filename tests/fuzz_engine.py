"""Fuzzing past loading (issue 14): fuzzed plans through the engine's pre-launch validation,
and fuzzed complete checkpoints through the checkpoint verifier. Shared by
tests/test_fuzz_engine.py and benchmarks/fuzz_counts.py; counted in a
:class:`fuzz_helpers.Tally` like the loading surfaces.

* **pre-launch**: a runnable plan (one of :func:`prelaunch_seeds`: data, tensor, pipeline
  parallel, ZeRO-3, and search plans forced onto the per-op runtime) with up to three
  mutations aimed at what the engine reads (``seq_len``, ``precision``, ``parallel``,
  ``stages``, ``param_placements``, ``mesh``, ``global_batch``, ``planner``, ``layout``,
  the model config), then :meth:`Plan.from_dict` and, if it loads,
  :func:`engine.preflight.prelaunch_check` — every check ``autoplan run`` makes before
  torchrun starts. Outcomes: rejected at load (PlanError), rejected before launch (an
  AutoplanError), accepted; anything else is unexpected. An accepted plan that differs
  from its seed in what the engine reads is "accepted (changed)": the counts script runs a
  sample of those under torchrun, where a crash (a traceback, not an ``error:`` line) is a
  silent wrong result of validation.
* **checkpoint**: one small real checkpoint (two complete steps) is built once; each input
  copies it and damages it — flipped bits, truncation, appended or replaced bytes, deletion
  of a file of each kind (shard, ``.metadata``, train state, manifest), a forged manifest
  field, damage to both steps, or another run's fingerprints — then
  :func:`engine.manifest.choose` picks the checkpoint to resume. Expected: the newest
  undamaged checkpoint, a clear CheckpointError when none is left, a CheckpointMismatch for
  another run. A damaged checkpoint chosen is a *silent wrong result* (its losses would
  differ); any other exception is unexpected.
"""

from __future__ import annotations

import copy
import json
import random
import shutil
from pathlib import Path
from typing import Any

from hypothesis import Phase, given, settings
from hypothesis import strategies as st

from fuzz_helpers import (BAD_VALUES, FUZZ_SETTINGS, Tally, _number_tweaks, _pick, _run_one,
                          _seeded, mutate)

#: Plan fields the engine reads (what a pre-launch mutation aims at).
ENGINE_FIELDS = ("seq_len", "precision", "parallel", "stages", "param_placements", "mesh",
                 "global_batch", "planner", "layout", "model")
_PLACEMENTS = ("Shard(0)", "Shard(1)", "Shard(2)", "Shard(-1)", "Replicate()", "Partial()",
               "Shard(0) ", "shard(0)", "")
_DTYPES = ("float32", "bfloat16", "float16", "int8", "float64", "", "fp32")


class SilentWrong(AssertionError):
    """A damaged checkpoint verified, or an accepted plan crashed the engine."""


# ---- pre-launch ----------------------------------------------------------------------------

def prelaunch_seeds() -> list[tuple[str, dict]]:
    """Plans the engine runs (the tests' own builder), as JSON documents."""
    from engine_helpers import make_plan

    plans = {"dp2-zero3": make_plan(dp=2, zero=3, num_micro_batches=2),
             "tp2-sp": make_plan(tp=2, sp=True),
             "pp2-1f1b": make_plan(pp=2, num_micro_batches=2),
             "dp2-per-op": make_plan(dp=2), "tp2-per-op": make_plan(tp=2)}
    out = []
    for name, plan in plans.items():
        doc = json.loads(plan.to_json())
        if name.endswith("per-op"):
            doc["planner"] = {"name": "auto", "runtime": "per_op"}
        out.append((name, doc))
    return out


@st.composite
def prelaunch_documents(draw, seeds: list[tuple[str, dict]]) -> tuple[dict, dict, str]:
    """(seed document, mutated document, note)."""
    name, seed = _pick(draw, seeds)
    doc = copy.deepcopy(seed)
    notes = [name]
    for _ in range(draw(st.integers(1, 3))):
        key = _pick(draw, ENGINE_FIELDS)
        kind = draw(st.integers(0, 3))
        # (an earlier mutation of this document may have replaced a section with a
        # non-mapping: then the generic mutation below takes it as it is)
        if key == "precision" and kind < 3 and isinstance(doc.get("precision"), dict):
            sub = _pick(draw, ["params", "compute", "reduce"])
            doc["precision"][sub] = _pick(draw, _DTYPES)
            notes.append(f"precision.{sub}={doc['precision'][sub]!r}")
        elif key == "param_placements" and kind < 3 and \
                isinstance(doc.get("param_placements"), dict) and doc["param_placements"] \
                and all(isinstance(v, dict) for v in doc["param_placements"].values()):
            fqn = _pick(draw, sorted(doc["param_placements"]))
            axis = _pick(draw, ["dp", "tp", "pp", "x"])
            doc["param_placements"][fqn][axis] = _pick(draw, _PLACEMENTS)
            notes.append(f"param_placements.{fqn}.{axis}")
        elif key in ("seq_len", "global_batch") and kind < 3:
            doc[key] = _pick(draw, _number_tweaks(doc.get(key) or 32) + [64, 4096, 1, 3])
            notes.append(f"{key}={doc[key]!r}")
        elif key == "parallel" and kind < 3 and isinstance(doc.get("parallel"), dict) \
                and doc["parallel"]:
            sub = _pick(draw, sorted(doc["parallel"]))
            value = doc["parallel"][sub]
            doc["parallel"][sub] = (_pick(draw, _number_tweaks(value) + [1, 2, 4])
                                    if isinstance(value, int) and not isinstance(value, bool)
                                    else draw(BAD_VALUES))
            notes.append(f"parallel.{sub}={doc['parallel'][sub]!r}"[:80])
        else:
            sub, note = mutate(draw, doc.get(key) if isinstance(doc.get(key), (dict, list))
                               else {key: doc.get(key)})
            if isinstance(doc.get(key), (dict, list)):
                doc[key] = sub
            elif isinstance(sub, dict) and key in sub:
                doc[key] = sub[key]
            notes.append(f"{key}: {note}"[:80])
    return seed, doc, "; ".join(notes)


def engine_view(doc: dict) -> str:
    """What the engine reads of a plan document, canonically."""
    return json.dumps({k: doc.get(k) for k in ENGINE_FIELDS}, sort_keys=True, default=str)


def check_prelaunch(seed: dict, doc: dict, work: Path, changed: list[dict]) -> str:
    """Load ``doc`` and run the pre-launch checks (module docstring). Appends accepted
    documents that differ from ``seed`` to ``changed``."""
    from autoplan.errors import AutoplanError, PlanError
    from autoplan.plan import Plan
    from engine.preflight import prelaunch_check

    try:
        plan = Plan.from_dict(copy.deepcopy(doc), source="fuzzed.json")
    except PlanError:
        return "rejected: PlanError at load"
    try:
        prelaunch_check(plan, "fuzzed.json", world_size=plan.world_size)
    except AutoplanError as exc:
        message = str(exc)
        assert message and "\n" not in message.strip(), f"not one line: {message!r}"
        return f"rejected: {type(exc).__name__} before launch"
    if engine_view(doc) != engine_view(seed):
        changed.append(doc)
        return "accepted"
    return "accepted"


def run_prelaunch_fuzz(tally: Tally, work: Path, *, max_examples: int = 1000,
                       strict: bool = True, seed: int | None = None,
                       changed: list[dict] | None = None) -> Tally:
    work.mkdir(parents=True, exist_ok=True)
    seeds = prelaunch_seeds()
    changed = [] if changed is None else changed

    @settings(max_examples=max_examples, **FUZZ_SETTINGS)
    @given(prelaunch_documents(seeds))
    def fuzz(case):
        seed_doc, doc, note = case
        _run_one(tally, strict, note, lambda: check_prelaunch(seed_doc, doc, work, changed))

    _seeded(fuzz, seed)()
    return tally


# ---- checkpoints ---------------------------------------------------------------------------

def build_checkpoint(work: Path) -> tuple[Path, Any]:
    """A real 1-rank run with checkpoints at steps 2 and 4; (checkpoints dir, plan)."""
    import os
    import subprocess
    import sys

    from engine_helpers import engine_env, make_plan

    plan = make_plan()
    path = plan.save(work / "plan.json")
    env = {k: v for k, v in engine_env().items()
           if k not in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    proc = subprocess.run([sys.executable, "-m", "engine.run", str(path), "--out",
                           str(work / "run"), "--steps", "4", "--checkpoint-every", "2",
                           "--memory", "off", "--log-every", "4"], env=env,
                          capture_output=True, text=True, timeout=600, cwd=os.getcwd())
    if proc.returncode != 0:
        raise RuntimeError(f"building the checkpoint failed: {proc.stderr[-2000:]}")
    return work / "run" / "checkpoints", plan


_DAMAGE = ("flip", "flip", "flip", "truncate", "delete", "append", "replace", "empty",
           "forge", "both", "mismatch", "swap")


def _damage(rng: random.Random, step_dir: Path, kind: str) -> str:
    files = sorted(p for p in step_dir.rglob("*") if p.is_file())
    target = rng.choice(files)
    rel = target.relative_to(step_dir).as_posix()
    data = bytearray(target.read_bytes())
    if kind == "flip" and data:
        for _ in range(rng.randint(1, 8)):
            i = rng.randrange(len(data))
            data[i] ^= 1 << rng.randrange(8)
        target.write_bytes(bytes(data))
    elif kind == "truncate":
        target.write_bytes(bytes(data[: rng.randrange(max(1, len(data)))]))
    elif kind == "delete":
        target.unlink()
    elif kind == "append":
        target.write_bytes(bytes(data) + rng.randbytes(rng.randint(1, 64)))
    elif kind == "replace":
        target.write_bytes(rng.randbytes(len(data)))
    elif kind == "empty":
        target.write_bytes(b"")
    elif kind == "swap" and len(files) > 1:
        other = rng.choice([f for f in files if f != target])
        a, b = target.read_bytes(), other.read_bytes()
        if a == b:
            target.write_bytes(a + b"\0")
        else:
            target.write_bytes(b)
            other.write_bytes(a)
        rel += f" <-> {other.relative_to(step_dir).as_posix()}"
    else:                                  # forge: edit a manifest value
        man = step_dir / "manifest.json"
        doc = json.loads(man.read_text())
        key = rng.choice(["step", "world_size", "plan_fingerprint", "model_fingerprint",
                          "files"])
        doc[key] = ({"x": {"size": 1, "sha256": "0"}} if key == "files" else
                    doc[key] + 1 if isinstance(doc[key], int) else "f" * 16)
        man.write_text(json.dumps(doc))
        return f"forge manifest.{key}"
    return f"{kind} {rel}"


def check_checkpoint_case(pristine: Path, case_dir: Path, plan: Any, rng: random.Random
                          ) -> tuple[str, str]:
    """Damage a copy of ``pristine`` and run the verifier; (outcome, note)."""
    from engine.manifest import CheckpointMismatch, choose, plan_fingerprint

    shutil.rmtree(case_dir, ignore_errors=True)
    shutil.copytree(pristine, case_dir)
    steps = sorted((int(p.name.split("_")[1]), p) for p in case_dir.glob("step_*"))
    kind = rng.choice(_DAMAGE)
    notes = []
    damaged = set()
    ids = dict(world_size=1, plan_fp=plan_fingerprint(plan), model_fp=plan.model_fingerprint)
    if kind == "mismatch":
        ids[rng.choice(["plan_fp", "model_fp"])] = "0123456789abcdef"
        notes.append("another run's fingerprints")
    else:
        victims = [steps[-1]] + ([steps[0]] if kind == "both" else [])
        for step, path in victims:
            notes.append(f"step {step}: " + _damage(rng, path, rng.choice(_DAMAGE[:9])
                                                     if kind == "both" else kind))
            damaged.add(step)
    note = "; ".join(notes)
    try:
        found, skipped = choose(steps, **ids)
    except CheckpointMismatch:
        if kind != "mismatch":
            raise SilentWrong(f"a damaged checkpoint read as another run's: {note}") from None
        return "rejected: CheckpointMismatch", note
    if kind == "mismatch":
        raise SilentWrong("another run's checkpoint was accepted")
    if found is None:
        if len(damaged) < len(steps):
            raise SilentWrong(f"an undamaged checkpoint was skipped: {note}; {skipped}")
        return "rejected: CheckpointError (none verifies)", note
    step, path = found
    if _differs(pristine / path.name, path):
        raise SilentWrong(f"damaged step {step} verified: {note}")
    if step in damaged:                   # the damage changed nothing (e.g. a no-op swap)
        return "accepted", note
    for s, _ in steps:
        if s > step and s not in damaged:
            raise SilentWrong(f"skipped the undamaged newer step {s}: {note}")
    return ("rejected: fell back to the previous checkpoint" if skipped else "accepted"), note


def _differs(a: Path, b: Path) -> bool:
    """Whether checkpoint ``b`` differs from ``a`` in what resuming reads: the bytes of
    every data file, the manifest's content (a manifest that lost only its final newline
    still says the same)."""
    from engine.manifest import MANIFEST

    fa = sorted(p.relative_to(a).as_posix() for p in a.rglob("*") if p.is_file())
    fb = sorted(p.relative_to(b).as_posix() for p in b.rglob("*") if p.is_file())
    if fa != fb:
        return True
    for f in fa:
        x, y = (a / f).read_bytes(), (b / f).read_bytes()
        if f == MANIFEST and x != y:
            try:
                if json.loads(x) == json.loads(y):
                    continue
            except ValueError:
                return True
        if x != y:
            return True
    return False


def run_checkpoint_fuzz(tally: Tally, work: Path, *, max_examples: int = 1000,
                        strict: bool = True, seed: int = 0,
                        built: tuple[Path, Any] | None = None) -> Tally:
    """Damage ``max_examples`` copies of one real checkpoint (module docstring)."""
    work.mkdir(parents=True, exist_ok=True)
    pristine, plan = built or build_checkpoint(work / "build")

    @settings(max_examples=max_examples, phases=(Phase.generate,), **FUZZ_SETTINGS)
    @given(st.integers(0, 2 ** 64 - 1))
    def fuzz(case_seed):
        rng = random.Random(case_seed)
        _run_one(tally, strict, f"damage seed {case_seed}",
                 lambda: check_checkpoint_case(pristine, work / "case", plan, rng)[0])

    _seeded(fuzz, seed)()
    return tally


def run_accepted_plans(docs: list[dict], work: Path, *, limit: int = 8,
                       timeout: float = 240) -> list[dict[str, Any]]:
    """Run up to ``limit`` distinct accepted-and-changed plans under torchrun for 2 steps:
    each must train (exit 0) or stop with a one-line ``error:`` — a traceback is a plan
    validation let through. Returns one row per plan run."""
    import subprocess
    import sys

    from autoplan.plan import Plan
    from engine_helpers import engine_env

    seen, rows = set(), []
    for doc in docs:
        key = engine_view(doc)
        if key in seen:
            continue
        seen.add(key)
        if len(rows) >= limit:
            break
        i = len(rows)
        plan = Plan.from_dict(copy.deepcopy(doc), source="fuzzed.json")
        path = plan.save(work / f"accepted{i}.json")
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               f"--nproc_per_node={plan.world_size}", "-m", "engine.run", str(path),
               "--steps", "2", "--memory", "off", "--out", str(work / f"run{i}")]
        proc = subprocess.run(cmd, env=engine_env(), capture_output=True, text=True,
                              timeout=timeout)
        crashed = proc.returncode != 0 and ("Traceback" in proc.stderr
                                            or "error:" not in proc.stderr)
        rows.append({"plan": i, "returncode": proc.returncode, "crashed": crashed,
                     "tail": proc.stderr.strip().splitlines()[-1][:300]
                     if proc.returncode and proc.stderr.strip() else ""})
    return rows

