"""The shape of the code base: the data flow stays visible (DESIGN.md, "one place per
concept").

* no import circles between modules of autoplan/ and engine/, except the model registry's
  plugin loop (the registry imports each built-in family, which registers itself);
* the planner side (autoplan/) never imports the runtime (engine/): what a runtime can
  execute is data (autoplan.capability), not a question asked of the engine; only the
  front doors that start the runtime for the user do;
* no module outside tests/ over 600 lines;
* no module imports another module's private names.
"""

import ast
import pathlib

import networkx as nx
import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
ALLOWED_CYCLE_MEMBERS = {"autoplan.models.registry"}     # the plugin loop
#: The front doors that start or wrap the runtime on the user's behalf (``autoplan run``, the
#: demo, ``autoplan.parallelize`` in the user's own script): the only autoplan modules that
#: may import engine.
RUNTIME_FRONT_DOORS = {"autoplan.cli", "autoplan.run_command", "autoplan.demo",
                       "autoplan.parallelize"}
MAX_LINES = 600


def _modules() -> dict[str, pathlib.Path]:
    out = {}
    for top in ("autoplan", "engine"):
        for p in (ROOT / top).rglob("*.py"):
            parts = p.relative_to(ROOT).with_suffix("").parts
            name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
            out[name] = p
    return out


def _imports(mods):
    """(importer, imported module, names) for every import statement, top level or not."""
    for m, p in mods.items():
        is_pkg = p.name == "__init__.py"
        for node in ast.walk(ast.parse(p.read_text())):
            if isinstance(node, ast.Import):
                for a in node.names:
                    yield m, a.name, ()
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    pkg = m.split(".")[: len(m.split(".")) - node.level + (1 if is_pkg else 0)]
                    base = ".".join(pkg + ([base] if base else []))
                for a in node.names:
                    full = f"{base}.{a.name}"
                    yield m, (full if full in mods else base), (a.name,)


def _owner(name, mods):
    while name and name not in mods:
        name = name.rpartition(".")[0]
    return name or None


@pytest.fixture(scope="module")
def graph():
    mods = _modules()
    g = nx.DiGraph()
    private = []
    for m, target, names in _imports(mods):
        t = _owner(target, mods)
        if t is None or t == m:
            continue
        g.add_edge(m, t)
        for n in names:
            if n.startswith("_") and not n.startswith("__") and t == target:
                private.append(f"{m} imports {t}.{n}")
    return mods, g, private


def test_no_import_circles(graph):
    _, g, _ = graph
    cycles = [c for c in nx.simple_cycles(g) if not set(c) & ALLOWED_CYCLE_MEMBERS]
    assert not cycles, "import circles: " + "; ".join(" -> ".join(c) for c in cycles)


def test_planner_side_never_imports_the_engine(graph):
    _, g, _ = graph
    bad = sorted(f"{a} -> {b}" for a, b in g.edges if a.startswith("autoplan")
                 and a not in RUNTIME_FRONT_DOORS and b.startswith("engine"))
    assert not bad, "planner modules importing engine: " + ", ".join(bad)


def test_no_module_over_600_lines(graph):
    mods, _, _ = graph
    big = sorted((n, len(p.read_text().splitlines())) for n, p in mods.items()
                 if len(p.read_text().splitlines()) > MAX_LINES)
    assert not big, f"modules over {MAX_LINES} lines: {big}"


def test_no_private_name_reaches(graph):
    _, _, private = graph
    assert not private, "; ".join(private)


#: String methods a hand-written placement parser would call on a placement string.
_STRING_PARSERS = {"startswith", "endswith", "replace", "split", "rsplit", "partition",
                   "removeprefix", "removesuffix", "strip", "match", "fullmatch", "search",
                   "compile", "findall"}
_PLACEMENT_WORDS = ("Shard", "Replicate", "Partial")


def test_placement_strings_are_parsed_in_one_module(graph):
    """autoplan.placement is the one parser/formatter of placement strings: no other module
    matches a regular expression for them (``Shard\\(``) or picks them apart with string
    methods (``p.startswith("Shard")``, ``p.replace("Shard(", ...)``)."""
    mods, _, _ = graph
    found = []
    for name, path in mods.items():
        if name == "autoplan.placement":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and any(
                    f"{w}\\(" in node.value for w in _PLACEMENT_WORDS):
                found.append(f"{name}:{node.lineno} regex {node.value!r}")
            elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and \
                    node.func.attr in _STRING_PARSERS:
                for arg in node.args:
                    if isinstance(arg, ast.Constant) and isinstance(arg.value, str) and any(
                            w in arg.value for w in _PLACEMENT_WORDS):
                        found.append(f"{name}:{node.lineno} .{node.func.attr}({arg.value!r})")
    assert not found, "placement strings parsed outside autoplan.placement: " + "; ".join(found)


def test_test_tiers_name_real_files():
    """tests/conftest.py gives each test one tier; the files it names for the fake-process-
    group tier exist, and every test file starting a fake process group is among them."""
    from conftest import FAKEPG_FILES

    tests = ROOT / "tests"
    assert all((tests / name).is_file() for name in FAKEPG_FILES), sorted(FAKEPG_FILES)
    fake = {p.name for p in tests.glob("test_*.py")
            if "FakeStore" + "()" in p.read_text() and not p.name.startswith("test_fuzz_")}
    assert fake <= FAKEPG_FILES, sorted(fake - FAKEPG_FILES)
