"""Sharded, resumable, exactly-once generation over every server.

A shard's prompts go to the servers through one async client that keeps at most each server's
limit in flight and sends each request to the server with the fewest outstanding, so a slow server
gets less work. Each finished row is appended to the shard's journal and flushed at once; a rerun
(after a crash, a SIGKILL, an Airflow retry or a clear) reads the journal and sends only the ids
that have no row. When the shard completes, its Parquet file is written outside ``data/`` and
renamed into it, so ``data/`` never holds half a file.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import logging
import os
import random
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator

import httpx
import pyarrow as pa
import pyarrow.parquet as pq

from regen.progress import RunProgress, format_duration
from regen.prompts import Prompt, PromptError, read_shard

log = logging.getLogger("regen.generate")

ROW_SCHEMA = pa.schema([
    ("id", pa.string()),
    ("messages", pa.list_(pa.struct([("role", pa.string()), ("content", pa.string())]))),
    ("reasoning_content", pa.string()),
    ("content", pa.string()),
    ("finish_reason", pa.string()),
    ("prompt_tokens", pa.int64()),
    ("completion_tokens", pa.int64()),
    ("error", pa.string()),
    ("enable_thinking", pa.bool_()),
    ("model", pa.string()),
    ("server", pa.string()),
    ("attempts", pa.int32()),
    ("latency_s", pa.float64()),
    ("settings_hash", pa.string()),
])
DEFAULT_CONCURRENCY = 32


class ShardFailed(RuntimeError):
    """The shard cannot finish now; what it finished is kept and a rerun resumes from it."""


@dataclass
class GenerationSettings:
    max_tokens: int = 4096
    temperature: float = 0.6
    top_p: float = 0.95
    top_k: int | None = 20
    seed: int | None = None
    enable_thinking: bool = True
    concurrency_per_server: int | None = None
    request_timeout_s: float = 1800.0
    max_attempts: int = 6
    max_error_fraction: float = 0.05
    retry_backoff_s: float = 0.5
    retry_backoff_max_s: float = 30.0
    failures_before_down: int = 3
    probe_interval_s: float = 2.0
    all_down_timeout_s: float = 60.0
    progress_interval_s: float = 5.0
    model_fingerprint: str | None = None

    @classmethod
    def from_config(cls, cfg) -> "GenerationSettings":
        from regen.stage import model_fingerprint

        return cls(
            model_fingerprint=model_fingerprint(cfg.model_path),
            max_tokens=cfg.max_tokens, temperature=cfg.temperature, top_p=cfg.top_p,
            top_k=cfg.top_k, seed=cfg.seed, enable_thinking=cfg.enable_thinking,
            concurrency_per_server=cfg.concurrency_per_server,
            request_timeout_s=cfg.request_timeout_s, max_attempts=cfg.max_attempts,
            max_error_fraction=cfg.max_error_fraction,
        )

    def settings_hash(self) -> str:
        """What decides whether an existing row can stand for a new run's row: the model (its
        config, weights and chat template) and every sampling setting."""
        key = {"model": self.model_fingerprint, "max_tokens": self.max_tokens, "temperature": self.temperature,
               "top_p": self.top_p, "top_k": self.top_k, "seed": self.seed,
               "enable_thinking": self.enable_thinking}
        return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]


@dataclass
class Endpoint:
    url: str
    api_key: str | None = None
    limit: int = DEFAULT_CONCURRENCY
    model: str | None = None
    in_flight: int = 0
    healthy: bool = True
    consecutive_failures: int = 0
    done: int = 0
    failed: int = 0
    tokens: int = 0
    metrics: dict[str, float] = field(default_factory=dict)
    # One connection pool per server: httpx scans its whole pool on every request, so a shared
    # pool over many servers' connections costs more CPU than the requests themselves.
    client: httpx.AsyncClient | None = field(default=None, repr=False)
    latency_s: float | None = None  # moving average of a successful request's latency
    starts: dict[int, float] = field(default_factory=dict)  # in flight: ticket -> start time

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}


class AllServersDown(ShardFailed):
    pass


class ServerPool:
    """Dispatch within per-server limits, and health probing of dropped servers.

    While prompts are waiting, a request goes to the server with the fewest outstanding requests
    (every slot stays busy, so each server takes work at the rate it finishes it). Once the shard
    drains, each last request goes where it is expected to *finish* first, waiting for a fast
    server's slot rather than starting on a slow one: the tail is what separates a shard's
    makespan from the ideal.
    """

    def __init__(self, endpoints: list[Endpoint], settings: GenerationSettings):
        self.endpoints = endpoints
        self.settings = settings
        self.cond = asyncio.Condition()
        self.draining = False
        self._tickets = 0
        self._down_since: float | None = None
        self._probes: set[asyncio.Task] = set()

    @property
    def capacity(self) -> int:
        return sum(e.limit for e in self.endpoints)

    async def acquire(self, avoid: Endpoint | None = None) -> tuple[Endpoint, int]:
        async with self.cond:
            while True:
                healthy = [e for e in self.endpoints if e.healthy]
                if len(healthy) > 1 and avoid in healthy:
                    healthy.remove(avoid)  # a retry goes to another server where there is one
                free = [e for e in healthy if e.in_flight < e.limit]
                wait = 1.0
                if free:
                    self._down_since = None
                    pick, wait = self._choose(healthy, free)
                    if pick is not None:
                        self._tickets += 1
                        pick.in_flight += 1
                        pick.starts[self._tickets] = time.monotonic()
                        return pick, self._tickets
                elif not healthy:
                    now = time.monotonic()
                    self._down_since = self._down_since or now
                    if now - self._down_since > self.settings.all_down_timeout_s:
                        raise AllServersDown(
                            f"every server is down ({', '.join(e.url for e in self.endpoints)}) "
                            f"for {self.settings.all_down_timeout_s:.0f} s; finished rows are kept: "
                            f"restart the servers (clear start_servers) and rerun the shard"
                        )
                try:
                    await asyncio.wait_for(self.cond.wait(), timeout=wait)
                except asyncio.TimeoutError:
                    pass

    def _choose(self, healthy: list[Endpoint], free: list[Endpoint]) -> tuple[Endpoint | None, float]:
        """(server to use now, or None to wait; how long to wait at most)."""
        least_outstanding = min(free, key=lambda e: e.in_flight / e.limit)
        if not self.draining or any(e.latency_s is None for e in healthy):
            return least_outstanding, 0.0
        now = time.monotonic()

        def next_free(e: Endpoint) -> float:
            if e.in_flight < e.limit:
                return now
            return max(now, min(e.starts.values()) + e.latency_s)

        best = min(healthy, key=lambda e: next_free(e) + e.latency_s)
        if best.in_flight < best.limit:
            return best, 0.0
        return None, max(0.005, next_free(best) - now)

    async def release(self, endpoint: Endpoint, ticket: int, latency_s: float | None = None) -> None:
        async with self.cond:
            endpoint.in_flight -= 1
            endpoint.starts.pop(ticket, None)
            if latency_s is not None:
                endpoint.latency_s = latency_s if endpoint.latency_s is None else (
                    0.8 * endpoint.latency_s + 0.2 * latency_s)
            self.cond.notify_all()

    def record_success(self, endpoint: Endpoint) -> None:
        endpoint.consecutive_failures = 0

    def record_failure(self, endpoint: Endpoint, reason: str, fatal: bool = False) -> None:
        endpoint.consecutive_failures += 1
        if endpoint.healthy and (fatal or endpoint.consecutive_failures >= self.settings.failures_before_down):
            endpoint.healthy = False
            log.warning("server %s out of rotation (%s); probing until it is back", endpoint.url, reason)
            task = asyncio.create_task(self._probe(endpoint))
            self._probes.add(task)
            task.add_done_callback(self._probes.discard)

    async def _probe(self, endpoint: Endpoint) -> None:
        while True:
            await asyncio.sleep(self.settings.probe_interval_s)
            try:
                response = await endpoint.client.get(f"{endpoint.url}/health", timeout=5.0)
            except httpx.HTTPError:
                continue
            if response.status_code == 200:
                async with self.cond:
                    endpoint.healthy = True
                    endpoint.consecutive_failures = 0
                    self.cond.notify_all()
                log.info("server %s is back in rotation", endpoint.url)
                return

    def close(self) -> None:
        for task in self._probes:
            task.cancel()


def _timeout(settings: GenerationSettings) -> httpx.Timeout:
    return httpx.Timeout(connect=10.0, read=settings.request_timeout_s, write=60.0, pool=None)


async def discover(url: str, api_key: str | None, settings: GenerationSettings) -> Endpoint:
    """The served model name and how many requests the server can run at once."""
    endpoint = Endpoint(url=url.rstrip("/"), api_key=api_key)
    endpoint.client = httpx.AsyncClient(timeout=_timeout(settings))
    try:
        models = await endpoint.client.get(f"{endpoint.url}/v1/models", headers=endpoint.headers,
                                           timeout=10)
        models.raise_for_status()
        endpoint.model = models.json()["data"][0]["id"]
    except (httpx.HTTPError, KeyError, IndexError, ValueError) as exc:
        endpoint.healthy = False
        log.warning("server %s not answering /v1/models (%s)", url, exc)
    reported = await _server_limit(endpoint) if endpoint.healthy else None
    limit = settings.concurrency_per_server or reported or DEFAULT_CONCURRENCY
    endpoint.limit = max(1, min(limit, reported) if reported else limit)
    return endpoint


@contextlib.asynccontextmanager
async def open_endpoints(endpoints: list[tuple[str, str | None]], settings: GenerationSettings):
    """Discovered endpoints with their own connection pools, closed on the way out."""
    eps: list[Endpoint] = []
    try:
        for url, key in endpoints:
            eps.append(await discover(url, key, settings))
        if not any(e.healthy for e in eps):
            raise AllServersDown(
                f"no server answers ({', '.join(e.url for e in eps)}): start them first "
                f"(clear start_servers too, or run `regen serve`) and rerun the shard"
            )
        yield eps
    finally:
        for endpoint in eps:
            await endpoint.client.aclose()


async def _server_limit(endpoint: Endpoint) -> int | None:
    """From /server_info; the effective per-DP value in internal_states wins (lower on hybrid
    Mamba models than the CLI value: SGLang issue 38846)."""
    for path in ("/server_info", "/get_server_info"):
        try:
            response = await endpoint.client.get(f"{endpoint.url}{path}", headers=endpoint.headers,
                                                 timeout=10)
            if response.status_code != 200:
                continue
            info = response.json()
        except (httpx.HTTPError, ValueError):
            continue
        values = [s.get("max_running_requests") for s in info.get("internal_states") or []
                  if isinstance(s, dict)]
        values = [v for v in values if isinstance(v, int) and v > 0]
        if values:
            return min(values)
        if isinstance(info.get("max_running_requests"), int):
            return info["max_running_requests"]
    return None


def _is_retryable_status(status: int) -> bool:
    return status in (408, 429) or status >= 500


class Generator:
    """Sends prompts through a ServerPool and hands each finished row to ``sink``."""

    def __init__(self, pool: ServerPool, settings: GenerationSettings,
                 sink: Callable[[dict], None]):
        self.pool = pool
        self.settings = settings
        self.sink = sink
        self.done = 0
        self.failed = 0
        self.tokens = 0
        self.recent: deque[tuple[float, int]] = deque()
        self.settings_hash = settings.settings_hash()

    def payload(self, endpoint: Endpoint, prompt: Prompt) -> dict[str, Any]:
        s = self.settings
        body: dict[str, Any] = {
            "model": endpoint.model or "default",
            "messages": prompt.messages,
            "max_tokens": s.max_tokens,
            "temperature": s.temperature,
            "top_p": s.top_p,
            "chat_template_kwargs": {"enable_thinking": s.enable_thinking},
            "separate_reasoning": True,
            "stream": False,
        }
        if s.top_k is not None:
            body["top_k"] = s.top_k
        if s.seed is not None:
            body["seed"] = s.seed
        return body

    async def run_one(self, prompt: Prompt) -> dict:
        s = self.settings
        last_error = "not attempted"
        endpoint: Endpoint | None = None
        started = time.monotonic()
        for attempt in range(1, s.max_attempts + 1):
            endpoint, ticket = await self.pool.acquire(avoid=endpoint)
            sent = time.monotonic()
            retry, latency = True, None
            try:
                response = await endpoint.client.post(
                    f"{endpoint.url}/v1/chat/completions", json=self.payload(endpoint, prompt),
                    headers=endpoint.headers,
                )
            except (httpx.ConnectError, httpx.ConnectTimeout) as exc:
                last_error = f"{type(exc).__name__}: {exc or 'connection failed'}"
                self.pool.record_failure(endpoint, last_error, fatal=True)
            except httpx.TransportError as exc:
                last_error = f"{type(exc).__name__}: {exc or 'transport error'}"
                self.pool.record_failure(endpoint, last_error)
            else:
                if response.status_code == 200:
                    try:
                        row = self.parse(prompt, endpoint, response.json(), attempt, started)
                    except (ValueError, KeyError, IndexError, TypeError) as exc:
                        last_error = f"unreadable response: {exc}"
                    else:
                        self.pool.record_success(endpoint)
                        latency = time.monotonic() - sent
                        endpoint.done += 1
                        endpoint.tokens += row["completion_tokens"] or 0
                        return row
                elif _is_retryable_status(response.status_code):
                    last_error = f"HTTP {response.status_code}: {_error_text(response)}"
                    self.pool.record_failure(endpoint, last_error)
                else:
                    last_error = f"HTTP {response.status_code}: {_error_text(response)}"
                    retry = False
            finally:
                await self.pool.release(endpoint, ticket, latency)
            if not retry:
                break
            if attempt < s.max_attempts:
                cap = min(s.retry_backoff_max_s, s.retry_backoff_s * 2 ** (attempt - 1))
                await asyncio.sleep(random.uniform(0, cap))
        endpoint.failed += 1
        return self.error_row(prompt, endpoint, last_error, attempt, started, retryable=retry)

    def parse(self, prompt: Prompt, endpoint: Endpoint, body: dict, attempt: int,
              started: float) -> dict:
        choice = body["choices"][0]
        message = choice["message"]
        # SGLang's reasoning parser fills `reasoning_content`; vLLM's fills `reasoning`.
        reasoning = message.get("reasoning_content")
        if reasoning is None:
            reasoning = message.get("reasoning")
        usage = body.get("usage") or {}
        return {
            "id": prompt.id,
            "messages": prompt.messages,
            "reasoning_content": reasoning,
            "content": message.get("content") or "",
            "finish_reason": choice.get("finish_reason"),
            "prompt_tokens": usage.get("prompt_tokens"),
            "completion_tokens": usage.get("completion_tokens"),
            "error": None,
            "enable_thinking": self.settings.enable_thinking,
            "model": body.get("model") or endpoint.model,
            "server": endpoint.url,
            "attempts": attempt,
            "latency_s": round(time.monotonic() - started, 3),
            "settings_hash": self.settings_hash,
        }

    def error_row(self, prompt: Prompt, endpoint: Endpoint, error: str, attempts: int,
                  started: float, retryable: bool) -> dict:
        return {
            "id": prompt.id, "messages": prompt.messages, "reasoning_content": None,
            "content": None, "finish_reason": None, "prompt_tokens": None,
            "completion_tokens": None, "error": error,
            "enable_thinking": self.settings.enable_thinking, "model": endpoint.model,
            "server": endpoint.url, "attempts": attempts,
            "latency_s": round(time.monotonic() - started, 3),
            "settings_hash": self.settings_hash,
            "retryable": retryable,
        }

    async def worker(self, queue: asyncio.Queue, feed: "_Feed") -> None:
        while True:
            prompt = await queue.get()
            if prompt is None:
                return
            feed.queued -= 1
            if feed.done and feed.queued == 0:
                self.pool.draining = True
            row = await self.run_one(prompt)
            if row["error"] is None:
                self.done += 1
                self.tokens += row["completion_tokens"] or 0
                self.recent.append((time.monotonic(), row["completion_tokens"] or 0))
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

    async def run(self, prompts: Iterable[Prompt]) -> None:
        capacity = max(1, self.pool.capacity)
        queue: asyncio.Queue = asyncio.Queue(maxsize=capacity * 2)
        feed = _Feed()
        workers = [asyncio.create_task(self.worker(queue, feed)) for _ in range(capacity)]
        feeder = asyncio.create_task(feed.run(queue, prompts, len(workers)))
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
    """Puts the prompts on the queue, counting what waits there, then one stop per worker."""

    def __init__(self) -> None:
        self.queued = 0
        self.done = False

    async def run(self, queue: asyncio.Queue, prompts: Iterable[Prompt], workers: int) -> None:
        for count, prompt in enumerate(prompts):
            self.queued += 1
            await queue.put(prompt)
            if count % 256 == 0:
                await asyncio.sleep(0)
        self.done = True
        for _ in range(workers):
            await queue.put(None)


def _error_text(response: httpx.Response) -> str:
    try:
        body = response.json()
        if isinstance(body, dict):
            err = body.get("error", body)
            if isinstance(err, dict):
                return str(err.get("message") or err)[:300]
            return str(err)[:300]
    except ValueError:
        pass
    return response.text[:300]


# --- the shard ------------------------------------------------------------------------------

def shard_name(shard: int, num_shards: int) -> str:
    return f"shard-{shard:05d}-of-{num_shards:05d}"


class Journal:
    """Append-only JSONL of finished rows; the last row of an id wins."""

    def __init__(self, path: Path):
        self.path = path
        path.parent.mkdir(parents=True, exist_ok=True)
        self._repair()
        self._fh = open(path, "ab")

    def _repair(self) -> None:
        """Drop a line cut short by a kill, so the next append starts on a fresh line."""
        if not self.path.exists() or self.path.stat().st_size == 0:
            return
        with open(self.path, "rb+") as fh:
            fh.seek(-1, os.SEEK_END)
            if fh.read(1) == b"\n":
                return
            fh.seek(0)
            data = fh.read()
            fh.truncate(data.rfind(b"\n") + 1)

    def append(self, row: dict) -> None:
        self._fh.write(json.dumps(row, ensure_ascii=False).encode() + b"\n")
        self._fh.flush()

    def close(self) -> None:
        try:
            self._fh.close()
        except OSError as exc:  # the disk filled: the append already failed the shard
            log.warning("journal %s: %s on close; a cut last line is dropped on resume",
                        self.path, exc.strerror or exc)

    @staticmethod
    def rows(path: Path) -> Iterator[dict]:
        if not path.exists():
            return
        with open(path, "rb") as fh:
            for raw in fh:
                try:
                    yield json.loads(raw)
                except json.JSONDecodeError:
                    continue


def settled_ids(journal_path: Path) -> set[str]:
    """Ids that need no new request: a good row, or an error no retry can fix (a 4xx)."""
    settled: set[str] = set()
    for row in Journal.rows(journal_path):
        if row.get("error") is None or not row.get("retryable", False):
            settled.add(row["id"])
        else:
            settled.discard(row["id"])
    return settled


def reusable_ids(final_path: Path, settings_hash: str) -> set[str]:
    """Ids of an existing shard file whose row is good and was made with the same model and
    settings: an incremental run does not send them again."""
    if not final_path.exists():
        return set()
    table = pq.read_table(final_path, columns=["id", "error", "settings_hash"])
    return {i for i, e, h in zip(table["id"].to_pylist(), table["error"].to_pylist(),
                                 table["settings_hash"].to_pylist()) if e is None and h == settings_hash}


def _shard_rows(final_path: Path, journal_path: Path) -> Iterator[dict]:
    """The shard's existing rows, then the journal's: later rows win."""
    if final_path.exists():
        for batch in pq.ParquetFile(final_path).iter_batches(batch_size=1000):
            yield from batch.to_pylist()
    yield from Journal.rows(journal_path)


def write_shard_file(final_path: Path, journal_path: Path, ids: set[str], batch_rows: int = 1000) -> int:
    """The last row of each current prompt id, streamed in batches into a file beside the
    journal, then renamed over the shard's file: data/ never holds half a file."""
    last: dict[str, int] = {}
    for index, row in enumerate(_shard_rows(final_path, journal_path)):
        if row["id"] in ids:
            last[row["id"]] = index
    keep = set(last.values())
    tmp = journal_path.with_suffix(".parquet.tmp")
    count = 0
    try:
        with pq.ParquetWriter(tmp, ROW_SCHEMA, compression="zstd") as writer:
            batch: list[dict] = []
            for index, row in enumerate(_shard_rows(final_path, journal_path)):
                if index not in keep:
                    continue
                row.pop("retryable", None)
                batch.append(row)
                if len(batch) >= batch_rows:
                    writer.write_table(pa.Table.from_pylist(batch, schema=ROW_SCHEMA))
                    count += len(batch)
                    batch = []
            if batch:
                writer.write_table(pa.Table.from_pylist(batch, schema=ROW_SCHEMA))
                count += len(batch)
        with open(tmp, "rb") as fh:
            os.fsync(fh.fileno())
        final_path.parent.mkdir(parents=True, exist_ok=True)
        os.replace(tmp, final_path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return count


@dataclass
class ShardResult:
    shard: int
    num_shards: int
    total: int
    done: int
    failed: int
    skipped: int
    bad_records: int
    seconds: float
    tokens: int
    path: Path | None

    def summary(self) -> str:
        rate = self.tokens / self.seconds if self.seconds > 0 else 0.0
        return (f"shard {self.shard}/{self.num_shards}: {self.done + self.skipped:,}/{self.total:,} rows "
                f"({self.skipped:,} from earlier runs), {self.failed:,} failed, "
                f"{self.bad_records:,} unreadable records, {rate:,.0f} tok/s, "
                f"{format_duration(self.seconds)}")


def generate_shard(prompts_path: str | Path, output: str | Path, endpoints: list[tuple[str, str | None]],
                   shard: int = 0, num_shards: int = 1,
                   settings: GenerationSettings | None = None,
                   on_row: Callable[[dict], None] | None = None) -> ShardResult:
    with shard_lock(Path(output), shard_name(shard, num_shards)):
        return asyncio.run(_generate_shard(Path(prompts_path), Path(output), endpoints, shard,
                                           num_shards, settings or GenerationSettings(), on_row))


@contextlib.contextmanager
def shard_lock(output: Path, name: str):
    """One generator per shard: a retry that starts while an old attempt still runs (a worker
    that lost its heartbeat, a remote job outliving its task) must not write the same journal."""
    import fcntl

    path = output / "work" / "locks" / f"{name}.lock"
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a+") as fh:
        try:
            fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            fh.seek(0)
            holder = fh.read().strip() or "another process"
            raise ShardFailed(f"{name} is being generated right now by {holder} ({path}); "
                              f"retry once it has stopped") from None
        fh.seek(0)
        fh.truncate()
        fh.write(f"pid {os.getpid()} on {os.uname().nodename}")
        fh.flush()
        yield


async def _generate_shard(prompts_path: Path, output: Path, endpoints: list[tuple[str, str | None]],
                          shard: int, num_shards: int, settings: GenerationSettings,
                          on_row: Callable[[dict], None] | None) -> ShardResult:
    if not 0 <= shard < num_shards:
        raise ValueError(f"shard {shard} is not in 0..{num_shards - 1}")
    started = time.monotonic()
    name = shard_name(shard, num_shards)
    final_path = output / "data" / f"{name}.parquet"
    work = output / "work"
    journal_path = work / "journal" / f"{name}.jsonl"
    errors_path = work / "errors" / f"{name}.txt"
    progress = RunProgress(output)

    settled = settled_ids(journal_path)
    if settings.model_fingerprint is not None:  # without knowing the model, reuse nothing
        settled |= reusable_ids(final_path, settings.settings_hash())
    ids: set[str] = set()
    bad: list[PromptError] = []
    for item in read_shard(prompts_path, shard, num_shards):
        if isinstance(item, PromptError):
            bad.append(item)
        else:
            ids.add(item.id)
    total = len(ids)
    settled &= ids
    if bad:
        errors_path.parent.mkdir(parents=True, exist_ok=True)
        errors_path.write_text("".join(f"{e}\n" for e in bad))
        for err in bad[:5]:
            log.warning("unreadable prompt record: %s", err)
        log.warning("%d unreadable record(s) listed in %s", len(bad), errors_path)
    skipped = len(settled)
    if final_path.exists() and not journal_path.exists() and skipped == total:
        log.info("%s is up to date: every prompt has a good row made with this model and these "
                 "settings (%s); nothing to send", name, final_path)
        RunProgress(output).write_shard(shard, {
            "state": "done", "shard": shard, "num_shards": num_shards, "total": total,
            "done": total, "failed": 0, "sent": 0, "tokens_per_s": 0.0, "eta_s": 0, "servers": {}})
        return ShardResult(shard, num_shards, total, 0, 0, total, len(bad), 0.0, 0, final_path)

    log.info("%s: %d prompts, %d already have a row, %d to send", name, total, skipped,
             total - skipped)
    journal = Journal(journal_path)
    try:
        async with open_endpoints(endpoints, settings) as eps:
            pool = ServerPool(eps, settings)

            def sink(row: dict) -> None:
                try:
                    journal.append(row)
                except OSError as exc:
                    raise ShardFailed(f"{name}: cannot write {journal_path}: {exc.strerror or exc}") from exc
                if on_row is not None:
                    on_row(row)
                if row["error"] is not None:
                    check()

            gen = Generator(pool, settings, sink)
            remaining = total - skipped

            def check() -> None:
                bound = settings.max_error_fraction * max(total, 1)
                permanent = gen.failed
                if permanent > bound and permanent >= 1:
                    raise ShardFailed(
                        f"{name}: {permanent} of {total} prompts failed (more than "
                        f"max_error_fraction {settings.max_error_fraction:.0%}); last errors in "
                        f"{journal_path}; finished rows are kept"
                    )

            def report(state: str = "running") -> dict:
                rows_s, tok_s = gen.rates()
                left = remaining - gen.done - gen.failed
                data = {
                    "state": state, "shard": shard, "num_shards": num_shards,
                    "total": total, "done": skipped + gen.done, "failed": gen.failed,
                    "sent": gen.done + gen.failed,
                    "rows_per_s": round(rows_s, 3), "tokens_per_s": round(tok_s, 1),
                    "eta_s": round(left / rows_s) if rows_s > 0 else None,
                    "elapsed_s": round(time.monotonic() - started, 1),
                    "servers": {e.url: {"done": e.done, "failed": e.failed, "in_flight": e.in_flight,
                                        "healthy": e.healthy, "limit": e.limit, "metrics": e.metrics}
                                for e in eps},
                }
                progress.write_shard(shard, data)
                return data

            async def reporter() -> None:
                from regen.alerts import check_overdue

                while True:
                    await asyncio.sleep(settings.progress_interval_s)
                    await asyncio.gather(*(_scrape_metrics(e) for e in eps))
                    data = report()
                    check_overdue(output)
                    log.info("shard %d/%d: %s/%s done, %d failed, %s tok/s, ETA %s", shard, num_shards,
                             f"{data['done']:,}", f"{total:,}", data["failed"],
                             f"{data['tokens_per_s']:,.0f}", format_duration(data["eta_s"]))

            report()
            reporter_task = asyncio.create_task(reporter())
            pending = (p for p in read_shard(prompts_path, shard, num_shards)
                       if isinstance(p, Prompt) and p.id not in settled)
            try:
                await gen.run(pending)
            except BaseException:
                report("failed")
                raise
            finally:
                reporter_task.cancel()
                pool.close()
    finally:
        journal.close()
    try:
        write_shard_file(final_path, journal_path, ids)
    except OSError as exc:
        raise ShardFailed(f"{name}: cannot write {final_path.name}: {exc.strerror or exc}; "
                          f"data/ is unchanged and the journal is kept") from exc
    journal_path.unlink()
    elapsed = time.monotonic() - started
    result = ShardResult(shard, num_shards, total, gen.done, gen.failed, skipped, len(bad), elapsed,
                         gen.tokens, final_path)
    data = report("done")
    data.update(tokens_per_s=round(gen.tokens / elapsed, 1) if elapsed > 0 else 0.0, eta_s=0)
    progress.write_shard(shard, data)
    log.info(result.summary())
    return result


async def _scrape_metrics(endpoint: Endpoint) -> None:
    """The few SGLang/vLLM gauges worth a glance: running, queued, throughput, accept length."""
    wanted = {"num_running_reqs": "running", "num_queue_reqs": "queued",
              "gen_throughput": "gen_throughput", "spec_accept_length": "spec_accept_length",
              "num_requests_running": "running", "num_requests_waiting": "queued"}
    try:
        response = await endpoint.client.get(f"{endpoint.url}/metrics", timeout=3.0)
    except httpx.HTTPError:
        return
    if response.status_code != 200:
        return
    metrics: dict[str, float] = {}
    for line in response.text.splitlines():
        if line.startswith("#") or " " not in line:
            continue
        name, _, value = line.rpartition(" ")
        base = name.split("{", 1)[0].split(":", 1)[-1]
        if base in wanted:
            try:
                metrics[wanted[base]] = float(value)
            except ValueError:
                continue
    endpoint.metrics = metrics


def generate_rows(prompts: list[Prompt], endpoints: list[tuple[str, str | None]],
                  settings: GenerationSettings) -> tuple[list[dict], int]:
    """Generate a handful of prompts in memory (the canary), through the same client; also
    return how many requests the servers can run at once."""
    async def run() -> tuple[list[dict], int]:
        rows: list[dict] = []
        async with open_endpoints(endpoints, settings) as eps:
            pool = ServerPool(eps, settings)
            try:
                await Generator(pool, settings, rows.append).run(prompts)
            finally:
                pool.close()
        return rows, pool.capacity

    return asyncio.run(run())
