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
from concurrent.futures import ThreadPoolExecutor
from typing import Iterable

import pyarrow as pa
import pyarrow.parquet as pq

from regen.errors import ShardFailed
from regen.layout import RunLayout
from regen.machine import node_name
from regen.objectstore import META, ObjectStore
from regen.rows import ROW_SCHEMA
from regen.store import Journal, ShardStore, of_this_run

log = logging.getLogger("regen.parts")

SETTLE_COLUMNS = ["id", "error", "prompt_hash", "settings_hash"]


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
        return sorted(int(n[1:7]) for n in self.store.names(f"{META}/fences/{self.name}") if n.endswith(".json"))

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
        fences = self.fences() if fences is None else fences
        if not fences:
            return []
        top = fences[-1]
        accepted = json.loads(self.store.read(self._fence_key(top)))["accepted"]
        own = [n[:-5] for n in self.store.names(f"{META}/commits/{self.name}")
               if n.endswith(".json") and n.startswith(f"f{top:06d}-")]
        return accepted + own

    # --- parts -------------------------------------------------------------------------------
    def committed_tables(self, columns: list[str] | None = None) -> list[pa.Table]:
        """The rows of every valid commit, each part checked against its commit's size: the
        commits read at once, the parts (``columns`` of them) by several threads."""
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

        with ThreadPoolExecutor(max_workers=8) as pool:
            return list(pool.map(read, names))

    def seal(self, rows: list[dict]) -> None:
        """Write ``rows`` as the attempt's next part and commit it, unless a later attempt claimed
        the shard (ClaimLost: nothing is committed)."""
        if not rows:
            return
        self.seq += 1
        name = f"f{self.fence:06d}-p{self.seq:06d}"
        data = _parquet_bytes(rows)
        if not self.store.create(self._part_key(name), data):
            raise ClaimLost(f"{self.name}: part {name} exists already: another writer holds fence {self.fence}")
        self.check_claim()
        commit = {"part": self._part_key(name), "rows": len(rows), "bytes": len(data), "sha256": _digest(data),
                  "ids_sha256": ids_digest(r["id"] for r in rows), "fence": self.fence, "seq": self.seq}
        self.store.create(self._commit_key(name), json.dumps(commit).encode())

    # --- the published shard -----------------------------------------------------------------
    def published(self) -> dict | None:
        try:
            return json.loads(self.store.read(self.published_key))
        except FileNotFoundError:
            return None

    def publish(self, hashes: dict[str, str], settings_hash: str) -> int:
        """One file of the shard's committed rows under data/, then its commit; the parts go."""
        done = self.published()
        if done is not None:
            return done["rows"]
        table = _last_of_this_run(self.committed_tables(), hashes, settings_hash)
        ids = table.column("id").to_pylist()
        if set(ids) != set(hashes):
            missing = sorted(set(hashes) - set(ids))
            raise ShardFailed(f"{self.name}: the committed parts hold {len(ids):,} of its {len(hashes):,} "
                              f"prompts (missing e.g. {missing[:3]}); nothing published")
        data = _parquet_bytes(table)
        if not self.store.create(self.data_key, data):
            data = self.store.read(self.data_key)  # another attempt published first: check it
            theirs = pq.read_table(io.BytesIO(data), columns=["id"]).column("id").to_pylist()
            if sorted(theirs) != sorted(hashes):
                raise ShardFailed(f"{self.store.url_of(self.data_key)}: holds {len(theirs):,} rows that are not "
                                  f"exactly this shard's {len(hashes):,} ids; remove it to publish again")
            ids = theirs
        commit = {"file": self.data_key, "rows": len(ids), "bytes": len(data), "sha256": _digest(data),
                  "ids_sha256": ids_digest(ids)}
        self.store.create(self.published_key, json.dumps(commit).encode())
        self._remove_parts()
        return len(ids)

    def _remove_parts(self) -> None:
        with contextlib.suppress(OSError):
            names = self.store.names(f"{META}/commits/{self.name}")
            self.store.remove([f"{META}/commits/{self.name}/{n}" for n in names])
            names = self.store.names(f"{META}/parts/{self.name}")
            self.store.remove([f"{META}/parts/{self.name}/{n}" for n in names])


def _last_of_this_run(tables: list[pa.Table], hashes: dict[str, str], settings_hash: str) -> pa.Table:
    """One row per id of this run (a later commit's row wins), in commit order."""
    if not tables:
        return ROW_SCHEMA.empty_table()
    table = pa.concat_tables([t.select(ROW_SCHEMA.names).cast(ROW_SCHEMA) for t in tables])
    keep: dict[str, int] = {}
    for index, row in enumerate(table.select(SETTLE_COLUMNS).to_pylist()):
        if of_this_run(row, hashes, settings_hash):
            keep[row["id"]] = index
    return table.take(sorted(keep.values()))


def shard_store(cfg, shard: int) -> ShardStore:
    """A shard's store for ``cfg``'s output: a local folder's, or an object store's."""
    layout = cfg.layout
    if layout.dataset is None:
        return ShardStore(layout, shard, cfg.num_shards)
    return BucketShardStore(layout, shard, cfg.num_shards, layout.store(), cfg.generation.part_rows,
                            cfg.generation.part_seconds)


class BucketShardStore(ShardStore):
    """A shard whose dataset is on an object store: the journal (and the lock of this node) stay in
    the local work folder; settled rows are sealed into parts; the published file is the store's."""

    def __init__(self, layout: RunLayout, shard: int, num_shards: int, store: ObjectStore,
                 part_rows: int, part_seconds: float):
        super().__init__(layout, shard, num_shards)
        self.parts = ShardParts(store, self.name)
        self.location = store.url_of(self.parts.data_key)
        self.part_rows, self.part_seconds = part_rows, part_seconds
        self._unsealed: dict[str, dict] = {}
        self._oldest: float | None = None

    @contextlib.contextmanager
    def lock(self):
        with super().lock():
            fence = self.parts.claim(f"pid {os.getpid()} on {node_name()}")
            log.info("%s: claimed attempt %d on %s", self.name, fence, self.parts.store.url)
            yield

    def settled_and_failed(self, hashes: dict[str, str], settings_hash: str) -> tuple[set[str], set[str], set[str]]:
        settled: set[str] = set()
        failed: set[str] = set()
        published = self.parts.published()
        if published is not None:
            fs, root = self.parts.store.arrow()
            tables = [pq.read_table(f"{root}/{published['file']}", filesystem=fs, columns=SETTLE_COLUMNS)]
        else:
            tables = self.parts.committed_tables(SETTLE_COLUMNS)
        committed: set[str] = set()
        for table in tables:
            for row in table.to_pylist():
                committed.add(row["id"])
                if of_this_run(row, hashes, settings_hash):
                    settled.add(row["id"])
                    if row["error"] is not None:
                        failed.add(row["id"])
        file_ids = committed if published is not None else set()
        self._unsealed.clear()
        for row in Journal.rows(self.journal_path):
            if not of_this_run(row, hashes, settings_hash) or row["id"] in committed:
                continue
            failed.discard(row["id"])
            if row.get("error") is None or not row.get("retryable", False):
                settled.add(row["id"])
                self._unsealed[row["id"]] = row
                if row.get("error") is not None:
                    failed.add(row["id"])
            else:
                settled.discard(row["id"])
                self._unsealed.pop(row["id"], None)
        self._oldest = time.monotonic() if self._unsealed else None
        return settled, file_ids, failed

    def complete(self, ids: list[str], settled: set[str], file_ids: set[str]) -> bool:
        return self.parts.published() is not None and file_ids == set(ids)

    def appended(self, row: dict) -> None:
        """A row the journal now holds: sealed with the next part once it settles its id."""
        if row.get("partial") or (row.get("error") is not None and row.get("retryable", False)):
            return
        self._unsealed[row["id"]] = {k: v for k, v in row.items() if k != "retryable"}
        if self._oldest is None:
            self._oldest = time.monotonic()
        if len(self._unsealed) >= self.part_rows or time.monotonic() - self._oldest >= self.part_seconds:
            self.seal()

    def seal(self) -> None:
        rows = list(self._unsealed.values())
        self.parts.seal(rows)
        self._unsealed.clear()
        self._oldest = None

    def publish(self, hashes: dict[str, str], settings_hash: str, batch_rows: int = 1000) -> int:
        self.seal()
        count = self.parts.publish(hashes, settings_hash)
        self.journal_path.unlink(missing_ok=True)
        return count
