"""The generate stage: shards of prompts, sent exactly once, resumable at any point.

A shard's prompts are the ids that hash to it. Ids that already have a row (in the journal of an
interrupted attempt, or in the shard's file from an earlier run with the same model and settings)
are not sent again. What a shard does is :class:`ShardRun`; where its rows live is
:class:`regen.store.ShardStore`; how requests reach the servers is :mod:`regen.client`.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import logging
import os
import sys
import threading
import time
import traceback
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator

from regen.alerts import check_overdue
from regen.client import Generator
from regen.config import RunConfig
from regen.coordination import FairShare, FileLock, check_held, end_approval_hold
from regen.dispatch import ClientTuning, ServerPool, open_endpoints, scrape_metrics
from regen.errors import ShardFailed
from regen.files import atomic_write_json, read_json
from regen.layout import shard_key
from regen.manifest import Manifest, ShardPrompts, model_fingerprint, prompt_hash, settings_hash, template_kwargs
from regen.placement import servers_for
from regen.progress import RunProgress
from regen.prompts import Prompt, PromptError, read_at
from regen.quality import QualityFailed, QualityGuard
from regen.results import GenerateResult, ShardResult
from regen.stages import DEADLINE_MOVED
from regen.servers.records import read_state
from regen.parts import shard_store
from regen.store import Journal, ShardStore
from regen.turns import Conversation
from regen.units import format_duration

log = logging.getLogger("regen.generate")
# Shards settling at once in one process, at most one per core: their reading is mostly off the GIL,
# and each reader holds ~0.1 GB.
SETTLE_THREADS = 8


def served_identity(endpoints: list) -> str:
    """The model's identity as the servers report it (engine, model names, model path), when no
    model directory says what they serve; servers that disagree are refused."""
    seen = {json.dumps({"engine": e.engine.name, "model": e.model, "path": e.served_path}, sort_keys=True)
            for e in endpoints if e.healthy}
    if len(seen) > 1:
        raise ShardFailed(f"the servers serve different models ({'; '.join(sorted(seen))}); a dataset "
                          f"comes from one model")
    return "served:" + hashlib.sha256(seen.pop().encode()).hexdigest()[:16]


@dataclass
class _Shard:
    """One shard of an attempt: its files, its slice of the index and what it has done."""

    store: ShardStore
    prompts: ShardPrompts
    settled: set[str] = field(default_factory=set)
    pending: set[str] = field(default_factory=set)
    resumed: dict[str, list[dict]] = field(default_factory=dict)
    journal: Journal | None = None
    bad: int = 0
    done: int = 0
    failed: int = 0
    tokens: int = 0
    up_to_date: bool = False
    last_error: str | None = None  # the last failed prompt's: what the run page shows a person
    publishing: asyncio.Future | None = None  # its publish, started once its last row is in

    @property
    def total(self) -> int:
        return len(self.prompts.ids)

    @property
    def skipped(self) -> int:
        return len(self.settled)

    def turns_left(self, prompt_id: str, all_turns: bool) -> int:
        return self.prompts.turns[prompt_id] - len(self.resumed.get(prompt_id, ())) if all_turns else 1


class ShardRun:
    """One attempt at one or more shards: settle what is done, send the rest, publish each
    shard's file.

    The shards of one attempt share one client: one feed of conversations (the longest chains
    of requests first, whichever shard they belong to), one budget of request slots, one lease.
    So a process that runs every shard (``regen generate`` without ``--shard``) never lets one
    shard's tail idle the servers while the next waits. Each row goes to its own shard's journal,
    and each shard's error bound is its own.

    ``model_identity``: what the servers serve (the fingerprint of the model copy they loaded);
    None takes it from what the servers report (`--endpoints` without a model directory).
    ``rebuild_index``: index the prompt file here when the manifest does not describe it (the
    CLI); a DAG shard instead refuses a file that changed after its run's preflight.
    """

    def __init__(self, cfg: RunConfig, endpoints: list[tuple[str, str | None]], shards: int | list[int],
                 model_identity: str | None, tuning: ClientTuning | None = None,
                 on_row: Callable[[dict], None] | None = None, rebuild_index: bool = True,
                 expected_models: dict[str, str] | None = None, run_id: str = "cli",
                 deadline_s: float | None = None):
        self.cfg = cfg
        self.deadline_s = deadline_s
        self.run_id = run_id
        self.endpoints = endpoints
        self.tuning = tuning or ClientTuning()
        self.on_row = on_row
        self.rebuild_index = rebuild_index
        self.expected_models = expected_models or {}
        self.layout = cfg.layout
        numbers = [shards] if isinstance(shards, int) else sorted(set(shards))
        if not numbers:
            raise ValueError("no shard to run")
        self.stores = [shard_store(cfg, n) for n in numbers]
        self.shards: dict[int, _Shard] = {}
        self.shard_of: dict[str, _Shard] = {}
        self.progress = RunProgress(self.layout)
        self.manifest = Manifest(self.layout)
        self.model_identity = model_identity
        self.started = time.monotonic()
        self.started_wall = time.time()
        # Its shards' parts share one pool of servers: progress counts the servers once per attempt.
        self.attempt = f"{self.cfg.this_node().name}:{os.getpid()}:{self.started_wall:.3f}"
        self.gen: Generator | None = None
        self.eps: list = []
        self.last_reply: float | None = None  # monotonic: when the attempt's last row came in
        self.paced_rows = 0  # the attempt's rows when its deadline was last looked at (_keep_pace)
        self.under_deadline = False  # generating, under the deadline (what _watch_loop watches)

    @property
    def name(self) -> str:
        names = [s.name for s in self.stores]
        return names[0] if len(names) == 1 else f"{names[0]} .. {names[-1]} ({len(names)} shards)"

    def run(self) -> GenerateResult:
        ended = threading.Event()
        watchdog = threading.Thread(target=self._watch_loop, args=(threading.get_ident(), ended), daemon=True,
                                    name=f"{self.name} loop watchdog")
        with contextlib.ExitStack() as locks:
            for store in self.stores:
                locks.enter_context(store.lock())
            if self.deadline_s is not None:
                watchdog.start()
            try:
                return asyncio.run(self._run())
            finally:
                ended.set()

    def _watch_loop(self, loop_thread: int, ended: threading.Event) -> None:
        """The attempt's deadline is an asyncio timeout, which a blocked event loop never fires (a
        C call that does not return, a callback that sleeps): past the deadline by LOOP_GRACE_S,
        this thread ends the process (EXIT_LOOP_BLOCKED) with the loop's stack in the log, rather
        than leave the attempt to the stage's one-week backstop. The journal keeps what it
        finished (exactly once under SIGKILL too); the retry resumes from there."""
        while not ended.wait(LOOP_CHECK_S):
            if not self.under_deadline or time.monotonic() < self.started + self.deadline_s + LOOP_GRACE_S:
                continue
            frame = sys._current_frames().get(loop_thread)
            stack = "".join(traceback.format_stack(frame)) if frame is not None else "(gone)"
            why = (f"{self.name}: its event loop has been blocked past its deadline of {self.deadline_s:.0f} s "
                   f"(by {LOOP_GRACE_S:.0f} s): the attempt ends (exit {EXIT_LOOP_BLOCKED}); what it finished is "
                   f"kept and its retry resumes from there")
            log.error("%s. The loop's stack:\n%s", why, stack)
            with contextlib.suppress(Exception):  # the loop is stuck: nothing else writes these now
                self._report("failed", why)
            for handler in logging.getLogger().handlers + log.handlers:
                with contextlib.suppress(Exception):
                    handler.flush()
            os._exit(EXIT_LOOP_BLOCKED)

    def _drain_marked(self) -> None:
        """The servers another shard of the run drained get no new request from this one either;
        with none left, the run stops (the next request raises)."""
        for endpoint in self.eps:
            endpoint.drained = endpoint.drained or self.guard.drained.get(endpoint.url)
        with contextlib.suppress(QualityFailed):  # marked stopped: the next request raises it
            self.guard.all_drained([e.url for e in self.eps])

    def _time_left(self) -> float | None:
        return None if self.deadline_s is None else max(self.deadline_s - (time.monotonic() - self.started), 0.0)

    def _report_bad(self, doc: dict, store: ShardStore) -> int:
        """Unreadable records of the prompt file that fall to this shard, listed with file:line."""
        bad = [text for line, text in (doc.get("prompts") or {}).get("unreadable", [])
               if line % self.cfg.num_shards == store.shard]
        if not bad:
            return 0
        store.errors_path.parent.mkdir(parents=True, exist_ok=True)
        store.errors_path.write_text("".join(f"{e}\n" for e in bad))
        for err in bad[:5]:
            log.warning("unreadable prompt record: %s", err)
        log.warning("%d unreadable record(s) listed in %s", len(bad), store.errors_path)
        return len(bad)

    def _conversations(self, work: list[_Shard]) -> Iterator[Conversation]:
        """The pending conversations of every shard, read where the index says they are, each
        checked against the hash the index recorded (a file changed under a running shard fails
        it, clearly); those with the most turns still to make first, as they are the longest
        chains of requests, then in file order. A conversation cut mid-way resumes after its last
        turn."""
        kwargs = template_kwargs(self.cfg)
        all_turns = self.cfg.generation.regenerate_turns == "all"
        order = sorted(((shard, i) for shard in work for i in shard.pending),
                       key=lambda item: (-item[0].turns_left(item[1], all_turns), item[0].prompts.places[item[1]]))
        for item in read_at(self.cfg.prompts, [shard.prompts.places[i] for shard, i in order]):
            shard = self.shard_of.get(getattr(item, "id", None))
            if isinstance(item, PromptError) or shard is None or \
                    shard.prompts.hashes.get(item.id) != prompt_hash(item.messages, kwargs, item.tools):
                raise ShardFailed(
                    f"{self.name}: {self.cfg.prompts} changed while the run went on (line "
                    f"{item.line} is not what was indexed); finished rows are kept. Clear the whole "
                    f"run to regenerate from the file as it is now")
            yield Conversation(item.id, item.messages,
                               {"prompt_hash": shard.prompts.hashes[item.id], "settings_hash": self.settings_hash},
                               list(shard.resumed.get(item.id, ())) if all_turns else [], all_turns, item.tools)

    def _settle(self, doc: dict) -> list[_Shard]:
        """Each shard's rows already made, and what it still has to send; the shards with work.
        The shards settle at once (SETTLE_THREADS): their journals are read off the GIL (Arrow's
        reader) and a bucket's requests overlap, so a resume of many shards in one process waits
        about as long as its largest shard."""
        all_turns = self.cfg.generation.regenerate_turns == "all"
        at_once = min(len(self.stores), os.cpu_count() or 1, SETTLE_THREADS)
        with ThreadPoolExecutor(at_once, thread_name_prefix="settle") as threads:
            shards = list(threads.map(lambda store: self._settle_shard(store, doc, all_turns), self.stores))
        for shard in shards:
            self.shards[shard.store.shard] = shard
            for prompt_id in shard.pending:
                self.shard_of[prompt_id] = shard
        work = [s for s in self.shards.values() if not s.up_to_date]
        for shard in work:
            self._check_errors(shard)  # a retry past the bound already fails before it sends anything
        self.demand = sum(s.turns_left(i, all_turns) for s in work for i in s.pending)
        return work

    def _settle_shard(self, store: ShardStore, doc: dict, all_turns: bool) -> _Shard:
        shard = _Shard(store, self.manifest.shard_prompts(store.shard), bad=self._report_bad(doc, store))
        turns: dict[str, list[tuple[int, int]]] = {}
        settled, file_ids, failed = store.settled_and_failed(shard.prompts.hashes, self.settings_hash, turns)
        shard.settled = settled
        if store.complete(shard.prompts.ids, settled, file_ids):
            shard.up_to_date = True
            store.tidy()
            log.info("%s is up to date: every prompt has a good row of this run's prompts, "
                     "model and settings (%s); nothing to send", store.name, store.location)
            return shard
        shard.pending = set(shard.prompts.ids) - settled
        # An earlier attempt's failures stay failures: the error bound is the shard's, not the attempt's.
        shard.failed = len(failed)
        if all_turns:
            shard.resumed = store.turns_at(turns)
        log.info("%s: %d prompts, %d already have a row, %d to send", store.name, shard.total,
                 shard.skipped, len(shard.pending))
        if shard.resumed:
            log.info("%s: %d conversations resume after their last finished turn", store.name,
                     len(set(shard.resumed) & shard.pending))
        return shard

    async def _run(self) -> GenerateResult:
        doc = self.manifest.ensure(self.cfg, rebuild=self.rebuild_index)
        work: list[_Shard] = []
        try:
            async with open_endpoints(self.endpoints, self.cfg, self.tuning, self.expected_models) as eps:
                self.eps = eps
                identity = self.model_identity or served_identity(eps)
                self.settings_hash = settings_hash(identity, self.cfg.sampling_settings())
                self.manifest.update(settings_hash=self.settings_hash, model_identity=identity)
                work = self._settle(doc)
                self._report("done", shards=[s for s in self.shards.values() if s.up_to_date])
                if not work:
                    return self._result()
                for shard in work:
                    shard.journal = Journal(shard.store.journal_path)
                share = FairShare(self.layout, shard_key(self.stores[0].shard), self.run_id, eps)
                pool = ServerPool(eps, self.tuning, share)
                pool.demand = self.demand
                self.guard = QualityGuard(self.layout, self.cfg.audit.max_degenerate_fraction,
                                          self.cfg.audit.max_loop_fraction, self.cfg.enable_thinking, self.run_id)
                self._drain_marked()
                sent = reasoning_recorded(self.cfg, doc, [e.served_path for e in eps])
                if not isinstance(sent, tuple):  # decided beside the first requests, which never need it
                    sent = asyncio.ensure_future(asyncio.to_thread(reasoning_probed, sent, self.cfg.enable_thinking,
                                                                   self.manifest, in_child=True))
                self.gen = Generator(pool, self.cfg, self.tuning, self._sink, self._append, sent, self.guard)
                self._report()
                deadline = asyncio.timeout(self._time_left())
                reporter = asyncio.create_task(self._reporter(deadline))
                self.under_deadline = True
                try:
                    async with deadline:  # never wait_for: it can lose a cancellation (Python 3.11)
                        await self.gen.run(self._conversations(work))
                except TimeoutError:
                    if not deadline.expired():
                        raise
                    failure = ShardFailed(f"{self.name} passed its deadline of {self.deadline_s:.0f} s "
                                          f"(from the canary's estimate, moved by its own pace while rows came "
                                          f"in); what it finished is kept and its retry resumes from there")
                    self._report("failed", str(failure))
                    raise failure from None
                except BaseException as exc:
                    self._report("failed", str(exc) or type(exc).__name__)
                    raise
                finally:
                    self.under_deadline = False  # the publish after it is not the deadline's
                    reporter.cancel()
                    pool.close()
                    # a publish under way finishes (or fails) before the attempt ends either way
                    await asyncio.gather(*(s.publishing for s in work if s.publishing), return_exceptions=True)
        finally:
            for shard in work:
                if shard.journal is not None:
                    shard.journal.close()
        for shard in work:
            if shard.publishing is not None:
                shard.publishing.result()  # its error, if any: ShardFailed naming the file
            else:
                self._publish(shard)
        if self.last_reply is not None:
            log.info("%s: published %.1f s after the last reply", self.name, time.monotonic() - self.last_reply)
        result = self._result()
        elapsed = time.monotonic() - self.started
        self._report("done", shards=work, tokens_per_s={
            s.store.shard: round(s.tokens / elapsed, 1) if elapsed > 0 else 0.0 for s in work})
        return result

    def _result(self) -> GenerateResult:
        seconds = time.monotonic() - self.started
        node = self.cfg.this_node().name
        return GenerateResult(seconds=seconds, shards=[ShardResult(
            shard=s.store.shard, num_shards=self.cfg.num_shards, total=s.total, done=s.done,
            failed=s.failed, skipped=s.skipped, bad_records=s.bad, seconds=seconds, tokens=s.tokens,
            path=s.store.location, node=node) for s in self.shards.values()])

    def _append(self, row: dict) -> None:
        shard = self.shard_of[row["id"]]
        check_held(self.cfg.layout)
        try:
            shard.journal.append(row)
            shard.store.appended(row)
        except OSError as exc:
            raise ShardFailed(f"{shard.store.name}: cannot write {shard.store.journal_path}: "
                              f"{exc.strerror or exc}") from exc

    def _publish(self, shard: _Shard) -> None:
        try:
            shard.store.publish(shard.prompts.hashes, self.settings_hash)
        except OSError as exc:
            raise ShardFailed(f"{shard.store.name}: cannot write {shard.store.location}: "
                              f"{exc.strerror or exc}; data/ is unchanged and the journal is kept") from exc

    def _sink(self, row: dict) -> None:
        self._append(row)
        shard = self.shard_of[row["id"]]
        self.last_reply = time.monotonic()
        if row["error"] is None:
            shard.done += 1
            shard.tokens += row.get("completion_tokens") or 0
        else:
            shard.failed += 1
            shard.last_error = f"{row['id']}: {row['error']}"[:500]
        if self.on_row is not None:
            self.on_row(row)
        if row["error"] is not None:
            self._check_errors(shard)
        if shard.done + shard.failed == len(shard.pending) and len(self.shards) > 1:
            # every row of this shard is in: it is published while the others still generate
            shard.journal.close()
            shard.journal = None
            # submitted now (run_in_executor), not when the loop next runs a task (to_thread)
            shard.publishing = asyncio.get_running_loop().run_in_executor(None, self._publish, shard)

    def _check_errors(self, shard: _Shard) -> None:
        bound = self.cfg.generation.max_error_fraction * max(shard.total, 1)
        if shard.failed > bound and shard.failed >= 1:
            raise ShardFailed(
                f"{shard.store.name}: {shard.failed} of {shard.total} prompts failed (more than "
                f"max_error_fraction {self.cfg.generation.max_error_fraction:.0%}); last errors in "
                f"{shard.store.journal_path}; finished rows are kept"
            )

    def _report_shard(self, shard: _Shard, state: str, reason: str | None = None) -> dict:
        rows_s, tok_s = self.gen.rates() if self.gen else (0.0, 0.0)
        share = (len(shard.pending) / max(sum(len(s.pending) for s in self.shards.values()), 1))
        left = len(shard.pending) - shard.done - shard.failed
        rows_s, tok_s = rows_s * share, tok_s * share  # the attempt's rates, by each shard's part
        return {
            "state": state, "shard": shard.store.shard, "num_shards": self.cfg.num_shards,
            "node": self.cfg.this_node().name, "attempt": self.attempt,
            "total": shard.total, "done": shard.skipped + shard.done, "failed": shard.failed,
            "sent": shard.done + shard.failed, "tokens": shard.tokens,
            "started_at": round(self.started_wall, 2),
            "rows_per_s": round(rows_s, 3), "tokens_per_s": round(tok_s, 1),
            "eta_s": 0 if state == "done" else (round(left / rows_s) if rows_s > 0 else None),
            "elapsed_s": round(time.monotonic() - self.started, 1),
            "servers": {e.url: e.report() for e in self.eps},
            "last_error": shard.last_error, "reason": reason,
        }

    def _report(self, state: str = "running", reason: str | None = None, shards: list[_Shard] | None = None,
                tokens_per_s: dict[int, float] | None = None) -> dict:
        """The parts of progress.json of ``shards`` (default: those with work), written and folded
        once (a fold per shard reads every part: the square of the shards, seconds at 64); the
        first one's document (the log line's). ``tokens_per_s``: a finished shard's, over the attempt."""
        parts = {}
        for shard in self.shards.values() if shards is None else shards:
            if shards is None and shard.up_to_date:
                continue
            data = parts[shard.store.shard] = self._report_shard(shard, state, reason)
            if tokens_per_s is not None:
                data.update(tokens_per_s=tokens_per_s[shard.store.shard], eta_s=0)
        if parts:
            self.progress.write_shards(parts)
        return next(iter(parts.values()), {})

    def _keep_pace(self, deadline: asyncio.Timeout, done: int, left: int) -> None:
        """Move the deadline out to SHARD_DEADLINE_FACTOR times what the rest takes at this
        attempt's own pace, each time rows came in since the last look: a canary's estimate that
        was too low never fails an honest shard; a hung one (no new row) meets the last deadline."""
        came_in, self.paced_rows = done > self.paced_rows, done
        if self.deadline_s is None or not came_in or left <= 0:
            return
        elapsed = time.monotonic() - self.started
        paced = elapsed + SHARD_DEADLINE_FACTOR * left * elapsed / done
        if paced > self.deadline_s * 1.1:  # in steps, so that a long run logs it a few times
            self.deadline_s = paced
            deadline.reschedule(self.started + paced)
            log.info("%s: %s %.0f s, %.0fx what its %s rows left take at its own pace (%s rows in %s)",
                     self.name, DEADLINE_MOVED, paced, SHARD_DEADLINE_FACTOR, f"{left:,}", f"{done:,}",
                     format_duration(elapsed))

    async def _reporter(self, deadline: asyncio.Timeout) -> None:
        while True:
            await asyncio.sleep(self.tuning.progress_interval_s)
            await asyncio.gather(*(scrape_metrics(e) for e in self.eps))
            # built on the loop (it reads what the loop changes), written off it (files, folding)
            parts = {s.store.shard: self._report_shard(s, "running")
                     for s in self.shards.values() if not s.up_to_date}
            await asyncio.to_thread(self.progress.write_shards, parts)
            check_overdue(self.layout)
            self.guard.refresh()
            self._drain_marked()
            work = [s for s in self.shards.values() if not s.up_to_date]
            total = sum(s.total for s in work)
            done = sum(s.skipped + s.done for s in work)
            rows_s, tok_s = self.gen.rates()
            left = total - done - sum(s.failed for s in work)
            self._keep_pace(deadline, sum(s.done + s.failed for s in work), left)
            pool = self.gen.pool
            log.info("%s: %s/%s done, %d failed, %s tok/s, ETA %s; %d requests on the server holding their "
                     "prefix, %d moved", self.name, f"{done:,}", f"{total:,}", sum(s.failed for s in work),
                     f"{tok_s:,.0f}", format_duration(round(left / rows_s) if rows_s > 0 else None),
                     pool.stayed, pool.moved)


def swept_concurrency(cfg: RunConfig) -> int | None:
    """The requests per server the canary's sweep chose for this output (None: every slot)."""
    if cfg.generation.concurrency_per_server:
        return None
    canary = read_json(cfg.layout.progress_part("canary")) or {}
    best = ((canary.get("estimate") or {}).get("sweep") or {}).get("best")
    return best if isinstance(best, int) and 1 <= best <= 4096 else None


def generate(cfg: RunConfig, shards: list[int], endpoints: list[str] | None = None,
             model_from: str = "servers", strict_index: bool = False, run_id: str | None = None,
             give_up_after_s: float | None = None, deadline_s: float | None = None) -> GenerateResult:
    """The generate stage: ``shards`` in one attempt (a DAG task's one, or every shard of a
    ``regen generate`` that names none), through one client. Default: the servers start_servers recorded, and the model identity it
    recorded (the fingerprint of the copy they loaded); with ``run_id`` (a DAG shard), servers
    that are gone are brought up here first, so any retry path resumes the shard.
    ``endpoints``: URLs of running servers; their model's identity is then what they report
    (``model_from="servers"``) or the config's model directory (``"model_path"``).
    ``strict_index``: the manifest must be the one this run's preflight wrote (a DAG shard); else
    the prompt file is indexed here when needed. ``give_up_after_s``: how long every server may
    be down before the shard fails (a run over several nodes retries it on another).
    ``deadline_s``: how long this attempt may take (:func:`shard_deadline_s`)."""
    if (swept := swept_concurrency(cfg)) is not None:
        log.info("concurrency per server: %d, the canary sweep's best", swept)
        cfg = cfg.model_copy(update={"concurrency_per_server": swept})
    if endpoints:
        # Servers `regen serve` started for this output take its key; others the deployment's.
        recorded = {r.url: r.api_key for r in read_state(cfg.layout)}
        pairs = [(url, cfg.servers.api_key or recorded.get(url.rstrip("/"))) for url in endpoints]
        identity = model_fingerprint(cfg.model_path) if model_from == "model_path" else None
        expected: dict[str, str] = {}
    else:
        records = servers_for(cfg, run_id)
        end_approval_hold(cfg.layout)  # answered: from here the shards' leases keep the servers up
        identities = {r.model_fingerprint for r in records}
        if len(identities) != 1 or None in identities:
            raise ShardFailed(f"the recorded servers do not serve one known model ({identities}); "
                              f"restart them (clear start_servers)")
        pairs = [(r.url, r.api_key) for r in records]
        identity = identities.pop()
        expected = {r.url: r.served_model for r in records if r.served_model}
    with _progress_bar() as on_row:
        tuning = ClientTuning(all_down_timeout_s=give_up_after_s) if give_up_after_s else None
        return ShardRun(cfg, pairs, shards, identity, tuning=tuning, on_row=on_row,
                        rebuild_index=not strict_index, expected_models=expected, run_id=run_id or "cli",
                        deadline_s=deadline_s).run()


# A shard attempt gets this many times the canary's estimate of the whole run (one shard cannot
# honestly take longer than all of them), and never less than the floor; while its rows come in,
# this many times what its rest takes at its own pace (ShardRun._keep_pace): a deadline catches a
# hung node or command, not a slow run or a low estimate.
SHARD_DEADLINE_FACTOR = 4.0
SHARD_DEADLINE_FLOOR_S = 1800.0
# A loop that has not ended its attempt this long past the deadline is blocked (ShardRun._watch_loop),
# checked this often; the process then exits with this code.
LOOP_GRACE_S = 120.0
LOOP_CHECK_S = 5.0
EXIT_LOOP_BLOCKED = 75


def shard_deadline_s(canary_estimate: dict | None) -> float | None:
    """A shard attempt's deadline from the canary's estimate; None when there is no estimate."""
    eta = (canary_estimate or {}).get("eta_s")
    if not isinstance(eta, (int, float)) or eta <= 0:
        return None
    return max(SHARD_DEADLINE_FLOOR_S, SHARD_DEADLINE_FACTOR * eta)


def reasoning_sent(cfg: RunConfig, manifest: dict, served: list[str | None] | None = None) -> tuple[bool, bool]:
    """(chat turns, agent-loop steps): where an earlier step's reasoning goes back in the request,
    as the *served* model's template renders it (see reasoning_recorded; what no record says is
    found here, with the model's tokenizer)."""
    known = reasoning_recorded(cfg, manifest, served)
    return known if isinstance(known, tuple) else reasoning_probed(known, cfg.enable_thinking)


def reasoning_recorded(cfg: RunConfig, manifest: dict, served: list[str | None] | None = None) -> tuple[bool, bool] | str:
    """Where an earlier step's reasoning goes back, when no template need be rendered to tell:
    never asked for; servers whose model is not here (named by URL only): sent at both, the
    served template renders what it renders; a finding in the manifest for a template of the
    same text (preflight's for the run's model, which a staged copy of it shares, or an earlier
    process's). Else the model folder whose template decides: the folder the servers say they
    serve (``served``: their model paths), else the run's ``model_path``; never a default."""
    if cfg.generation.history_reasoning == "never" or cfg.generation.regenerate_turns == "last":
        return False, False
    folders = {str(Path(p)) for p in served or [] if p}
    model = folders.pop() if len(folders) == 1 else None if folders else str(Path(cfg.model_path))
    if model is None or not (Path(model) / "tokenizer_config.json").is_file():
        return True, True
    return _finding_for(manifest.get("history_reasoning") or {}, model, cfg.enable_thinking) or model


def _finding_for(probe: dict, model: str, enable_thinking: bool) -> tuple[bool, bool] | None:
    """A manifest's probe record, when it was found for this model's template text (by its path
    only for a folder without one: a template edited in place is probed again) and thinking mode."""
    from regen.chat.render import template_digest

    digest = template_digest(model)
    same = probe.get("template") == digest if digest is not None else probe.get("model_path") == model
    if same and probe.get("enable_thinking") == enable_thinking:
        return bool(probe.get("chat_turns")), bool(probe.get("tool_steps"))
    return None


def reasoning_probed(model: str, enable_thinking: bool, manifest: "Manifest | None" = None,
                     in_child: bool = False) -> tuple[bool, bool]:
    """reasoning_recorded's answer for ``model``, by rendering its template (transformers and a
    tokenizer: seconds of CPU); kept in ``manifest`` for the next process, and rendered once by
    shard processes started together (the others wait off their event loops, then read it).
    ``in_child``: in a child held to preflight's template budget (a thread beside the event loop
    has no render bound of its own, and the child's imports leave the loop's core alone). A
    template that fails or passes its budget (preflight's to report): sent at both, and kept so,
    or each waiting process would spend the budget again."""
    if manifest is None:
        return _found(_probed(model, enable_thinking, in_child))
    with FileLock(manifest.layout.template_probe_lock):
        known = _finding_for(manifest.read().get("history_reasoning") or {}, model, enable_thinking)
        if known is not None:
            return known
        probe = _probed(model, enable_thinking, in_child)
        try:
            from regen.chat.render import template_digest

            manifest.update(history_reasoning={"model_path": model, "enable_thinking": enable_thinking,
                                               "template": template_digest(model), **probe})
        except OSError:  # a record for the next process only
            pass
    return _found(probe)


def _probed(model: str, enable_thinking: bool, in_child: bool) -> dict:
    """The probe's record: this user's earlier finding for a template of the same text (a CLI run
    on a new output renders nothing the node has rendered before), else a render. Only a render
    that succeeded is kept there: a budget passed under a busy node's load would last for good."""
    from regen.chat.render import history_reasoning_of

    known = template_finding(model, enable_thinking)
    record = read_json(known, 4096) if known else None
    if isinstance(record, dict) and all(isinstance(record.get(k), bool) for k in ("chat_turns", "tool_steps")):
        return record
    try:
        if in_child:
            from regen.childpool import call_bounded
            from regen.preflight.template import TEMPLATE_MEMORY_BYTES, TEMPLATE_SECONDS

            record = call_bounded("regen.chat.render:history_reasoning_of", (model, enable_thinking),
                                  TEMPLATE_SECONDS, TEMPLATE_MEMORY_BYTES)
        else:
            record = history_reasoning_of(model, enable_thinking)
    except Exception as exc:
        return {"chat_turns": True, "tool_steps": True, "failed": f"{type(exc).__name__}: {exc}"[:500]}
    if known:
        with contextlib.suppress(OSError):
            known.parent.mkdir(mode=0o700, exist_ok=True)
            atomic_write_json(known, record, private=True, durable=False)
    return record


def template_finding(model: str, enable_thinking: bool) -> Path | None:
    """Where this user keeps the probe's finding for ``model``'s template text; None when the
    folder has no template or the user has no findings folder."""
    from regen.chat.render import template_digest

    digest, folder = template_digest(model), findings_folder()
    return folder / f"{digest}-{int(enable_thinking)}.json" if digest and folder else None


def findings_folder() -> Path | None:
    """In the owner-only folder (regen.procs.private_dir) that no output, temp folder or other
    user can write; None when that folder is not this user's alone."""
    from regen.errors import RegenError
    from regen.procs import private_dir

    try:
        return private_dir() / "template-findings"
    except (RegenError, OSError):
        return None


def _found(probe: dict) -> tuple[bool, bool]:
    return bool(probe["chat_turns"]), bool(probe["tool_steps"])


def shards_to_run(cfg: RunConfig) -> list[int]:
    """The shards with work left for this config's model (as staged: the fingerprint of its
    directory) and settings, from the manifest preflight just wrote; none when a scheduled run
    finds nothing new, so that no server starts. Every shard when the model is not here."""
    identity = model_fingerprint(cfg.model_path)
    if identity is None:
        return list(range(cfg.num_shards))
    wanted = settings_hash(identity, cfg.sampling_settings())
    manifest = Manifest(cfg.layout)
    left = []
    for shard in range(cfg.num_shards):
        store, prompts = shard_store(cfg, shard), manifest.shard_prompts(shard)
        if not store.complete(prompts.ids, *store.settled(prompts.hashes, wanted)):
            left.append(shard)
        else:
            store.tidy()  # a shard no task runs: what a killed publish of it left goes here
    return left


@contextlib.contextmanager
def _progress_bar():
    """A tqdm bar when a person watches a terminal; nothing otherwise (the log has progress)."""
    if not sys.stderr.isatty() or os.environ.get("REGEN_NO_PROGRESS_BAR"):
        yield None
        return
    from tqdm import tqdm

    bar = tqdm(unit="row", dynamic_ncols=True)

    def update(row: dict) -> None:
        bar.update(1)
        if row.get("error"):
            bar.set_postfix_str(f"last error: {row['error'][:40]}")

    try:
        yield update
    finally:
        bar.close()


def generate_rows(cfg: RunConfig, prompts: list[Prompt], endpoints: list[tuple[str, str | None]],
                  tuning: ClientTuning | None = None) -> tuple[list[dict], int]:
    """Generate a handful of prompts in memory (the canary), through the same client; also
    return how many requests the servers can run at once."""
    tuning = tuning or ClientTuning()

    async def run() -> tuple[list[dict], int]:
        rows: list[dict] = []
        async with open_endpoints(endpoints, cfg, tuning) as eps:
            pool = ServerPool(eps, tuning, FairShare(cfg.layout, "canary", "", eps))
            conversations = [Conversation(p.id, p.messages, all_turns=cfg.generation.regenerate_turns == "all",
                                          tools=p.tools) for p in prompts]
            pool.demand = sum(c.turn_count for c in conversations)
            try:
                await Generator(pool, cfg, tuning, rows.append,
                                send_reasoning=reasoning_sent(cfg, Manifest(cfg.layout).read())).run(conversations)
            finally:
                pool.close()
        return rows, pool.capacity

    return asyncio.run(run())
