"""Export the dataset as the JSONL that SpecForge and DFlash training read.

The shape is what SpecForge's ``scripts/regenerate_train_data.py`` writes:
``{"id", "conversations": [{"role", "content", "reasoning_content"?}, ...], "status": "success"}``,
one line per prompt, every regenerated assistant turn with its reasoning. Rows that would fail
``scripts/validate_regenerated_data.py --expect-reasoning --strict-think-markers`` (failed
prompts, empty messages, roles out of order, an assistant turn without reasoning, leftover think
markers) are left out and counted, so the file passes that validator as written.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from regen.audit import iter_batches
from regen.layout import RunLayout

THINK_MARKERS = ("<think>", "</think>")


@dataclass
class ExportResult:
    path: Path
    written: int = 0
    left_out: Counter = field(default_factory=Counter)

    def summary(self) -> str:
        reasons = ", ".join(f"{reason} {n:,}" for reason, n in self.left_out.most_common())
        return (f"wrote {self.written:,} conversations to {self.path}; left out "
                f"{sum(self.left_out.values()):,}" + (f" ({reasons})" if reasons else ""))


def why_left_out(row: dict, expect_reasoning: bool) -> str | None:
    """Why SpecForge's validator (``--expect-reasoning --strict-think-markers``) would refuse the
    row's conversation, or None: every message non-empty, an optional system prompt first, then
    user and assistant alternating from a user turn to an assistant turn, every assistant turn
    with non-empty reasoning and no think marker in its answer or reasoning."""
    if row.get("error") is not None:
        return "failed"
    conversation = sharegpt_record(row)["conversations"]
    expected, seen_user = "user", False
    for message in conversation:
        role, content = message["role"], message.get("content")
        if not isinstance(content, str) or not content.strip():
            return "empty answer" if role == "assistant" else f"empty {role} message"
        if role == "system" and not seen_user:
            continue
        if role != expected:
            return "role order"
        seen_user = True
        expected = "assistant" if role == "user" else "user"
        if role != "assistant":
            continue
        reasoning = message.get("reasoning_content")
        if expect_reasoning and not (reasoning or "").strip():
            return "no reasoning"
        if any(m in text.lower() for m in THINK_MARKERS for text in (content, reasoning or "")):
            return "think markers"
    return None if conversation[-1]["role"] == "assistant" else "role order"


def sharegpt_record(row: dict) -> dict:
    """Every regenerated turn, each assistant turn with its reasoning, then the last one."""
    messages = row["messages"]
    if hasattr(messages, "tolist"):
        messages = messages.tolist()
    conversations = []
    for m in [*messages, {"role": "assistant", "content": row["content"],
                          "reasoning_content": row.get("reasoning_content")}]:
        message = {"role": m["role"], "content": m["content"]}
        if m["role"] == "assistant" and m.get("reasoning_content") is not None:
            message["reasoning_content"] = m["reasoning_content"]
        conversations.append(message)
    return {"id": str(row["id"]), "conversations": conversations, "status": "success"}


def export_sharegpt(data_dir: str | Path, out: str | Path, expect_reasoning: bool = True) -> ExportResult:
    """Stream the shards into ``out``, written beside it and renamed into place when complete."""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    result = ExportResult(out)
    fd, tmp = tempfile.mkstemp(prefix=f".{out.name}.", dir=out.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            for rows in iter_batches(RunLayout.from_data_arg(data_dir)):
                for row in rows:
                    reason = why_left_out(row, expect_reasoning)
                    if reason:
                        result.left_out[reason] += 1
                        continue
                    fh.write(json.dumps(sharegpt_record(row), ensure_ascii=False) + "\n")
                    result.written += 1
        os.replace(tmp, out)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return result
