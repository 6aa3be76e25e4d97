"""regen's simulator of the part of SGLang's HTTP API that regen uses.

It stands in for a GPU server in demos and tests, and injects the faults that matter: slow
tokens, HTTP 500s, hangs, a full queue, a prompt longer than the context, and a server that
ignores ``enable_thinking`` (the failure that ruined the 914k-sample dataset). It takes SGLang's
launch flags where they apply, so the server manager starts it through the same code path.

Text is deterministic per (prompt, seed); a "token" is a word, which is what ``usage`` counts.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hashlib
import json
import random
import secrets
import sys
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

REASONING_WORDS = (
    "okay let me think about this carefully first the question asks for the answer so I "
    "should check each step then consider whether the result makes sense because a small "
    "mistake here would change everything hmm wait actually that is right now compute the "
    "value and verify it again before writing the final answer clearly"
).split()
ANSWER_WORDS = (
    "the answer is that this works because each part follows from the previous one and the "
    "result is consistent with what we expected in summary here is a clear explanation"
).split()
NO_THINKING_ANSWER = "OK."
FAULT_MARKER = "[sim-fault]"


@dataclass
class SimSettings:
    model_path: str
    served_model_name: str
    context_length: int
    max_running_requests: int | None = None  # the launch value; None when not given, as SGLang
    effective_max_running_requests: int | None = None  # lower, as on hybrid Mamba models
    tokens_per_second: float = 0.0  # per request, alone in the batch
    batch_slowdown: float = 0.0  # how much each running request slows the others (see BatchScheduler)
    prefill_tokens_per_second: float = 0.0  # 0: prefill is free
    ttft_s: float = 0.0
    failure_rate: float = 0.0
    hang_rate: float = 0.0
    ignore_thinking: bool = False
    ignore_thinking_after: int | None = None  # a server restarted mid-run without thinking
    startup_delay_s: float = 0.0
    fail_while: str | None = None  # while this file exists, prompts holding FAULT_MARKER get 500s
    request_log: str | None = None  # append each request's messages here (JSON lines), for tests
    api_key: str | None = None
    speculative_algorithm: str | None = None
    reasoning_parser: str | None = None
    seed: int = 0


@dataclass
class SimState:
    started: float = field(default_factory=time.monotonic)
    running: int = 0
    queued: int = 0
    requests_total: int = 0
    prompt_tokens_total: int = 0
    generation_tokens_total: int = 0
    waited_total: int = 0  # requests that found every slot taken and queued
    in_flight: int = 0  # received and not yet answered
    peak: int = 0  # the most requests in flight at once
    recent: deque = field(default_factory=lambda: deque(maxlen=4096))

    def throughput(self, window: float = 10.0) -> float:
        now = time.monotonic()
        while self.recent and self.recent[0][0] < now - window:
            self.recent.popleft()
        return sum(n for _, n in self.recent) / window


def _rng(messages: list[dict], seed: int | None, base_seed: int) -> random.Random:
    key = json.dumps(messages, sort_keys=True) + f"|{seed if seed is not None else base_seed}"
    return random.Random(hashlib.sha256(key.encode()).digest())


def compose(messages: list[dict], thinking: bool, seed: int | None, base_seed: int = 0) -> tuple[list[str], list[str]]:
    """(reasoning words, answer words) for a request; no reasoning when thinking is off."""
    rng = _rng(messages, seed, base_seed)
    if not thinking:
        return [], [NO_THINKING_ANSWER]
    reasoning = [rng.choice(REASONING_WORDS) for _ in range(rng.randint(40, 120))]
    answer = [rng.choice(ANSWER_WORDS) for _ in range(rng.randint(12, 48))]
    answer[-1] = answer[-1] + "."
    return reasoning, answer


def count_prompt_tokens(messages: list[dict]) -> int:
    return sum(len(str(m.get("content", "")).split()) + 4 for m in messages) + 2


class BatchScheduler:
    """Continuous batching, as SGLang and vLLM run it. Up to ``limit`` requests decode together;
    with b of them running each gains ``tokens_per_second / (1 + batch_slowdown * (b - 1))``
    tokens a second, so a fuller batch is slower per request and faster in all. A new request's
    prompt is prefilled first, at ``prefill_tokens_per_second``, while the running ones wait. The
    rest queue. Requests that started together with the same length finish together, in a burst,
    as a batch's do on a real server."""

    def __init__(self, settings: "SimSettings", limit: int, state: "SimState"):
        self.tps = settings.tokens_per_second
        self.slowdown = settings.batch_slowdown
        self.prefill_tps = settings.prefill_tokens_per_second
        self.limit, self.state = limit, state
        self.waiting: deque = deque()  # [tokens left, future, prompt tokens]
        self.running: list = []
        self.wake = asyncio.Event()
        self.task: asyncio.Task | None = None

    def rate(self, batch: int) -> float:
        return self.tps / (1 + self.slowdown * (batch - 1))

    async def submit(self, prompt_tokens: int, tokens: int) -> None:
        future = asyncio.get_running_loop().create_future()
        if len(self.running) >= self.limit or self.waiting:
            self.state.waited_total += 1
        self.waiting.append([float(tokens), future, prompt_tokens])
        self._count()
        if self.task is None:
            self.task = asyncio.create_task(self._run())
        self.wake.set()
        await future

    def _count(self) -> None:
        self.state.running, self.state.queued = len(self.running), len(self.waiting)

    async def _run(self) -> None:
        last = time.monotonic()
        while True:
            now = time.monotonic()
            if self.running:
                step = (now - last) * self.rate(len(self.running))
                for item in self.running:
                    item[0] -= step
                for item in [i for i in self.running if i[0] <= 1e-6]:
                    self.running.remove(item)
                    if not item[1].done():
                        item[1].set_result(None)
            last = now
            prefill = 0
            while self.waiting and len(self.running) < self.limit:
                item = self.waiting.popleft()
                self.running.append(item)
                prefill += item[2]
            self._count()
            if prefill and self.prefill_tps:
                await asyncio.sleep(prefill / self.prefill_tps)  # the batch waits for the prefill
                last = time.monotonic()
                continue
            self.wake.clear()
            if not self.running:
                await self.wake.wait()
                last = time.monotonic()
                continue
            next_done = min(i[0] for i in self.running) / self.rate(len(self.running))
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self.wake.wait(), timeout=max(next_done, 0.0005))


class SimTokens:
    """Token ids as an engine returns them, with the model directory's own tokenizer and chat
    template (the `tokenizers` library and Jinja, loaded on the first request that asks): the
    prompt as the generation prompt renders it, the output as the model would have written it
    (think block, answer, end-of-turn token)."""

    def __init__(self, model_path: str):
        self.model_path = Path(model_path)
        self._loaded: tuple | None = None

    def _load(self) -> tuple:
        if self._loaded is None:
            import jinja2
            from jinja2.sandbox import ImmutableSandboxedEnvironment
            from tokenizers import Tokenizer

            config = json.loads((self.model_path / "tokenizer_config.json").read_text())
            template = config.get("chat_template")
            if template is None and (self.model_path / "chat_template.jinja").exists():
                template = (self.model_path / "chat_template.jinja").read_text()

            def raise_exception(message):
                raise jinja2.TemplateError(message)

            env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
            env.globals["raise_exception"] = raise_exception
            env.filters["tojson"] = lambda value, **kw: json.dumps(value, ensure_ascii=False, **kw)
            eos = config.get("eos_token")
            eos = eos.get("content") if isinstance(eos, dict) else eos
            self._loaded = (Tokenizer.from_file(str(self.model_path / "tokenizer.json")),
                            env.from_string(template), eos or "<|im_end|>")
        return self._loaded

    def ids(self, messages: list[dict], kwargs: dict, message: dict, finished: bool) -> tuple[list[int], list[int]]:
        tokenizer, template, eos = self._load()
        prompt = template.render(messages=messages, add_generation_prompt=True, **kwargs)
        reasoning, content = message["reasoning_content"], message["content"] or ""
        output = (f"<think>\n{reasoning}\n</think>\n\n" if reasoning is not None else "") + content
        output += eos if finished else ""
        encode = lambda text: tokenizer.encode(text, add_special_tokens=False).ids  # noqa: E731
        return encode(prompt), encode(output)


def build_app(settings: SimSettings):
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import JSONResponse, PlainTextResponse
    from starlette.routing import Route

    state = SimState()
    tokens = SimTokens(settings.model_path)
    effective = settings.effective_max_running_requests or settings.max_running_requests or 64
    scheduler = BatchScheduler(settings, effective, state)
    failures = random.Random(settings.seed ^ 0x5EED)

    def ready() -> bool:
        return time.monotonic() - state.started >= settings.startup_delay_s

    def unauthorized(request: Request):
        if settings.api_key is None:
            return None
        if request.headers.get("authorization") != f"Bearer {settings.api_key}":
            return JSONResponse({"error": {"message": "Unauthorized", "code": 401}}, status_code=401)
        return None

    async def health(request: Request):
        if not ready():
            return PlainTextResponse("warming up", status_code=503)
        return PlainTextResponse("")

    async def models(request: Request):
        if (denied := unauthorized(request)) is not None:
            return denied
        return JSONResponse({"object": "list", "data": [{
            "id": settings.served_model_name, "object": "model", "owned_by": "sglang",
            "root": settings.model_path, "max_model_len": settings.context_length}]})

    async def server_info(request: Request):
        # SGLang 0.5.23's shape: the resolved server arguments at the top level and in each
        # internal state (max_running_requests is the launch value, null when not given), plus
        # the scheduler's real limit, effective_max_running_requests_per_dp.
        args = {
            "model_path": settings.model_path,
            "served_model_name": settings.served_model_name,
            "context_length": settings.context_length,
            "max_running_requests": settings.max_running_requests,
            "speculative_algorithm": settings.speculative_algorithm,
            "reasoning_parser": settings.reasoning_parser,
        }
        return JSONResponse({
            **args,
            "version": "regen-sim",
            "internal_states": [{
                **args,
                "effective_max_running_requests_per_dp": effective,
                "last_gen_throughput": state.throughput(),
                "sim_waited_requests_total": state.waited_total,
                "sim_peak_requests_in_flight": state.peak,
                "sim_requests_in_flight": state.in_flight,
            }],
        })

    async def metrics(request: Request):
        labels = f'{{model_name="{settings.served_model_name}"}}'
        accept = 3.6 if settings.speculative_algorithm else 1.0
        lines = [
            "# TYPE sglang:num_running_reqs gauge", f"sglang:num_running_reqs{labels} {state.running}",
            "# TYPE sglang:num_queue_reqs gauge", f"sglang:num_queue_reqs{labels} {state.queued}",
            "# TYPE sglang:gen_throughput gauge", f"sglang:gen_throughput{labels} {state.throughput():.3f}",
            "# TYPE sglang:spec_accept_length gauge", f"sglang:spec_accept_length{labels} {accept}",
            "# TYPE sglang:num_requests_total counter",
            f"sglang:num_requests_total{labels} {state.requests_total}",
            "# TYPE sglang:prompt_tokens_total counter",
            f"sglang:prompt_tokens_total{labels} {state.prompt_tokens_total}",
            "# TYPE sglang:generation_tokens_total counter",
            f"sglang:generation_tokens_total{labels} {state.generation_tokens_total}",
        ]
        return PlainTextResponse("\n".join(lines) + "\n", media_type="text/plain; version=0.0.4")

    async def chat(request: Request):
        if (denied := unauthorized(request)) is not None:
            return denied
        if not ready():
            return JSONResponse({"error": {"message": "server is warming up"}}, status_code=503)
        state.requests_total += 1  # every request received, rejected ones included
        try:
            body = await request.json()
            messages = body["messages"]
            assert isinstance(messages, list) and messages
        except Exception:
            return JSONResponse({"object": "error", "message": "messages: field required",
                                 "type": "BadRequestError", "code": 400}, status_code=400)
        if settings.request_log:
            with open(settings.request_log, "a") as log_file:
                log_file.write(json.dumps({"messages": messages}) + "\n")
        max_tokens = int(body.get("max_completion_tokens") or body.get("max_tokens") or 2048)
        prompt_tokens = count_prompt_tokens(messages)
        if prompt_tokens + max_tokens > settings.context_length:
            return JSONResponse({
                "object": "error", "type": "BadRequestError", "code": 400,
                "message": (f"Requested token count exceeds the model's maximum context length of "
                            f"{settings.context_length} tokens. You requested a total of "
                            f"{prompt_tokens + max_tokens} tokens: {prompt_tokens} tokens from the "
                            f"input messages and {max_tokens} tokens for the completion."),
            }, status_code=400)
        roll = failures.random()
        faulty = (settings.fail_while is not None and Path(settings.fail_while).exists()
                  and FAULT_MARKER in json.dumps(messages))
        if roll < settings.failure_rate or faulty:
            return JSONResponse({"object": "error", "message": "simulated internal error",
                                 "code": 500}, status_code=500)
        kwargs = body.get("chat_template_kwargs") or {}
        degraded = settings.ignore_thinking or (
            settings.ignore_thinking_after is not None
            and state.requests_total > settings.ignore_thinking_after)
        thinking = bool(kwargs.get("enable_thinking", True)) and not degraded
        reasoning, answer = compose(messages, thinking, body.get("seed"), settings.seed)

        budget = max_tokens
        think_tokens = reasoning[:budget]
        budget -= len(think_tokens) + (1 if reasoning else 0)
        answer_tokens = answer[:max(budget, 0)]
        finished = len(think_tokens) == len(reasoning) and len(answer_tokens) == len(answer)
        completion = min(len(think_tokens) + (1 if reasoning else 0) + len(answer_tokens), max_tokens)
        state.in_flight += 1
        state.peak = max(state.peak, state.in_flight)
        try:
            if roll < settings.failure_rate + settings.hang_rate:
                await asyncio.sleep(3600)
            if settings.ttft_s > 0:
                await asyncio.sleep(settings.ttft_s)
            if settings.tokens_per_second > 0:
                await scheduler.submit(prompt_tokens, completion)
        finally:
            state.in_flight -= 1
        state.prompt_tokens_total += prompt_tokens
        state.generation_tokens_total += completion
        state.recent.append((time.monotonic(), completion))
        message = {
            "role": "assistant",
            "content": " ".join(answer_tokens) if answer_tokens else None,
            "reasoning_content": " ".join(think_tokens) if reasoning else None,
            "tool_calls": None,
        }
        choice = {"index": 0, "message": message, "finish_reason": "stop" if finished else "length"}
        if body.get("return_prompt_token_ids") or body.get("return_token_ids"):
            prompt_ids, output_ids = tokens.ids(messages, kwargs, message, finished)
            if body.get("return_prompt_token_ids"):
                choice["prompt_token_ids"] = prompt_ids
            if body.get("return_token_ids"):
                choice["response_token_ids"] = output_ids
        return JSONResponse({
            "id": secrets.token_hex(8),
            "object": "chat.completion",
            "created": int(time.time()),
            "model": settings.served_model_name,
            "choices": [choice],
            "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion,
                      "total_tokens": prompt_tokens + completion},
        })

    return Starlette(routes=[
        Route("/health", health),
        Route("/health_generate", health),
        Route("/v1/models", models),
        Route("/server_info", server_info),
        Route("/get_server_info", server_info),
        Route("/metrics", metrics),
        Route("/v1/chat/completions", chat, methods=["POST"]),
    ])


def model_context_length(model_path: str) -> int:
    cfg = json.loads((Path(model_path) / "config.json").read_text())
    return int(cfg.get("max_position_embeddings") or 32768)


def argument_parser() -> argparse.ArgumentParser:
    """SGLang's launch flags that apply to the simulator, plus its own ``--sim-*`` knobs."""
    p = argparse.ArgumentParser(prog="regen sim", description=__doc__.splitlines()[0])
    p.add_argument("--port", type=int, default=30000)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--model-path", default=None,
                   help="model directory; its config.json gives the context length")
    p.add_argument("--served-model-name", default=None)
    p.add_argument("--api-key", default=None)
    p.add_argument("--context-length", type=int, default=None)
    p.add_argument("--max-running-requests", type=int, default=None)
    p.add_argument("--reasoning-parser", default=None)
    p.add_argument("--speculative-algorithm", default=None)
    p.add_argument("--random-seed", type=int, default=0)
    p.add_argument("--enable-metrics", action="store_true", help="accepted; metrics are always on")
    for flag in ("--speculative-num-steps", "--speculative-eagle-topk",
                 "--speculative-num-draft-tokens", "--mem-fraction-static",
                 "--max-mamba-cache-size"):
        p.add_argument(flag, default=None, help="accepted for SGLang parity; no effect")
    p.add_argument("--sim-tokens-per-second", type=float, default=0.0)
    p.add_argument("--sim-ttft", type=float, default=0.0)
    p.add_argument("--sim-batch-slowdown", type=float, default=0.0,
                   help="per-request decode speed with b running: tokens-per-second / (1 + this x (b-1))")
    p.add_argument("--sim-prefill-tokens-per-second", type=float, default=0.0,
                   help="prompt tokens prefilled a second while the batch waits (0: free)")
    p.add_argument("--sim-failure-rate", type=float, default=0.0)
    p.add_argument("--sim-hang-rate", type=float, default=0.0)
    p.add_argument("--sim-ignore-thinking", action="store_true")
    p.add_argument("--sim-ignore-thinking-after", type=int, default=None, metavar="N",
                   help="think for the first N requests, then ignore enable_thinking (a server "
                   "relaunched mid-run with the wrong flags)")
    p.add_argument("--sim-startup-delay", type=float, default=0.0)
    p.add_argument("--sim-fail-while", metavar="FILE", default=None,
                   help=f"while FILE exists, answer HTTP 500 to prompts containing {FAULT_MARKER!r} "
                   "(a fault that goes away, to test retries and clears)")
    p.add_argument("--sim-request-log", metavar="FILE", default=None,
                   help="append every chat request's messages to FILE (JSON lines)")
    p.add_argument("--sim-effective-max-running-requests", type=int, default=None,
                   help="run and report fewer requests than --max-running-requests, as SGLang does "
                   "on hybrid Mamba models (issue 38846)")
    p.add_argument("--sim-orphan-child", action="store_true",
                   help="leave a child that ignores SIGTERM and outlives the server, as SGLang's "
                   "scheduler children have been seen to do (issues 23627, 15165)")
    return p


def main(argv: list[str] | None = None) -> int:
    import uvicorn

    args = argument_parser().parse_args(argv)
    # As SGLang does at start-up: every resolved argument, the API key included.
    print(f"server_args=ServerArgs({', '.join(f'{k}={v!r}' for k, v in vars(args).items())})", flush=True)
    context = args.context_length
    if args.model_path:
        if not (Path(args.model_path) / "config.json").is_file():
            print(f"error: {args.model_path}: no config.json (not a model directory)", file=sys.stderr)
            return 1
        context = context or model_context_length(args.model_path)
    settings = SimSettings(
        model_path=args.model_path or "sim",
        served_model_name=args.served_model_name or Path(args.model_path or "sim").name,
        context_length=context or 32768,
        max_running_requests=args.max_running_requests,
        effective_max_running_requests=args.sim_effective_max_running_requests,
        tokens_per_second=args.sim_tokens_per_second,
        batch_slowdown=args.sim_batch_slowdown,
        prefill_tokens_per_second=args.sim_prefill_tokens_per_second,
        ttft_s=args.sim_ttft,
        failure_rate=args.sim_failure_rate,
        hang_rate=args.sim_hang_rate,
        ignore_thinking=args.sim_ignore_thinking,
        ignore_thinking_after=args.sim_ignore_thinking_after,
        startup_delay_s=args.sim_startup_delay,
        fail_while=args.sim_fail_while,
        request_log=args.sim_request_log,
        api_key=args.api_key,
        speculative_algorithm=args.speculative_algorithm,
        reasoning_parser=args.reasoning_parser,
        seed=args.random_seed,
    )
    print(f"regen sim: {settings.served_model_name} on http://{args.host}:{args.port} "
          f"(context {settings.context_length}, max running {settings.max_running_requests or 64}"
          f"{', ignoring enable_thinking' if settings.ignore_thinking else ''})", flush=True)
    if args.sim_orphan_child:
        import subprocess

        subprocess.Popen([sys.executable, "-c", "import signal, time; "
                          "signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(86400)"])
    config = uvicorn.Config(build_app(settings), host=args.host, port=args.port,
                            log_level="warning", access_log=False, lifespan="off")
    server = uvicorn.Server(config)
    server.run()
    return 0 if server.started else 1
