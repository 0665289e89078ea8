"""Structure-aware fuzzing of autoplan's inputs (issue #7): cluster YAML, plan JSON, profile
files and command lines. Shared by tests/test_fuzz_*.py and benchmarks/fuzz_counts.py.

Inputs look like real mistakes, not only random bytes: take a valid document (a preset
cluster YAML, a device file, a saved plan, a slice of a committed profile), apply up to three
structural mutations (drop / rename / add a key, a wrong type, negative / zero / huge / NaN /
inf numbers, unicode, nesting, a list where a mapping belongs, ...), serialise it, and maybe
damage the text (truncation, an inserted or deleted run, a duplicated line -- duplicate keys
in YAML --, a duplicated JSON key, a huge number literal, invalid UTF-8, very deep nesting, an
empty file, or a fully random string / random bytes).

Each ``check_*`` function loads one input and returns its outcome, ``"accepted"`` or
``"rejected: <ErrorType>"``, after asserting the contract of issue #7:

* accepted: the object re-validates and round-trips through its dict / file form;
* rejected: the error is the project's own type (an :class:`AutoplanError` subclass) whose
  message names the file, and the field whenever the text parses into a mapping;
* anything else -- a bare exception, a message without the file, an input that takes more
  than :data:`TIME_LIMIT_S` -- is a bug.

``run_*`` functions drive one surface with hypothesis, counting outcomes in a :class:`Tally`
the caller owns (no module-level state). With ``strict=True`` (the tests) the first
unexpected exception propagates, so hypothesis shrinks and reports it; with ``strict=False``
(the counts script) it is counted and the run goes on. ``seed`` fixes hypothesis's random
seed (reproducible counts).
"""

from __future__ import annotations

import contextlib
import copy
import io
import json
import math
import os
import re
import shutil
import signal
import string
import tempfile
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any, Callable, Iterator

import yaml
from hypothesis import HealthCheck, Phase, event, given, settings
from hypothesis import seed as hypothesis_seed
from hypothesis import strategies as st

from autoplan.errors import AutoplanError, ConfigError, PlanError
from autoplan.trust import key_label

REPO = Path(__file__).resolve().parents[1]
PROFILES = REPO / "profiles"
TIME_LIMIT_S = 20.0          # one input taking longer than this counts as a hang

#: hypothesis settings of every fuzz run (besides max_examples): no per-example deadline (a
#: shared 2-core machine), no example database (no .hypothesis/ folder to clean up).
FUZZ_SETTINGS = MappingProxyType(dict(
    deadline=None, database=None,
    suppress_health_check=(HealthCheck.too_slow, HealthCheck.data_too_large,
                           HealthCheck.filter_too_much)))

_FIELD = re.compile(r"field '(.*?)': ", re.DOTALL)


@contextlib.contextmanager
def scratch_dir(fallback: Path) -> Iterator[Path]:
    """A temporary folder in RAM (``/dev/shm``) where there is one, else under ``fallback``:
    a fuzz run writes a few thousand small files, and a disk-backed /tmp makes each write
    cost milliseconds."""
    shm = Path("/dev/shm")
    base = shm if shm.is_dir() and os.access(shm, os.W_OK) else fallback
    with tempfile.TemporaryDirectory(prefix="autoplan-fuzz-", dir=base) as d:
        yield Path(d)


# ---- counting ------------------------------------------------------------------------------

@dataclass
class Tally:
    """Outcomes of one surface: inputs tried, accepted, rejected by error type, unexpected."""

    surface: str
    tried: int = 0
    accepted: int = 0
    rejected: Counter = field(default_factory=Counter)
    unexpected: Counter = field(default_factory=Counter)
    examples: list[str] = field(default_factory=list)   # the first unexpected ones

    def record(self, outcome: str) -> None:
        self.tried += 1
        if outcome == "accepted":
            self.accepted += 1
        elif outcome.startswith("rejected"):
            self.rejected[outcome.partition(": ")[2] or "usage"] += 1
        event(outcome)

    def record_unexpected(self, exc: BaseException, note: str) -> None:
        self.tried += 1
        self.unexpected[type(exc).__name__] += 1
        if self.unexpected[type(exc).__name__] <= 3:      # the first few of each type
            self.examples.append(f"{type(exc).__name__}: {str(exc)[:300]} <- {note[:300]}")
        event(f"unexpected: {type(exc).__name__}")

    def as_dict(self) -> dict[str, Any]:
        return {"surface": self.surface, "tried": self.tried, "accepted": self.accepted,
                "rejected": sum(self.rejected.values()),
                "rejected_by_type": dict(sorted(self.rejected.items())),
                "unexpected": sum(self.unexpected.values()),
                "unexpected_by_type": dict(sorted(self.unexpected.items())),
                "unexpected_examples": list(self.examples)}

    def line(self) -> str:
        d = self.as_dict()
        return (f"{self.surface}: {d['tried']} inputs, {d['accepted']} accepted, "
                f"{d['rejected']} rejected {d['rejected_by_type']}, "
                f"{d['unexpected']} unexpected {d['unexpected_by_type']}")


class Hang(Exception):
    """One input ran past :data:`TIME_LIMIT_S`."""


@contextlib.contextmanager
def time_limit(seconds: float) -> Iterator[None]:
    """Raise :class:`Hang` in the main thread after ``seconds`` (SIGALRM)."""
    def on_alarm(signum, frame):
        raise Hang(f"no answer within {seconds:g} s")

    previous = signal.signal(signal.SIGALRM, on_alarm)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def _seeded(test: Callable, seed: int | None) -> Callable:
    """``test`` with hypothesis's random seed fixed (reproducible counts), or as it is."""
    return test if seed is None else hypothesis_seed(seed)(test)


def _run_one(tally: Tally, strict: bool, note: str, check: Callable[[], str]) -> None:
    try:
        with time_limit(TIME_LIMIT_S):
            outcome = check()
    except Exception as exc:  # noqa: BLE001 -- anything else is exactly the bug we look for
        tally.record_unexpected(exc, note)
        if strict:
            raise
        return
    tally.record(outcome)


# ---- values and structural mutations -------------------------------------------------------

_ODD_TEXT = ("", " ", "null", "NaN", "1e400", "-0", "0x10", "nvswitch", "h100-sxm", "cpu",
             "Shard(0)", "Replicate()", "bfloat16", "\u202egnp", "\u00e9t\u00e9", "\U0001F680",
             "\u0663", "line\nbreak", "tab\there", "a" * 300, "../../etc/passwd", "~", "*", "&")
_SCALARS = st.one_of(
    st.none(), st.booleans(),
    st.integers(min_value=-2 ** 64, max_value=2 ** 64),
    st.sampled_from([0, -1, 1, 2, 3, 7, 2 ** 31, 2 ** 63, 10 ** 30, 10 ** 400]),
    st.floats(),
    st.sampled_from([0.0, -0.0, 0.5, 1e-320, 1e308, math.nan, math.inf, -math.inf]),
    st.text(max_size=12), st.sampled_from(_ODD_TEXT))
_KEYS = st.one_of(st.text(max_size=10), st.sampled_from(["", "Name", "nodes ", "colour",
                                                         "format", "version", "\u00fc"]))
#: values that do not belong where they are put (deeper structures come from "nest")
BAD_VALUES = st.one_of(_SCALARS, st.lists(_SCALARS, max_size=3),
                       st.dictionaries(_KEYS, _SCALARS, max_size=3))

_OPS = ("replace", "replace", "drop", "rename", "add", "wrap", "flip", "nest", "number",
        "number", "swap")


def _paths(doc: Any, prefix: tuple = ()) -> list[tuple]:
    out = [prefix]
    if isinstance(doc, dict):
        for k, v in doc.items():
            out += _paths(v, prefix + (k,))
    elif isinstance(doc, list):
        for i, v in enumerate(doc):
            out += _paths(v, prefix + (i,))
    return out


def _get(doc: Any, path: tuple) -> Any:
    for p in path:
        doc = doc[p]
    return doc


def _set(doc: Any, path: tuple, value: Any) -> Any:
    """``doc`` with the node at ``path`` replaced (the root replaced when path is empty)."""
    if not path:
        return value
    _get(doc, path[:-1])[path[-1]] = value
    return doc


def _nested(value: Any, depth: int, as_list: bool) -> Any:
    for _ in range(depth):
        value = [value] if as_list else {"a": value}
    return value


def _number_tweaks(x: Any) -> list[Any]:
    out: list[Any] = [0, -1, 10 ** 400, math.nan, math.inf, -math.inf, True, str(x), [x],
                      None, 1e308, 2 ** 63]
    if isinstance(x, (int, float)) and not isinstance(x, bool) and abs(x) < 1e300:
        out += [-x, x * 1e300 if isinstance(x, float) else x * 10 ** 30, float(x) + 0.5,
                int(x) if isinstance(x, float) and math.isfinite(x) else float(x)]
    return out


def _pick(draw, items: list | tuple) -> Any:
    """One of ``items`` (an index draw: cheaper than building a sampled_from per call)."""
    return items[draw(st.integers(0, len(items) - 1))]


def mutate(draw, doc: Any) -> tuple[Any, str]:
    """One structural mutation of ``doc`` (modified in place where possible)."""
    paths = _paths(doc)
    path = _pick(draw, paths)
    op = _pick(draw, _OPS)
    node = _get(doc, path)
    parent = _get(doc, path[:-1]) if path else None
    where = ".".join(map(str, path)) or "<root>"
    if op == "drop" and path:
        del parent[path[-1]]
    elif op == "rename" and path and isinstance(parent, dict):
        key = path[-1]
        new = (draw(_KEYS) if draw(st.booleans()) else
               _pick(draw, [key + "s", key.upper(), key[:-1], key.replace("_", "-"), " " + key]))
        parent[new] = parent.pop(key)
        where += f" -> {new!r}"
    elif op == "add" and isinstance(node, dict):
        key = draw(_KEYS)
        node[key] = draw(BAD_VALUES)
        where += f" + {key!r}"
    elif op == "add" and isinstance(node, list):
        node.insert(draw(st.integers(0, len(node))), draw(BAD_VALUES))
    elif op == "wrap":
        doc = _set(doc, path, [node])
    elif op == "flip" and isinstance(node, dict):
        doc = _set(doc, path, list(node.values()))
    elif op == "flip" and isinstance(node, list):
        doc = _set(doc, path, {str(i): v for i, v in enumerate(node)})
    elif op == "nest":
        doc = _set(doc, path, _nested(node, draw(st.integers(1, 40)), draw(st.booleans())))
    elif op == "number":
        doc = _set(doc, path, _pick(draw, _number_tweaks(node)))
    elif op == "swap" and len(paths) > 1:
        other = _pick(draw, paths[1:])
        if other[:len(path)] != path and path[:len(other)] != other:
            a, b = copy.deepcopy(node), copy.deepcopy(_get(doc, other))
            doc = _set(doc, path, b)
            doc = _set(doc, other, a)
    else:
        doc = _set(doc, path, draw(BAD_VALUES))
        op = "replace"
    return doc, f"{op} {where}"


# ---- serialisation and text damage ---------------------------------------------------------

_YAML_DUMPER = getattr(yaml, "CSafeDumper", yaml.SafeDumper)   # libyaml when present: faster


def dump_yaml(doc: Any) -> str:
    return yaml.dump(doc, Dumper=_YAML_DUMPER, allow_unicode=True, sort_keys=False, width=100)


def dump_json(doc: Any) -> str:
    # one object per line at the top level (so line damage hits one field), the rest
    # compact: json's C encoder only runs without ``indent``, and the pure one is slow
    if isinstance(doc, dict) and doc:
        items = [f"{json.dumps(str(k), ensure_ascii=False)}: {json.dumps(v, ensure_ascii=False)}"
                 for k, v in doc.items()]
        return "{\n" + ",\n".join(items) + "\n}\n"
    return json.dumps(doc, ensure_ascii=False)


_INSERTS = ("{", "}", "[", "]", ":", ",", '"', "'", "\t", "- ", "&a ", "*a", "? ", "!!binary ",
            "!!python/object:os.system ", "\x00", "\ufeff", "\\u0000", "#", "%YAML 1.1\n", "---\n")


@dataclass(frozen=True)
class FuzzInput:
    """One generated input: the bytes written, and how they were made (for reports)."""

    data: bytes
    note: str


@st.composite
def documents(draw, seeds: list[tuple[str, Any]], dump: Callable[[Any], str], *,
              deep: Callable[[int, int], str]) -> FuzzInput:
    """A seed document, mutated up to three times, serialised, perhaps damaged as text."""
    name, seed = _pick(draw, seeds)
    notes = [name]
    choice = draw(st.integers(0, 19))
    if choice == 0:
        return FuzzInput(draw(st.binary(max_size=300)), "random bytes")
    if choice == 1:
        return FuzzInput(draw(st.text(max_size=300)).encode("utf-8", "surrogatepass"),
                         "random text")
    if choice == 2:
        depth = draw(st.sampled_from([50, 500, 5000, 100_000]))
        form = draw(st.integers(0, 1))
        return FuzzInput(deep(depth, form).encode(), f"nesting depth {depth} (form {form})")
    doc = copy.deepcopy(seed)
    for _ in range(draw(st.integers(0 if choice > 3 else 1, 3))):
        doc, note = mutate(draw, doc)
        notes.append(note)
    text = dump(doc)
    damage = draw(st.integers(0, 15))
    if damage == 0 and text:
        text = text[:draw(st.integers(0, len(text) - 1))]
        notes.append("truncated")
    elif damage == 1:
        at = draw(st.integers(0, len(text)))
        ins = draw(st.one_of(st.sampled_from(_INSERTS), st.text(min_size=1, max_size=4)))
        text = text[:at] + ins + text[at:]
        notes.append(f"inserted {ins!r}")
    elif damage == 2 and text:
        at = draw(st.integers(0, len(text) - 1))
        text = text[:at] + text[at + draw(st.integers(1, 20)):]
        notes.append("deleted a run")
    elif damage == 3:
        lines = text.splitlines(keepends=True)
        if lines:
            i = draw(st.integers(0, len(lines) - 1))
            lines.insert(i, lines[i])
            text = "".join(lines)
            notes.append(f"duplicated line {i + 1}")
    elif damage == 4:
        digits = [m.start() for m in re.finditer(r"\d+", text)]
        if digits:
            at = draw(st.sampled_from(digits))
            text = text[:at] + "9" * draw(st.sampled_from([400, 5000])) + text[at:]
            notes.append("huge number literal")
    elif damage == 5:
        notes.append("invalid UTF-8")
        raw = text.encode()
        at = draw(st.integers(0, len(raw)))
        return FuzzInput(raw[:at] + b"\xff\xfe\xc3" + raw[at:], " / ".join(notes))
    elif damage == 6:
        text = ""
        notes.append("empty")
    elif damage == 7 and text.lstrip().startswith("{"):
        key = draw(st.sampled_from(sorted(doc) or ["x"])) if isinstance(doc, dict) else "x"
        at = text.index("{") + 1
        text = text[:at] + f"{json.dumps(key)}: {json.dumps(draw(BAD_VALUES))}, " + text[at:]
        notes.append(f"duplicate JSON key {key!r}")
    return FuzzInput(text.encode("utf-8", "surrogatepass"), " / ".join(notes))


# ---- the contract --------------------------------------------------------------------------

class _DupYamlLoader(yaml.SafeLoader):
    """The oracle's YAML parser: PyYAML's (pure Python) safe loader, as autoplan uses,
    flagging duplicate keys."""


def _dup_mapping(loader, node, deep=False):
    keys = [loader.construct_object(k, deep=deep) for k, _ in node.value]
    try:
        if len(set(keys)) != len(keys):
            raise _Duplicate()
    except TypeError:
        raise _Duplicate() from None           # unhashable keys: not a plain mapping
    return loader.construct_mapping(node, deep=deep)


class _Duplicate(Exception):
    pass


_DupYamlLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _dup_mapping)


def _dup_pairs(pairs):
    keys = [k for k, _ in pairs]
    if len(set(keys)) != len(keys):
        raise _Duplicate()
    return dict(pairs)


def _bracket_depth(text: str) -> int:
    depth = deepest = 0
    for ch in text:
        if ch in "[{":
            depth += 1
            deepest = max(deepest, depth)
        elif ch in "]}" and depth:
            depth -= 1
    return deepest


def oracle_parse(data: bytes, kind: str) -> tuple[str, Any]:
    """How a careful reader sees ``data``: ('mapping', doc), ('other', doc), or ('unparsed',
    None) for text that is not UTF-8, not valid syntax, nested beyond the parser, or holds
    duplicate keys."""
    try:
        text = data.decode("utf-8")
        if kind == "yaml" and _bracket_depth(text) > 64:
            return "unparsed", None     # PyYAML's pure scanner is quadratic in the depth
        if kind == "yaml":
            doc = yaml.load(text, Loader=_DupYamlLoader)  # noqa: S506 (a SafeLoader)
        else:
            doc = json.loads(text, object_pairs_hook=_dup_pairs)
    except (ValueError, OverflowError, RecursionError, yaml.YAMLError, _Duplicate, TypeError):
        return "unparsed", None     # OverflowError: a "\U999..." escape beyond chr()'s range
    return ("mapping" if isinstance(doc, dict) else "other"), doc


def assert_names_location(message: str, files: tuple[str, ...],
                          parse: Callable[[], tuple[str, Any]], known_roots: set[str]) -> None:
    """The error message names the file, and a field when the text parses into a mapping
    (one in the schema or in the document); when it parses into something else, it says the
    top level is wrong. ``parse`` is the oracle (:func:`oracle_parse`), called only when the
    message names no field or names one outside the schema."""
    assert any(f in message for f in files), f"message does not name {files}: {message!r}"
    assert "Traceback" not in message
    found = _FIELD.search(message)
    if found:
        name = found.group(1)
        root = re.split(r"[.\[]", name, maxsplit=1)[0]
        if root in known_roots or root == "<top level>":
            return
        parsed, doc = parse()
        keys = {str(k) for k in doc} if isinstance(doc, dict) else set()   # YAML: 'on' -> True
        # a key as messages name it: "" for the empty key, control characters escaped
        labels = keys | {key_label(k) for k in keys}
        assert root in labels or name in labels, \
            f"field {name!r} is in neither the document nor the schema: {message!r}"
        return
    parsed, _ = parse()
    assert parsed != "mapping", f"message names no field: {message!r}"
    if parsed == "other":
        assert "top level" in message, f"message does not say the top level is wrong: " \
                                       f"{message!r}"


# ---- surface: cluster and device YAML ------------------------------------------------------

CLUSTER_ROOTS = {"name", "nodes", "devices_per_node", "device", "intra_node", "inter_node",
                 "description", "device_overrides", "source"}
DEVICE_ROOTS = {"name", "peak_tflops", "memory_gb", "memory_bandwidth_gbps", "family",
                "description", "sources"}
#: a cluster that any device suits (no GPU-only fabric), naming the fuzzed device file
FUZZ_DEVICE = "fuzz-dev"
_DEVICE_CLUSTER = {"name": "fuzz-device-host", "nodes": 2, "devices_per_node": 4,
                   "device": FUZZ_DEVICE,
                   "intra_node": {"kind": "pcie", "bandwidth_gbps": 20, "latency_us": 2},
                   "inter_node": {"kind": "ethernet", "bandwidth_gbps": 10, "latency_us": 10}}


def cluster_seeds() -> list[tuple[str, Any]]:
    """(name, document): every preset as written, presets in their self-contained plan form
    (device inline), and every device file (fuzzed as ``devices/fuzz-dev.yaml``)."""
    from autoplan.cluster import load_cluster

    seeds = []
    for path in sorted((PROFILES / "clusters").glob("*.yaml")):
        seeds.append((f"cluster:{path.stem}", yaml.safe_load(path.read_text())))
    for name in ("dgx-a100", "local-cpu"):
        seeds.append((f"cluster-inline:{name}", load_cluster(name).to_dict()))
    for path in sorted((PROFILES / "devices").glob("*.yaml")):
        seeds.append((f"device:{path.stem}", yaml.safe_load(path.read_text())))
    return seeds


def make_profiles_dir(root: Path) -> Path:
    """A writable copy of profiles/ (devices and cluster presets) for device-file fuzzing."""
    for sub in ("devices", "clusters"):
        shutil.copytree(PROFILES / sub, root / sub, dirs_exist_ok=True)
    return root


def check_cluster_input(inp: FuzzInput, device_file: bool, work: Path,
                        profiles_dir: Path) -> str:
    """Load a fuzzed cluster file (or a cluster naming a fuzzed device file)."""
    from autoplan.cluster import Cluster, load_cluster

    cluster_path = work / "cluster.yaml"
    if device_file:
        (profiles_dir / "devices" / f"{FUZZ_DEVICE}.yaml").write_bytes(inp.data)
        cluster_path.write_text(dump_yaml(_DEVICE_CLUSTER))
        files = (str(cluster_path), f"devices/{FUZZ_DEVICE}.yaml")
        roots = DEVICE_ROOTS | CLUSTER_ROOTS
    else:
        cluster_path.write_bytes(inp.data)
        files = (str(cluster_path),)
        roots = CLUSTER_ROOTS
    try:
        cluster = load_cluster(str(cluster_path), profiles_dir=profiles_dir)
    except AutoplanError as exc:
        assert isinstance(exc, ConfigError), f"{type(exc).__name__} is not a ConfigError"
        assert_names_location(str(exc), files, lambda: oracle_parse(inp.data, "yaml"), roots)
        if exc.field is not None:
            assert f"field '{exc.field}'" in str(exc)
        return f"rejected: {type(exc).__name__}"
    # accepted: every figure is a finite positive number, and it round-trips
    for value in (*cluster.device.peak_tflops.values(), cluster.device.memory_gb,
                  cluster.device.memory_bandwidth_gbps, cluster.intra_node.bandwidth_gbps,
                  cluster.inter_node.bandwidth_gbps):
        assert isinstance(value, float) and math.isfinite(value) and value > 0
    assert cluster.world_size >= 1
    assert Cluster.from_dict(cluster.to_dict(), profiles_dir=profiles_dir) == cluster
    again = work / "again.yaml"
    again.write_text(dump_yaml(cluster.to_dict()))
    assert load_cluster(str(again), profiles_dir=profiles_dir) == cluster
    return "accepted"


def run_cluster_fuzz(tally: Tally, work: Path, *, max_examples: int = 1000,
                     strict: bool = True, seed: int | None = None) -> Tally:
    """Fuzz cluster YAML files and device files through :func:`autoplan.cluster.load_cluster`."""
    seeds = cluster_seeds()
    profiles_dir = make_profiles_dir(work / "profiles")
    def deep(n: int, form: int) -> str:     # flow brackets, or block sequences ("- - - x")
        return "a: " + "[" * n + "]" * n if form == 0 else "a:\n" + "- " * n + "x\n"

    @settings(max_examples=max_examples, **FUZZ_SETTINGS)
    @given(st.data())
    def fuzz(data):
        inp = data.draw(documents(seeds, dump_yaml, deep=deep))
        device_file = inp.note.startswith("device:")
        _run_one(tally, strict, inp.note,
                 lambda: check_cluster_input(inp, device_file, work, profiles_dir))

    _seeded(fuzz, seed)()
    return tally


# ---- surface: plan JSON --------------------------------------------------------------------

PLAN_ROOTS = {"format", "version", "created_by", "model", "model_fingerprint", "num_params",
              "cluster", "global_batch", "seq_len", "mesh", "parallel", "stages",
              "param_placements", "precision", "prediction", "alternatives", "planner"}


def plan_seeds(work: Path) -> list[tuple[str, Any]]:
    """Two saved plans: the search's best plan for a small MLP (pipelined, interleaved) and a
    GPT configuration with TP + SP, PP, ZeRO-1 and checkpointing (per-parameter placements)."""
    import autoplan

    work.mkdir(parents=True, exist_ok=True)
    plans = {
        "plan:mlp-tiny": autoplan.optimize("mlp-tiny", "local-cpu", global_batch=8, top_k=3),
        "plan:gpt-tiny": autoplan.estimate("gpt-tiny", "local-cpu", global_batch=8, tp=2,
                                           pp=2, zero=1, checkpoint="full",
                                           sequence_parallel=True),
    }
    seeds = []
    for name, plan in plans.items():
        path = plan.save(work / f"{name.split(':')[1]}.json")
        seeds.append((name, json.loads(path.read_text())))
    return seeds


def _finite_numbers(obj: Any, where: str = "") -> None:
    if isinstance(obj, dict):
        for k, v in obj.items():
            _finite_numbers(v, f"{where}.{k}")
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            _finite_numbers(v, f"{where}[{i}]")
    else:
        assert (isinstance(obj, (int, float)) and not isinstance(obj, bool)
                and math.isfinite(obj)), f"prediction{where} = {obj!r} is not a finite number"


def _load_json_input(inp: FuzzInput, path: Path, load, error: type, roots):
    """Write the fuzzed bytes to ``path`` and ``load`` them: ``(object, None)``, or
    ``(None, "rejected: <error>")`` once the rejection is checked to be ``error`` naming
    the file and the field."""
    path.write_bytes(inp.data)
    try:
        return load(path), None
    except AutoplanError as exc:
        assert isinstance(exc, error), f"{type(exc).__name__} is not a {error.__name__}"
        assert_names_location(str(exc), (str(path),), lambda: oracle_parse(inp.data, "json"),
                              roots)
        return None, f"rejected: {error.__name__}"


def check_plan_input(inp: FuzzInput, work: Path) -> str:
    """Load a fuzzed plan file with :meth:`Plan.load`."""
    from autoplan.cluster import Cluster
    from autoplan.models.registry import ModelSpec
    from autoplan.plan import Plan

    path = work / "plan.json"
    plan, rejected = _load_json_input(inp, path, Plan.load, PlanError, PLAN_ROOTS)
    if rejected:
        return rejected
    # accepted: it validates, its embedded sections are valid, its figures are finite
    # numbers, and it survives save -> load byte for byte
    plan.validate()
    try:
        Cluster.from_dict(plan.cluster, source=str(path))
        ModelSpec.from_dict(plan.model, source_file=str(path))
    except ConfigError as exc:
        raise AssertionError(f"accepted a plan whose embedded cluster or model is invalid: "
                             f"{exc}") from None
    if plan.prediction is not None:
        _finite_numbers(plan.prediction.to_dict())
    text = plan.to_json()
    again = Plan.from_dict(json.loads(text), source="<round trip>")
    assert again.to_json() == text
    return "accepted"


def run_plan_fuzz(tally: Tally, work: Path, *, max_examples: int = 1000,
                  strict: bool = True, shrink: bool = True,
                  seeds: list[tuple[str, Any]] | None = None,
                  seed: int | None = None) -> Tally:
    """Fuzz plan files through :meth:`autoplan.plan.Plan.load` (``shrink=False``: report the
    first failing input as found, without minimising it; ``seeds``: :func:`plan_seeds`)."""
    work.mkdir(parents=True, exist_ok=True)
    seeds = seeds or plan_seeds(work / "seeds")
    def deep(n: int, form: int) -> str:
        inner = "[" * n + "]" * n if form == 0 else '{"a": ' * n + "1" + "}" * n
        return '{"format": "autoplan.plan", "version": 1, "x": ' + inner + "}"

    phases = tuple(Phase) if shrink else (Phase.explicit, Phase.reuse, Phase.generate)

    @settings(max_examples=max_examples, phases=phases, **FUZZ_SETTINGS)
    @given(st.data())
    def fuzz(data):
        inp = data.draw(documents(seeds, dump_json, deep=deep))
        _run_one(tally, strict, inp.note, lambda: check_plan_input(inp, work))

    _seeded(fuzz, seed)()
    return tally


# ---- surface: op and link profile files ----------------------------------------------------

OP_ROOTS = {"format", "version", "device", "sources", "entries"}
LINK_ROOTS = {"format", "version", "cluster", "backend", "levels_present", "note", "sources",
              "points", "fits", "published"}


def profile_seeds() -> list[tuple[str, Any]]:
    """Slices of the committed profiles (a few entries / points / fits each, with the sources
    they cite): small enough that a thousand loads stay fast, with every kind of field."""
    seeds = []
    ops = json.loads((PROFILES / "ops" / "cpu-amd-epyc.json").read_text())
    keys = sorted(ops["entries"])
    picked = [k for k in keys if "timed_as" in ops["entries"][k]][:1] + keys[:2] + keys[-1:]
    entries = {k: ops["entries"][k] for k in picked}
    used = {e["source"] for e in entries.values()}
    seeds.append(("ops:cpu-amd-epyc", {**ops, "entries": entries,
                                       "sources": {k: v for k, v in ops["sources"].items()
                                                   if k in used}}))
    for name in ("local-cpu", "dgx-a100"):
        links = json.loads((PROFILES / "links" / f"{name}.json").read_text())
        small = {**links, "points": links["points"][:3], "fits": links["fits"][:3],
                 "published": links["published"][:2]}
        used = {x["source"] for x in small["points"] + small["fits"]}
        small["sources"] = {k: v for k, v in links["sources"].items() if k in used}
        seeds.append((f"links:{name}", small))
    return seeds


def check_profile_input(inp: FuzzInput, work: Path) -> str:
    """Load a fuzzed op or link profile file (the seed's kind) and, if accepted, write it back
    through the locked atomic writer and load that again."""
    from autoplan.profile.files import ProfileError, locked_update
    from autoplan.profile.store import LinkProfile, OpProfile

    cls, roots = (OpProfile, OP_ROOTS) if inp.note.startswith("ops:") else (LinkProfile,
                                                                             LINK_ROOTS)
    path = work / "profile.json"
    prof, rejected = _load_json_input(inp, path, cls.load, ProfileError, roots)
    if rejected:
        return rejected
    # compared as JSON text: a NaN in a free-form provenance record is not equal to itself
    text = json.dumps(prof.to_dict(), sort_keys=True)
    again = cls.from_dict(json.loads(text), source="<round trip>")
    assert json.dumps(again.to_dict(), sort_keys=True) == text
    out = work / "rewritten.json"
    out.unlink(missing_ok=True)
    locked_update(out, lambda current: prof.to_dict())
    assert json.dumps(cls.load(out).to_dict(), sort_keys=True) == text
    return "accepted"


def run_profile_fuzz(tally: Tally, work: Path, *, max_examples: int = 1000,
                     strict: bool = True, seed: int | None = None) -> Tally:
    """Fuzz op and link profile files through ``OpProfile.load`` / ``LinkProfile.load``."""
    work.mkdir(parents=True, exist_ok=True)
    seeds = profile_seeds()
    def deep(n: int, form: int) -> str:
        inner = "[" * n + "]" * n if form == 0 else '{"a": ' * n + "1" + "}" * n
        return '{"format": "autoplan.op_profile", "version": 1, "entries": ' + inner + "}"

    @settings(max_examples=max_examples, **FUZZ_SETTINGS)
    @given(st.data())
    def fuzz(data):
        inp = data.draw(documents(seeds, dump_json, deep=deep))
        if not inp.note.startswith(("ops:", "links:")):     # random text: pick a reader
            inp = FuzzInput(inp.data, data.draw(st.sampled_from(["ops:", "links:"])) + inp.note)
        _run_one(tally, strict, inp.note, lambda: check_profile_input(inp, work))

    _seeded(fuzz, seed)()
    return tally


# ---- surface: the command line -------------------------------------------------------------

SENTINEL = "SENTINEL: must survive a failed command\n"
_SAFE_NAME = st.text(alphabet=string.ascii_letters + string.digits + "._-\u00fc",
                     min_size=1, max_size=12).filter(lambda s: s not in (".", ".."))


@dataclass(frozen=True)
class CliEnv:
    """Files the command-line fuzzer points at: plan files (one valid, the rest broken in
    ways :meth:`Plan.load` reports), cluster files (valid and broken)."""

    valid_plan: str
    bad_plans: tuple[str, ...]
    clusters: tuple[str, ...]
    bad_clusters: tuple[str, ...]


def make_cli_env(root: Path, valid_plan: Path) -> CliEnv:
    from autoplan.plan import Plan

    root.mkdir(parents=True, exist_ok=True)
    text = valid_plan.read_text()
    doc = json.loads(text)
    bad = {"truncated.json": text[: len(text) // 2], "notjson.json": "plan: yes\n",
           "empty.json": "", "list.json": "[]\n",
           "version.json": json.dumps({**doc, "version": 99}),
           "unknown-key.json": json.dumps({**doc, "colour": "red"}),
           "stages.json": json.dumps({**doc, "stages": []})}
    for name, body in bad.items():
        (root / name).write_text(body)
    (root / "a-directory.json").mkdir(exist_ok=True)
    bad_plans = tuple(str(root / n) for n in [*bad, "a-directory.json", "missing.json"])
    for path in bad_plans:          # each must fail to load, before any expensive work
        try:
            Plan.load(path)
        except PlanError:
            continue
        raise AssertionError(f"{path} should not load")
    good_cluster = root / "good-cluster.yaml"
    good_cluster.write_text((PROFILES / "clusters" / "local-cpu.yaml").read_text())
    bad_clusters = {"bad-kind.yaml": dump_yaml({**yaml.safe_load(good_cluster.read_text()),
                                                "intra_node": {"kind": "wifi",
                                                               "bandwidth_gbps": 1,
                                                               "latency_us": 1}}),
                    "bad-syntax.yaml": "name: [unclosed\n", "bad-top.yaml": "- a\n- b\n"}
    for name, body in bad_clusters.items():
        (root / name).write_text(body)
    return CliEnv(valid_plan=str(valid_plan), bad_plans=bad_plans,
                  clusters=("local-cpu", str(good_cluster)),
                  bad_clusters=tuple(str(root / n) for n in [*bad_clusters, "missing.yaml"])
                  + ("no-such-preset", "dgx-a100/../x"))


_BAD_INTS = ["0", "-1", "-7", "1.5", "x", "", "1e3", " 7", "\u0663", "2147483648",
             "1" + "0" * 30, "-" + "9" * 40]
_INTS = st.one_of(st.integers(-2, 33).map(str), st.sampled_from(_BAD_INTS))
_SMALL_INTS = st.one_of(st.integers(-1, 9).map(str), st.sampled_from(["0", "-1", "x", "1.5"]))
_JUNK = st.one_of(st.sampled_from(["--bogus", "-x", "--", "-", "--json=1", "--nodes",
                                   "--top-k", "extra", "-o", "--help-me", "--=", "\u00fc"]),
                  st.text(alphabet=string.printable.strip() + "\u00fc\u4e2d", max_size=8))
#: --set values of the right type for the key (or unknown keys, or no '='): the paths that
#: reach the tracer; _SETS adds known keys with values of the wrong type ('layers="2"',
#: 'hidden=1e3'), which the model configs reject (tests/test_fuzz_cli.py pins them).
_SETS_TYPED = st.one_of(st.sampled_from(["kv_heads=2", "dropout=0.5", "bogus=1", "style=llama",
                                         "style=x", "=3", "noequals", "attention=sdpa",
                                         "attention=flash", "heads=0", "layers=-1",
                                         "kv_heads=3", "ffn_hidden=8", "depth=2",
                                         "n_layer=2"]),
                        st.tuples(_SAFE_NAME, _SAFE_NAME).map("=".join))
_SETS = st.one_of(_SETS_TYPED, st.sampled_from(['layers="2"', "hidden=1e3", "seq_len=null",
                                                "vocab_size=[1]", "hidden={}", "n_layer=x",
                                                "dropout=NaN", "kv_heads=0",
                                                "tie_embeddings=1", "layers=100000"]))


@st.composite
def cli_argvs(draw, env: CliEnv, *, expensive: bool) -> list[str]:
    """argv for plan / estimate / show / export / report.

    ``expensive=False``: ``plan`` and ``estimate`` always carry one input that fails before
    the model is traced (an unknown model, a bad cluster, a non-positive or absurd global
    batch or node count), so a thousand of them run in seconds; ``show`` / ``export`` get the
    valid plan or a broken one, ``report`` (which renders figures) only broken ones or a bad
    flag. ``expensive=True``: ``estimate --no-compare`` of a tiny model on a valid cluster and
    batch with mostly valid model-size, configuration and output flags -- the paths that
    trace and predict (``plan``'s search, ~1 s a run, is left to explicit tests).
    """
    outs = lambda: st.one_of(st.sampled_from(["out.json", "sentinel.json", "a-dir",  # noqa
                                              "a-file/x.json", "new/sub/out.json"]),
                             _SAFE_NAME)
    cmd = draw(st.sampled_from(["estimate"] if expensive else      # `plan` searches: ~1 s
                               ["plan", "estimate", "show", "export", "report"]))
    args: list[str] = [cmd]
    options: list[tuple[str, Any]] = []
    if cmd in ("plan", "estimate"):
        poison = None if expensive else draw(st.sampled_from(
            ["model", "cluster", "batch", "nodes"]))
        if poison == "model":
            model = draw(st.one_of(
                st.sampled_from(["gpt-5", "hf:no-such-type", "hf:/nonexistent/config.json",
                                 "import:autoplan_no_such_module:build", "import:json:nope",
                                 "import:json", "import:", "hf:", "", "-", "mlp-tiny "]),
                _SAFE_NAME.filter(lambda s: not s.startswith("-"))))
        elif expensive:
            model = draw(st.sampled_from(["mlp-tiny", "gpt-tiny"]))
        else:
            model = draw(st.sampled_from(["mlp-tiny", "gpt-tiny", "gpt", "gpt-1.7b",
                                          "llama3-8b", "hf:gpt2", "mlp"]))
        cluster = draw(st.sampled_from(env.bad_clusters if poison == "cluster"
                                       else env.clusters))
        batch = draw(st.sampled_from(["0", "-8", "-" + "9" * 30]) if poison == "batch"
                     else st.sampled_from(["4", "8", "16", "12"]))
        if poison == "nodes":
            options.append(("--nodes", draw(st.sampled_from(["0", "-2", "1" + "0" * 30,
                                                             "100000000"]))))
        args += [model, "--cluster", cluster, "--global-batch", batch]
        if expensive:      # mostly valid values: what matters is what tracing and planning do
            count = st.integers(1, 8).map(str)
            pool: list[tuple[str, Any]] = [
                ("--layers", st.sampled_from(["1", "2", "3", "0"])),
                ("--hidden", st.sampled_from(["8", "12", "16", "32", "0"])),
                ("--heads", st.sampled_from(["1", "2", "3", "4", "0"])),
                ("--vocab", st.sampled_from(["1", "16", "64", "100"])),
                ("--set", _SETS),
                ("--seq-len", st.sampled_from(["1", "8", "13", "16", "0", "-3"])),
                ("--nodes", st.sampled_from(["1", "2"])),
                ("--precision", st.sampled_from(["mixed", "fp32"])),
                ("--json", None), ("-o", outs()), ("--output", outs())]
            zero = st.sampled_from(["0", "1", "2", "3"])
            checkpoint = st.sampled_from(["none", "full"])
            schedule = st.sampled_from(["gpipe", "1f1b", "interleaved_1f1b"])
        else:
            count = _SMALL_INTS
            pool = [("--layers", _INTS), ("--hidden", _INTS), ("--heads", _INTS),
                    ("--vocab", _INTS), ("--set", _SETS), ("--seq-len", _INTS),
                    ("--nodes", _INTS),
                    ("--precision", st.sampled_from(["mixed", "fp32", "fp8", ""])),
                    ("--json", None), ("-o", outs()), ("--output", outs())]
            zero = _SMALL_INTS
            checkpoint = st.sampled_from(["none", "full", "some"])
            schedule = st.sampled_from(["gpipe", "1f1b", "interleaved_1f1b", "zb"])
        if poison == "nodes":           # a later --nodes would override the poisoned one
            pool = [p for p in pool if p[0] != "--nodes"]
        if cmd == "plan":
            pool += [("--top-k", count)]
        else:
            pool += [("--tp", count), ("--pp", count), ("--dp", count), ("--zero", zero),
                     ("--micro-batch", count), ("--checkpoint", checkpoint),
                     ("--schedule", schedule), ("--virtual-stages", count), ("--sp", None)]
            options.append(("--no-compare", None))    # the search is `plan`'s to test
    else:
        plan_files = ([*env.bad_plans] if cmd == "report"
                      else [env.valid_plan, env.valid_plan, *env.bad_plans])
        args.append(draw(st.sampled_from(plan_files)))
        pool = [("--json", None), ("--top-k", _INTS)]
        if cmd == "export":
            args += ["--to", draw(st.sampled_from(["torchtitan", "megatron", "deepspeed",
                                                   "alpa", ""]))]
            pool += [("-o", outs()), ("--output", outs()), ("--steps", _INTS)]
            pool = [p for p in pool if p[0] != "--top-k"]
        if cmd == "report":
            pool += [("-o", outs()), ("--png", outs())]
    for flag, values in draw(st.lists(st.sampled_from(pool), max_size=5)):
        options.append((flag, None if values is None else draw(values)))
    for flag, value in options:
        args += [flag] if value is None else [flag, value]
    if expensive:
        return args
    for _ in range(draw(st.integers(0, 2) if draw(st.integers(0, 4)) == 0 else st.just(0))):
        args.insert(draw(st.integers(1, len(args))), draw(_JUNK))
    if draw(st.integers(0, 30)) == 0 and len(args) > 1:      # a required value cut off
        args = args[:draw(st.integers(1, len(args) - 1))]
    return args


def _prepare_workspace(work: Path) -> None:
    work.mkdir(parents=True)
    (work / "sentinel.json").write_text(SENTINEL)
    (work / "a-dir").mkdir()
    (work / "a-file").write_text(SENTINEL)


def _complete_output(path: Path) -> bool:
    """A finished output file: a loadable plan, a whole HTML page, or an exported config."""
    from autoplan.plan import Plan

    text = path.read_text(errors="replace")
    if text == SENTINEL:
        return True
    if text.rstrip().endswith("</html>"):
        return True
    try:
        Plan.load(path)
        return True
    except AutoplanError:
        return False


def check_cli_argv(argv: list[str], work: Path) -> str:
    """Run ``autoplan.cli.main(argv)`` in a fresh workspace; check the exit status, stderr and
    that no output file is partial."""
    from autoplan.cli import main

    _prepare_workspace(work)
    out, err = io.StringIO(), io.StringIO()
    usage_exit = False
    with contextlib.chdir(work), contextlib.redirect_stdout(out), \
            contextlib.redirect_stderr(err):
        try:
            rc = main(argv)
        except SystemExit as exc:          # argparse: usage errors exit 2, --help exits 0
            rc, usage_exit = exc.code, True
    stderr = err.getvalue()
    assert "Traceback" not in stderr, stderr
    assert rc in (0, 2), f"exit status {rc!r}; stderr {stderr[-500:]!r}"
    if usage_exit:
        assert ("usage:" in stderr and "error:" in stderr) if rc else "usage:" in out.getvalue()
    elif rc:
        lines = stderr.strip("\n").split("\n")
        assert len(lines) == 1 and lines[0].startswith("error: "), \
            f"expected one 'error: ...' line, got {stderr!r}"
    elif "--json" in argv and argv[0] in ("plan", "estimate", "show", "export", "report"):
        json.loads(out.getvalue())
    # nothing half-written: no temp files anywhere; after a failure the sentinels are intact
    # and any file there is complete; after plan / estimate every file written is a plan
    leftovers = [p for p in work.rglob(".*.tmp")]
    assert not leftovers, f"temp files left behind: {leftovers}"
    written = [p for p in work.rglob("*") if p.is_file() and p.name != "a-file"]
    if rc:
        assert (work / "a-file").read_text() == SENTINEL
        for path in written:
            assert _complete_output(path), f"partial output {path}: {path.read_bytes()[:200]!r}"
    elif argv[0] in ("plan", "estimate") and not usage_exit:
        from autoplan.plan import Plan

        for path in written:
            if path.read_text(errors="replace") != SENTINEL:
                Plan.load(path)
    return "accepted" if rc == 0 else ("rejected: usage" if usage_exit else "rejected: error")


def run_cli_fuzz(tally: Tally, work: Path, env: CliEnv, *, max_examples: int = 1000,
                 expensive: bool = False, strict: bool = True,
                 seed: int | None = None) -> Tally:
    """Fuzz ``autoplan.cli.main(argv)`` (see :func:`cli_argvs` for the two modes)."""
    work.mkdir(parents=True, exist_ok=True)

    @settings(max_examples=max_examples, **FUZZ_SETTINGS)
    @given(cli_argvs(env, expensive=expensive))
    def fuzz(argv):
        ws = work / f"ex{tally.tried}"
        _run_one(tally, strict, repr(argv), lambda: check_cli_argv(argv, ws))

    with untranslated():
        _seeded(fuzz, seed)()
    return tally


@contextlib.contextmanager
def untranslated() -> Iterator[None]:
    """``LANGUAGE=C`` while fuzzing the CLI: argparse asks gettext for a translation of every
    string it registers, and with a locale such as C.UTF-8 each lookup searches the disk for
    catalogues; that is two thirds of the ~13 ms ``main()`` spends building its parser.
    The messages are the same (argparse ships no catalogues here)."""
    before = os.environ.get("LANGUAGE")
    os.environ["LANGUAGE"] = "C"
    try:
        yield
    finally:
        if before is None:
            del os.environ["LANGUAGE"]
        else:
            os.environ["LANGUAGE"] = before
