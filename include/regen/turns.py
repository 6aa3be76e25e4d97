"""Conversations whose every assistant message is regenerated, in order, one step each.

As SpecForge's regenerate_train_data.py does, a conversation is replayed step by step: every
assistant message of the dataset is a step, and so is the answer after its last user message or
tool result. The request for step k holds the conversation's own system, user and tool messages
before its k-th assistant message, each earlier assistant message replaced by the model's own
step: its visible content and its tool calls, and its reasoning where the model's chat template
renders it (``history_reasoning: template``; Qwen3's render the agent loop's steps after the
last user message with their reasoning and drop it from earlier chat turns): the history a
served model sees. The row keeps each earlier step with its reasoning: training needs it. The
dataset's original assistant text is never sent.

Agentic rows (regen.toolcalls) send the row's ``tools`` with every step. A recorded tool result
is spliced after the model's own call to the same function in the same position (its
``tool_call_id`` rewritten to the model's call id); tools are never executed. A step whose calls
are not the recorded ones (another function, none, or some where none were made) ends the
conversation there, not as an error: the row keeps that step as its last and says why in
``divergence``. Arguments that differ from the recorded ones are kept and counted, never fixed.
With ``regenerate_turns: last`` a conversation is one request, its history as the dataset has it.

A finished turn that is not the last is journaled as a *turn row* (``partial``); a conversation
cut mid-way resumes from its last finished turn, and it is done only when all its turns are. An
earlier turn that was truncated or came back empty ends the conversation as an error: no later
turn is built on an answer training would not use.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from typing import Any

from regen.toolcalls import compare_calls

ANSWER_FIELDS = ("reasoning_content", "content", "tool_calls", "finish_reason", "prompt_tokens",
                 "completion_tokens", "completion_token_ids", "prompt_token_ids")
EARLIER_TURN_CUT = "earlier turn unusable"  # how the error of such a conversation starts
TOOL_DIVERGENCE = "tool_divergence"  # how the divergence of such a conversation starts
SHARED_PREFIX_MIN_CHARS = 1000  # about 250 tokens: below it, a prefix cache hit saves little


@dataclass
class Conversation:
    """One prompt to regenerate: its id, its messages, the answers of the turns already done,
    and what to stamp on its rows."""

    id: str
    messages: list[dict]
    stamp: dict[str, Any] = field(default_factory=dict)
    answers: list[dict] = field(default_factory=list)
    all_turns: bool = True
    tools: list[dict] | None = None

    @property
    def turn_count(self) -> int:
        return steps(self.messages) if self.all_turns else 1

    def recorded_calls(self, step: int) -> list[dict] | None:
        """The calls the dataset's ``step``-th assistant message made (None: the last step)."""
        recorded = [m for m in self.messages if m["role"] == "assistant"]
        return (recorded[step].get("tool_calls") or []) if step < len(recorded) else None

    def shared_prefix_key(self) -> str | None:
        """A key for the prefix this conversation may share with others (its system prompt and
        tools), when that prefix is long enough for a server's prefix cache to matter."""
        system = [m.get("content") for m in self.messages[:1] if m["role"] == "system"]
        text = json.dumps([system, self.tools], ensure_ascii=False) if (system or self.tools) else ""
        if len(text) < SHARED_PREFIX_MIN_CHARS:
            return None
        return "prefix:" + hashlib.sha1(text.encode()).hexdigest()[:16]

    @property
    def turns_left(self) -> int:
        return self.turn_count - len(self.answers)

    def request_messages(self, send_reasoning: tuple[bool, bool] = (False, False)) -> list[dict]:
        """The messages of the next step's request: earlier steps' visible content and calls, and
        their reasoning where ``send_reasoning`` says (chat turns, agent-loop steps)."""
        return served_history(self._history(with_reasoning=any(send_reasoning)), send_reasoning)

    def _history(self, with_reasoning: bool) -> list[dict]:
        """The messages before the next step: the model's own steps in place of the dataset's
        assistant messages, each recorded result answering the model's call in its position."""
        if not self.all_turns:
            return self.messages
        out: list[dict] = []
        own_id: dict[str, str] = {}  # recorded call id -> the model's call id in that position
        step = 0
        for message in self.messages:
            if message["role"] == "tool":
                out.append({**message, "tool_call_id": own_id.get(message.get("tool_call_id"),
                                                                  message.get("tool_call_id"))})
                continue
            if message["role"] != "assistant":
                out.append(message)
                continue
            if step == len(self.answers):
                return out
            answer = self.answers[step]
            own = {"role": "assistant", "content": answer["content"] or ""}
            if answer.get("tool_calls"):
                own["tool_calls"] = answer["tool_calls"]
                own_id = {r["id"]: p["id"] for r, p in zip(message.get("tool_calls") or [], answer["tool_calls"])}
            if with_reasoning:
                own["reasoning_content"] = answer["reasoning_content"]
            out.append(own)
            step += 1
        return out

    def unusable(self, row: dict) -> str | None:
        """Why a finished step that is not the last cannot carry the conversation on, or None."""
        turn = len(self.answers)
        if row.get("finish_reason") == "length":
            return f"{EARLIER_TURN_CUT}: turn {turn} was truncated (finish_reason length); no later turn built on it"
        if not ((row.get("content") or "").strip() or row.get("tool_calls")):
            return f"{EARLIER_TURN_CUT}: turn {turn} came back with an empty answer; no later turn built on it"
        return None

    def divergence(self, row: dict) -> str | None:
        """Why a finished step that is not the last cannot take the recorded results (its calls
        are not the recorded ones), or None."""
        reason, _ = compare_calls(row.get("tool_calls"), self.recorded_calls(len(self.answers)))
        return None if reason is None else f"{TOOL_DIVERGENCE}: step {len(self.answers)}: {reason}"

    def add_answer(self, row: dict) -> dict:
        """Take a finished step that is not the last; its record for the journal."""
        answer = {k: row.get(k) for k in ANSWER_FIELDS}
        self.answers.append(answer)
        return {"id": self.id, "partial": True, "turn": len(self.answers) - 1, **answer, **self.stamp}

    def conversation_row(self, row: dict, divergence: str | None = None) -> dict:
        """The dataset's row: the last step's answer after the conversation with every earlier
        step and its reasoning, every step's outcome, and for an agentic row what was spliced."""
        done = self.answers + ([{k: row.get(k) for k in ANSWER_FIELDS}] if row["error"] is None else [])
        messages = self._history(with_reasoning=True)
        out = {**row, "messages": [_stored(m) for m in messages],
               "turns": [{"finish_reason": a["finish_reason"], "prompt_tokens": a["prompt_tokens"],
                          "completion_tokens": a["completion_tokens"],
                          "completion_token_ids": a.get("completion_token_ids"),
                          "prompt_token_ids": a.get("prompt_token_ids")} for a in done]}
        if self.tools or any(a.get("tool_calls") for a in done) or any(m["role"] == "tool" for m in messages):
            own = self.all_turns  # with regenerate_turns last, the history's calls and results are the dataset's
            out.update(tools=_json(self.tools), tool_calls=_json(row.get("tool_calls")), divergence=divergence,
                       spliced_results=sum(m["role"] == "tool" for m in messages) if own else 0,
                       argument_diffs=sum(compare_calls(a.get("tool_calls"), self.recorded_calls(k))[1]
                                          for k, a in enumerate(done)) if own else 0)
        else:
            out.pop("tool_calls", None)
        return out


def _json(value: Any) -> str | None:
    return None if value is None else json.dumps(value, ensure_ascii=False)


def _stored(message: dict) -> dict:
    """A message as a row's Parquet column holds it: tool calls as their JSON."""
    return {**message, "tool_calls": _json(message["tool_calls"])} if "tool_calls" in message else message


REASONING_POSITIONS = ("chat_turns", "tool_steps")


def served_history(messages: list[dict], send_reasoning: tuple[bool, bool]) -> list[dict]:
    """``messages`` as a request sends them: an assistant message's reasoning kept where
    ``send_reasoning`` says (a chat turn, before the last user message; an agent-loop step, after
    it), dropped elsewhere. Training's events of an agentic row use it too: the context each step
    was generated from."""
    users = [i for i, m in enumerate(messages) if m["role"] == "user"]
    last_user = users[-1] if users else -1

    def sent(i: int, message: dict) -> dict:
        if "reasoning_content" not in message or (send_reasoning[i > last_user] and message["reasoning_content"]):
            return message
        return {k: v for k, v in message.items() if k != "reasoning_content"}
    return [sent(i, m) for i, m in enumerate(messages)]


def reasoning_positions(send_reasoning: tuple[bool, bool]) -> str | None:
    """How a row records where its requests carried earlier reasoning (Row.history_reasoning)."""
    return ",".join(name for name, on in zip(REASONING_POSITIONS, send_reasoning) if on) or None


def reasoning_sent_at(recorded: str | None) -> tuple[bool, bool]:
    names = set((recorded or "").split(","))
    return REASONING_POSITIONS[0] in names, REASONING_POSITIONS[1] in names


def steps(messages: list[dict]) -> int:
    """How many requests regenerate a conversation: one per assistant message, and the answer
    after the last user message or tool result (for a chat, one per user message)."""
    return sum(1 for m in messages if m["role"] == "assistant") + 1


def resumed_answers(turn_rows: list[dict]) -> list[dict]:
    """The answers of turns 0, 1, ... a journal holds for one conversation (a later record of a
    turn wins; the list stops at the first turn missing)."""
    by_turn = {row["turn"]: {k: row.get(k) for k in ANSWER_FIELDS} for row in turn_rows}
    answers = []
    while len(answers) in by_turn:
        answers.append(by_turn[len(answers)])
    return answers
