"""What a deployment decides without editing the DAG files: which runs exist and when they run.

Without ``REGEN_CONFIG_DIR`` there is one DAG, ``regenerate_dataset``, with the demo's defaults
and the schedule of ``REGEN_SCHEDULE``. With it, every ``NAME.yaml`` in that folder (a run config,
the same schema as ``regen ... --config``, plus an optional ``schedule:``) is its own DAG,
``regenerate_NAME``, whose Params default to the file's values. Read at parse time: small YAML
files and pydantic, no connection, nothing heavy.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from pathlib import Path

from regen.config import ConfigError, RunConfig, read_config_file
from regen.dags.schedule import file_schedule, schedule_spec

DEFAULT_DAG_ID = "regenerate_dataset"
_NAME = re.compile(r"^[A-Za-z0-9_\-]+$")


@dataclass(frozen=True)
class RunDefinition:
    """One DAG a deployment asks for: its id, its Params' defaults, its schedule and dataset."""

    dag_id: str
    config: RunConfig
    schedule: str | list[str] | None
    source: Path | None = None  # the config file, None for the built-in demo DAG

    @property
    def where(self) -> str:
        """Where this DAG's deployment fields are set, as messages and the trigger form name it."""
        return str(self.source) if self.source else "regen's built-in defaults, no REGEN_CONFIG_DIR"

    def doc_md(self, how_it_works: str) -> str:
        """The DAG's own page: which dataset it makes from what, with which model and when, then
        how every regen DAG works (``how_it_works``, the DAG file's text without its title)."""
        c = self.config
        nodes = f" over the nodes {', '.join(s.name for s in c.nodes)}" if c.nodes else ""
        when = ("on a schedule: " + (", ".join(f"`{s}`" for s in self.schedule) if isinstance(self.schedule, list)
                                     else f"`{self.schedule}`")) if self.schedule else "when triggered"
        body = how_it_works.strip()
        body = body.split("\n", 1)[1].lstrip() if body.startswith("###") else body
        return (f"### {self.dag_id}\n\nRegenerates `{c.prompts}` with the model `{c.model_path}` ({c.engine}"
                f"{nodes}) into `{c.output}`, {when}. Defaults and deployment fields from {self.where}.\n\n"
                f"{self.deployment_table()}\n\n{body}")

    def deployment_table(self) -> str:
        """The deployment fields' values: they are not in the trigger form (regen.dags.params), so
        the DAG's page is where a user reads them. The servers' key is never shown."""
        from regen.config.deployment import DEPLOYMENT_FIELDS

        rows = []
        for name in DEPLOYMENT_FIELDS:
            if name == "node":  # regen's own, per stage
                continue
            value = self.config.flat_value(name)
            if name == "api_key":
                shown = "set (never shown)" if value else "empty: a fresh key for each run"
            elif name == "nodes":
                shown = ", ".join(f"`{node.name}`" for node in value) or "empty: this machine"
            elif value in (None, "", []):
                shown = "empty"
            else:
                shown = f"`{json.dumps(value) if isinstance(value, list) else value}`"
            rows.append(f"| `{name}` | {shown.replace('|', '&#124;')} |")
        return ("#### Set by the deployment, not in the trigger form\n\nA run whose conf changes one of these "
                "is refused at preflight. Set in: " + self.where + ".\n\n| field | value |\n| --- | --- |\n"
                + "\n".join(rows))

    @property
    def dataset_name(self) -> str | None:
        """The Asset a finished run announces (configured DAGs); None: the shared alias only."""
        return self.dag_id if self.source else None


def config_dirs() -> list[Path]:
    """REGEN_CONFIG_DIR's folders (``os.pathsep`` between them, as PATH): a second node's override
    adds its folder to the first's."""
    return [Path(part) for part in os.environ.get("REGEN_CONFIG_DIR", "").strip().split(os.pathsep) if part.strip()]


def configured_file(path: Path) -> RunDefinition:
    """A deployment's ``NAME.yaml``; ConfigError naming the file and the field when it is bad."""
    if not _NAME.match(path.stem):
        raise ConfigError(f"{path}: the file name must be letters, digits, '_' or '-' (it names the DAG)")
    data = read_config_file(path)
    schedule = file_schedule(data.pop("schedule", None), path)
    cfg = RunConfig.from_mapping(data, source=str(path), base_dir=path.resolve().parent)
    return RunDefinition(f"regenerate_{path.stem}", cfg, schedule, path)


def run_definitions() -> tuple[list[RunDefinition], list[str]]:
    """The DAGs this deployment defines, and one message per config file that is broken."""
    folders = config_dirs()
    if not folders:
        return [RunDefinition(DEFAULT_DAG_ID, RunConfig(), schedule_spec(os.environ.get("REGEN_SCHEDULE")))], []
    definitions: dict[str, RunDefinition] = {}
    problems = []
    for folder in folders:
        if not folder.is_dir():
            problems.append(f"REGEN_CONFIG_DIR: {folder} is not a directory")
            continue
        for path in sorted(folder.glob("*.yaml")) + sorted(folder.glob("*.yml")):
            try:
                found = configured_file(path)
            except ConfigError as exc:
                problems.append(str(exc))
                continue
            if found.dag_id in definitions:
                problems.append(f"{path}: {found.dag_id} is already defined by {definitions[found.dag_id].source}")
            else:
                definitions[found.dag_id] = found
    return list(definitions.values()), problems


def queue() -> str:
    """On a Celery cluster, the queue of the GPU node's worker."""
    return os.environ.get("REGEN_QUEUE", "default")


def shard_pool() -> str:
    """A pool bounding the shards in flight."""
    return os.environ.get("REGEN_POOL", "default_pool")


def shard_retries() -> tuple[int, float]:
    """Automatic retries of a shard (each resumes from its journal) and the pause before each."""
    return int(os.environ.get("REGEN_SHARD_RETRIES", "2")), float(os.environ.get("REGEN_SHARD_RETRY_DELAY_S", "30"))


class NotRegenDag(ConfigError):
    """A DAG id that none of this deployment's definitions has."""


def triggered_config(dag_id: str, conf: dict | None) -> RunConfig:
    """The config of a run of ``dag_id`` triggered with ``conf``, read from this deployment's
    files as they are now (regen.config.deployment): what every task and the run page use."""
    from regen.config.deployment import triggered_run_config

    definitions = run_definitions()[0]
    mine = {d.dag_id: d for d in definitions}.get(dag_id)
    if mine is None:
        raise NotRegenDag(f"{dag_id!r} is not a regen DAG of this deployment (REGEN_CONFIG_DIR={os.environ.get('REGEN_CONFIG_DIR') or 'unset'})")
    others = {d.dag_id: d.config.output for d in definitions if d.dag_id != dag_id}
    return triggered_run_config(mine.config, mine.where, conf, others)
