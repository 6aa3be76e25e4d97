"""Where a shard's rows live: the journal while it runs, its Parquet file once it is complete.

Each finished row is appended to the shard's journal and flushed at once; a rerun (after a crash,
a SIGKILL, an Airflow retry or a clear) reads the journal back. When the shard completes, its
Parquet file is written beside the journal and renamed into ``data/``, so ``data/`` never holds
half a file. A per-shard lock refuses a second generator on the same shard.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import time
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_for
from pathlib import Path
from typing import Iterable, Iterator

import pyarrow as pa
import pyarrow.json as pj
import pyarrow.parquet as pq

from regen.coordination import FileLock, LockHeld, check_held
from regen.errors import ShardFailed
from regen.files import atomic_path, install, scratch_file
from regen.layout import RunLayout, shard_name
from regen.machine import node_name
from regen.rows import PYTHON_BYTES_PER_ID, ROW_SCHEMA
from regen.turns import resumed_answers

log = logging.getLogger("regen.store")
STOPPING_ATTEMPT_GRACE_S = 60.0

REPAIR_BLOCK = 1 << 16
SETTLE_COLUMNS = ["id", "error", "prompt_hash", "settings_hash"]
# What settling reads of a journal line (its head): what a row settles, and whether it is a turn.
HEAD_SCHEMA = pa.schema([("id", pa.string()), ("prompt_hash", pa.string()), ("settings_hash", pa.string()),
                         ("error", pa.string()), ("retryable", pa.bool_()), ("partial", pa.bool_())])
HEAD_BLOCK = 1 << 20  # Arrow's JSON reader's block: ~30 MB each while parsed, one per core at most


class _Misaligned(Exception):
    """Arrow's reader passed over a line (a blank one): the line-by-line reading takes it from there."""


class Journal:
    """Append-only JSONL of finished rows (the last row of an id wins) and of finished turns of
    conversations still going on (``partial`` rows: see regen.turns)."""

    def __init__(self, path: Path):
        self.path = path
        path.parent.mkdir(parents=True, exist_ok=True)
        self._repair()
        self._fh = open(path, "ab")

    def _repair(self) -> None:
        """Drop a line cut short by a kill, so the next append starts on a fresh line. Reads
        back from the end a block at a time (a journal of a long shard runs to gigabytes: it is
        never read whole)."""
        if not self.path.exists() or self.path.stat().st_size == 0:
            return
        with open(self.path, "rb+") as fh:
            end = fh.seek(0, os.SEEK_END)
            fh.seek(end - 1)
            if fh.read(1) == b"\n":
                return
            cut = end
            while cut > 0:
                start = max(0, cut - REPAIR_BLOCK)
                fh.seek(start)
                newline = fh.read(cut - start).rfind(b"\n")
                if newline >= 0:
                    fh.truncate(start + newline + 1)
                    return
                cut = start
            fh.truncate(0)

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
    def rows(path: Path, partial: bool | None = False) -> Iterator[dict]:
        """The finished rows, or with ``partial`` the turn rows (None: both, in order): the lines
        :meth:`heads` finds, each built whole."""
        return Journal.heads(path, partial, whole=True)

    @staticmethod
    def heads(path: Path, partial: bool | None = False, whole: bool = False) -> Iterator[dict]:
        """What settling needs of each line (HEAD_SCHEMA's fields, None where a line has none) and
        where the line is (``at``: its byte range, for :meth:`rows_at`), or with ``whole`` the row.

        The heads come from Arrow's JSON reader, in C++ that skips the token ids and releases the
        GIL (so shards settle in parallel): 1.7x faster than building the rows on one core, more
        with its threads (measured on a journal of engine token ids). A last
        line without its newline (a kill cut it) is no row; from a line the reader cannot take
        (none regen writes) on, each line is read as JSON and one that is not is passed over, as a
        resume always did, through a block, and the reader goes on from there. Rows and heads go
        through the same lines, so an index into one is an index into the other. Read as a stream:
        memory does not grow with the journal."""
        if not path.exists():
            return
        with open(path, "rb") as lines:
            yield from Journal._read_heads(path, lines, partial, whole)

    @staticmethod
    def _read_heads(path: Path, lines, partial: bool | None, whole: bool) -> Iterator[dict]:
        def wanted(head: dict) -> bool:
            return partial is None or bool(head.get("partial")) is partial

        def found(head: dict, line: bytes) -> dict:
            if whole:
                try:
                    return json.loads(line)
                except ValueError:
                    raise ValueError(f"{path}: the line at byte {pos:,} is not JSON") from None
            return {**head, "at": (pos, pos + len(line))}

        pos, line = 0, b""
        while True:
            try:
                with pa.OSFile(str(path)) as source:  # the reader's own handle (Arrow's: read in C++), from pos
                    source.seek(pos)
                    reader = pj.open_json(source, read_options=pj.ReadOptions(block_size=HEAD_BLOCK),
                                          parse_options=pj.ParseOptions(explicit_schema=HEAD_SCHEMA,
                                                                        unexpected_field_behavior="ignore"))
                    for batch in reader:
                        for head in batch.to_pylist():
                            line = lines.readline()
                            if not line.startswith(b"{") or not line.endswith(b"\n"):
                                raise _Misaligned  # a blank line the reader passed over, or the cut end
                            if wanted(head):
                                yield found(head, line)
                            pos, line = pos + len(line), b""
                return
            except (pa.ArrowInvalid, _Misaligned):
                pass
            # Line by line through a block at least (past what the reader could not take), then
            # the reader again from there.
            stop = pos + HEAD_BLOCK
            while pos < stop:
                line = line or lines.readline()
                if not line.endswith(b"\n"):
                    return  # the end, or a last line a kill cut
                try:
                    row = json.loads(line)
                except ValueError:
                    row = None
                if isinstance(row, dict) and wanted(row):
                    yield row if whole else found({k: row.get(k) for k in HEAD_SCHEMA.names}, line)
                pos, line = pos + len(line), b""

    @staticmethod
    def rows_at(path: Path, places: Iterable[tuple[int, int]]) -> Iterator[dict]:
        """The rows at these byte ranges (:meth:`heads`' ``at``), in the order given."""
        places = list(places)
        if not places:
            return
        with open(path, "rb") as fh:
            for start, stop in places:
                fh.seek(start)
                yield json.loads(fh.read(stop - start))


# A publish batch's rows: their text and token ids as Python objects.
PUBLISH_BATCH_BYTES = 256 << 20


def _row_bytes(row: dict) -> int:
    """Roughly what a row holds as Python objects: its text and its token ids."""
    def size(value) -> int:
        if isinstance(value, str):
            return len(value)
        if isinstance(value, list):  # token ids are all numbers: counted, not walked
            return (sum(size(v) for v in value) if value and isinstance(value[0], (str, dict, list))
                    else PYTHON_BYTES_PER_ID * len(value))
        if isinstance(value, dict):
            return sum(size(v) for v in value.values())
        return 8
    return size(row)


def of_this_run(row: dict, hashes: dict[str, str], settings_hash: str) -> bool:
    """A row of this run: its id's prompt as indexed, sent with this run's settings."""
    return hashes.get(row["id"]) == row.get("prompt_hash") and row.get("settings_hash") == settings_hash


def settles_its_id(row: dict) -> bool:
    """A finished row that needs no new request: good, or failed in a way no retry fixes."""
    return not row.get("partial") and (row.get("error") is None or not row.get("retryable", False))


# An attempt's rows go into its shard's file this many at a time (or this many bytes of them).
STAGE_ROWS = 256
STAGE_BYTES = 64 << 20


class _StagedFile:
    """The shard's Parquet file written while its rows come in: the rows that settle their id in
    this attempt, STAGE_ROWS at a time, by a thread of its own, in a scratch file beside the
    journal. So a shard whose rows all came in this attempt is published by closing and renaming
    it, not by reading its journal back (a second, 0.4 ms per row at the end of every shard). The
    journal stays what a resume reads: a kill loses this file, never a row."""

    def __init__(self, store: "ShardStore"):
        self._scratch = contextlib.ExitStack()
        self.path = self._scratch.enter_context(scratch_file(store.journal_path.parent, store.final.name))
        self.heads: dict[str, tuple[str | None, str | None]] = {}  # id -> (prompt hash, settings hash)
        self.duplicated = False  # an id came in twice: its last row is not known here
        self._pending: list[dict] = []
        self._bytes = 0
        self._writer: pq.ParquetWriter | None = None
        self._failure: BaseException | None = None
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"stage-{store.name}")
        self._writing: list[Future] = []

    def add(self, row: dict) -> None:
        self.duplicated |= row["id"] in self.heads
        self.heads[row["id"]] = (row.get("prompt_hash"), row.get("settings_hash"))
        self._pending.append(row)
        self._bytes += _row_bytes(row)
        if len(self._pending) >= STAGE_ROWS or self._bytes >= STAGE_BYTES:
            self._flush()

    def _flush(self) -> None:
        rows, self._pending, self._bytes = self._pending, [], 0
        if rows:
            self._writing.append(self._thread.submit(self._write, rows))

    def _write(self, rows: list[dict]) -> None:
        if self._failure is not None:
            return
        try:
            if self._writer is None:
                self._writer = pq.ParquetWriter(self.path, ROW_SCHEMA, compression="zstd")
            self._writer.write_table(pa.Table.from_pylist(rows, schema=ROW_SCHEMA))
        except Exception as exc:  # a full disk, say: the publish reads the journal instead
            self._failure = exc

    def writer(self, hashes: dict[str, str], settings_hash: str) -> pq.ParquetWriter | None:
        """The open file once every row is in it; None when it cannot be the shard's (a write failed,
        an id came in twice, a row of another run)."""
        self._flush()
        wait_for(self._writing)
        self._thread.shutdown()
        if self._failure is not None:
            log.warning("%s: writing the shard's file as rows came in failed (%s); published from the journal",
                        self.path.name, self._failure)
            return None
        if self.duplicated or any(hashes.get(i) != prompt or settings != settings_hash
                                  for i, (prompt, settings) in self.heads.items()):
            return None
        return self._writer

    def discard(self) -> None:
        self._pending.clear()
        wait_for(self._writing)
        self._thread.shutdown()
        if self._writer is not None:
            with contextlib.suppress(OSError):
                self._writer.close()
        self._scratch.close()  # the scratch file goes


class ShardStore:
    """The files of one shard of one output directory."""

    def __init__(self, layout: RunLayout, shard: int, num_shards: int):
        if not 0 <= shard < num_shards:
            raise ValueError(f"shard {shard} is not in 0..{num_shards - 1}")
        self.layout, self.shard, self.num_shards = layout, shard, num_shards
        self.name = shard_name(shard, num_shards)
        self.final = layout.shard_file(shard, num_shards)
        self.location = str(self.final)  # where the published file is, as a person reads it
        self.journal_path = layout.journal(shard, num_shards)
        self.errors_path = layout.errors(shard, num_shards)
        self._staged: _StagedFile | None = None

    @contextlib.contextmanager
    def lock(self):
        """One generator per shard: a retry that starts while an old attempt still runs (a worker
        that lost its heartbeat, a remote job outliving its task) must not write the same journal.
        An attempt Airflow is stopping (a run marked failed, then cleared at once) writes its
        journal and exits within seconds: its successor waits up to STOPPING_ATTEMPT_GRACE_S."""
        path = self.layout.shard_lock(self.shard, self.num_shards)
        lock = FileLock(path, note=f"pid {os.getpid()} on {node_name()}")
        ends, told = time.monotonic() + STOPPING_ATTEMPT_GRACE_S, False
        while True:
            try:
                lock.acquire(blocking=False)
                break
            except LockHeld as held:
                if time.monotonic() >= ends:
                    raise ShardFailed(f"{self.name} is being generated right now by {held} ({path}), still after "
                                      f"{STOPPING_ATTEMPT_GRACE_S:.0f} s; retry once it has stopped") from None
                if not told:
                    log.warning("%s is held by %s (an attempt still stopping?); waiting up to %.0f s for it",
                                self.name, held, STOPPING_ATTEMPT_GRACE_S)
                    told = True
                time.sleep(0.5)  # polling a lock another process holds
        try:
            self._remove_orphan_temporaries()
            yield
        finally:
            if self._staged is not None:  # an attempt that did not publish
                self._staged.discard()
                self._staged = None
            lock.release()

    def _remove_orphan_temporaries(self) -> None:
        """Half-written shard files an attempt killed while publishing left (atomic_path's names);
        only the lock holder publishes this shard, so none of them is being written."""
        for orphan in self.journal_path.parent.glob(f".{self.final.name}.*.tmp"):
            orphan.unlink(missing_ok=True)
            log.info("%s: removed %s, left by an attempt killed while it published", self.name, orphan.name)

    def settled(self, hashes: dict[str, str], settings_hash: str) -> tuple[set[str], set[str]]:
        """(ids that need no new request, ids the shard file holds now): :meth:`settled_and_failed`
        without the failures."""
        settled, file_ids, _ = self.settled_and_failed(hashes, settings_hash)
        return settled, file_ids

    def settled_and_failed(self, hashes: dict[str, str], settings_hash: str,
                           turns: dict[str, list[tuple[int, int]]] | None = None) -> tuple[set[str], set[str], set[str]]:
        """(ids that need no new request, ids the shard file holds now, ids of those whose last
        row failed in a way no retry fixes). A row settles its id when it is this run's (the id's
        prompt hash, this settings hash) and good, or failed for good (a 4xx); rows of other
        prompts or settings settle nothing, so a rerun that changed them sends them again. The
        published file's rows come first, then what attempts since sealed (a bucket's parts), then
        the journal. The failures are an earlier attempt's, which count against the shard's error
        bound on a retry. The one decision of what a shard holds, for a folder and a bucket.

        ``turns``: filled in the same reading with where the journal's finished turns of the
        conversations still going are (for :meth:`turns_at`): a place per turn is all that is
        kept, and a conversation's go once a row settles it."""
        settled: set[str] = set()
        file_ids: set[str] = set()
        for row in self._file_rows(SETTLE_COLUMNS):
            file_ids.add(row["id"])
            if of_this_run(row, hashes, settings_hash) and row["error"] is None:
                settled.add(row["id"])
        failed: set[str] = set()
        sealed: set[str] = set()
        for row in self._sealed_rows(SETTLE_COLUMNS):
            sealed.add(row["id"])
            if of_this_run(row, hashes, settings_hash):
                settled.add(row["id"])
                (failed.add if row["error"] is not None else failed.discard)(row["id"])
        for head in Journal.heads(self.journal_path, partial=None):
            if not of_this_run(head, hashes, settings_hash):
                continue
            if head["partial"]:
                if turns is not None:
                    turns.setdefault(head["id"], []).append(head["at"])
                continue
            settles = settles_its_id(head)
            if settles and turns is not None:
                turns.pop(head["id"], None)
            if head["id"] in sealed:
                continue
            failed.discard(head["id"])
            self._journalled(head, settles)
            if settles:
                settled.add(head["id"])
                if head["error"] is not None:
                    failed.add(head["id"])
            else:
                settled.discard(head["id"])
        return settled, file_ids, failed

    def _file_rows(self, columns: list[str] | None = None) -> Iterator[dict]:
        """The published shard file's rows."""
        if self.final.exists():
            for batch in pq.ParquetFile(self.final).iter_batches(batch_size=1000, columns=columns):
                yield from batch.to_pylist()

    def _sealed_rows(self, columns: list[str] | None = None) -> Iterator[dict]:
        """Rows attempts made durable since the file was published: none on a local disk (its
        journal is durable)."""
        return iter(())

    def _journalled(self, head: dict, settles: bool) -> None:
        """A journal row of this run (its head) that no sealed row holds: a local shard keeps it there."""

    def turns_at(self, turns: dict[str, list[tuple[int, int]]]) -> dict[str, list[dict]]:
        """Per conversation cut mid-way in an earlier attempt: the answers of its finished turns,
        read from where :meth:`settled_and_failed` found them (only the unfinished ones' turns, with
        their token ids, are ever held, however long the journal)."""
        rows: dict[str, list[dict]] = {}
        for row in Journal.rows_at(self.journal_path, sorted(p for places in turns.values() for p in places)):
            rows.setdefault(row["id"], []).append(row)
        return {i: resumed_answers(r) for i, r in rows.items()}

    def complete(self, ids: list[str], settled: set[str], file_ids: set[str]) -> bool:
        """The shard file holds exactly these ids, each settled, and nothing waits to be published."""
        return len(settled) == len(ids) and file_ids == set(ids) and not self._waiting(file_ids)

    def _waiting(self, file_ids: set[str]) -> bool:
        """Rows not in the shard file yet: a journal."""
        return self.journal_path.exists()

    def tidy(self) -> None:
        """What a killed publish of a complete shard left behind: nothing on a local disk (its
        temporaries go under the lock)."""

    def appended(self, row: dict) -> None:
        """A row the journal now holds: one that settles its id goes into the staged file too."""
        if settles_its_id(row):
            if self._staged is None:
                self._staged = _StagedFile(self)
            self._staged.add(row)

    def _rows(self, columns: list[str] | None = None) -> Iterator[dict]:
        """The shard's existing rows, then what attempts sealed, then the journal's: later rows win
        (``columns`` narrows the stored ones, never their order)."""
        yield from self._file_rows(columns)
        yield from self._sealed_rows(columns)
        narrow = columns is not None and set(columns) <= set(HEAD_SCHEMA.names)
        yield from Journal.heads(self.journal_path) if narrow else Journal.rows(self.journal_path)

    def _chosen(self, hashes: dict[str, str], settings_hash: str) -> set[int]:
        """The index in :meth:`_rows` of each id's last row of this run; refused unless every one of
        the shard's ids (``hashes``: id -> prompt hash) has one."""
        last: dict[str, int] = {}
        for index, row in enumerate(self._rows(SETTLE_COLUMNS)):
            if of_this_run(row, hashes, settings_hash):
                last[row["id"]] = index
        if len(last) != len(hashes):
            missing = sorted(set(hashes) - set(last))
            raise ShardFailed(f"{self.name}: has rows for {len(last):,} of its {len(hashes):,} prompts "
                              f"(missing e.g. {missing[:3]}); nothing published, the journal is kept")
        return set(last.values())

    def _write(self, path: Path, keep: set[int], batch_rows: int) -> int:
        """The rows of :meth:`_rows` at ``keep`` streamed in batches into a Parquet file at ``path``:
        at most ``batch_rows`` rows and PUBLISH_BATCH_BYTES of their text and token ids, so rows of
        32k-token answers do not hold gigabytes at once."""
        with pq.ParquetWriter(path, ROW_SCHEMA, compression="zstd") as writer:
            return self._write_into(writer, keep, batch_rows)

    def _write_into(self, writer: pq.ParquetWriter, keep: set[int], batch_rows: int) -> int:
        count = 0
        batch: list[dict] = []
        size = 0
        for index, row in enumerate(self._rows()):
            if index not in keep:
                continue
            row.pop("retryable", None)
            batch.append(row)
            size += _row_bytes(row)
            if len(batch) >= batch_rows or size >= PUBLISH_BATCH_BYTES:
                writer.write_table(pa.Table.from_pylist(batch, schema=ROW_SCHEMA))
                count += len(batch)
                batch, size = [], 0
        if batch:
            writer.write_table(pa.Table.from_pylist(batch, schema=ROW_SCHEMA))
            count += len(batch)
        return count

    def publish(self, hashes: dict[str, str], settings_hash: str, batch_rows: int = 1000) -> int:
        """The last row of this run for each of the shard's ids, in a file beside the journal, then
        renamed over the shard's file; the journal goes. The file is the one staged as rows came in,
        with the rows of earlier attempts (or an earlier file) that this attempt did not replace
        added; without one, every row is streamed from the journal."""
        staged, self._staged = self._staged, None
        writer = staged.writer(hashes, settings_hash) if staged is not None else None
        if writer is None:
            if staged is not None:
                staged.discard()
            keep = self._chosen(hashes, settings_hash)
            check_held(self.layout)
            with atomic_path(self.final, work_dir=self.journal_path.parent) as tmp:
                count = self._write(tmp, keep, batch_rows)
        else:
            try:
                with writer:
                    rest = {i: h for i, h in hashes.items() if i not in staged.heads}
                    count = len(staged.heads)
                    if rest:  # a resume: what earlier attempts left, read back
                        count += self._write_into(writer, self._chosen(rest, settings_hash), batch_rows)
                check_held(self.layout)
                self.final.parent.mkdir(parents=True, exist_ok=True)
                install(staged.path, self.final)
            finally:
                staged.discard()
        self.journal_path.unlink(missing_ok=True)
        return count
