"""The HTTP client of generation: one chat completion per request, with retries.

Transport errors, 5xx and 429 are retried with backoff on another server (:mod:`regen.dispatch`
picks it); a 4xx becomes an error row at once. Each finished row goes to a sink (the shard's
journal, or the canary's list).
"""

from __future__ import annotations

import asyncio
import json
import logging
import random
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

import httpx2
import msgspec

from regen.config import RunConfig
from regen.dispatch import ClientTuning, Endpoint, ServerPool
from regen.protocol import chat_request, read_chat_response
from regen.quality import QUALITY_BAD, QualityFailed, QualityGuard
from regen.rows import Row
from regen.turns import Conversation, reasoning_positions

log = logging.getLogger("regen.client")


def _is_retryable_status(status: int) -> bool:
    return status in (408, 429) or status >= 500


def _error_text(body: bytes) -> str:
    try:
        doc = json.loads(body)
        if isinstance(doc, dict):
            err = doc.get("error", doc)
            if isinstance(err, dict):
                return str(err.get("message") or err)[:300]
            return str(err)[:300]
    except ValueError:
        pass
    return body.decode("utf-8", "replace")[:300]


@dataclass
class Request:
    """One chat completion to make: an id, the messages, and what to stamp on its row;
    ``affinity``: the keys of the prefixes it shares with earlier requests (its conversation's,
    then a shared system prompt's), of which ``shared`` name prefixes many conversations share."""

    id: str
    messages: list[dict]
    stamp: dict[str, Any] = field(default_factory=dict)
    tools: list[dict] | None = None
    affinity: list[str] = field(default_factory=list)
    shared: set[str] = field(default_factory=set)


class Generator:
    """Regenerates conversations through a ServerPool, turn after turn; hands each finished
    conversation's row to ``sink`` and each finished turn that is not the last to ``turn_sink``."""

    def __init__(self, pool: ServerPool, cfg: RunConfig, tuning: ClientTuning,
                 sink: Callable[[dict], None], turn_sink: Callable[[dict], None] | None = None,
                 send_reasoning: "tuple[bool, bool] | asyncio.Future" = (False, False),
                 guard: "QualityGuard | None" = None):
        """``send_reasoning``: where an earlier step's reasoning goes back in the request (chat
        turns, agent-loop steps; regen.generate.reasoning_sent), or a future of it: a first
        step's request carries no earlier step, so it goes out before the answer is known; its
        row and any later step wait for it. ``guard``: judges every answer as it comes back
        (regen.quality), drains a server gone bad, stops a run gone bad."""
        self.pool = pool
        self.guard = guard
        self._deciding = None if isinstance(send_reasoning, tuple) else send_reasoning
        self.send_reasoning = send_reasoning if self._deciding is None else (False, False)
        self.cfg = cfg
        self.tuning = tuning
        self.sink = sink
        self.turn_sink = turn_sink or (lambda row: None)
        self.done = 0
        self.failed = 0
        self.tokens = 0
        self.recent: deque[tuple[float, int]] = deque()
        self.sampling = cfg.sampling_settings()

    async def decided(self) -> tuple[bool, bool]:
        """send_reasoning, once known."""
        if self._deciding is not None:
            self.send_reasoning = await self._deciding
            self._deciding = None
        return self.send_reasoning

    def payload(self, endpoint: Endpoint, request: Request) -> dict[str, Any]:
        return chat_request(endpoint.model or "default", request.messages, self.sampling,
                            endpoint.engine.request_fields, request.tools, endpoint.engine.history_reasoning_field)

    async def run_one(self, request: Request) -> dict:
        last_error = "not attempted"
        endpoint: Endpoint | None = None
        started = time.monotonic()
        retry = True
        attempt = 0
        for attempt in range(1, self.cfg.generation.max_attempts + 1):
            if self.guard is not None and self.guard.stopped:
                raise QualityFailed(self.guard.stopped)
            endpoint = await self.pool.acquire(avoid=endpoint, prefer=self.pool.homes(request.affinity, request.shared))
            sent = time.monotonic()
            retry, latency, tokens = True, None, 0
            try:
                status, body = await endpoint.transport.request(
                    "POST", "/v1/chat/completions", msgspec.json.encode(self.payload(endpoint, request)))
            except (httpx2.ConnectError, httpx2.ConnectTimeout) as exc:
                last_error = f"{type(exc).__name__}: {exc or 'connection failed'}"
                self.pool.record_failure(endpoint, last_error, fatal=True)
            except httpx2.TransportError as exc:
                last_error = f"{type(exc).__name__}: {exc or 'transport error'}"
                self.pool.record_failure(endpoint, last_error)
            else:
                await self.decided()  # the row records it
                if status == 200:
                    try:
                        row = self.parse(request, endpoint, msgspec.json.decode(body), attempt, started)
                    except (ValueError, KeyError, IndexError, TypeError, msgspec.DecodeError) as exc:
                        last_error = f"unreadable response: {exc}"
                    else:
                        self.pool.record_success(endpoint)
                        latency, tokens = time.monotonic() - sent, row["completion_tokens"] or 0
                        endpoint.done += 1
                        endpoint.tokens += tokens
                        refused = self._judged(row, endpoint)
                        if refused is None:
                            self.pool.remember(request.affinity, endpoint, request.shared)
                            return row
                        last_error = refused
                elif _is_retryable_status(status):
                    last_error = f"HTTP {status}: {_error_text(body)}"
                    self.pool.record_failure(endpoint, last_error)
                else:
                    last_error = f"HTTP {status}: {_error_text(body)}"
                    retry = False
            finally:
                await self.pool.release(endpoint, latency, tokens)
            if not retry:
                break
            if attempt < self.cfg.generation.max_attempts:
                cap = min(self.tuning.retry_backoff_max_s, self.tuning.retry_backoff_s * 2 ** (attempt - 1))
                await asyncio.sleep(random.uniform(0, cap))
        endpoint.failed += 1
        await self.decided()
        return self.error_row(request, endpoint, last_error, attempt, started, retryable=retry)

    def _judged(self, row: dict, endpoint: Endpoint) -> str | None:
        """The guard's verdict on an answer: None to keep it; why not, when its server is drained
        and the answer shows what drained it (it is sent again to another server)."""
        if self.guard is None:
            return None
        findings = self.guard.check(row, endpoint.url)
        why = self.guard.drained.get(endpoint.url)
        if why is None:
            return None
        if not endpoint.drained:
            endpoint.drained = why
            self.guard.all_drained([e.url for e in self.pool.endpoints])
        bad = QUALITY_BAD & set(findings)
        return f"server drained by the quality guard ({why}); this answer: {', '.join(sorted(bad))}" if bad else None

    def parse(self, request: Request, endpoint: Endpoint, body: dict, attempt: int,
              started: float) -> dict:
        reply = read_chat_response(body, endpoint.engine)
        return {**Row(
            id=request.id, messages=request.messages, reasoning_content=reply.reasoning_content,
            content=reply.content or "", finish_reason=reply.finish_reason, prompt_tokens=reply.prompt_tokens,
            completion_tokens=reply.completion_tokens, error=None,
            enable_thinking=self.sampling["enable_thinking"], model=reply.model or endpoint.model,
            server=endpoint.url, made_by=endpoint.made_by, attempts=attempt,
            latency_s=round(time.monotonic() - started, 3),
            prompt_token_ids=reply.prompt_token_ids, completion_token_ids=reply.completion_token_ids,
            history_reasoning=reasoning_positions(self.send_reasoning),
        ).to_dict(), "tool_calls": reply.tool_calls, **request.stamp}

    def error_row(self, request: Request, endpoint: Endpoint, error: str, attempts: int,
                  started: float, retryable: bool) -> dict:
        return {**Row(
            id=request.id, messages=request.messages, error=error,
            enable_thinking=self.sampling["enable_thinking"], model=endpoint.model, server=endpoint.url,
            made_by=endpoint.made_by, attempts=attempts, latency_s=round(time.monotonic() - started, 3),
            history_reasoning=reasoning_positions(self.send_reasoning),
        ).to_dict(), **request.stamp, "retryable": retryable}

    async def converse(self, conversation: Conversation) -> dict:
        """The conversation's remaining steps, one request each, in order."""
        own, shared = f"conversation:{conversation.id}", conversation.shared_prefix_key()
        affinity = [own, shared] if shared else [own]
        try:
            return await self._converse(conversation, affinity, {shared} if shared else set())
        finally:
            self.pool.forget(own)

    async def _converse(self, conversation: Conversation, affinity: list[str], shared: set[str]) -> dict:
        while True:
            if conversation.answers:  # a later step: its history may carry reasoning
                await self.decided()
            row = await self.run_one(Request(conversation.id, conversation.request_messages(self.send_reasoning), conversation.stamp,
                                             conversation.tools, affinity, shared))
            last = row["error"] is not None or conversation.turns_left == 1
            self.pool.demand = max(0, self.pool.demand - (conversation.turns_left if last else 1))
            if row["error"] is None:
                self.tokens += row["completion_tokens"] or 0
                self.recent.append((time.monotonic(), row["completion_tokens"] or 0))
            if last:
                return conversation.conversation_row(row)
            unusable = conversation.unusable(row)
            if unusable:
                self.pool.demand = max(0, self.pool.demand - (conversation.turns_left - 1))
                return conversation.conversation_row({**row, "error": unusable, "retryable": False})
            divergence = conversation.divergence(row)
            if divergence:  # the row ends with this step, the model's own: not an error
                self.pool.demand = max(0, self.pool.demand - (conversation.turns_left - 1))
                return conversation.conversation_row(row, divergence)
            self.turn_sink(conversation.add_answer(row))

    async def worker(self, queue: asyncio.Queue, feed: "_Feed") -> None:
        while True:
            conversation = await queue.get()
            if conversation is None:
                return
            feed.queued -= 1
            if feed.done and feed.queued == 0:
                self.pool.draining = True
            row = await self.converse(conversation)
            if row["error"] is None:
                self.done += 1
            else:
                self.failed += 1
            self.sink(row)

    def rates(self, window: float = 60.0) -> tuple[float, float]:
        """(rows/s, output tokens/s) over the last ``window`` seconds."""
        now = time.monotonic()
        while self.recent and self.recent[0][0] < now - window:
            self.recent.popleft()
        if not self.recent:
            return 0.0, 0.0
        span = max(now - self.recent[0][0], 1.0)
        return len(self.recent) / span, sum(n for _, n in self.recent) / span

    async def run(self, conversations: Iterable[Conversation]) -> None:
        capacity = max(1, self.pool.capacity)
        queue: asyncio.Queue = asyncio.Queue(maxsize=capacity * 2)
        feed = _Feed()
        workers = [asyncio.create_task(self.worker(queue, feed)) for _ in range(capacity)]
        feeder = asyncio.create_task(feed.run(queue, conversations, len(workers)))
        tasks = [*workers, feeder]
        try:
            pending = set(tasks)
            while pending:
                finished, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_EXCEPTION)
                for task in finished:
                    if task.exception() is not None:
                        raise task.exception()
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)


class _Feed:
    """Puts the conversations on the queue, counting what waits there, then one stop per worker."""

    def __init__(self) -> None:
        self.queued = 0
        self.done = False

    async def run(self, queue: asyncio.Queue, conversations: Iterable[Conversation], workers: int) -> None:
        for count, conversation in enumerate(conversations):
            self.queued += 1
            await queue.put(conversation)
            if count % 256 == 0:
                await asyncio.sleep(0)
        self.done = True
        for _ in range(workers):
            await queue.put(None)
