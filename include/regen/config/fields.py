"""The run's fields by their flat names: what Params, CLI flags and config files call them.

:class:`regen.config.RunConfig` groups its fields by job (servers, engine options, sampling,
...), but a user writes them flat (``max_tokens: 2048``, ``--sim-ttft-s 1``, the Param
``max_tokens``): each group's field has the flat name ``prefix + field`` unless the group names
it otherwise. This module maps the two, once, for everything that shows or reads fields by name.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, ClassVar

from pydantic import BaseModel, ConfigDict, ValidationError
from pydantic.fields import FieldInfo

from regen.errors import RegenError
from regen.secrets import flagged_values, is_secret_name


class ConfigError(RegenError, ValueError):
    """A config that cannot be used; the message names each bad field, one per line."""


class Options(BaseModel):
    """A group of the run's fields. ``section``: where its fields show in the trigger form and
    the Params reference (a field may name its own); ``flat_prefix`` and ``flat_names``: their flat names."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)
    section: ClassVar[str] = "Run"
    flat_prefix: ClassVar[str] = ""
    flat_names: ClassVar[dict[str, str]] = {}

    @classmethod
    def flat_name(cls, attr: str) -> str:
        return cls.flat_names.get(attr, cls.flat_prefix + attr)


@dataclass(frozen=True)
class FlatField:
    """One field as a user names it: ``group`` is the RunConfig attribute holding it (None for
    a top-level field) and ``attr`` its name there."""

    name: str
    group: str | None
    attr: str
    info: FieldInfo
    section: str

    @property
    def annotation(self) -> Any:
        return self.info.annotation


def section_of(info: FieldInfo, default: str) -> str:
    return (info.json_schema_extra or {}).get("section", default) if isinstance(info.json_schema_extra, dict) else default


@functools.cache
def flat_fields(model: type[BaseModel]) -> dict[str, FlatField]:
    """Every field of ``model`` (RunConfig) by flat name, in declaration order, groups inlined."""
    out: dict[str, FlatField] = {}
    for name, info in model.model_fields.items():
        group = info.annotation if isinstance(info.annotation, type) and issubclass(info.annotation, Options) else None
        if group is None:
            out[name] = FlatField(name, None, name, info, section_of(info, "Run"))
            continue
        for attr, sub in group.model_fields.items():
            flat = group.flat_name(attr)
            out[flat] = FlatField(flat, name, attr, sub, section_of(sub, group.section))
    return out


def nest(model: type[BaseModel], data: dict[str, Any]) -> dict[str, Any]:
    """Flat names folded into their groups; a group given as a mapping is kept and merged, and
    unknown names stay where validation will name them."""
    fields = flat_fields(model)
    out: dict[str, Any] = {}
    for key, value in data.items():
        field = fields.get(key)
        if field is not None and field.group is not None:
            group = out.setdefault(field.group, {})
            if isinstance(group, dict):
                group[field.attr] = value
                continue
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = {**value, **out[key]}
        else:
            out[key] = value
    return out


def flatten(model: type[BaseModel], nested: dict[str, Any]) -> dict[str, Any]:
    return {name: (nested[f.group][f.attr] if f.group else nested[name])
            for name, f in flat_fields(model).items() if (f.group or name) in nested}


def flat_location(model: type[BaseModel], loc: tuple) -> str:
    """A validation error's location by the flat name a user wrote."""
    parts = [str(p) for p in loc]
    if len(parts) >= 2:
        for name, f in flat_fields(model).items():
            if f.group == parts[0] and f.attr == parts[1]:
                return ".".join([name, *parts[2:]])
    return ".".join(parts) or "(config)"


def did_you_mean(name: str, known) -> str:
    """`` (did you mean 'max_tokens'?)`` for a name close to a known one; empty otherwise."""
    import difflib

    close = difflib.get_close_matches(name.split(".")[-1], list(known), n=1, cutoff=0.75)
    return f" (did you mean {close[0]!r}?)" if close else ""


def format_validation_error(model: type[BaseModel], exc: ValidationError, source: str) -> str:
    """One line per bad field, named as the user wrote it, with the value it got; never a
    secret's value (a task log, an alert and an import error all repeat this message): not for a
    secret field, not for an error of the whole config (its input is every field), and any
    secret that would still appear in the text is replaced."""
    secrets = {name for name, f in flat_fields(model).items()
               if isinstance(f.info.json_schema_extra, dict) and f.info.json_schema_extra.get("secret")}
    lines = []
    for err in exc.errors():
        field = flat_location(model, err["loc"])
        msg = "unknown field" + did_you_mean(field, flat_fields(model)) if err["type"] == "extra_forbidden" else err["msg"]
        # An unknown field may be the key under a misspelt name: its value is never shown either.
        hidden = (field.split(".")[0] in secrets or is_secret_name(field.split(".")[-1]) or not err["loc"]
                  or err["type"] == "extra_forbidden")
        shown = "" if hidden else f" (got {err.get('input')!r})"
        lines.append(f"{source}: field '{field}': {msg}{shown}")
    text = "\n".join(lines)
    for value in _secret_values(exc, secrets):
        text = text.replace(value, "<redacted>")
    return text


def _secret_values(exc: ValidationError, secrets: set[str]) -> set[str]:
    """The values given for secret fields anywhere in the failed input (flat or grouped)."""
    found: set[str] = set()

    def walk(value: Any) -> None:
        if isinstance(value, dict):
            for key, item in value.items():
                if (key in secrets or is_secret_name(key)) and isinstance(item, str) and item:
                    found.add(item)
                walk(item)
        elif isinstance(value, list):
            for item in value:
                walk(item)

    for err in exc.errors():
        walk(err.get("input"))
        found |= flagged_values(err.get("input"))  # a key inside another field's value
    return found
