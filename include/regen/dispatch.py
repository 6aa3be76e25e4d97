"""The servers as the client sees them: discovery, per-server limits, dispatch, health probing.

A request goes to a server with a free request slot, never waits for one while another server
has a slot free: the server that holds its prefix (the conversation's earlier turns, or the
shared system prompt and tools of conversations before it; a shared prefix this process has not
placed yet, the server every process ranks first for it) when it has a free slot and, in the
tail, is not behind (its requests decoding at under half the fastest free server's speed); else the one with the fewest outstanding requests relative to its limit, so a slow server
gets less work; and once the feed has drained, the fastest server with a free slot, so the tail
ends sooner. A server that keeps failing leaves the rotation and is probed until it is back.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import logging
import time
from dataclasses import dataclass, field

import httpx2

from regen.config import RunConfig
from regen.coordination import FairShare, SlotPool
from regen.engines import Engine, engine, engine_of_server
from regen.errors import ShardFailed
from regen.transport import StreamTransport

log = logging.getLogger("regen.dispatch")
# httpx2 logs every request at INFO: a million lines in a task log, and a measurable share of
# the client's CPU per request.
logging.getLogger("httpx2").setLevel(logging.WARNING)


class AllServersDown(ShardFailed):
    pass


@dataclass(frozen=True)
class ClientTuning:
    """How the client paces itself. Not part of a run's config: tests shorten the waits."""

    retry_backoff_s: float = 0.5
    retry_backoff_max_s: float = 30.0
    failures_before_down: int = 3
    probe_interval_s: float = 2.0
    all_down_timeout_s: float = 60.0
    progress_interval_s: float = 5.0
    rebalance_interval_s: float = 0.5
    default_concurrency: int = 32  # per server, when neither the config nor the server says


@dataclass
class Endpoint:
    url: str
    api_key: str | None = None
    engine: Engine | None = None
    size: int = 1  # this server's request slots on the node: its effective limit plus the queue margin
    limit: int = 1  # the request slots this process holds now
    slots: "SlotPool | None" = field(default=None, repr=False)
    model: str | None = None
    served_path: str | None = None
    info: dict = field(default_factory=dict)
    in_flight: int = 0
    healthy: bool = True
    consecutive_failures: int = 0
    done: int = 0
    failed: int = 0
    tokens: int = 0
    metrics: dict[str, float] = field(default_factory=dict)
    # Its own kept-alive connections, one per request slot (regen.transport).
    transport: StreamTransport | None = field(default=None, repr=False)
    speed: float | None = None  # moving average of one request's output tokens a second
    unauthorized: bool = False  # it answered 401: it wants a key this client does not have
    drained: str | None = None  # why the quality guard gives it no new request (regen.quality)
    made_by: str | None = None  # what makes its rows (:func:`made_by`), recorded with each

    def connect(self, cfg: RunConfig, slots: int) -> None:
        """Connections for ``slots`` requests in flight, and one each for the health probe and
        the metrics scrape."""
        url = httpx2.URL(self.url)
        headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        tls = url.scheme == "https"
        self.transport = StreamTransport(url.host, url.port or (443 if tls else 80), slots + 2,
                                         read_timeout=cfg.generation.request_timeout_s, headers=headers, tls=tls)

    async def get_json(self, path: str, timeout: float = 10.0):
        """The JSON body of a GET that answered 200; ValueError otherwise."""
        status, body = await self.transport.request("GET", path, read_timeout=timeout)
        if status != 200:
            raise ValueError(f"{path}: HTTP {status}")
        return json.loads(body)

    def report(self) -> dict:
        return {"done": self.done, "failed": self.failed, "in_flight": self.in_flight,
                "healthy": self.healthy, "slots": self.size, "limit": self.limit, "metrics": self.metrics,
                **({"drained": self.drained} if self.drained else {})}


# A server holding a request's prefix takes it while it has a free slot (the request starts at
# once there, its prefix already computed) and, in the tail, is not behind: its requests decode
# at least half as fast as on the fastest server with a free slot (a slower one would finish the
# tail's last turns later than a recomputed prefix costs elsewhere).
AFFINITY_MIN_SPEED = 0.5
# Before the tail a request may also wait in its prefix's home's own queue, this many beyond the
# server's slots, rather than recompute the prefix on a server with a free slot: that slot goes to
# the next request of the feed, so no slot idles, and a shared system prompt stays warm on few
# servers (as SGLang's cache-aware router keeps it) instead of on every one.
AFFINITY_QUEUE = 2
# Shared prefixes (system prompt and tools) remembered, most recent first.
SHARED_PREFIXES = 4096


class ServerPool:
    """Dispatch within per-server limits, prefix affinity, and health probing of dropped servers.

    A request takes a free slot at once whenever there is one (or, before the tail, a place in
    its prefix's home's queue: AFFINITY_QUEUE): the drain never holds a request back while a
    server has room (the DAG's mapped shards on one node hand each other their slots
    in the tail through :class:`regen.coordination.FairShare`; a request kept waiting for a
    faster server would leave those slots idle).
    """

    def __init__(self, endpoints: list[Endpoint], tuning: ClientTuning, share: "FairShare | None" = None):
        self.endpoints = endpoints
        self.tuning = tuning
        self.share = share
        self.demand = sum(e.size for e in endpoints)  # requests still to make; the caller updates it
        self.cond = asyncio.Condition()
        self.draining = False
        self.stayed = 0  # requests that went to the server holding their prefix
        self.moved = 0  # requests with a known prefix that went elsewhere
        self._homes: dict[str, list[Endpoint]] = {}  # prefix key -> servers that hold it, newest first
        self._down_since: float | None = None
        self._probes: set[asyncio.Task] = set()
        for endpoint in endpoints:
            if not endpoint.healthy:
                self._start_probe(endpoint)
        if share is not None:
            share.rebalance(self.demand)
            self._probes.add(asyncio.create_task(self._rebalancer()))

    @property
    def capacity(self) -> int:
        """The most requests this pool may ever have in flight (every slot of every budget)."""
        return sum(e.size for e in self.endpoints)

    async def _rebalancer(self) -> None:
        """Hold the fair share of each server's budget as shards come and go. It must outlive
        any one failure: a shard whose rebalancing stopped would wait for slots forever."""
        while True:
            await asyncio.sleep(self.tuning.rebalance_interval_s)
            in_use = sum(e.in_flight for e in self.endpoints)
            try:
                self.share.rebalance(max(self.demand, in_use))
            except Exception as exc:  # logged, then tried again at the next interval
                log.warning("rebalancing the server budgets failed: %s: %s", type(exc).__name__, exc)
            async with self.cond:
                self.cond.notify_all()

    def homes(self, keys: list[str], shared: set[str] | frozenset[str] = frozenset()) -> list[Endpoint]:
        """The servers that hold a prefix of these keys (the most specific key first). A shared
        prefix no request of this process has placed yet goes to its rendezvous server: the
        DAG's mapped shards, each with its own memory, then warm it on the same server."""
        seen: list[Endpoint] = []
        for key in keys:
            held = self._homes.get(key, ())
            if not held and key in shared:
                held = self._rendezvous(key)
            for endpoint in held:
                if endpoint not in seen:
                    seen.append(endpoint)
        return seen

    def _rendezvous(self, key: str) -> list[Endpoint]:
        """The healthy server ranked first for ``key`` by every process alike (highest random
        weight: a server leaving moves only its own keys)."""
        healthy = [e for e in self.endpoints if e.healthy and not e.drained]
        if not healthy:
            return []
        return [max(healthy, key=lambda e: hashlib.blake2b(f"{key}|{e.url}".encode(), digest_size=8).digest())]

    def remember(self, keys: list[str], endpoint: Endpoint, shared: set[str]) -> None:
        """``endpoint`` now holds the prefixes of ``keys``; a key in ``shared`` (a system prompt
        many conversations start with) may be held by several servers."""
        for key in keys:
            held = [e for e in self._homes.pop(key, ()) if e is not endpoint] if key in shared else []
            self._homes[key] = [endpoint, *held]
        while len(self._homes) > SHARED_PREFIXES + self.capacity * 2:
            self._homes.pop(next(iter(self._homes)))

    def forget(self, key: str) -> None:
        self._homes.pop(key, None)

    async def acquire(self, avoid: Endpoint | None = None, prefer: list[Endpoint] | None = None) -> Endpoint:
        """A server with a free slot (``prefer``: those holding the request's prefix, best first)."""
        async with self.cond:
            while True:
                healthy = [e for e in self.endpoints if e.healthy and not e.drained]
                if len(healthy) > 1 and avoid in healthy:
                    healthy.remove(avoid)  # a retry goes to another server where there is one
                free = [e for e in healthy if e.in_flight < e.limit]
                home = None if self.draining else next(
                    (e for e in prefer or () if e in healthy and e.in_flight < e.limit + AFFINITY_QUEUE), None)
                if home is not None and home not in free:
                    self.stayed += 1
                    home.in_flight += 1
                    return home
                if free:
                    self._down_since = None
                    pick = self._choose(free, prefer or [])
                    pick.in_flight += 1
                    return pick
                if not healthy:
                    now = time.monotonic()
                    self._down_since = self._down_since or now
                    if now - self._down_since > self.tuning.all_down_timeout_s:
                        raise AllServersDown(
                            f"every server is down ({', '.join(e.url for e in self.endpoints)}) "
                            f"for {self.tuning.all_down_timeout_s:.0f} s; finished rows are kept: "
                            f"restart the servers (clear start_servers) and rerun the shard"
                        )
                with contextlib.suppress(TimeoutError):  # asyncio.timeout: wait_for can lose a cancel
                    async with asyncio.timeout(1.0):  # a release or a probe notifies sooner
                        await self.cond.wait()

    def _choose(self, free: list[Endpoint], prefer: list[Endpoint]) -> Endpoint:
        """One of the servers with a free slot."""
        load = lambda e: e.in_flight / e.limit  # noqa: E731
        known = [e for e in free if e.speed]
        fastest = max((e.speed for e in known), default=None)
        for home in prefer:
            if home in free and not (self.draining and fastest and home.speed
                                     and home.speed < AFFINITY_MIN_SPEED * fastest):
                self.stayed += 1
                return home
        if prefer:
            self.moved += 1
        if self.draining and len(known) == len(free):
            return max(free, key=lambda e: (e.speed, -load(e)))  # the tail: where it finishes first
        return min(free, key=load)

    async def release(self, endpoint: Endpoint, latency_s: float | None = None, tokens: int = 0) -> None:
        async with self.cond:
            endpoint.in_flight -= 1
            if latency_s and tokens:
                speed = tokens / latency_s
                endpoint.speed = speed if endpoint.speed is None else 0.9 * endpoint.speed + 0.1 * speed
            self.cond.notify_all()

    def record_success(self, endpoint: Endpoint) -> None:
        endpoint.consecutive_failures = 0

    def record_failure(self, endpoint: Endpoint, reason: str, fatal: bool = False) -> None:
        endpoint.consecutive_failures += 1
        if endpoint.healthy and (fatal or endpoint.consecutive_failures >= self.tuning.failures_before_down):
            endpoint.healthy = False
            log.warning("server %s out of rotation (%s); probing until it is back", endpoint.url, reason)
            self._start_probe(endpoint)

    def _start_probe(self, endpoint: Endpoint) -> None:
        task = asyncio.create_task(self._probe(endpoint))
        self._probes.add(task)
        task.add_done_callback(self._probes.discard)

    async def _probe(self, endpoint: Endpoint) -> None:
        while True:
            await asyncio.sleep(self.tuning.probe_interval_s)
            try:
                status, _ = await endpoint.transport.request("GET", "/health", read_timeout=5.0)
            except httpx2.HTTPError:
                continue
            if status == 200:
                async with self.cond:
                    endpoint.healthy = True
                    endpoint.consecutive_failures = 0
                    self.cond.notify_all()
                log.info("server %s is back in rotation", endpoint.url)
                return

    def close(self) -> None:
        for task in self._probes:
            task.cancel()
        if self.share is not None:
            self.share.close()


async def discover(url: str, api_key: str | None, cfg: RunConfig, tuning: ClientTuning) -> Endpoint:
    """The served model, the engine behind it and how many requests it runs at once."""
    endpoint = Endpoint(url=url.rstrip("/"), api_key=api_key, engine=engine(cfg.engine))
    endpoint.connect(cfg, 1)
    try:
        doc = await endpoint.get_json("/v1/models")
        endpoint.model = doc["data"][0]["id"]
        endpoint.served_path = doc["data"][0].get("root")
        endpoint.engine = engine_of_server(doc, cfg.engine)
    except (httpx2.HTTPError, KeyError, IndexError, ValueError, TypeError) as exc:
        endpoint.healthy = False
        endpoint.unauthorized = "HTTP 401" in str(exc)
        log.warning("server %s not answering /v1/models (%s); probing until it is back", url, exc)
    if endpoint.healthy:
        endpoint.info = await _server_info(endpoint)
        endpoint.served_path = endpoint.served_path or endpoint.engine.served_model_path(endpoint.info)
        endpoint.made_by = made_by(endpoint)
    reported = endpoint.engine.effective_limit(endpoint.info, None)
    wanted = cfg.generation.concurrency_per_server
    if reported:
        budget = reported + cfg.generation.queue_margin
        endpoint.size = min(wanted, budget) if wanted else budget
    else:
        endpoint.size = wanted or tuning.default_concurrency
    endpoint.limit = endpoint.size
    await endpoint.transport.aclose()
    endpoint.connect(cfg, endpoint.size)
    return endpoint


# What SGLang 0.5.23's /server_info reports (its resolved server arguments, launch_command,
# scheduler info, kv_events, startup_time, internal_states) that differs between servers of one
# fleet by design, or changes while it runs: not part of what makes a row.
_PER_SERVER = {"host", "port", "internal_states", "base_gpu_id", "gpu_id", "dist_init_addr", "nccl_port",
               "api_key", "log_level", "file_storage_path", "enable_metrics", "last_gen_throughput",
               "memory_usage", "decode_log_interval", "launch_command", "startup_time", "kv_events"}


def made_by(endpoint: Endpoint) -> str:
    """What makes this server's rows, as one JSON string recorded with each (regen.rows.Row.made_by):
    its engine and version, its parsers, the hash of the chat template it renders with (the
    served model folder's, read here; the launch's own ``chat_template`` override named by its
    path) and of its launch arguments (what is per server left out)."""
    from regen.chat.render import template_digest

    info = endpoint.info or {}
    launch = {k: v for k, v in info.items() if k not in _PER_SERVER and not k.startswith("sim_")}
    override = info.get("chat_template")
    template = (f"launch:{override}" if override else
                template_digest(endpoint.served_path) if endpoint.served_path else None)
    return json.dumps({"engine": endpoint.engine.name if endpoint.engine else None, "version": info.get("version"),
                       "reasoning_parser": info.get("reasoning_parser"), "tool_call_parser": info.get("tool_call_parser"),
                       "chat_template": template,
                       "launch": hashlib.sha256(json.dumps(launch, sort_keys=True, default=str).encode()).hexdigest()[:12]},
                      sort_keys=True)


async def _server_info(endpoint: Endpoint) -> dict:
    for path in endpoint.engine.info_paths:
        try:
            info = await endpoint.get_json(path)
        except (httpx2.HTTPError, ValueError):
            continue
        if isinstance(info, dict):
            return info
    return {}


@contextlib.asynccontextmanager
async def open_endpoints(endpoints: list[tuple[str, str | None]], cfg: RunConfig, tuning: ClientTuning,
                         expected_models: dict[str, str] | None = None):
    """Discovered endpoints with their own connection pools, closed on the way out.
    ``expected_models``: url -> the model name its server was started with; a server that now
    answers with another name is not the one recorded, and is never used."""
    eps: list[Endpoint] = []
    try:
        for url, key in endpoints:
            endpoint = await discover(url, key, cfg, tuning)
            wanted = (expected_models or {}).get(url)
            if wanted and endpoint.model and endpoint.model != wanted:
                await endpoint.transport.aclose()
                raise AllServersDown(
                    f"{url} serves {endpoint.model!r}, not {wanted!r} which this run's servers were "
                    f"started with: another server took its port; not using it")
            eps.append(endpoint)
        refused = [e.url for e in eps if e.unauthorized]
        if not any(e.healthy for e in eps) and refused:
            raise AllServersDown(
                f"{', '.join(refused)} answered HTTP 401 Unauthorized: the servers want an API key this run "
                f"does not have (with `--endpoints`: servers `regen serve` started for this output use its key; "
                f"others take the deployment's api_key)")
        if not any(e.healthy for e in eps):
            raise AllServersDown(
                f"no server answers ({', '.join(e.url for e in eps)}): start them first "
                f"(clear start_servers too, or run `regen serve`) and rerun the shard"
            )
        yield eps
    finally:
        for endpoint in eps:
            await endpoint.transport.aclose()


async def scrape_metrics(endpoint: Endpoint) -> None:
    """The few gauges worth a glance (running, queued, throughput, accept length), read with
    prometheus_client's parser and named by the endpoint's engine."""
    from prometheus_client.parser import text_string_to_metric_families

    try:
        status, body = await endpoint.transport.request("GET", "/metrics", read_timeout=3.0)
    except httpx2.HTTPError:
        return
    if status != 200:
        return
    metrics: dict[str, float] = {}
    try:
        for family in text_string_to_metric_families(body.decode("utf-8", "replace")):
            for sample in family.samples:
                name = endpoint.engine.metric(sample.name)
                if name is not None:
                    metrics[name] = metrics.get(name, 0.0) + float(sample.value)
    except ValueError as exc:
        log.debug("unreadable /metrics from %s: %s", endpoint.url, exc)
        return
    endpoint.metrics = metrics
