"""The simulator's scheduler: continuous batching as SGLang and vLLM run it, and the counters
its /metrics and /server_info report."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import deque
from dataclasses import dataclass, field

from regen.engines.simulator.settings import SimSettings


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
    cached_tokens_total: int = 0  # prompt tokens the prefix cache saved from prefill
    slot_seconds: float = 0.0  # the integral of running requests over time, up to slot_clock
    slot_clock: float = field(default_factory=time.monotonic)
    recent: deque = field(default_factory=lambda: deque(maxlen=4096))
    # Wall-clock seconds, for a bench's time to the first request and after the last reply.
    first_request_at: float | None = None
    last_reply_at: float | None = None
    longest_completion: int = 0  # tokens: one request's decoding bounds a makespan from below

    def busy_slot_seconds(self) -> float:
        """Request-seconds of decoding so far: over (slots x time), how busy the batch was."""
        return self.slot_seconds + self.running * (time.monotonic() - self.slot_clock)

    def throughput(self, window: float = 10.0) -> float:
        now = time.monotonic()
        while self.recent and self.recent[0][0] < now - window:
            self.recent.popleft()
        return sum(n for _, n in self.recent) / window


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
        now = time.monotonic()
        self.state.slot_seconds += self.state.running * (now - self.state.slot_clock)
        self.state.slot_clock = now
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
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(max(next_done, 0.0005)):
                    await self.wake.wait()
