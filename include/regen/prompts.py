"""Reading prompt files (JSONL or Parquet) into requests, and sharding them by id.

A bad record never stops the read: it comes back as a :class:`PromptError` naming its file and
line, so the caller can report it and go on with the rest.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import msgspec

from regen.toolcalls import answer_calls_in_order, names, normalize_calls, normalize_tools
from regen.units import format_bytes

_ROLE_ALIASES = {
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    "model": "assistant",
    "bot": "assistant",
    "system": "system",
    "tool": "tool",
    "observation": "tool",  # ShareGPT's tool result
    "function": "tool",  # OpenAI's older name for it
    "function_call": "function_call",  # ShareGPT's assistant call(s): merged into an assistant message
}


@dataclass(frozen=True, slots=True)
class Prompt:
    id: str
    messages: list[dict[str, Any]]
    line: int
    offset: int = -1  # where the record starts: a byte offset (JSONL) or a row number (Parquet)
    tools: list[dict] | None = None  # an agentic row's tools (regen.toolcalls' shape)

    @property
    def agentic(self) -> bool:
        return bool(self.tools) or any(m["role"] == "tool" or m.get("tool_calls") for m in self.messages)


@dataclass(frozen=True, slots=True)
class PromptError:
    """A record that cannot be sent: unreadable, or (``rule`` set) a conversation SpecForge's
    validator refuses, which ``skip_invalid`` leaves out instead of failing preflight."""

    file: str
    line: int
    reason: str
    rule: str | None = None

    def __str__(self) -> str:
        return f"{self.file}:{self.line}: {self.reason}"


class InvalidConversation(ValueError):
    """A conversation SpecForge's regeneration validator refuses, by the rule it breaks."""

    def __init__(self, rule: str, reason: str):
        super().__init__(f"{rule}: {reason}")
        self.rule = rule


# The rules of SpecForge's conversation validator (scripts/conversation_validation.py, used by
# regenerate_train_data.py on its input), each under the name preflight counts it by.
RULES = ("empty_content", "tool_message", "unanswered_call", "late_system", "leading_assistant", "role_order",
         "no_user")


def check_conversation(messages: list[dict]) -> None:
    """Raise InvalidConversation for the first rule the messages break: every content a
    non-empty string (an assistant message that calls tools may have none), system messages only
    before the first user message, then user and assistant alternating from a user; an assistant
    message that calls tools is followed by one result per call (by ``tool_call_id``), then by an
    assistant message. A result that answers no call before it cannot be replayed (``tool_message``);
    nor can a call no result answers before the conversation goes on (``unanswered_call``)."""
    expected, seen_user, pending, caller = "user", False, [], -1
    for i, message in enumerate(messages):
        role, content = message["role"], message.get("content")
        if role == "tool":
            call_id = message.get("tool_call_id")
            if call_id not in pending:
                raise InvalidConversation("tool_message", f"message {i} is a tool result that answers no call "
                                          f"before it" + (f" (tool_call_id {call_id!r})" if call_id else ""))
            if not isinstance(content, str):
                raise InvalidConversation("empty_content", f"message {i} (tool) has no text")
            pending.remove(call_id)
            continue
        if pending:
            raise InvalidConversation("unanswered_call", f"message {caller} calls {names(messages[caller]['tool_calls'])} "
                                      f"and no tool result answers {pending} before message {i}")
        calls = message.get("tool_calls") if role == "assistant" else None
        if not isinstance(content, str) or not (content.strip() or calls):
            raise InvalidConversation("empty_content", f"message {i} ({role}) has no text")
        if role == "system":
            if seen_user:
                raise InvalidConversation("late_system", f"message {i} is a system message after a user message")
            continue
        if role == "assistant" and i > 0 and messages[i - 1]["role"] == "tool":
            expected = "assistant"  # the answer after the results
        if role != expected:
            if not seen_user:
                raise InvalidConversation("leading_assistant", "the conversation starts with an assistant message")
            raise InvalidConversation("role_order", f"message {i} is a second {role} message in a row")
        seen_user = True
        expected = "assistant" if role == "user" else "user"
        if calls:
            pending, caller = [c["id"] for c in calls], i
    if not seen_user:
        raise InvalidConversation("no_user", "no user message")


def shard_of(prompt_id: str, num_shards: int) -> int:
    """Stable across rereads, processes and added prompts: a hash of the id, not a position."""
    digest = hashlib.blake2b(prompt_id.encode("utf-8"), digest_size=8).digest()
    return int.from_bytes(digest, "big") % num_shards


def normalize_record(record: Any) -> tuple[str, list[dict[str, Any]], list[dict] | None]:
    """(id, request messages, tools) of one record; raises ValueError with the reason."""
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
    tools = normalize_tools(record.get("tools"))
    return str(prompt_id), request_messages(messages), tools


def _message(turn: dict, role: str, content: Any, where: str, index: int) -> dict[str, Any]:
    """One message in the OpenAI shape; tool results that are objects become their JSON."""
    if role == "tool" and content is not None and not isinstance(content, str):
        content = json.dumps(content, ensure_ascii=False)
    raw_calls = turn.get("tool_calls") or turn.get("function_call") if role == "assistant" else None
    if raw_calls:
        return {"role": role, "content": content or "", "tool_calls": normalize_calls(raw_calls, where, index)}
    if not isinstance(content, str):
        raise InvalidConversation("empty_content", f"{where} has no text content")
    message = {"role": role, "content": content}
    if role == "tool":
        message |= {k: str(turn[k]) for k in ("tool_call_id", "name") if turn.get(k)}
    return message


def _normalize_turns(turns: Any, field: str) -> list[dict[str, Any]]:
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
        role = _ROLE_ALIASES[role]
        if role == "function_call":  # the value is the call(s) the assistant makes here
            calls = normalize_calls(content, f"'{field}[{i}]'", len(out))
            if out and out[-1]["role"] == "assistant" and not out[-1].get("tool_calls"):
                out[-1]["tool_calls"] = calls  # the text it said before calling
            else:
                out.append({"role": "assistant", "content": "", "tool_calls": calls})
            continue
        out.append(_message(turn, role, content, f"'{field}[{i}]'", len(out)))
    answer_calls_in_order(out)
    check_conversation(out)
    return out


def request_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The conversation up to and including its last user message or tool result: what the
    target answers (the assistant messages before it are the steps regenerated on the way)."""
    if not any(m["role"] == "user" for m in messages):
        raise ValueError("no user turn")
    last = max(i for i, m in enumerate(messages) if m["role"] in ("user", "tool"))
    return messages[: last + 1]


def is_parquet(path: str | Path) -> bool:
    return Path(path).suffix in (".parquet", ".pq")


def iter_records(path: str | Path) -> Iterator[tuple[int, int, Any]]:
    """(line number, offset, raw record); a JSON error yields (line, offset, PromptError)."""
    path = Path(path)
    if is_parquet(path):
        import pyarrow.parquet as pq

        row = 0
        for batch in pq.ParquetFile(path).iter_batches(batch_size=4096):
            for record in batch.to_pylist():
                yield row + 1, row, record
                row += 1
        return
    offset = 0
    with path.open("rb") as fh:
        lineno = 0
        while True:
            raw, size = _line(fh)
            if not size:
                return
            lineno += 1
            record = _decode(path, lineno, raw, offset)
            if record is not None:
                yield lineno, offset, record
            offset += size


# A record is a conversation, not a corpus: a longer line is refused (file:line), never read whole.
MAX_LINE_BYTES = 64 * 2**20


def _line(fh) -> tuple[bytes | None, int]:
    """The next line (None when it is longer than MAX_LINE_BYTES) and the bytes it takes."""
    raw = fh.readline(MAX_LINE_BYTES + 1)
    if len(raw) <= MAX_LINE_BYTES or raw.endswith(b"\n"):
        return raw, len(raw)
    size = len(raw)
    while raw and not raw.endswith(b"\n"):  # skip the rest of it, a block at a time
        raw = fh.readline(2**20)
        size += len(raw)
    return None, size


def _decode(path: str | Path, line: int, raw: bytes | None, offset: int) -> Any:
    """A line's record, a PromptError naming file:line, or None for a blank line."""
    if raw is None:
        return PromptError(str(path), line, f"longer than {format_bytes(MAX_LINE_BYTES)}: not a prompt record")
    try:
        return msgspec.json.decode(_without_bom(raw, offset))  # several times json.loads' speed
    except msgspec.DecodeError as exc:
        return PromptError(str(path), line, f"not valid JSON: {exc}") if raw.strip() else None
    except RecursionError:
        return PromptError(str(path), line, "not valid JSON: nested too deep")


def _without_bom(raw: bytes, offset: int) -> bytes:
    """The first line without the UTF-8 byte order mark some editors write (JSON has none)."""
    return raw[3:] if offset == 0 and raw.startswith(b"\xef\xbb\xbf") else raw


def _prompt(path: str | Path, line: int, offset: int, record: Any) -> Prompt | PromptError:
    if isinstance(record, PromptError):
        return record
    try:
        prompt_id, messages, tools = normalize_record(record)
    except InvalidConversation as exc:
        return PromptError(str(path), line, f"{exc} (id {record.get('id')!r})", exc.rule)
    except ValueError as exc:
        return PromptError(str(path), line, str(exc))
    return Prompt(prompt_id, messages, line, offset, tools)


def read_prompts(path: str | Path) -> Iterator[Prompt | PromptError]:
    for line, offset, record in iter_records(path):
        yield _prompt(path, line, offset, record)


def read_at(path: str | Path, places: list[tuple[int, int]]) -> Iterator[Prompt | PromptError]:
    """The records at (line, offset) places the prompt index recorded, in the order given: a
    resumed shard reads only what it still has to send."""
    if is_parquet(path):
        import pyarrow.parquet as pq

        table = pq.read_table(path)
        for line, offset in places:
            yield _prompt(path, line, offset, table.slice(offset, 1).to_pylist()[0])
        return
    with Path(path).open("rb") as fh:
        for line, offset in places:
            fh.seek(offset)
            raw, _ = _line(fh)
            yield _prompt(path, line, offset, _decode(path, line, raw, offset) or
                          PromptError(str(path), line, "not valid JSON: an empty line"))
