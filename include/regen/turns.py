"""Conversations whose every assistant turn is regenerated, in order.

As SpecForge's regenerate_train_data.py does, a conversation is replayed user message by user
message: the request for turn k holds the conversation's own system, user and tool messages up
to its k-th user message, each earlier user message followed by the model's own answer, its
visible content only (the reasoning is never sent back: the same prompt on every engine, and
the history a served model sees). The row keeps each earlier answer with its reasoning: training
needs it. The dataset's original assistant text is never sent. With ``regenerate_turns: last`` a
conversation is one request, its history as the dataset has it.

A finished turn that is not the last is journaled as a *turn row* (``partial``); a conversation
cut mid-way resumes from its last finished turn, and it is done only when all its turns are. An
earlier turn that was truncated or came back empty ends the conversation as an error: no later
turn is built on an answer training would not use.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

ANSWER_FIELDS = ("reasoning_content", "content", "finish_reason", "prompt_tokens", "completion_tokens",
                 "completion_token_ids")
EARLIER_TURN_CUT = "earlier turn unusable"  # how the error of such a conversation starts


def user_turns(messages: list[dict]) -> int:
    return sum(1 for m in messages if m["role"] == "user")


@dataclass
class Conversation:
    """One prompt to regenerate: its id, its messages, the answers of the turns already done,
    and what to stamp on its rows."""

    id: str
    messages: list[dict]
    stamp: dict[str, Any] = field(default_factory=dict)
    answers: list[dict] = field(default_factory=list)
    all_turns: bool = True

    @property
    def turn_count(self) -> int:
        return user_turns(self.messages) if self.all_turns else 1

    @property
    def turns_left(self) -> int:
        return self.turn_count - len(self.answers)

    def request_messages(self) -> list[dict]:
        """The messages of the next turn's request: earlier answers' visible content only."""
        return self._history(with_reasoning=False)

    def _history(self, with_reasoning: bool) -> list[dict]:
        if not self.all_turns:
            return self.messages
        out: list[dict] = []
        users = 0
        for message in self.messages:
            if message["role"] == "assistant":
                continue
            out.append(message)
            if message["role"] == "user":
                if users == len(self.answers):
                    return out
                answer = self.answers[users]
                out.append({"role": "assistant", "content": answer["content"]}
                           | ({"reasoning_content": answer["reasoning_content"]} if with_reasoning else {}))
                users += 1
        return out

    def unusable(self, row: dict) -> str | None:
        """Why a finished turn that is not the last cannot carry the conversation on, or None."""
        turn = len(self.answers)
        if row.get("finish_reason") == "length":
            return f"{EARLIER_TURN_CUT}: turn {turn} was truncated (finish_reason length); no later turn built on it"
        if not (row.get("content") or "").strip():
            return f"{EARLIER_TURN_CUT}: turn {turn} came back with an empty answer; no later turn built on it"
        return None

    def add_answer(self, row: dict) -> dict:
        """Take a finished turn that is not the last; its record for the journal."""
        answer = {k: row.get(k) for k in ANSWER_FIELDS}
        self.answers.append(answer)
        return {"id": self.id, "partial": True, "turn": len(self.answers) - 1, **answer, **self.stamp}

    def conversation_row(self, row: dict) -> dict:
        """The dataset's row: the last turn's answer after the conversation with every earlier
        answer and its reasoning, and every turn's outcome."""
        done = self.answers + ([{k: row.get(k) for k in ANSWER_FIELDS}] if row["error"] is None else [])
        return {**row, "messages": self._history(with_reasoning=True),
                "turns": [{"finish_reason": a["finish_reason"], "prompt_tokens": a["prompt_tokens"],
                           "completion_tokens": a["completion_tokens"],
                           "completion_token_ids": a.get("completion_token_ids")} for a in done]}


def resumed_answers(turn_rows: list[dict]) -> list[dict]:
    """The answers of turns 0, 1, ... a journal holds for one conversation (a later record of a
    turn wins; the list stops at the first turn missing)."""
    by_turn = {row["turn"]: {k: row.get(k) for k in ANSWER_FIELDS} for row in turn_rows}
    answers = []
    while len(answers) in by_turn:
        answers.append(by_turn[len(answers)])
    return answers
