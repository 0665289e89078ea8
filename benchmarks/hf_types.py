"""Every causal-LM architecture the installed transformers knows, planned from its config.

For each ``model_type`` of transformers' ``MODEL_FOR_CAUSAL_LM_MAPPING_NAMES`` (196 in
transformers 5.24), a fresh process runs::

    autoplan plan hf:TYPE --set num_hidden_layers=2 --cluster dgx-a100 --nodes 2 \\
        --global-batch 32 -o PLAN.json

(the type's default config, cut to two layers where the config takes that key -- for a
composite vision- or audio-language config, its language model's; ``num_layers=2`` for a
config that names it so (LongCat-Flash), and uncut where autoplan takes neither key
(Nemotron-H's list of block types: :func:`layer_key`) -- so that a row costs seconds) and
the outcome is classified:

* **planned** (exit 0, a plan written);
* **refused** (exit 2, autoplan's one-line ``error:``): a data-dependent op (an MoE router
  calling ``.item()``), a module looping over the sequence (``MAX_OPS_PER_CALL`` of
  ``autoplan/trace/capture.py``), a default config its own model class cannot build, a
  config whose layer count has another name (``num_layers``), ...;
* **crashed** (any other exit status, or a traceback): a defect;
* **timed out** (over ``--timeout`` seconds, 180 by default): a defect, the user sees a
  hang.

Targets: no crash, no time-out, and at least 70% of the types planned. The rows give each
type's outcome, wall seconds (rows run ``--jobs`` at a time) and its error line.

    python benchmarks/hf_types.py [--jobs 2] [--only llama,mixtral] [--timeout 180]
    python benchmarks/hf_types.py --quick        # two types (the tests run this)
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import ROOT, print_table, target, write_results  # noqa: E402

QUICK = ("llama", "dbrx")   # one that plans; one whose config transformers fails to build
PLANNED_SHARE = 0.70


def types() -> list[str]:
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


def layer_key(model_type: str) -> str | None:
    """The key of ``model_type``'s config that autoplan takes as its layer count:
    ``num_hidden_layers`` (an alias such as GPT-2's ``n_layer``, or a composite config's
    language model's), else ``num_layers`` (LongCat-Flash), else None: the default config is
    planned uncut (Nemotron-H's layers are a list of block types, BLT's sit in sub-configs)."""
    from autoplan.errors import ConfigError
    from autoplan.models.registry import resolve

    for key in ("num_hidden_layers", "num_layers"):
        try:
            resolve(f"hf:{model_type}", **{key: 2})
        except ConfigError as exc:
            if "unknown" in str(exc) and key in str(exc):
                continue
        except Exception:  # noqa: BLE001 -- the plan's own process reports what is wrong
            pass
        return key
    return None


def run_type(model_type: str, timeout: float, work: Path) -> dict:
    """One ``autoplan plan`` of ``model_type`` in a fresh process: outcome, CPU s, error."""
    key = layer_key(model_type)
    cut = ["--set", f"{key}=2"] if key else []
    cmd = [sys.executable, "-m", "autoplan.cli", "plan", f"hf:{model_type}", *cut,
           "--cluster", "dgx-a100", "--nodes", "2", "--global-batch", "32",
           "-o", str(work / f"{model_type}.json")]
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        out, err = proc.communicate(timeout=timeout)
        code = proc.returncode
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
        code = None
    wall = time.perf_counter() - t0
    if code == 0:
        outcome, why = "planned", ""
    elif code is None:
        outcome, why = "timed out", f"over {timeout:.0f} s"
    elif code == 2 and "Traceback" not in err:
        outcome = "refused"
        lines = [ln for ln in err.splitlines() if ln.startswith("error:")] or \
            err.strip().splitlines()[-1:]
        why = lines[-1] if lines else ""
    else:
        outcome = "crashed"
        raised = [ln for ln in err.splitlines() if re.match(r"^[\w.]*(Error|Exception)\b", ln)]
        why = raised[-1] if raised else f"exit {code}"
    return {"type": model_type, "outcome": outcome, "exit": code, "wall_s": round(wall, 1),
            "why": " ".join(why.split())[:300]}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", help="comma-separated model types")
    ap.add_argument("--quick", action="store_true", help=f"only {', '.join(QUICK)}")
    ap.add_argument("--jobs", type=int, default=1, help="types planned at once (default 1)")
    ap.add_argument("--timeout", type=float, default=180.0, help="seconds per type")
    args = ap.parse_args(argv)
    names = types()
    if args.quick:
        names = [n for n in QUICK if n in names]
    elif args.only:
        names = [n for n in args.only.split(",") if n]
    with tempfile.TemporaryDirectory() as tmp, \
            ThreadPoolExecutor(max(1, args.jobs)) as pool:
        rows = list(pool.map(lambda n: run_type(n, args.timeout, Path(tmp)), names))
    counts = {k: sum(r["outcome"] == k for r in rows)
              for k in ("planned", "refused", "crashed", "timed out")}
    print_table("transformers causal-LM types, planned on 16 A100s (2 layers each)",
                ["type", "outcome", "wall s", "why"],
                [[r["type"], r["outcome"], r["wall_s"], r["why"][:110]] for r in rows])
    share = counts["planned"] / max(1, len(rows))
    targets = [
        target("types that crash (a traceback or an unexpected exit)", "0",
               counts["crashed"], counts["crashed"] == 0),
        target(f"types over {args.timeout:.0f} s", "0", counts["timed out"],
               counts["timed out"] == 0),
        target("types planned", f">= {PLANNED_SHARE:.0%}",
               f"{counts['planned']}/{len(rows)}",
               args.quick or args.only is not None or share >= PLANNED_SHARE),
    ]
    import transformers

    name = "hf_types_quick" if args.quick else "hf_types"
    write_results(name, rows, targets, extra={"counts": counts,
                                              "transformers": transformers.__version__})
    return 0 if all(t["met"] for t in targets) else 1


if __name__ == "__main__":
    sys.exit(main())
