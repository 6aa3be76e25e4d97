"""Export the dataset as the JSONL that SpecForge and DFlash training read.

The shape is what SpecForge's ``scripts/regenerate_train_data.py`` writes:
``{"id", "conversations": [{"role", "content", "reasoning_content"?}, ...], "status": "success"}``,
one line per prompt, ending with the regenerated assistant turn. Rows that would fail
``scripts/validate_regenerated_data.py --expect-reasoning --strict-think-markers`` (failed
prompts, empty answers, missing reasoning, leftover think markers) are left out and counted, so
the file passes that validator as written.
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
    if row.get("error") is not None:
        return "failed"
    content = row.get("content") or ""
    reasoning = row.get("reasoning_content")
    if not content.strip():
        return "empty answer"
    if expect_reasoning and not (reasoning or "").strip():
        return "no reasoning"
    if any(m in content or m in (reasoning or "") for m in THINK_MARKERS):
        return "think markers"
    return None


def sharegpt_record(row: dict) -> dict:
    messages = row["messages"]
    if hasattr(messages, "tolist"):
        messages = messages.tolist()
    assistant = {"role": "assistant", "content": row["content"]}
    if row.get("reasoning_content") is not None:
        assistant["reasoning_content"] = row["reasoning_content"]
    conversations = [{"role": m["role"], "content": m["content"]} for m in messages] + [assistant]
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
