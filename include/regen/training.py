"""A row as training will see it, in one of SpecForge's two layouts, judged once for the export
and the audit alike.

- ``conversation``: one record per prompt, every assistant turn with its reasoning, what
  SpecForge's ``scripts/regenerate_train_data.py`` writes and ``validate_regenerated_data.py
  --expect-reasoning --strict-think-markers`` accepts (``why_left_out`` says when it would not).
- ``events``: SpecForge's recipe for multi-turn reasoning data (docs/basic_usage/data_preparation.md,
  "Multi-turn structured reasoning"; ``scripts/expand_reasoning_conversations.py``): one record per
  assistant turn, ``ID#turnK``, its history with earlier answers' visible content only, trained
  with ``train_only_last_turn``. A conversation any of whose turns is invalid is left out whole.
  An agentic row's events keep in their history the reasoning its requests sent back
  (``history_reasoning``): each step is trained on the context it was generated from.

Agentic rows are SpecForge's tool-use shape in both layouts: ``tools`` on the record (its data
loader passes them to the chat template), each assistant step with its ``tool_calls``, each
recorded result a ``tool`` message. SpecForge's own expander and validator take user and
assistant messages only; regen's events of an agentic row are one per assistant step, as theirs
are per turn, the history keeping the tool calls and results it was generated after.
"""

from __future__ import annotations

import json
from typing import Any, Literal

from regen.chat.onpolicy import Served
from regen.rows import asked_thinking, final_message, row_messages, row_tools
from regen.turns import reasoning_sent_at, served_history

TrainLayout = Literal["events", "conversation"]
THINK_MARKERS = ("<think>", "</think>")


# The keys a message of an exported record keeps, by role.
_KEYS = {"assistant": ("reasoning_content", "tool_calls"), "tool": ("tool_call_id", "name")}


def conversation_record(row: dict) -> dict:
    """Every regenerated step, each assistant step with its reasoning and tool calls, then the
    last one; an agentic row's tools on the record."""
    conversations = []
    for m in [*row_messages(row), final_message(row)]:
        message = {"role": m["role"], "content": m["content"]}
        message |= {k: m[k] for k in _KEYS.get(m["role"], ()) if m.get(k) is not None}
        conversations.append(message)
    record = {"id": str(row["id"]), "conversations": conversations, "status": "success"}
    tools = row_tools(row)
    return record | {"tools": tools} if tools else record


def training_conversation(row: dict, template) -> tuple[list[dict], list[dict] | None]:
    """(messages, tools) of a row as the training's parser (``template``) prepares them."""
    from regen.chat.render import training_messages

    final = final_message(row)
    return (training_messages(row_messages(row), final["reasoning_content"], final["content"], template,
                              final.get("tool_calls")), row_tools(row))


def served(row: dict, prefill: str) -> Served:
    """What the engine was served and generated for the sample's last turn, for its certificate."""
    return Served(row.get("prompt_token_ids"), row.get("completion_token_ids"),
                  row.get("finish_reason") in ("stop", "tool_calls"), prefill)


def why_left_out(row: dict, expect_reasoning: bool) -> str | None:
    """Why SpecForge's validator (``--expect-reasoning --strict-think-markers``) would refuse the
    row's conversation, or None: every message non-empty, an optional system prompt first, then
    user and assistant alternating from a user turn to an assistant turn, every assistant turn
    with non-empty reasoning and no think marker in its answer or reasoning. Its expander applies
    the same rules (reasoning always expected), so this is also why it skips a conversation."""
    if row.get("error") is not None:
        return "failed"
    conversation = conversation_record(row)["conversations"]
    expected, seen_user = {"user"}, False
    for message in conversation:
        role, content = message["role"], message.get("content")
        if not isinstance(content, str) or not (content.strip() or message.get("tool_calls") or role == "tool"):
            return "empty answer" if role == "assistant" else f"empty {role} message"
        if role == "system" and not seen_user:
            continue
        if role not in expected:
            return "role order"
        seen_user = True
        expected = {"user": {"assistant"}, "tool": {"tool", "assistant", "user"},
                    "assistant": {"tool"} if message.get("tool_calls") else {"user"}}.get(role, set())
        if role != "assistant":
            continue
        reasoning = message.get("reasoning_content")
        if expect_reasoning and not (reasoning or "").strip():
            return "no reasoning"
        if any(m in text.lower() for m in THINK_MARKERS for text in (content, reasoning or "")):
            return "think markers"
    return None if conversation[-1]["role"] == "assistant" else "role order"


def history_kept(row: dict) -> tuple[bool, bool]:
    """Where an event's history keeps earlier steps' reasoning (chat turns, agent-loop steps): an
    agentic row's where its requests sent it back; a chat row's nowhere, as SpecForge's expander
    writes them."""
    agentic = row_tools(row) or any(m["role"] == "tool" or m.get("tool_calls") for m in row_messages(row))
    return reasoning_sent_at(row.get("history_reasoning")) if agentic else (False, False)


def event_records(record: dict, source_row_index: int, kept: tuple[bool, bool] = (False, False)) -> list[dict]:
    """The generation events of one conversation record, as SpecForge's expander writes them
    (``kept``: :func:`history_kept`)."""
    history: list[dict[str, Any]] = []
    events = []
    tools = {"tools": record["tools"]} if record.get("tools") else {}
    for message in record["conversations"]:
        if message["role"] != "assistant":
            history.append(dict(message))
            continue
        turn = sum(1 for m in history if m["role"] == "assistant")
        events.append({"id": f"{record['id']}#turn{turn}", "source_id": record["id"],
                       "source_row_index": source_row_index, "assistant_turn_index": turn,
                       "conversations": [dict(m) for m in served_history(history, kept)] + [dict(message)],
                       "status": record["status"], **tools})
        history.append(dict(message))
    return events


def event_rows(row: dict) -> list[dict]:
    """The row's events as rows the audit reads: each assistant turn the last message of its own
    sample, its history visible content only, each with the engine's token ids of its own request
    (where the row has them per turn)."""
    messages = row_messages(row)
    outcomes = list(row.get("turns") or [])
    kept = history_kept(row)
    history: list[dict] = []
    events = []
    blank = {"prompt_token_ids": None, "completion_token_ids": None, "turns": None}
    for message in messages:
        if message["role"] != "assistant":
            history.append(message)
            continue
        k = len(events)
        outcome = outcomes[k] if k < len(outcomes) - 1 else {}
        calls = message.get("tool_calls")
        events.append({**row, **blank, "id": f"{row['id']}#turn{k}", "source_id": row["id"],
                       "messages": served_history(history, kept), "reasoning_content": message.get("reasoning_content"),
                       "content": message.get("content"), "tool_calls": json.dumps(calls) if calls else None,
                       "finish_reason": outcome.get("finish_reason", "stop"),
                       "completion_tokens": outcome.get("completion_tokens"),
                       "completion_token_ids": outcome.get("completion_token_ids"),
                       "prompt_token_ids": outcome.get("prompt_token_ids"), "last_step": False})
        history.append({"role": "assistant", "content": message.get("content"),
                        "reasoning_content": message.get("reasoning_content")} | ({"tool_calls": calls} if calls else {}))
    events.append({**row, "turns": None, "id": f"{row['id']}#turn{len(events)}", "source_id": row["id"],
                   "messages": served_history(history, kept), "last_step": True, "row_steps": len(outcomes)})
    return events


def training_samples(rows: list[dict], train_layout: TrainLayout, default_thinking: bool,
                     template_thinks: bool = True) -> list[dict]:
    """The samples training will see, one verdict for the export and the audit: a failed row or
    one the export leaves out is one sample (marked ``left_out`` with the reason), the others
    one sample per row (conversation) or per assistant turn (events). Reasoning is expected of
    a row that asked for thinking, and of every row when the training template is a thinking
    one (``template_thinks``): data made with thinking off fails there, the seed's lesson."""
    out = []
    for row in rows:
        thinking = asked_thinking(row, default_thinking)
        reason = why_left_out(row, expect_reasoning=thinking or template_thinks or train_layout == "events")
        if row.get("error") is not None:
            out.append(row)
        elif reason is not None:
            out.append({**row, "left_out": reason})
        elif train_layout == "events":
            out.extend(event_rows(row))
        else:
            out.append(row)
    return out
