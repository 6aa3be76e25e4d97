"""The trigger form: one Airflow Param per run field, by its flat name, from the run's schema."""

from __future__ import annotations

import functools
from typing import Any

from regen.config import RunConfig, run_fields
from regen.config.deployment import DEPLOYMENT_FIELDS


@functools.cache
def _flat_properties() -> dict[str, dict[str, Any]]:
    """Each field's JSON schema by its flat name, with the form section it shows in."""
    top = RunConfig.model_json_schema()["properties"]
    out = {}
    for name, field in run_fields().items():
        if field.group is None:
            prop = dict(top[name])
        else:
            group = RunConfig.model_fields[field.group].annotation
            prop = dict(group.model_json_schema()["properties"][field.attr])
        out[name] = {**prop, "section": field.section}
    return out

# Never in the trigger form: regen sets `node` for a stage; the deployment's fields (the servers'
# key among them) are the deployment's to choose (regen.config.deployment). Airflow 3.3's form has
# no read-only input (a `const` Param is hidden only when its value is truthy), so they are absent:
# the DAG's page lists their values (RunDefinition.doc_md), and a REST conf that names one with
# another value is refused at preflight, naming the field and where the deployment sets it.
NOT_PARAMS = frozenset({"node", *DEPLOYMENT_FIELDS})
EMPTY_CHOICE = "(empty: not set)"


def param_schemas(defaults: RunConfig | None = None) -> dict[str, tuple[Any, dict[str, Any]]]:
    """Per run field: (default, JSON schema) for an Airflow Param, from the pydantic schema; the
    defaults are ``defaults``' values (a deployment's config file) or the schema's own.

    Optional fields become ``type: [T, "null"]`` so that Airflow's trigger form shows a plain
    input that may be left empty.
    """
    defaults = (defaults or RunConfig()).model_dump(mode="json")
    out: dict[str, tuple[Any, dict[str, Any]]] = {}
    for name, prop in _flat_properties().items():
        if name in NOT_PARAMS:
            continue
        prop = dict(prop)
        if "$ref" in prop.get("items", {}):
            # A list of objects (nodes): the form takes JSON, pydantic checks each field by name
            # when the run starts; the full object schema, copied into every task's Params, would
            # cost parse time in every DAG of a deployment.
            prop["items"] = {"type": "object", "required": ["name"]}
        spec: dict[str, Any] = {}
        variants = prop.pop("anyOf", None)
        if variants:
            types = []
            for variant in variants:
                types.append(variant.get("type", "string"))
                for key in ("enum", "items", "minimum", "maximum", "exclusiveMinimum",
                            "exclusiveMaximum", "const"):
                    if key in variant:
                        spec[key] = variant[key]
            if "const" in spec:
                spec["enum"] = [spec.pop("const")]
            if "enum" in spec and "null" in types:
                spec["enum"] = [*spec["enum"], None]
            spec["type"] = types
        for key in ("type", "enum", "items", "minimum", "maximum", "exclusiveMinimum",
                    "exclusiveMaximum", "title", "section"):
            if key in prop:
                spec[key] = prop[key]
        if "const" in prop:
            spec["enum"] = [prop["const"]]
        if None in spec.get("enum", ()):  # the form's label for leaving it empty, not "null"
            spec["values_display"] = {"null": EMPTY_CHOICE}
        # description_md: Airflow's form renders it as Markdown (a plain `description` shows backticks raw)
        spec["description_md"] = prop.get("description", "")
        out[name] = (defaults[name], spec)
    return out
