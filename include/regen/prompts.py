"""Reading prompt files (JSONL or Parquet) into requests, and sharding them by id.

A bad record never stops the read: it comes back as a :class:`PromptError` naming its file and
line, so the caller can report it and go on with the rest.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import msgspec

_ROLE_ALIASES = {
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    "model": "assistant",
    "bot": "assistant",
    "system": "system",
    "tool": "tool",
}


@dataclass(frozen=True, slots=True)
class Prompt:
    id: str
    messages: list[dict[str, str]]
    line: int


@dataclass(frozen=True, slots=True)
class PromptError:
    file: str
    line: int
    reason: str

    def __str__(self) -> str:
        return f"{self.file}:{self.line}: {self.reason}"


def shard_of(prompt_id: str, num_shards: int) -> int:
    """Stable across rereads, processes and added prompts: a hash of the id, not a position."""
    digest = hashlib.blake2b(prompt_id.encode("utf-8"), digest_size=8).digest()
    return int.from_bytes(digest, "big") % num_shards


def normalize_record(record: Any) -> tuple[str, list[dict[str, str]]]:
    """(id, request messages) of one record; raises ValueError with the reason."""
    if not isinstance(record, dict):
        raise ValueError(f"record is a {type(record).__name__}, not an object")
    if "id" not in record or record["id"] is None or str(record["id"]).strip() == "":
        raise ValueError("missing 'id'")
    prompt_id = record["id"]
    if not isinstance(prompt_id, (str, int)) or isinstance(prompt_id, bool):
        raise ValueError(f"'id' must be a string or an integer, got {type(prompt_id).__name__}")
    if record.get("messages") is not None:
        messages = _normalize_turns(record["messages"], "messages")
    elif record.get("conversations") is not None:
        messages = _normalize_turns(record["conversations"], "conversations")
    elif record.get("prompt") is not None:
        if not isinstance(record["prompt"], str) or not record["prompt"].strip():
            raise ValueError("'prompt' must be a non-empty string")
        messages = [{"role": "user", "content": record["prompt"]}]
    else:
        raise ValueError("no 'messages', 'conversations' or 'prompt' field")
    return str(prompt_id), request_messages(messages)


def _normalize_turns(turns: Any, field: str) -> list[dict[str, str]]:
    if hasattr(turns, "tolist"):  # numpy arrays from Parquet
        turns = turns.tolist()
    if not isinstance(turns, list) or not turns:
        raise ValueError(f"'{field}' must be a non-empty list")
    out = []
    for i, turn in enumerate(turns):
        if not isinstance(turn, dict):
            raise ValueError(f"'{field}[{i}]' is not an object")
        role = turn.get("role", turn.get("from"))
        content = turn.get("content", turn.get("value"))
        if role not in _ROLE_ALIASES:
            raise ValueError(f"'{field}[{i}]' has unknown role {role!r}")
        if not isinstance(content, str):
            raise ValueError(f"'{field}[{i}]' has no text content")
        out.append({"role": _ROLE_ALIASES[role], "content": content})
    return out


def request_messages(messages: list[dict[str, str]]) -> list[dict[str, str]]:
    """The conversation up to and including its last user turn: what the target answers."""
    last_user = max((i for i, m in enumerate(messages) if m["role"] == "user"), default=None)
    if last_user is None:
        raise ValueError("no user turn")
    return messages[: last_user + 1]


def iter_records(path: str | Path) -> Iterator[tuple[int, Any]]:
    """(line number, raw record) pairs; a JSON error yields (line, PromptError)."""
    path = Path(path)
    if path.suffix in (".parquet", ".pq"):
        import pyarrow.parquet as pq

        row = 0
        for batch in pq.ParquetFile(path).iter_batches(batch_size=4096):
            for record in batch.to_pylist():
                row += 1
                yield row, record
        return
    decode = msgspec.json.decode  # several times json.loads' speed: a million lines in seconds
    with path.open("rb") as fh:
        for lineno, raw in enumerate(fh, start=1):
            try:
                yield lineno, decode(raw)
            except msgspec.DecodeError as exc:
                if raw.strip():
                    yield lineno, PromptError(str(path), lineno, f"not valid JSON: {exc}")


def read_prompts(path: str | Path) -> Iterator[Prompt | PromptError]:
    for line, record in iter_records(path):
        if isinstance(record, PromptError):
            yield record
            continue
        try:
            prompt_id, messages = normalize_record(record)
        except ValueError as exc:
            yield PromptError(str(path), line, str(exc))
            continue
        yield Prompt(prompt_id, messages, line)


def read_shard(path: str | Path, shard: int, num_shards: int) -> Iterator[Prompt | PromptError]:
    """The prompts of one shard, and every unreadable record (each shard reports its own)."""
    for item in read_prompts(path):
        if isinstance(item, PromptError):
            if item.line % num_shards == shard:
                yield item
        elif shard_of(item.id, num_shards) == shard:
            yield item
