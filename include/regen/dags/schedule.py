"""A regen DAG's schedule, as a deployment writes it: in REGEN_SCHEDULE or a config file's
``schedule:``. Airflow's side of a run's definition; the run's config does not hold it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from regen.config import ConfigError


def schedule_spec(value: str | None) -> str | list[str] | None:
    """The DAG's schedule as the deployment sets it in REGEN_SCHEDULE, without a code change:
    empty or "none" (triggered by hand), a cron expression or preset ("0 3 * * 6", "@weekly"),
    or "asset:URI" terms joined by "|" (a run when any of them updates, e.g. a new checkpoint)."""
    value = (value or "").strip()
    if value.lower() in ("", "none"):
        return None
    if value.startswith("asset:"):
        uris = [term.strip()[len("asset:"):] for term in value.split("|")]
        if not all(uris) or not all(term.strip().startswith("asset:") for term in value.split("|")):
            raise ConfigError(f"REGEN_SCHEDULE: {value!r}: write asset:URI[|asset:URI...]")
        return uris
    return value


def file_schedule(raw: Any, path: Path) -> str | list[str] | None:
    """A config file's ``schedule:`` (its DAG's, in a deployment's REGEN_CONFIG_DIR): a cron
    expression, a preset, "none", "asset:URI|..." or a list of asset URIs."""
    if isinstance(raw, list):
        if not raw or not all(isinstance(uri, str) and uri for uri in raw):
            raise ConfigError(f"{path}: field 'schedule': a list must hold asset URIs")
        return list(raw)
    if raw is None or isinstance(raw, str):
        try:
            return schedule_spec(raw)
        except ConfigError as exc:
            raise ConfigError(f"{path}: field 'schedule': {exc}") from None
    raise ConfigError(f"{path}: field 'schedule': a cron expression, a preset, 'none', "
                      f"'asset:URI|...' or a list of asset URIs (got {raw!r})")
