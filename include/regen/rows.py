"""A dataset row: the one type the client writes, the journal and the shard files hold and the
audit reads, and reading the rows of an output directory back, a batch at a time.

The Parquet schema and the audit's columns derive from :class:`Row`'s fields.
"""

from __future__ import annotations

import json
import types
import typing
from dataclasses import dataclass, field, fields
from typing import Any, Iterator

import pyarrow as pa

from regen.errors import DataError
from regen.layout import RunLayout

# An agentic message's tool calls are their JSON (a struct per call would fix one schema for
# every tool's arguments); row_messages gives them back as lists.
MESSAGE_TYPE = pa.struct([("role", pa.string()), ("content", pa.string()), ("reasoning_content", pa.string()),
                          ("tool_calls", pa.string()), ("tool_call_id", pa.string()), ("name", pa.string())])
TOKEN_IDS = pa.list_(pa.int32())
TURN_TYPE = pa.struct([("finish_reason", pa.string()), ("prompt_tokens", pa.int64()),
                       ("completion_tokens", pa.int64()), ("completion_token_ids", TOKEN_IDS),
                       ("prompt_token_ids", TOKEN_IDS)])


def _col(arrow: pa.DataType | None = None, audit: bool = False) -> Any:
    return field(default=None, metadata={"arrow": arrow, "audit": audit})


@dataclass
class Row:
    """One prompt's row. For a conversation: ``messages`` is the request of its last turn (its
    earlier assistant turns the regenerated ones, each with its reasoning), the answer fields are
    that turn's, ``turns`` every turn's outcome."""

    id: str = _col(audit=True)
    messages: list[dict] = _col(pa.list_(MESSAGE_TYPE), audit=True)
    reasoning_content: str | None = _col(audit=True)
    content: str | None = _col(audit=True)
    finish_reason: str | None = _col(audit=True)
    prompt_tokens: int | None = _col()
    completion_tokens: int | None = _col(audit=True)
    error: str | None = _col(audit=True)  # None on success; the reason when the prompt failed for good
    enable_thinking: bool | None = _col(audit=True)
    model: str | None = _col()
    server: str | None = _col()
    # What made the row (regen.dispatch.made_by, JSON): the engine and its version, its parsers, the
    # hash of the chat template it rendered with and of its launch arguments.
    made_by: str | None = _col(audit=True)
    attempts: int | None = _col(pa.int32())
    latency_s: float | None = _col()
    prompt_hash: str | None = _col(audit=True)  # of exactly what was sent (messages, template kwargs)
    settings_hash: str | None = _col(audit=True)  # of the served model and the sampling settings
    # The last turn's tokens as the engine saw and produced them (where it returns them).
    prompt_token_ids: list[int] | None = _col(TOKEN_IDS, audit=True)
    completion_token_ids: list[int] | None = _col(TOKEN_IDS, audit=True)
    turns: list[dict] | None = _col(pa.list_(TURN_TYPE), audit=True)
    # Agentic rows (regen.turns): the row's tools and the last step's calls (JSON), why the
    # conversation ended early (a step that did not make the recorded calls), the recorded
    # results spliced in and the calls whose arguments differ from the recorded ones.
    tools: str | None = _col(audit=True)
    tool_calls: str | None = _col(audit=True)
    divergence: str | None = _col(audit=True)
    spliced_results: int | None = _col(audit=True)
    argument_diffs: int | None = _col(audit=True)
    # Where this row's requests carried an earlier step's reasoning (regen.turns.reasoning_positions):
    # "tool_steps", "chat_turns", both comma-separated; empty when none was ever sent.
    history_reasoning: str | None = _col(audit=True)

    def to_dict(self) -> dict[str, Any]:
        return dict(vars(self))


_PLAIN = {str: pa.string(), int: pa.int64(), float: pa.float64(), bool: pa.bool_()}


def _arrow_type(f) -> pa.DataType:
    if f.metadata.get("arrow") is not None:
        return f.metadata["arrow"]
    hints = typing.get_type_hints(Row)[f.name]
    base = [a for a in typing.get_args(hints) if a is not type(None)] if isinstance(hints, types.UnionType) else [hints]
    return _PLAIN[base[0]]


ROW_SCHEMA = pa.schema([(f.name, _arrow_type(f)) for f in fields(Row)])
AUDIT_COLUMNS = tuple(f.name for f in fields(Row) if f.metadata["audit"])
# The engine's token ids: most of a row's bytes (32k ids are 128 KB of Arrow, ~1.2 MB as Python ints);
# only the audit's certificate and the token export read them.
TOKEN_COLUMNS = ("prompt_token_ids", "completion_token_ids", "turns")
TEXT_COLUMNS = tuple(c for c in AUDIT_COLUMNS if c not in TOKEN_COLUMNS)
REQUIRED_COLUMNS = ("id", "messages", "content")  # a user's own Parquet may hold only these
# A token id as a Python object: an int and its list slot (4 bytes in Arrow). A row as Python
# objects holds up to about this many times its Arrow bytes (text about 1x): batches are sized by it.
PYTHON_BYTES_PER_ID = 36
PYTHON_BYTES_PER_ARROW_BYTE = 10


def row_messages(row: dict) -> list[dict]:
    """The row's messages as plain dicts, without the keys Parquet filled with null."""
    messages = row["messages"]
    if hasattr(messages, "tolist"):
        messages = messages.tolist()
    out = [{k: v for k, v in m.items() if v is not None or k == "content"} for m in messages]
    for m in out:
        if isinstance(m.get("tool_calls"), str):
            m["tool_calls"] = json.loads(m["tool_calls"])
    return out


def row_tools(row: dict) -> list[dict] | None:
    """An agentic row's tools (None for a chat row)."""
    return json.loads(row["tools"]) if row.get("tools") else None


def final_message(row: dict) -> dict:
    """The row's last step as an assistant message: its answer, reasoning and tool calls."""
    message = {"role": "assistant", "content": row.get("content"), "reasoning_content": row.get("reasoning_content")}
    if row.get("tool_calls"):
        message["tool_calls"] = json.loads(row["tool_calls"])
    return message


def asked_thinking(row: dict, default: bool) -> bool:
    """Whether the row was generated with thinking on (rows of older data may not say)."""
    thinking = row.get("enable_thinking")
    return default if thinking is None else bool(thinking)


SIZE_SAMPLE_ROWS = 32


def arrow_bytes_per_row(parquet, columns: list[str]) -> float:
    """A row's ``columns`` in Arrow memory: the larger of the footer's uncompressed size (which
    dictionary encoding shrinks for repeated text) and the first rows' own size, read."""
    meta = parquet.metadata
    columns = [c for c in columns if c in parquet.schema_arrow.names]
    if not meta.num_rows or not columns:
        return 0.0
    total = 0
    for g in range(meta.num_row_groups):
        group = meta.row_group(g)
        total += sum(group.column(c).total_uncompressed_size for c in range(group.num_columns)
                     if group.column(c).path_in_schema.split(".")[0] in columns)
    sample = next(parquet.iter_batches(batch_size=SIZE_SAMPLE_ROWS, columns=columns), None)
    sampled = sample.nbytes / sample.num_rows if sample is not None and sample.num_rows else 0.0
    return max(total / meta.num_rows, sampled)


def record_batches(layout: RunLayout, batch_size: int = 512, columns: tuple[str, ...] = AUDIT_COLUMNS,
                   max_batch_bytes: int | None = None) -> Iterator[pa.RecordBatch]:
    """The data's ``columns`` (those it has) in Arrow batches, one file at a time: at most
    ``batch_size`` rows, and fewer where their Python objects would pass ``max_batch_bytes``
    (a row of 32k-token ids is ~1.2 MB of them): memory holds one batch, however large the rows."""
    files = layout.data_files()
    if not files:
        raise DataError(f"{layout.data}: no Parquet files to read")
    for path in files:
        parquet = layout.parquet(path)
        names = parquet.schema_arrow.names
        missing = set(REQUIRED_COLUMNS) - set(names)
        if missing:
            raise DataError(f"{path}: the data has no column(s) {sorted(missing)}")
        wanted = [c for c in columns if c in names]
        rows = batch_size
        if max_batch_bytes:
            row_bytes = arrow_bytes_per_row(parquet, wanted) * PYTHON_BYTES_PER_ARROW_BYTE
            rows = max(1, min(batch_size, int(max_batch_bytes // max(row_bytes, 1))))
        yield from parquet.iter_batches(batch_size=rows, columns=wanted)


def iter_batches(layout: RunLayout, batch_size: int = 512, columns: tuple[str, ...] = AUDIT_COLUMNS,
                 max_batch_bytes: int | None = None) -> Iterator[list[dict]]:
    """:func:`record_batches` as rows."""
    for batch in record_batches(layout, batch_size, columns, max_batch_bytes):
        yield batch.to_pylist()


def count_rows(layout: RunLayout) -> int:
    return sum(layout.parquet(p).metadata.num_rows for p in layout.data_files())
