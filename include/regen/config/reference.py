"""The Params reference (docs/params.md), written from the schema the DAG's Params, the CLI's flags
and its YAML share: one source, so the reference cannot drift from what the form and the CLI take
(`make docs` writes it; tests/test_docs.py fails when the committed page differs)."""

from __future__ import annotations

import json
import typing
from typing import Any

from regen.config.run import run_fields
from regen.paths import PROJECT_ROOT, VAR_DIR

HEADER = """# Params

The DAG's Params (the trigger form), the CLI's `--config` YAML and its flags (`--max-tokens 2048`,
`--no-enable-thinking`, `--gpus 0,1,2`) are one schema, `include/regen/config/`; an invalid value is
refused with the field named, in the trigger form and in the CLI. Every Param has a default that
runs on a CPU. A *deployment field* is set by the deployment's config file and is not in the trigger
form: a triggered run may not change it ([Who may choose what](deployment.md#who-may-choose-what)). This page is written from the
schema by `make docs`.

| section | name | default | choices | meaning |
| --- | --- | --- | --- | --- |
"""


def _default(field) -> str:
    if field.default_factory is not None:
        value: Any = field.default_factory()
    else:
        value = field.default
    if value is None or value == "":
        return "empty"
    if isinstance(value, str):  # paths of this checkout as a clone names them
        value = value.replace(str(VAR_DIR), "var").replace(str(PROJECT_ROOT) + "/", "")
    return f"`{json.dumps(value)}`"


def _choices(field) -> str:
    annotation = field.annotation
    literal = [a for a in (annotation, *typing.get_args(annotation)) if typing.get_origin(a) is typing.Literal]
    return ", ".join(f"`{c}`" for c in typing.get_args(literal[0])) if literal else ""


def _cell(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|")


def params_reference() -> str:
    """docs/params.md: a row per field, in the schema's order (its section, flat name, default,
    choices, and its title and description)."""
    rows = []
    for name, flat in run_fields().items():
        info = flat.info
        meaning = (info.title or name).rstrip(".")
        if info.description:
            meaning += ". " + info.description
        rows.append(f"| {flat.section} | `{name}` | {_default(info)} | {_choices(info)} | {_cell(meaning)} |")
    return HEADER + "\n".join(rows) + "\n"
