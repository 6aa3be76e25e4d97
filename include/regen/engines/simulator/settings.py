"""The simulator's settings, declared once: each is a field here, a command-line flag of
``regen sim`` (SGLang's own name where SGLang has the flag, ``--sim-*`` where it is a fault or a
speed knob of the simulator), and what the engine adapter (regen.engines.sim) passes at launch."""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field, fields
from typing import Any

from regen.engines.simulator.calls import TOOL_CALL_PARSERS

FAULT_MARKER = "[sim-fault]"

def _flag(name: str, help: str = "", default: Any = None, names_a_file: bool = False,
          choices: list[str] | None = None, fault: bool = False) -> Any:
    """``fault``: a knob that breaks the server on purpose (the deployment's, never a run's)."""
    return field(default=default, metadata={"flag": name, "help": help, "file": names_a_file, "choices": choices,
                                            "fault": fault})


@dataclass
class SimSettings:
    model_path: str | None = _flag("--model-path", "model directory: its config.json gives the context "
                                   "length, its tokenizer and chat template the token ids")
    served_model_name: str | None = _flag("--served-model-name")
    context_length: int | None = _flag("--context-length")
    max_running_requests: int | None = _flag("--max-running-requests", "the launch value; null in "
                                             "/server_info when not given, as SGLang")
    api_key: str | None = _flag("--api-key")
    speculative_algorithm: str | None = _flag("--speculative-algorithm")
    reasoning_parser: str | None = _flag("--reasoning-parser")
    tool_call_parser: str | None = _flag("--tool-call-parser", "read the calls a reply writes as SGLang's parser "
                                         "of that name does (without it, as SGLang: the calls' text in `content`)",
                                         choices=list(TOOL_CALL_PARSERS))
    seed: int = _flag("--random-seed", default=0)
    dp_size: int = _flag("--dp-size", "data parallel ranks: each runs up to the per-rank limit, and "
                         "/server_info reports one internal state per rank, as SGLang", 1)
    effective_max_running_requests: int | None = _flag(
        "--sim-effective-max-running-requests", "run and report fewer requests than "
        "--max-running-requests, as SGLang does on hybrid Mamba models (issue 38846)")
    tokens_per_second: float = _flag("--sim-tokens-per-second", "decode speed per request, alone in "
                                     "the batch (0: answer at once)", 0.0)
    batch_slowdown: float = _flag("--sim-batch-slowdown", "per-request decode speed with b running: "
                                  "tokens-per-second / (1 + this x (b-1))", 0.0)
    prefill_tokens_per_second: float = _flag("--sim-prefill-tokens-per-second", "prompt tokens "
                                             "prefilled a second while the batch waits (0: free)", 0.0)
    ttft_s: float = _flag("--sim-ttft", "time to first token (s)", 0.0)
    prefix_cache_tokens: int = _flag("--sim-prefix-cache-tokens", "prompt tokens the prefix cache holds (at "
                                     "message boundaries, least recently used evicted): a request's cached "
                                     "prefix is not prefilled, as SGLang's radix cache saves it", 1_000_000)
    disable_radix_cache: bool = _flag("--disable-radix-cache", "no prefix cache, as SGLang's flag", False)
    enable_cache_report: bool = _flag("--enable-cache-report", "usage.prompt_tokens_details.cached_tokens in "
                                      "each response, as SGLang's flag", False)
    reasoning_median: int = _flag("--sim-reasoning-median", "median words of a thinking trace (0: 40 to 120, "
                                  "uniform)", 0)
    length_sigma: float = _flag("--sim-length-sigma", "spread of trace lengths around the median (log-normal "
                                "sigma; 0.77 puts the 99th percentile at 6x the median, as reasoning traces "
                                "are)", 0.0)
    failure_rate: float = _flag("--sim-failure-rate", "fraction of requests answered with HTTP 500", 0.0, fault=True)
    hang_rate: float = _flag("--sim-hang-rate", "fraction of requests that never answer", 0.0, fault=True)
    tool_divergence: float = _flag("--sim-tool-divergence", "fraction of tool-calling steps that call another "
                                   "tool of the request than the prompt asks for (or none), per prompt", 0.0)
    ignore_thinking: bool = _flag("--sim-ignore-thinking", "answer like a server launched with "
                                  "thinking off", False, fault=True)
    always_think: bool = _flag("--sim-always-think", "think whatever enable_thinking says (a chat template "
                               "that does not read the flag)", False, fault=True)
    ignore_thinking_after: int | None = _flag(
        "--sim-ignore-thinking-after", "think for the first N requests, then ignore enable_thinking "
        "(a server relaunched mid-run with the wrong flags)", fault=True)
    loop_rate: float = _flag("--sim-loop-rate", "fraction of answers whose reasoning loops on one sentence "
                             "until max_tokens (greedy decoding's repetition): every 1/F-th request", 0.0, fault=True)
    fault_port: int | None = _flag("--sim-faults-on-port", "the faults above only on the server of this port "
                                   "(one bad server of several)", fault=True)
    startup_delay_s: float = _flag("--sim-startup-delay", "seconds before /health answers 200", 0.0, fault=True)
    fail_while: str | None = _flag("--sim-fail-while", f"while FILE exists, answer HTTP 500 to prompts "
                                   f"containing {FAULT_MARKER!r} (a fault that goes away)", names_a_file=True, fault=True)
    follow_recorded: str | None = _flag(
        "--sim-follow-recorded", "call what each conversation of this prompts FILE records at the step "
        "(a model that behaves like the data), instead of what its last user message names", names_a_file=True)
    request_log: str | None = _flag("--sim-request-log", "append every chat request's messages to "
                                    "FILE (JSON lines; {port} in it becomes the server's port)", names_a_file=True)
    orphan_child: bool = _flag("--sim-orphan-child", "leave a child that ignores SIGTERM and outlives "
                               "the server, as SGLang's scheduler children have been seen to do "
                               "(issues 23627, 15165)", False, fault=True)

    @classmethod
    def run_flags(cls) -> frozenset[str]:
        """The simulator's own knobs that name no file and inject no fault (a triggered run may
        set these)."""
        return frozenset(f.metadata["flag"] for f in fields(cls) if f.metadata["flag"].startswith("--sim-")
                         and not f.metadata["file"] and not f.metadata["fault"])

    @property
    def served_name(self) -> str:
        return self.served_model_name or (self.model_path or "sim").rstrip("/").rsplit("/", 1)[-1]


def argument_parser() -> argparse.ArgumentParser:
    """``regen sim``'s flags: the settings', SGLang's that only need accepting, and where to listen."""
    p = argparse.ArgumentParser(prog="regen sim", description="an SGLang-compatible simulator")
    p.add_argument("--port", type=int, default=30000)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--enable-metrics", action="store_true", help="accepted; metrics are always on")
    for flag in ("--tp-size", "--speculative-num-steps", "--speculative-eagle-topk", "--speculative-num-draft-tokens",
                 "--mem-fraction-static", "--max-mamba-cache-size"):
        p.add_argument(flag, default=None, help="accepted for SGLang parity; no effect")
    for f in fields(SimSettings):
        kind = f.type if isinstance(f.type, type) else str(f.type)
        options: dict[str, Any] = {"dest": f.name, "help": f.metadata["help"] or None}
        if kind is bool or kind == "bool":
            p.add_argument(f.metadata["flag"], action="store_true", **options)
            continue
        base = kind.split("|")[0].strip() if isinstance(kind, str) else kind.__name__
        p.add_argument(f.metadata["flag"], type={"int": int, "float": float}.get(base, str),
                       default=f.default, choices=f.metadata["choices"], **options)
    return p


def from_args(args: argparse.Namespace) -> SimSettings:
    return SimSettings(**{f.name: getattr(args, f.name) for f in fields(SimSettings)})


def to_argv(**values: Any) -> list[str]:
    """The flags that set ``values`` (settings by field name); defaults are left out."""
    argv: list[str] = []
    for f in fields(SimSettings):
        if f.name not in values or values[f.name] == f.default:
            continue
        value = values[f.name]
        argv += [f.metadata["flag"]] if value is True else [f.metadata["flag"], str(value)]
    return argv
