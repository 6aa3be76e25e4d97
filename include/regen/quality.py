"""What a row shows without a tokenizer, and the live guard that watches every row as it comes back.

The audit proves the data after the last shard and the canary before the first; a run of days
sits between them. The guard reads each row as it is journaled, with the audit's own findings
that need no tokenizer (:func:`text_findings`) and the audit's own bounds, in a sliding window per
server and one for the whole shard:

- a server whose window passes a bound is **drained**: it gets no new request, the rows it
  still returns with the finding are sent again elsewhere, and it is marked for every shard of
  the run (progress.json's ``quality`` section: the run page, ``regen summary``, an alert);
- when every server is drained, or the shard's own window passes a bound, the shard fails at
  once naming the finding and its first rows, and so does every later attempt of the run
  until its servers are started again: a run whose servers all went bad costs minutes, not days.

A window passes its bound when its bad rows exceed what the bound allows in a full window plus
three standard deviations of a binomial at that rate, plus one (:func:`over_bound`): with the
default max_degenerate_fraction of 0.01, 5 of a server's last 100 rows, 11 of a shard's last 400.
A server at the bound's rate is rarely drained by chance; one that stopped thinking is drained at
its fifth bad row.
"""

from __future__ import annotations

import logging
import math
import time
from collections import deque
from dataclasses import dataclass, field

from regen.alerts import send
from regen.chat.templates import QWEN, ChatFormat
from regen.coordination import FileLock
from regen.errors import ShardFailed
from regen.files import atomic_write_json, read_json
from regen.layout import RunLayout
from regen.progress import RunProgress
from regen.rows import asked_thinking, row_messages

log = logging.getLogger("regen.quality")

# A loop: the text ends in one span repeated back to back, at least LOOP_MIN_REPEATS times and
# over at least LOOP_MIN_CHARS (greedy decoding's "wait, let me re-check ..." until max_tokens),
# or its last LOOP_WORDS words are mostly repeated 8-grams (a loop whose counter changes).
LOOP_MIN_REPEATS = 4
LOOP_MIN_CHARS = 200
LOOP_TAIL = 32  # the end the search starts from
LOOP_WORDS = 2000
LOOP_NGRAM = 8
LOOP_MIN_NGRAMS = 64
LOOP_MAX_DISTINCT = 0.3  # distinct 8-grams over all of them, at most

SERVER_WINDOW = 100  # rows of one server the guard judges it on
RUN_WINDOW = 400  # rows of a shard (every server) it judges the run on


def repetition_loop(text: str | None) -> bool:
    """The text loops (see LOOP_*): the degenerate tail greedy decoding gives reasoning models."""
    text = (text or "").rstrip()
    if len(text) >= LOOP_MIN_CHARS:
        tail = text[-LOOP_TAIL:]
        before = text.rfind(tail, 0, len(text) - 1)
        if before != -1:
            period = len(text) - LOOP_TAIL - before  # the nearest earlier copy of the end: its period
            repeats = max(LOOP_MIN_REPEATS, math.ceil(LOOP_MIN_CHARS / period))
            if period * repeats <= len(text) and text[-period * repeats:] == text[-period:] * repeats:
                return True
    words = text.rsplit(None, LOOP_WORDS)[-LOOP_WORDS:]  # the last words only, without splitting the rest
    grams = len(words) - LOOP_NGRAM + 1
    if grams < LOOP_MIN_NGRAMS:
        return False
    distinct = len({tuple(words[i:i + LOOP_NGRAM]) for i in range(grams)})
    return distinct / grams <= LOOP_MAX_DISTINCT


def regenerated_turns(row: dict) -> list[dict]:
    """The earlier assistant turns this run regenerated (all of them with regenerate_turns all;
    none with last, whose history is the dataset's own)."""
    turns = row.get("turns")
    earlier = len(turns) - 1 if turns else 0
    if earlier <= 0:
        return []
    return [m for m in row_messages(row) if m["role"] == "assistant"][-earlier:]


def text_findings(row: dict, default_thinking: bool = True, fmt: ChatFormat = QWEN) -> list[str]:
    """The audit's findings a row shows as text, without rendering it (regen.audit.findings):
    thinking as asked, truncation, an empty answer, think markers in the answer, loops."""
    findings = []
    content = row.get("content") or ""
    thinking = asked_thinking(row, default_thinking)
    reasonings = [row.get("reasoning_content")] + [m.get("reasoning_content") for m in regenerated_turns(row)]
    if thinking and not all((r or "").strip() for r in reasonings):
        findings.append("missing_reasoning")
    if not thinking and (any((r or "").strip() for r in reasonings) or fmt.think_end in content):
        findings.append("thinking_mode_mismatch")  # the request's thinking off did nothing
    if row.get("finish_reason") == "length":
        findings.append("truncated")
        if (fmt.think_start in content and fmt.think_end not in content) or (
                (reasonings[0] or "").strip() and not content.strip()):
            findings.append("truncated_in_thinking")
    if not content.strip() and not row.get("tool_calls"):
        findings.append("empty_answer")
    if fmt.think_start in content or fmt.think_end in content:
        findings.append("think_markers_in_content")
    if repetition_loop(row.get("reasoning_content")) or repetition_loop(content):
        findings.append("repetition_loop")
    return findings


# What makes a row bad for the guard, each held to its audit bound (max_degenerate_fraction,
# max_loop_fraction); a drained server's answers that show one are sent again elsewhere.
DEGENERATE = frozenset({"missing_reasoning", "thinking_mode_mismatch"})
QUALITY_BAD = DEGENERATE | {"repetition_loop"}


def over_bound(bad: int, rows: int, bound: float) -> bool:
    """More bad rows than ``bound`` allows in ``rows``, beyond chance: the bound's count plus
    three binomial standard deviations, plus one."""
    return bad > rows * bound + 3 * math.sqrt(rows * bound * (1 - bound)) + 1


class QualityFailed(ShardFailed):
    """The run's rows crossed an audit bound while they were made: nothing more is sent."""


@dataclass
class _Window:
    size: int
    rows: deque = field(default_factory=deque)  # (id, degenerate, loops)

    def add(self, row_id: str, degenerate: bool, loops: bool) -> None:
        self.rows.append((row_id, degenerate, loops))
        if len(self.rows) > self.size:
            self.rows.popleft()

    def crossed(self, max_degenerate: float, max_loops: float) -> str | None:
        """Why the window passed a bound (the finding, its count, its first rows), or None. The
        bound is the full window's count from the first row on: a server bad from its start is
        drained as soon as one that went bad later."""
        for kind, index, bound, name in (("degenerate", 1, max_degenerate, "max_degenerate_fraction"),
                                         ("repetition_loop", 2, max_loops, "max_loop_fraction")):
            bad = [r[0] for r in self.rows if r[index]]
            if over_bound(len(bad), self.size, bound):
                return (f"{kind} in {len(bad)} of its last {len(self.rows)} rows (the audit's {name} is {bound:g}; "
                        f"first: {', '.join(bad[:3])})")
        return None


class QualityGuard:
    """The guard of one shard process: windows per server and for the shard, and the run's marks
    (progress.json's ``quality`` section) shared with its other shards."""

    def __init__(self, layout: RunLayout, max_degenerate: float, max_loops: float, default_thinking: bool,
                 run_id: str = "cli"):
        self.layout, self.run_id = layout, run_id
        self.max_degenerate, self.max_loops, self.default_thinking = max_degenerate, max_loops, default_thinking
        self.servers: dict[str, _Window] = {}
        self.shard = _Window(RUN_WINDOW)
        self.drained: dict[str, str] = {}
        self.stopped: str | None = None
        self.refresh()

    def marks(self) -> dict:
        return read_json(self.layout.progress_part("quality")) or {}

    def refresh(self) -> None:
        """The drains and the stop other shards of the run marked."""
        doc = self.marks()
        self.drained.update({url: d["why"] for url, d in (doc.get("drained") or {}).items()})
        self.stopped = self.stopped or (doc.get("stopped") or {}).get("why")

    def _mark(self, key: str, value: dict) -> None:
        with FileLock(self.layout.quality_lock):
            doc = self.marks()
            if key == "drained":
                doc.setdefault("drained", {}).update(value)
            else:
                doc.setdefault(key, value)
            atomic_write_json(self.layout.progress_part("quality"), {**doc, "updated": time.time()})
        RunProgress(self.layout).fold()

    def check(self, row: dict, server: str) -> list[str]:
        """The row's findings, judged: QualityFailed when the run must stop. A server whose window
        passes a bound is drained here (the caller stops sending to it)."""
        if self.stopped:
            raise QualityFailed(self.stopped)
        findings = text_findings(row, self.default_thinking) if row.get("error") is None else []
        degenerate, loops = bool(DEGENERATE & set(findings)), "repetition_loop" in findings
        if server in self.drained and (degenerate or loops):
            return findings  # not kept: the caller sends it again elsewhere
        window = self.servers.setdefault(server, _Window(SERVER_WINDOW))
        window.add(row["id"], degenerate, loops)
        self.shard.add(row["id"], degenerate, loops)
        why = None if server in self.drained else window.crossed(self.max_degenerate, self.max_loops)
        if why:
            self.drained[server] = why
            log.error("server %s drained by the quality guard: %s", server, why)
            self._mark("drained", {server: {"why": why, "at": time.time(), "run_id": self.run_id}})
            send("quality guard", f"server {server} drained: {why}")
        run_why = self.shard.crossed(self.max_degenerate, self.max_loops)
        if run_why:
            self.stop(f"the run's rows: {run_why}")
        return findings

    def stop(self, why: str) -> None:
        """Stop the run: this shard now, every later attempt of the run at its start."""
        why = (f"quality guard: {why}; nothing more is sent (rows kept). Fix the servers or the sampling, "
               f"then start them again (clear start_servers) and clear the shards")
        self.stopped = why
        self._mark("stopped", {"why": why, "at": time.time(), "run_id": self.run_id})
        raise QualityFailed(why)

    def all_drained(self, servers: list[str]) -> None:
        """Stop the run (QualityFailed) when every one of ``servers`` is drained: nothing is left to send to."""
        if self.stopped:
            raise QualityFailed(self.stopped)
        if servers and all(s in self.drained for s in servers):
            self.stop("every server drained: " + "; ".join(f"{s}: {self.drained[s]}" for s in servers))


def clear_quality_marks(layout: RunLayout, urls: list[str]) -> None:
    """Servers started again: their drains and the run's stop are forgotten (a person fixed them)."""
    path = layout.progress_part("quality")
    if not path.exists():
        return
    with FileLock(layout.quality_lock):
        doc = read_json(path) or {}
        drained = {url: d for url, d in (doc.get("drained") or {}).items() if url not in urls}
        atomic_write_json(path, {"drained": drained, "updated": time.time()})
    RunProgress(layout).fold()
