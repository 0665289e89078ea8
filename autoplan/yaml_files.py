"""Data files under ``profiles/``: where they live, and strict YAML reading.

Cluster and device files are data (DESIGN.md, "Trust"): read with ``yaml.SafeLoader`` (no
object construction), duplicate keys refused, flow nesting bounded before parsing (a file of
``[[[[...`` would otherwise exhaust the parser), the document's size with its aliases expanded
bounded before it is built (nine anchors of ten aliases each, a few hundred bytes, expand to
10^9 values: the "billion laughs"), every error a one-line ConfigError naming the file.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import yaml

from autoplan.errors import ConfigError
from autoplan.user_files import read_bytes


def profiles_root(profiles_dir: str | os.PathLike | None = None) -> Path:
    """``profiles_dir``, else ``$AUTOPLAN_PROFILES``, else the repository's ``profiles/``."""
    if profiles_dir is not None:
        return Path(profiles_dir)
    env = os.environ.get("AUTOPLAN_PROFILES")
    if env:
        return Path(env)
    return Path(__file__).resolve().parents[1] / "profiles"


class _StrictLoader(yaml.SafeLoader):
    """yaml.SafeLoader that rejects duplicate keys (PyYAML keeps the last one silently)."""


def _construct_mapping(loader: _StrictLoader, node: yaml.MappingNode, deep: bool = False):
    seen: set[Any] = set()
    for key_node, _ in node.value:
        key = loader.construct_object(key_node, deep=deep)
        try:
            hash(key)
        except TypeError:
            raise yaml.constructor.ConstructorError(
                None, None, f"a key must be a plain value, not a {type(key).__name__}",
                key_node.start_mark) from None
        if key in seen:
            raise yaml.constructor.ConstructorError(
                None, None, f"duplicate key {key!r}", key_node.start_mark)
        seen.add(key)
    return loader.construct_mapping(node, deep=deep)


_StrictLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG,
                              _construct_mapping)


#: Deepest ``[`` / ``{`` nesting read: PyYAML's scanner slows quadratically with the depth
#: (100,000 brackets would take hours) and its constructor recurses; no real file nests so.
MAX_FLOW_DEPTH = 64


def _flow_depth_exceeded(text: str, limit: int = MAX_FLOW_DEPTH) -> int | None:
    """The 1-based line where bracket nesting first exceeds ``limit`` (quotes not parsed:
    an over-estimate, harmless at this limit), else None."""
    depth = 0
    for i, ch in enumerate(text):
        if ch in "[{":
            depth += 1
            if depth > limit:
                return text.count("\n", 0, i) + 1
        elif ch in "]}" and depth:
            depth -= 1
    return None


#: Most values (scalars, sequences, mappings) a document may hold with its aliases expanded;
#: a cluster file holds a few dozen, a device file with per-dtype peaks about a hundred.
MAX_EXPANDED_VALUES = 100_000


class _TooLarge(ValueError):
    """The document, its aliases expanded, is larger than a data file can be, or holds itself."""


def _expanded_values(root: yaml.Node, limit: int = MAX_EXPANDED_VALUES) -> int:
    """Values ``root`` holds with every alias expanded, counting stops past ``limit``. An
    alias is the same node object as its anchor, so the count is memoised per node: linear
    in the file, whatever the expansion. A node that contains itself (``a: &x [*x]``) raises
    :class:`_TooLarge`: expanded, it has no end."""
    sizes: dict[int, int] = {}
    open_: set[int] = set()

    def size(node: yaml.Node) -> int:
        key = id(node)
        if key in open_:
            raise _TooLarge(f"line {node.start_mark.line + 1}: an alias (*name) inside its "
                            f"own anchor's value")
        if key not in sizes:
            open_.add(key)
            children: list[yaml.Node] = []
            if isinstance(node, yaml.SequenceNode):
                children = node.value
            elif isinstance(node, yaml.MappingNode):
                children = [n for pair in node.value for n in pair]
            total = 1
            for child in children:
                total = min(limit + 1, total + size(child))
            open_.discard(key)
            sizes[key] = total
        return sizes[key]

    return size(root)


def _load(text: str) -> Any:
    """The document of ``text``: composed, its expanded size checked, then constructed."""
    loader = _StrictLoader(text)
    try:
        node = loader.get_single_node()
        if node is None:
            return None
        if _expanded_values(node) > MAX_EXPANDED_VALUES:
            raise _TooLarge(f"more than {MAX_EXPANDED_VALUES:,} values once its aliases "
                            f"(*name) are expanded")
        return loader.construct_document(node)
    finally:
        loader.dispose()


def read_yaml(path: Path, shown: str) -> dict[str, Any]:
    """Parse a YAML mapping; syntax errors become ConfigError with the line and column."""
    try:
        raw = read_bytes(path)
    except OSError as exc:
        raise ConfigError(f"cannot read ({exc.strerror})", source=shown) from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = raw.count(b"\n", 0, exc.start) + 1
        raise ConfigError(f"not UTF-8 text: byte 0x{raw[exc.start]:02x} at line {line}",
                          source=shown) from None
    deep_line = _flow_depth_exceeded(text)
    if deep_line is not None:
        raise ConfigError(f"invalid YAML at line {deep_line}: nested more than "
                          f"{MAX_FLOW_DEPTH} levels deep", source=shown)
    try:
        data = _load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(exc, "problem", None) or str(exc)
        raise ConfigError(f"invalid YAML{where}: {problem}", source=shown) from None
    except RecursionError:
        raise ConfigError("invalid YAML: nested too deeply", source=shown) from None
    except _TooLarge as exc:
        raise ConfigError(f"refused: {exc}", source=shown) from None
    except (ValueError, OverflowError) as exc:   # an int of > 4300 digits, a 13th month, ...
        raise ConfigError(f"invalid YAML: a value cannot be read ({exc})", source=shown) from None
    if not isinstance(data, dict):
        raise ConfigError(f"top level must be a mapping, got {type(data).__name__}",
                          source=shown)
    return data
