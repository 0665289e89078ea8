"""The JSON Schema of every ``autoplan COMMAND --json`` output (``output.schema.json``,
JSON Schema draft 2020-12, shipped as package data).

    from autoplan.schema import schema_for
    jsonschema.validate(doc, schema_for("estimate"))

One definition per command under ``$defs``; ``plan``, ``show`` and ``estimate`` share
``plan_output``, whose fields the README's "Output fields" table lists (tests/
test_output_schema.py checks the two agree). Validating needs the ``jsonschema`` package
(a test dependency); reading the schema does not.
"""

from __future__ import annotations

import json
from functools import lru_cache
from pathlib import Path
from typing import Any

FILE = Path(__file__).with_name("output.schema.json")


@lru_cache(maxsize=1)
def load() -> dict[str, Any]:
    """The whole schema document."""
    return json.loads(FILE.read_text())


def commands() -> list[str]:
    """The commands with a definition (those whose --json output is specified)."""
    return sorted(k for k, v in load()["$defs"].items() if v.get("description", "").startswith("`autoplan "))


def schema_for(command: str) -> dict[str, Any]:
    """A schema for ``autoplan COMMAND --json``: the command's definition with the document's
    ``$defs`` beside it, so its references resolve."""
    doc = load()
    if command not in doc["$defs"]:
        raise KeyError(f"no schema for {command!r}; known: {', '.join(commands())}")
    return {"$schema": doc["$schema"], "$defs": doc["$defs"],
            "$ref": f"#/$defs/{command}"}
