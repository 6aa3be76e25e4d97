"""progress.json: done / failed / total, throughput and ETA, per shard and per server.

Each shard (a separate Airflow task, maybe on another worker) writes its own part under
``work/progress/``; whoever writes next folds them into ``progress.json``, replaced atomically so a
reader never sees half a file. The canary and the audit add their sections the same way. The read
side (what the run page shows) is :mod:`regen.status`.
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path

from regen.files import atomic_write_json, atomic_write_text, read_json
from regen.layout import RunLayout, is_shard_key, shard_key

log = logging.getLogger("regen.progress")

# The throughput history holds at most this many points over the whole run (thin_history), so a
# multi-day run's chart starts at its start, its file stays under ~200 KB, and the last minutes keep 5 s.
HISTORY_POINTS = 2000
HISTORY_RECENT = 500
HISTORY_LINE_BYTES = 64  # fewer than a point's line (~85): a file past POINTS of them is counted
FOLD_EVERY_S = 2.0  # progress.json is at most this much older than the newest running shard's part


class RunProgress:
    """The progress files of one output directory."""

    def __init__(self, layout: RunLayout | str | Path):
        self.layout = layout if isinstance(layout, RunLayout) else RunLayout(layout)
        self.dir = self.layout.progress_parts
        self.path = self.layout.progress_file

    def write_shard(self, shard: int, data: dict) -> None:
        self._write(shard_key(shard), data)

    def write_section(self, name: str, data: dict) -> None:
        """A run-level section (canary estimate, audit verdict) kept beside the shards."""
        self._write(name, data)

    def clear_section(self, name: str) -> None:
        """A run-level section gone (a setup stage that failed, then passed)."""
        part = self.layout.progress_part(name)
        if part.exists():
            part.unlink(missing_ok=True)
            self.fold()

    def write_shards(self, parts: dict[int, dict]) -> None:
        """Several shards' parts at once (one process's report), folded once."""
        for shard, data in parts.items():
            self._write(shard_key(shard), data, fold=False)
        try:
            self._fold_due(any(d.get("state") != "running" for d in parts.values()))
        except OSError as exc:  # best effort, as each part's write
            log.warning("progress not written (%s): %s", self.path, exc.strerror or exc)

    def _write(self, name: str, data: dict, fold: bool = True) -> None:
        """Best effort: progress informs, it must never be what fails (or masks) the work. No fsync
        (a crash loses a report, never shows half of one)."""
        try:
            atomic_write_json(self.layout.progress_part(name), {**data, "updated": time.time()}, durable=False)
            if fold:
                self._fold_due(not is_shard_key(name) or data.get("state") != "running")
        except OSError as exc:
            log.warning("progress not written (%s): %s", self.path, exc.strerror or exc)

    def _fold_due(self, now: bool) -> None:
        """progress.json rebuilt from every part: at once for a change of state or a run-level
        section, else only when it is older than FOLD_EVERY_S. With N shards reporting every few
        seconds the parts are read about N times per interval in all, not N times per report
        (the square of the shards: 15 s per report at 64 shards)."""
        try:
            if not now and time.time() - self.path.stat().st_mtime < FOLD_EVERY_S:
                return
        except OSError:
            pass  # none yet
        self.fold()

    def fold(self) -> dict:
        shards, sections = {}, {}
        if self.dir.exists():
            for path in sorted(self.dir.glob("*.json")):
                data = read_json(path)
                if data is None:
                    continue
                if is_shard_key(path.stem):
                    shards[path.stem] = data
                else:
                    sections[path.stem] = data
        done = sum(s.get("done", 0) for s in shards.values())
        failed = sum(s.get("failed", 0) for s in shards.values())
        total = sum(s.get("total", 0) for s in shards.values())
        running = [s for s in shards.values() if s.get("state") == "running"]
        tps = sum(s.get("tokens_per_s", 0.0) for s in running)
        rps = sum(s.get("rows_per_s", 0.0) for s in running)
        remaining = total - done - failed
        servers: dict[str, dict] = {}
        for s in _one_part_per_attempt(shards.values()):
            live = s.get("state") == "running"
            for url, srv in (s.get("servers") or {}).items():
                agg = servers.setdefault(url, {"done": 0, "failed": 0, "in_flight": 0, "healthy": True})
                agg["done"] += srv.get("done", 0)
                agg["failed"] += srv.get("failed", 0)
                if live:
                    agg["in_flight"] += srv.get("in_flight", 0)
                    agg["healthy"] = agg["healthy"] and srv.get("healthy", True)
                    if srv.get("metrics"):
                        agg["metrics"] = srv["metrics"]
        summary = {
            "done": done, "failed": failed, "total": total,
            "tokens_per_s": round(tps, 1),
            "eta_s": round(remaining / rps) if rps > 0 else None,
            "shards": shards, "servers": servers, **sections,
            "updated": time.time(),
        }
        atomic_write_json(self.path, summary, durable=False)
        self._append_history(summary)
        return summary

    def _append_history(self, summary: dict, every_s: float = 5.0) -> None:
        """One point every few seconds, whoever writes: the run page's throughput chart."""
        path = self.layout.history
        if path.exists() and time.time() - path.stat().st_mtime < every_s:
            return
        point = {k: summary[k] for k in ("done", "failed", "total", "tokens_per_s")}
        with open(path, "a") as fh:
            fh.write(json.dumps({"t": round(time.time(), 1), **point}) + "\n")
        if path.stat().st_size > HISTORY_POINTS * HISTORY_LINE_BYTES:
            thin_history(path)


def _one_part_per_attempt(parts) -> list[dict]:
    """The shard parts whose servers count: an attempt that runs several shards (one process, one
    pool of servers) reports the same servers in each of its parts, so only its newest counts."""
    newest: dict[str, dict] = {}
    alone = []
    for part in parts:
        attempt = part.get("attempt")
        if attempt is None:
            alone.append(part)
        elif attempt not in newest or part.get("updated", 0) > newest[attempt].get("updated", 0):
            newest[attempt] = part
    return alone + list(newest.values())


def thin_history(path: Path) -> None:
    """Once the file holds more than HISTORY_POINTS points: the newest HISTORY_RECENT kept, and of
    those before them the first of each of HISTORY_POINTS / 2 equal spans of time (the run's start
    included), so the whole run stays drawn at an even resolution that coarsens as it runs."""
    lines = path.read_text().splitlines(keepends=True)
    if len(lines) <= HISTORY_POINTS:
        return
    older, recent = lines[:-HISTORY_RECENT], lines[-HISTORY_RECENT:]
    times = []
    for line in older:
        try:
            times.append(float(json.loads(line)["t"]))
        except (ValueError, KeyError, TypeError):
            times.append(None)  # a cut line: dropped
    known = [t for t in times if t is not None]
    if not known:
        atomic_write_text(path, "".join(recent))
        return
    start, width = known[0], max((known[-1] - known[0]) / (HISTORY_POINTS // 2), 1e-9)
    kept, seen = [], set()
    for line, t in zip(older, times):
        if t is not None and (span := int((t - start) // width)) not in seen:
            seen.add(span)
            kept.append(line)
    atomic_write_text(path, "".join(kept + recent))
