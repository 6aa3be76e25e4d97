"""A shard's rows on an object store, exactly once, with nothing but create-only writes.

::

    URL/data/shard-IIIII-of-NNNNN.parquet                the dataset: a complete shard, written once
    URL/_regen/published/shard-….json                    its commit: rows, bytes, sha256, ids digest
    URL/_regen/fences/shard-…/f000003.json               attempt 3's claim, and the commits it accepts
    URL/_regen/parts/shard-…/f000003-p000007.parquet     a sealed part of attempt 3
    URL/_regen/commits/shard-…/f000003-p000007.json      its commit

An attempt claims the shard by creating the next fence record, which lists the commits it accepts
from earlier attempts (all the valid ones it sees). A shard's valid commits are those its highest
fence accepts plus that fence's own: a zombie (an older attempt still running after its task was
retried) may still write a part and a commit, but neither counts, and it stops at its next seal
when it sees a higher fence. The journal stays on node-local disk; every ``part_rows`` rows or
``part_seconds`` seconds its settled rows that no valid commit holds are sealed into a part, so a
lost node costs at most one part plus what was in flight. A complete shard is published as one
file under ``data/`` and committed; its parts then go. Readers list ``_regen/published``.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import logging
import os
import time
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_for
from pathlib import Path
from typing import Callable, Iterable, Iterator, TypeVar

import pyarrow as pa
import pyarrow.parquet as pq

from regen.coordination import check_held
from regen.errors import ShardFailed
from regen.files import scratch_file, sha256_file
from regen.layout import RunLayout
from regen.machine import node_name
from regen.objectstore import META, ObjectStore, transient_errors
from regen.rows import ROW_SCHEMA
from regen.store import Journal, ShardStore, settles_its_id

log = logging.getLogger("regen.parts")
READ_THREADS = 8  # parts read at once
T = TypeVar("T")


class ClaimLost(ShardFailed):
    """A later attempt claimed the shard: this one's parts no longer count."""


def _digest(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def ids_digest(ids: Iterable[str]) -> str:
    return _digest("\n".join(sorted(ids)).encode())


def _parquet_bytes(rows: list[dict] | pa.Table) -> bytes:
    table = rows if isinstance(rows, pa.Table) else pa.Table.from_pylist(rows, schema=ROW_SCHEMA)
    buffer = io.BytesIO()
    pq.write_table(table, buffer, compression="zstd")
    return buffer.getvalue()


class ShardParts:
    """The keys of one shard on a store, and the fence protocol over them."""

    def __init__(self, store: ObjectStore, name: str):
        self.store, self.name = store, name
        self.fence: int | None = None
        self.seq = 0

    # --- keys --------------------------------------------------------------------------------
    @property
    def data_key(self) -> str:
        return f"data/{self.name}.parquet"

    @property
    def published_key(self) -> str:
        return f"{META}/published/{self.name}.json"

    def _fence_key(self, fence: int) -> str:
        return f"{META}/fences/{self.name}/f{fence:06d}.json"

    def _part_key(self, name: str) -> str:
        return f"{META}/parts/{self.name}/{name}.parquet"

    def _commit_key(self, name: str) -> str:
        return f"{META}/commits/{self.name}/{name}.json"

    # --- the claim ---------------------------------------------------------------------------
    def fences(self) -> list[int]:
        return sorted(_fence_of(n) for n in self.store.names(f"{META}/fences/{self.name}") if n.endswith(".json"))

    def claim(self, holder: str) -> int:
        """Take the next fence; the commits valid now stay valid under it."""
        for _ in range(32):
            fences = self.fences()
            fence = fences[-1] + 1 if fences else 1
            doc = {"fence": fence, "holder": holder, "at": round(time.time(), 3),
                   "accepted": self.valid_commits(fences)}
            if self.store.create(self._fence_key(fence), json.dumps(doc).encode()):
                self.fence, self.seq = fence, 0
                return fence
        raise ShardFailed(f"{self.name}: could not claim a fence on {self.store.url} (32 attempts raced)")

    def check_claim(self) -> None:
        top = self.fences()[-1]
        if top != self.fence:
            doc = json.loads(self.store.read(self._fence_key(top)))
            raise ClaimLost(f"{self.name}: attempt {self.fence} lost its claim to attempt {top} "
                            f"({doc.get('holder')}); its rows are redone there, nothing of it is committed")

    def valid_commits(self, fences: list[int] | None = None) -> list[str]:
        """The commits the highest fence accepts and its own, less those the published file holds."""
        fences = self.fences() if fences is None else fences
        if not fences:
            return []
        top = fences[-1]
        accepted = json.loads(self.store.read(self._fence_key(top)))["accepted"]
        own = [n[:-5] for n in self.store.names(f"{META}/commits/{self.name}")
               if n.endswith(".json") and n.startswith(f"f{top:06d}-")]
        published = (self.published() or {}).get("fence", 0)
        return [n for n in accepted + own if _fence_of(n) > published]

    # --- parts -------------------------------------------------------------------------------
    def committed_tables(self, columns: list[str] | None = None) -> Iterator[pa.Table]:
        """The rows of every valid commit in commit order, each part checked against its commit's
        size; read a few at once by threads, never all of them at once."""
        names = self.valid_commits()
        commits = [json.loads(raw) for raw in self.store.read_many([self._commit_key(n) for n in names])]
        sizes = self.store.sizes(f"{META}/parts/{self.name}")
        for name, commit in zip(names, commits):
            if sizes.get(f"{name}.parquet") != commit["bytes"]:
                raise ShardFailed(f"{self.store.url_of(self._part_key(name))}: {sizes.get(f'{name}.parquet')} "
                                  f"bytes where its commit says {commit['bytes']:,}; the store changed a committed part")
        fs, root = self.store.arrow()

        def read(name: str) -> pa.Table:
            return pq.read_table(f"{root}/{self._part_key(name)}", filesystem=fs, columns=columns)

        with ThreadPoolExecutor(max_workers=READ_THREADS) as pool:
            for start in range(0, len(names), READ_THREADS):
                yield from pool.map(read, names[start:start + READ_THREADS])

    def seal(self, rows: list[dict]) -> None:
        """Write ``rows`` as the attempt's next part and commit it, unless a later attempt claimed
        the shard (ClaimLost: nothing is committed, the part goes)."""
        if not rows:
            return
        seq = self.seq + 1  # taken once it is committed: a retry writes the same name, its own bytes
        name = f"f{self.fence:06d}-p{seq:06d}"
        data = _parquet_bytes(rows)
        if not self.store.create(self._part_key(name), data):
            raise ClaimLost(f"{self.name}: part {name} exists already: another writer holds fence {self.fence}")
        try:
            self.check_claim()
        except ClaimLost:
            self.store.remove([self._part_key(name)])
            raise
        commit = {"part": self._part_key(name), "rows": len(rows), "bytes": len(data), "sha256": _digest(data),
                  "ids_sha256": ids_digest(r["id"] for r in rows), "fence": self.fence, "seq": seq}
        self.store.create(self._commit_key(name), json.dumps(commit).encode())
        self.seq = seq

    # --- the published shard -----------------------------------------------------------------
    def published(self) -> dict | None:
        try:
            return json.loads(self.store.read(self.published_key))
        except FileNotFoundError:
            return None

    def install(self, path: Path, ids: Iterable[str], rows: int) -> None:
        """The shard's file (written at ``path``) under data/, replacing the one there, then its
        commit naming this attempt's fence: every part of this fence or before is in it. A reader
        of data/ sees the old file or the new one, never both. The leftovers go (:meth:`gc`)."""
        self.check_claim()
        self.store.replace_file(self.data_key, path)
        commit = {"file": self.data_key, "rows": rows, "bytes": path.stat().st_size,
                  "sha256": sha256_file(path), "ids_sha256": ids_digest(ids), "fence": self.fence}
        self.store.put(self.published_key, json.dumps(commit).encode())
        self.gc()

    def gc(self) -> None:
        """Remove what no reader needs: the parts and commits the published file holds (its fence
        or before), those of superseded attempts no fence accepts, and every fence record but the
        highest (a claim reads only that one). Any process may run it: a live attempt's keys are
        the highest fence's, or accepted by it."""
        published = self.published()
        fences = self.fences()
        if published is None or not fences:
            return
        top, done = fences[-1], published.get("fence", 0)
        valid = set(self.valid_commits(fences))

        def stale(name: str, stem: str) -> bool:
            return _fence_of(name) <= done or (_fence_of(name) < top and stem not in valid)

        drop = [n for n in self.store.names(f"{META}/commits/{self.name}") if n.endswith(".json") and stale(n, n[:-5])]
        parts = [n for n in self.store.names(f"{META}/parts/{self.name}") if n.endswith(".parquet")
                 and stale(n, n[:-8])]
        old = [self._fence_key(f) for f in fences[:-1]]
        # Commits before their parts: a part without its commit is never read.
        self.store.remove([f"{META}/commits/{self.name}/{n}" for n in drop])
        self.store.remove([f"{META}/parts/{self.name}/{n}" for n in parts] + old)
        if drop or parts or old:
            log.info("%s: removed %d parts, %d commits and %d fence records a finished publish no longer needs",
                     self.name, len(parts), len(drop), len(old))


def _fence_of(name: str) -> int:
    """The fence of a fence record, a part or a commit by its name (``f000003…``)."""
    return int(name[1:7])


def shard_store(cfg, shard: int) -> ShardStore:
    """A shard's store for ``cfg``'s output: a local folder's, or an object store's."""
    layout = cfg.layout
    if layout.dataset is None:
        return ShardStore(layout, shard, cfg.num_shards)
    return BucketShardStore(layout, shard, cfg.num_shards, layout.store(), cfg.generation.part_rows,
                            cfg.generation.part_seconds, cfg.generation.store_outage_s)


class BucketShardStore(ShardStore):
    """A shard whose dataset is on an object store: the journal (and the lock of this node) stay in
    the local work folder; settled rows are sealed into parts; the published file is the store's.
    What the shard holds is decided as on a local disk (ShardStore): the published file, then the
    sealed parts, then the journal. Parts are sealed by a thread of their own, in order: a stalled
    store holds up neither the requests nor the progress lines (the journal holds every row)."""

    def __init__(self, layout: RunLayout, shard: int, num_shards: int, store: ObjectStore,
                 part_rows: int, part_seconds: float, outage_s: float = 300.0):
        super().__init__(layout, shard, num_shards)
        self.parts = ShardParts(store, self.name)
        self.location = store.url_of(self.parts.data_key)
        self.part_rows, self.part_seconds, self.outage_s = part_rows, part_seconds, outage_s
        self._unsealed: dict[str, dict] = {}
        self._oldest: float | None = None
        self._sealer = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"seal-{self.name}")
        self._sealing: list[Future] = []
        self._gathered: Path | None = None  # while publishing: the store's rows, read once (_gather)
        self._file_batches = 0  # how many of its batches are the published file's

    def _store_io(self, what: str, operation: Callable[[], T]) -> T:
        """``operation`` (idempotent: a create-only write that finds its own bytes succeeds) tried
        again for ``outage_s`` while the store fails; then one line naming the URL and the cause,
        not the client's traceback."""
        ends, pause = time.monotonic() + self.outage_s, 1.0
        while True:
            try:
                return operation()
            except transient_errors() as exc:
                if isinstance(exc, (FileNotFoundError, PermissionError)):
                    raise ShardFailed(f"{self.name}: cannot {what} {self.parts.store.url}: {exc}") from exc
                cause = f"{type(exc).__name__}: {(str(exc).strip().splitlines() or [''])[0]}"
                if time.monotonic() + pause > ends:
                    raise ShardFailed(f"{self.name}: cannot {what} {self.parts.store.url} for {self.outage_s:.0f} s "
                                      f"(store_outage_s): {cause}; every row made is in the journal on this node, "
                                      f"a retry resumes from it") from exc
                log.warning("%s: cannot %s %s (%s); trying again in %.0f s", self.name, what,
                            self.parts.store.url, cause, pause)
                time.sleep(pause)  # the store is down: waiting is the point
                pause = min(pause * 2, 15.0)

    @contextlib.contextmanager
    def lock(self):
        with super().lock():
            fence = self._store_io("claim the shard on", lambda: self.parts.claim(f"pid {os.getpid()} on {node_name()}"))
            log.info("%s: claimed attempt %d on %s", self.name, fence, self.parts.store.url)
            try:
                yield
            finally:
                wait_for(self._sealing)  # no seal of this attempt outlives its lock

    def _file_rows(self, columns: list[str] | None = None) -> Iterator[dict]:
        store = self.parts.store
        if not store.exists(self.parts.data_key):
            return
        fs, root = store.arrow()
        with fs.open_input_file(f"{root}/{self.parts.data_key}") as fh:
            for batch in pq.ParquetFile(fh).iter_batches(batch_size=1000, columns=columns):
                yield from batch.to_pylist()

    def _sealed_rows(self, columns: list[str] | None = None) -> Iterator[dict]:
        for table in self.parts.committed_tables(columns):
            yield from table.to_pylist()

    def _publish_order(self) -> Iterator[pa.RecordBatch | dict]:
        """While publishing: the published file's rows, the journal's, then the sealed parts' (as
        Arrow batches of the gathered file, the journal's as rows). A part's copy of a journal row
        comes later and wins, as the settle reads them (a sealed id is the part's): only the rows
        no part holds (retryable errors) are chosen from the journal."""
        with pa.memory_map(str(self._gathered)) as source:
            reader = pa.ipc.open_file(source)
            for i in range(self._file_batches):
                yield reader.get_batch(i)
            yield from Journal.rows(self.journal_path)
            for i in range(self._file_batches, reader.num_record_batches):
                yield reader.get_batch(i)

    def _rows(self, columns: list[str] | None = None) -> Iterator[dict]:
        if self._gathered is None:
            yield from super()._rows(columns)
            return
        for item in self._publish_order():
            if isinstance(item, dict):
                yield item
            else:
                yield from (item.select(columns) if columns else item).to_pylist()

    def _write(self, path: Path, keep: set[int], batch_rows: int) -> int:
        """While publishing, the rows at ``keep`` of :meth:`_publish_order`: the gathered batches
        filtered as Arrow (no row becomes a Python object), the journal's few as rows."""
        if self._gathered is None:
            return super()._write(path, keep, batch_rows)
        count = index = 0
        rows: list[dict] = []
        with pq.ParquetWriter(path, ROW_SCHEMA, compression="zstd") as writer:
            def write_rows() -> None:
                writer.write_table(pa.Table.from_pylist(rows, schema=ROW_SCHEMA))
                rows.clear()

            for item in self._publish_order():
                if isinstance(item, dict):
                    if index in keep:
                        item.pop("retryable", None)
                        rows.append(item)
                        count += 1
                        if len(rows) >= batch_rows:
                            write_rows()
                    index += 1
                    continue
                kept = item.filter(pa.array([index + j in keep for j in range(item.num_rows)], pa.bool_()))
                index += item.num_rows
                if kept.num_rows:
                    writer.write_batch(kept)
                    count += kept.num_rows
            if rows:
                write_rows()
        return count

    def _gather(self, path: Path) -> None:
        """The store's rows of this shard (its published file, then the sealed parts) into one
        local file, in their order: a publish reads the bucket once, not once per pass (Arrow's
        uncompressed file format, mapped: its two passes cost no decompression)."""
        with pa.OSFile(str(path), "wb") as sink, pa.ipc.new_file(sink, ROW_SCHEMA) as writer:
            def write(table: pa.Table) -> int:
                if table.schema != ROW_SCHEMA:  # an older writer's columns: as the row schema says
                    table = pa.Table.from_pylist(table.to_pylist(), schema=ROW_SCHEMA)
                batches = table.to_batches()
                for batch in batches:
                    writer.write_batch(batch)
                return len(batches)

            self._file_batches = 0
            store = self.parts.store
            if store.exists(self.parts.data_key):
                fs, root = store.arrow()
                with fs.open_input_file(f"{root}/{self.parts.data_key}") as fh:
                    for batch in pq.ParquetFile(fh).iter_batches(batch_size=1000):
                        self._file_batches += write(pa.Table.from_batches([batch]))
            for table in self.parts.committed_tables():
                write(table)

    def settled_and_failed(self, hashes: dict[str, str], settings_hash: str,
                           turns: dict[str, list[tuple[int, int]]] | None = None) -> tuple[set[str], set[str], set[str]]:
        def settle():
            self._unsealed.clear()
            if turns is not None:
                turns.clear()  # a retried reading starts over
            found = super(BucketShardStore, self).settled_and_failed(hashes, settings_hash, turns)
            # the heads the settle kept, as the rows they are (in the same order)
            rows = Journal.rows_at(self.journal_path, [head["at"] for head in self._unsealed.values()])
            self._unsealed.update(zip(list(self._unsealed), rows))
            return found

        found = self._store_io("read the shard from", settle)
        self._oldest = time.monotonic() if self._unsealed else None
        return found

    def _journalled(self, head: dict, settles: bool) -> None:
        """Journal rows no part holds yet (a retry on the same node): sealed with the next part."""
        if settles:
            self._unsealed[head["id"]] = head
        else:
            self._unsealed.pop(head["id"], None)

    def _waiting(self, file_ids: set[str]) -> bool:
        """Rows not in the published file yet (a journal, sealed parts), or a file whose commit
        does not name its ids (a publish killed between the two)."""
        def waiting() -> bool:
            published = self.parts.published()
            return (published is None or published.get("ids_sha256") != ids_digest(file_ids)
                    or bool(self.parts.valid_commits()))

        return super()._waiting(file_ids) or self._store_io("read the shard from", waiting)

    def tidy(self) -> None:
        self._store_io("tidy the shard on", self.parts.gc)

    def appended(self, row: dict) -> None:
        """A row the journal now holds: sealed with the next part once it settles its id."""
        self._check_sealing()
        if not settles_its_id(row):
            return
        self._unsealed[row["id"]] = row
        if self._oldest is None:
            self._oldest = time.monotonic()
        if len(self._unsealed) >= self.part_rows or time.monotonic() - self._oldest >= self.part_seconds:
            rows = self._take()
            self._sealing.append(self._sealer.submit(self._seal, rows))

    def _take(self) -> list[dict]:
        rows = [{k: v for k, v in row.items() if k != "retryable"} for row in self._unsealed.values()]
        self._unsealed.clear()
        self._oldest = None
        return rows

    def _seal(self, rows: list[dict]) -> None:
        check_held(self.layout)
        self._store_io("seal a part on", lambda: self.parts.seal(rows))

    def _check_sealing(self, wait: bool = False) -> None:
        """A seal that failed fails the shard (its rows stay in the journal); ``wait``: all of them."""
        if wait:
            wait_for(self._sealing)
        for future in [f for f in self._sealing if f.done()]:
            self._sealing.remove(future)
            future.result()

    def seal(self) -> None:
        """Seal what is unsealed now, after the parts being sealed."""
        self._check_sealing(wait=True)
        self._seal(self._take())

    def publish(self, hashes: dict[str, str], settings_hash: str, batch_rows: int = 1000) -> int:
        """Seal what the journal holds, then the shard's file as on a local disk (the last row of
        this run per id), streamed to the work folder and uploaded over the published one."""
        self.seal()
        folder = self.journal_path.parent
        with scratch_file(folder, f"{self.name}.stored.arrow") as stored, \
                scratch_file(folder, f"{self.name}.parquet") as tmp:
            def publish() -> int:
                self._gather(stored)
                self._gathered = stored
                try:
                    count = self._write(tmp, self._chosen(hashes, settings_hash), batch_rows)
                finally:
                    self._gathered = None
                check_held(self.layout)
                self.parts.install(tmp, hashes, count)
                return count

            count = self._store_io("publish the shard to", publish)
        self.journal_path.unlink(missing_ok=True)
        return count
