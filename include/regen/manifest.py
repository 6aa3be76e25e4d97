"""The run manifest: what this run sends, to which model, with which settings.

Preflight writes it before any GPU time is spent: the prompt set as an index (per id: its shard,
the hash of exactly what is sent, where the record is in the file) and the sampling settings.
Staging adds the fingerprint of the model copy the servers will load. Every later stage reads it:
a shard settles and resumes against its slice of the index, and publishes only when it holds
exactly its ids; the audit refuses rows the manifest does not account for.

A row counts only when its ``prompt_hash`` is the index's for its id and its ``settings_hash`` is
this run's (model identity + sampling): a rerun with another model, other settings or edited
prompts regenerates, and deleted prompts leave the dataset.
"""

from __future__ import annotations

import hashlib
import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec

from regen.config import RunConfig
from regen.coordination import FileLock
from regen.errors import RegenError
from regen.files import atomic_path, atomic_write_json, read_json
from regen.layout import RunLayout
from regen.prompts import PromptError, read_prompts, shard_of
from regen.turns import steps

INDEX_SCHEMA_FIELDS = ("id", "shard", "prompt_hash", "line", "offset", "turns")
INDEX_VERSION = 2  # an index written by an older regen (no turns) is rebuilt
STAGED_COPY_RECORD = ".regen-manifest.json"  # a staged copy's record of its source (regen.weights)
SMALL_FILE = 64 * 1024 * 1024  # hashed whole; larger files by size and their ends


class ManifestError(RegenError):
    """The manifest is missing, or no longer describes the prompt file."""


def template_kwargs(cfg: RunConfig) -> dict[str, Any]:
    return {"enable_thinking": cfg.enable_thinking}


def prompt_hash(messages: list[dict], kwargs: dict[str, Any], tools: list[dict] | None = None) -> str:
    """Hash of exactly what is sent for a prompt: its messages, the template's kwargs, and an
    agentic row's tools."""
    sent = {"messages": messages, "chat_template_kwargs": kwargs} | ({"tools": tools} if tools else {})
    doc = msgspec.json.encode(sent)
    return hashlib.blake2b(doc, digest_size=8).hexdigest()


def settings_hash(model_identity: str | None, sampling: dict[str, Any]) -> str:
    """What decides whether a row can stand for this run's: the model as served and every
    sampling setting."""
    key = {"model": model_identity, **sampling}
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]


def model_fingerprint(model_dir: str | Path) -> str | None:
    """What makes two generations comparable: the model's config, tokenizer and chat template
    (contents) and its weight files (names, sizes, and their first and last MiB: a retrained
    checkpoint of the same shape differs there, a copy does not). None when the directory is not
    here."""
    model_dir = Path(model_dir)
    if not (model_dir / "config.json").is_file():
        return None
    digest = hashlib.sha256()
    for path in sorted(p for p in model_dir.rglob("*") if p.is_file() and p.name != STAGED_COPY_RECORD):
        rel = str(path.relative_to(model_dir))
        digest.update(rel.encode())
        size = path.stat().st_size
        if path.suffix in (".json", ".jinja", ".txt", ".model") and size <= SMALL_FILE:
            digest.update(path.read_bytes())
            continue
        digest.update(str(size).encode())
        with open(path, "rb") as fh:
            digest.update(fh.read(1 << 20))
            fh.seek(max(0, size - (1 << 20)))
            digest.update(fh.read(1 << 20))
    return digest.hexdigest()[:16]


def prompt_file_stat(path: str | Path) -> dict[str, Any]:
    st = Path(path).stat()
    return {"path": str(path), "size": st.st_size, "mtime_ns": st.st_mtime_ns}


class PromptIndexWriter:
    """Collects (id, shard, hash, line, offset) while the prompts are read, and what could not be
    read or repeats an id (the first record of an id counts)."""

    UNREADABLE_KEPT = 10_000

    def __init__(self, cfg: RunConfig):
        self.cfg = cfg
        # The file as it was when reading began: what the index describes (a line appended while
        # it is read may or may not be in it, so a file that changed meanwhile is not described).
        self.source_stat = prompt_file_stat(cfg.prompts)
        self.kwargs = template_kwargs(cfg)
        self.columns: dict[str, list] = {name: [] for name in INDEX_SCHEMA_FIELDS}
        self.first_line: dict[str, int] = {}
        self.unreadable: list[tuple[int, str]] = []  # (line, "file:line: reason")
        self.unreadable_count = 0

    def feed(self, item) -> str | None:
        """Index a prompt; for a record that cannot be sent, the problem line (file:line)."""
        if isinstance(item, PromptError) and item.rule is not None:
            return str(item)  # refused by a rule: preflight fails, or lists it as skipped
        if isinstance(item, PromptError):
            problem, line = str(item), item.line
        elif item.id in self.first_line:
            problem = (f"{self.cfg.prompts}:{item.line}: duplicate id {item.id!r} "
                       f"(first at line {self.first_line[item.id]})")
            line = item.line
        else:
            self.first_line[item.id] = item.line
            if self.cfg.generation.limit is None or len(self.columns["id"]) < self.cfg.generation.limit:
                self.add(item)  # a trial's index holds its first N; the rest of the file is still checked
            return None
        self.unreadable_count += 1
        if len(self.unreadable) < self.UNREADABLE_KEPT:
            self.unreadable.append((line, problem))
        return problem

    def add(self, prompt) -> None:
        c = self.columns
        c["id"].append(prompt.id)
        c["shard"].append(shard_of(prompt.id, self.cfg.num_shards))
        c["prompt_hash"].append(prompt_hash(prompt.messages, self.kwargs, prompt.tools))
        c["line"].append(prompt.line)
        c["offset"].append(prompt.offset)
        c["turns"].append(steps(prompt.messages))

    def write(self, layout: RunLayout) -> int:
        """The index, sorted by shard (a shard reads its slice only), beside the manifest."""
        import pyarrow as pa
        import pyarrow.compute as pc
        import pyarrow.parquet as pq

        table = pa.table({
            "id": pa.array(self.columns["id"], pa.string()),
            "shard": pa.array(self.columns["shard"], pa.int32()),
            "prompt_hash": pa.array(self.columns["prompt_hash"], pa.string()),
            "line": pa.array(self.columns["line"], pa.int64()),
            "offset": pa.array(self.columns["offset"], pa.int64()),
            "turns": pa.array(self.columns["turns"], pa.int32()),
        })
        table = table.take(pc.sort_indices(table, [("shard", "ascending"), ("line", "ascending")]))
        with atomic_path(layout.prompt_index) as tmp:
            pq.write_table(table, tmp, row_group_size=64 * 1024, compression="zstd")
        return table.num_rows


@dataclass(frozen=True)
class ShardPrompts:
    """A shard's slice of the index."""

    ids: list[str]
    hashes: dict[str, str]
    places: dict[str, tuple[int, int]]  # id -> (line, offset)
    turns: dict[str, int]  # id -> user turns (the requests a conversation makes with regenerate_turns all)


class Manifest:
    """manifest.json of one output directory (sections written by the stage that knows them)."""

    def __init__(self, layout: RunLayout):
        self.layout = layout

    def read(self) -> dict[str, Any]:
        return read_json(self.layout.manifest) or {}

    def update(self, **sections: Any) -> dict[str, Any]:
        with FileLock(self.layout.manifest_lock):
            doc = {**self.read(), **sections, "updated": time.time()}
            atomic_write_json(self.layout.manifest, doc)
        return doc

    def write_prompts(self, cfg: RunConfig, index: PromptIndexWriter, run_id: str) -> dict[str, Any]:
        now = prompt_file_stat(cfg.prompts)
        if now != index.source_stat:
            raise ManifestError(f"prompts {cfg.prompts}: changed while it was read ({index.source_stat['size']:,} -> "
                                f"{now['size']:,} bytes): run again once the file is complete")
        count = index.write(self.layout)
        return self.update(run_id=run_id, num_shards=cfg.num_shards, sampling=cfg.sampling_settings(),
                           index_version=INDEX_VERSION,
                           prompts={**index.source_stat, "count": count,
                                    "chat_template_kwargs": template_kwargs(cfg),
                                    "unreadable": index.unreadable,
                                    "unreadable_count": index.unreadable_count})

    def current_for(self, cfg: RunConfig) -> dict[str, Any] | None:
        """The manifest when it describes this prompt file (as it is now), shard count and
        template kwargs; None otherwise."""
        doc = self.read()
        prompts = doc.get("prompts") or {}
        if not self.layout.prompt_index.exists() or not Path(cfg.prompts).exists():
            return None
        if ({k: prompts.get(k) for k in ("path", "size", "mtime_ns")} != prompt_file_stat(cfg.prompts)
                or doc.get("num_shards") != cfg.num_shards or doc.get("index_version") != INDEX_VERSION
                or prompts.get("chat_template_kwargs") != template_kwargs(cfg)):
            return None
        return doc

    def ensure(self, cfg: RunConfig, rebuild: bool, run_id: str = "cli") -> dict[str, Any]:
        """The current manifest. ``rebuild``: index the prompts here when it is missing or stale
        (the CLI's `regen generate`); else a stale one is an error (a DAG run, whose preflight
        wrote it: the file changed since)."""
        doc = self.current_for(cfg)
        if doc is not None:
            return doc
        if not rebuild:
            raise ManifestError(
                f"{cfg.prompts} changed since preflight indexed it for this run (or the index in "
                f"{self.layout.work} is missing): the dataset would mix prompt sets. Clear the whole "
                f"run, preflight included, to regenerate from the file as it is now")
        with FileLock(self.layout.index_lock):  # shards started together index the file once
            doc = self.current_for(cfg)
            if doc is not None:
                return doc
            index = PromptIndexWriter(cfg)
            for item in read_prompts(cfg.prompts):
                index.feed(item)
            return self.write_prompts(cfg, index, run_id)

    def shard_prompts(self, shard: int) -> ShardPrompts:
        import pyarrow.parquet as pq

        table = pq.read_table(self.layout.prompt_index, filters=[("shard", "=", shard)],
                              columns=["id", "prompt_hash", "line", "offset", "turns"])
        ids = table["id"].to_pylist()
        return ShardPrompts(ids, dict(zip(ids, table["prompt_hash"].to_pylist())),
                            dict(zip(ids, zip(table["line"].to_pylist(), table["offset"].to_pylist()))),
                            dict(zip(ids, table["turns"].to_pylist())))

