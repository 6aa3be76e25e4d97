"""The simulator's HTTP app: SGLang's routes (/health, /v1/models, /server_info, /metrics,
/v1/chat/completions) over the batching scheduler, with the faults its settings ask for.

    regen sim --port PORT [--model-path DIR] [--sim-* ...]
"""

from __future__ import annotations

import asyncio
import json
import random
import subprocess
import sys
import time
from pathlib import Path

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse
from starlette.routing import Route

from regen.engines.simulator.batching import BatchScheduler, SimState
from regen.engines.simulator.prefixcache import PrefixCache
from regen.engines.simulator.calls import RecordedSteps, call_format, parse_calls, plan_calls, write_call
from regen.engines.simulator.settings import FAULT_MARKER, SimSettings, argument_parser, from_args
from regen.engines.simulator.text import SimTokens, compose, count_prompt_tokens, message_tokens
from regen.modelconfig import context_length
from regen.protocol import SAMPLING_FIELDS, ChatReply, chat_response, error_body, server_info


LOOP_SENTENCE = "wait , let me re-check that step once more .".split()


class SimServer:
    """One simulated server: its settings, counters, scheduler and routes."""

    def __init__(self, settings: SimSettings, port: int = 0):
        self.settings = settings
        self.faulty = settings.fault_port in (None, port)  # --sim-faults-on-port: this server's faults only
        self.request_log = settings.request_log.replace("{port}", str(port)) if settings.request_log else None
        self.state = SimState()
        self.tokens = SimTokens(settings.model_path) if settings.model_path else None
        self.effective = settings.effective_max_running_requests or settings.max_running_requests or 64
        self.scheduler = BatchScheduler(settings, self.effective * settings.dp_size, self.state)
        self.cache = PrefixCache(0 if settings.disable_radix_cache else settings.prefix_cache_tokens)
        self.failures = random.Random(settings.seed ^ 0x5EED)
        self.recorded = RecordedSteps(settings.follow_recorded) if settings.follow_recorded else None
        self.call_format = call_format(self.tokens.template_source() if self.tokens else None)

    def app(self) -> Starlette:
        return Starlette(routes=[
            Route("/health", self.health), Route("/health_generate", self.health),
            Route("/v1/models", self.models), Route("/server_info", self.server_info),
            Route("/get_server_info", self.server_info), Route("/metrics", self.metrics),
            Route("/v1/chat/completions", self.chat, methods=["POST"]),
        ])

    def ready(self) -> bool:
        return time.monotonic() - self.state.started >= self.settings.startup_delay_s

    def unauthorized(self, request: Request) -> JSONResponse | None:
        key = self.settings.api_key
        if key is None or request.headers.get("authorization") == f"Bearer {key}":
            return None
        return JSONResponse({"error": {"message": "Unauthorized", "code": 401}}, status_code=401)

    async def health(self, request: Request):
        if not self.ready():
            return PlainTextResponse("warming up", status_code=503)
        return PlainTextResponse("")

    async def models(self, request: Request):
        if (denied := self.unauthorized(request)) is not None:
            return denied
        s = self.settings
        return JSONResponse({"object": "list", "data": [{
            "id": s.served_name, "object": "model", "owned_by": "sglang",
            "root": s.model_path or "sim", "max_model_len": s.context_length}]})

    async def server_info(self, request: Request):
        s = self.settings
        args = {"model_path": s.model_path or "sim", "served_model_name": s.served_name,
                "context_length": s.context_length, "max_running_requests": s.max_running_requests,
                "speculative_algorithm": s.speculative_algorithm, "reasoning_parser": s.reasoning_parser,
                "dp_size": s.dp_size}
        return JSONResponse(server_info(args, s.dp_size, {
            "effective_max_running_requests_per_dp": self.effective,
            "memory_usage": {"token_capacity": s.prefix_cache_tokens},
            "last_gen_throughput": self.state.throughput(),
            "sim_waited_requests_total": self.state.waited_total,
            "sim_peak_requests_in_flight": self.state.peak,
            "sim_requests_in_flight": self.state.in_flight,
            "sim_busy_slot_seconds": round(self.state.busy_slot_seconds(), 3),
            "sim_first_request_at": self.state.first_request_at,
            "sim_last_reply_at": self.state.last_reply_at,
            "sim_longest_completion_tokens": self.state.longest_completion,
        }))

    async def metrics(self, request: Request):
        state, labels = self.state, f'{{model_name="{self.settings.served_name}"}}'
        gauges = {"num_running_reqs": state.running, "num_queue_reqs": state.queued,
                  "gen_throughput": f"{state.throughput():.3f}",
                  "spec_accept_length": 3.6 if self.settings.speculative_algorithm else 1.0}
        gauges["cache_hit_rate"] = f"{state.cached_tokens_total / max(state.prompt_tokens_total, 1):.4f}"
        counters = {"num_requests_total": state.requests_total, "prompt_tokens_total": state.prompt_tokens_total,
                    "generation_tokens_total": state.generation_tokens_total}
        lines = []
        for kind, values in (("gauge", gauges), ("counter", counters)):
            for name, value in values.items():
                lines += [f"# TYPE sglang:{name} {kind}", f"sglang:{name}{labels} {value}"]
        lines += ["# TYPE sglang:cached_tokens_total counter",
                  f'sglang:cached_tokens_total{labels[:-1]},cache_source="device"}} {state.cached_tokens_total}']
        return PlainTextResponse("\n".join(lines) + "\n", media_type="text/plain; version=0.0.4")

    async def chat(self, request: Request):
        if (denied := self.unauthorized(request)) is not None:
            return denied
        if not self.ready():
            return JSONResponse({"error": {"message": "server is warming up"}}, status_code=503)
        s, state = self.settings, self.state
        state.requests_total += 1  # every request received, rejected ones included
        if state.first_request_at is None:
            state.first_request_at = time.time()
        try:
            body = await request.json()
            messages = body["messages"]
            assert isinstance(messages, list) and messages
        except Exception:
            return JSONResponse(error_body("messages: field required", 400), status_code=400)
        try:
            templated = with_decoded_arguments(messages)
        except ValueError as exc:
            return JSONResponse(error_body(str(exc), 400), status_code=400)
        if self.request_log:
            with open(self.request_log, "a") as log_file:
                log_file.write(json.dumps({"messages": messages, "chat_template_kwargs": body.get("chat_template_kwargs"),
                                           **{k: body[k] for k in SAMPLING_FIELDS if k in body}}) + "\n")
        max_tokens = int(body.get("max_completion_tokens") or body.get("max_tokens") or 2048)
        prompt_tokens = count_prompt_tokens(messages)
        cached, _ = self.cache.lookup(messages, body.get("tools"), message_tokens)
        if prompt_tokens + max_tokens > s.context_length:
            return JSONResponse(error_body(
                f"Requested token count exceeds the model's maximum context length of {s.context_length} "
                f"tokens. You requested a total of {prompt_tokens + max_tokens} tokens: {prompt_tokens} "
                f"tokens from the input messages and {max_tokens} tokens for the completion.", 400), status_code=400)
        roll = self.failures.random()
        faulty = s.fail_while is not None and Path(s.fail_while).exists() and FAULT_MARKER in json.dumps(messages)
        if roll < s.failure_rate or faulty:
            return JSONResponse({"object": "error", "message": "simulated internal error", "code": 500},
                                status_code=500)
        kwargs = body.get("chat_template_kwargs") or {}
        degraded = self.faulty and (s.ignore_thinking or (s.ignore_thinking_after is not None
                                                          and state.requests_total > s.ignore_thinking_after))
        thinking = (bool(kwargs.get("enable_thinking", True)) or s.always_think) and not degraded
        reasoning, answer = compose(messages, thinking, body.get("seed"), s.seed, s.reasoning_median, s.length_sigma)
        if reasoning and self.faulty and s.loop_rate and state.requests_total % round(1 / s.loop_rate) == 0:
            reasoning = reasoning[:8] + LOOP_SENTENCE * (max_tokens // len(LOOP_SENTENCE) + 1)  # until max_tokens
        budget = max_tokens
        think_tokens = reasoning[:budget]
        budget -= len(think_tokens) + (1 if reasoning else 0)
        answer_tokens = answer[:max(budget, 0)]
        finished = len(think_tokens) == len(reasoning) and len(answer_tokens) == len(answer)
        completion = min(len(think_tokens) + (1 if reasoning else 0) + len(answer_tokens), max_tokens)
        state.in_flight += 1
        state.peak = max(state.peak, state.in_flight)
        try:
            if roll < s.failure_rate + s.hang_rate:
                await asyncio.sleep(3600)
            if s.ttft_s > 0:
                await asyncio.sleep(s.ttft_s)
            if s.tokens_per_second > 0:
                await self.scheduler.submit(prompt_tokens - cached, completion)  # the cached prefix is not prefilled
        finally:
            state.in_flight -= 1
        state.prompt_tokens_total += prompt_tokens
        state.cached_tokens_total += cached
        state.generation_tokens_total += completion
        state.longest_completion = max(state.longest_completion, completion)
        state.recent.append((time.monotonic(), completion))
        reply = ChatReply(content=" ".join(answer_tokens),  # "" when none, as SGLang 0.5.23 answers
                          reasoning_content=" ".join(think_tokens) if reasoning else None,
                          finish_reason="stop" if finished else "length",
                          prompt_tokens=prompt_tokens, completion_tokens=completion,
                          cached_tokens=cached if s.enable_cache_report else None)
        calls = plan_calls(messages, body.get("tools") if body.get("tool_choice") != "none" else None,
                           s.tool_divergence, body.get("seed"), s.seed, self.recorded) if finished else None
        text = reply.content
        if calls:  # the model writes its calls instead of an answer; the parser (if any) reads them
            text = "\n".join(write_call(c, self.call_format) for c in calls)
            reply.content = text
            if s.tool_call_parser:
                reply.content, parsed = parse_calls(text, s.tool_call_parser, body.get("tools"))
                reply.tool_calls = [{"id": c["id"], "type": "function", "function": {
                    "name": name, "arguments": json.dumps(arguments, ensure_ascii=False)}}
                    for c, (name, arguments) in zip(calls, parsed)] or None
                reply.finish_reason = "tool_calls" if reply.tool_calls else reply.finish_reason
        if self.tokens is not None and (body.get("return_prompt_token_ids") or body.get("return_token_ids")):
            prompt_ids, output_ids = self.tokens.ids(templated, kwargs, reply.reasoning_content, text, finished,
                                                     body.get("tools"))
            reply.prompt_token_ids = prompt_ids if body.get("return_prompt_token_ids") else None
            reply.completion_token_ids = output_ids if body.get("return_token_ids") else None
        state.last_reply_at = time.time()
        return JSONResponse(chat_response(s.served_name, reply))


def with_decoded_arguments(messages: list[dict]) -> list[dict]:
    """The messages as SGLang hands them to the chat template: each history call's arguments
    decoded to an object (``serving_chat.normalize_assistant_tool_call_arguments``, strict)."""
    out = []
    for message in messages:
        if message.get("role") == "assistant" and isinstance(message.get("tool_calls"), list):
            calls = []
            for call in message["tool_calls"]:
                function = dict(call.get("function") or {})
                if isinstance(function.get("arguments"), str):
                    try:
                        function["arguments"] = json.loads(function["arguments"])
                    except ValueError:
                        raise ValueError("Assistant tool call function.arguments must be valid JSON.") from None
                    if not isinstance(function["arguments"], dict):
                        raise ValueError("Assistant tool call function.arguments must be a JSON object.")
                calls.append({**call, "function": function})
            message = {**message, "tool_calls": calls}
        out.append(message)
    return out


def model_context_length(model_path: str) -> int:
    """As SGLang derives it (nested text_config, other key names, rope scaling); 32,768 when the
    config names none."""
    return context_length(json.loads((Path(model_path) / "config.json").read_text())) or 32768


def main(argv: list[str] | None = None) -> int:
    import uvicorn

    args = argument_parser().parse_args(argv)
    # As SGLang does at start-up: every resolved argument, the API key included.
    print(f"server_args=ServerArgs({', '.join(f'{k}={v!r}' for k, v in vars(args).items())})", flush=True)
    settings = from_args(args)
    if settings.model_path:
        if not (Path(settings.model_path) / "config.json").is_file():
            print(f"error: {settings.model_path}: no config.json (not a model directory)", file=sys.stderr)
            return 1
        settings.context_length = settings.context_length or model_context_length(settings.model_path)
    settings.context_length = settings.context_length or 32768
    print(f"regen sim: {settings.served_name} on http://{args.host}:{args.port} "
          f"(context {settings.context_length}, max running {settings.max_running_requests or 64}"
          f"{', ignoring enable_thinking' if settings.ignore_thinking else ''}"
          f"{'' if settings.model_path else ', no model directory: no token ids'})", flush=True)
    if settings.orphan_child:
        subprocess.Popen([sys.executable, "-c", "import signal, time; "
                          "signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(86400)"])
    config = uvicorn.Config(SimServer(settings, args.port).app(), host=args.host, port=args.port,
                            log_level="warning", access_log=False, lifespan="off")
    server = uvicorn.Server(config)
    server.run()
    return 0 if server.started else 1


if __name__ == "__main__":
    sys.exit(main())
