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
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from regen.chat.render import load_tokenizer
from regen.chat.templates import TRAIN_TEMPLATES
from regen.files import atomic_file
from regen.layout import RunLayout
from regen.rows import iter_batches

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
    def record(row: dict) -> tuple[dict | None, str | None]:
        reason = why_left_out(row, expect_reasoning)
        return (None, reason) if reason else (sharegpt_record(row), None)

    return _export(data_dir, out, record)


class TokenMasker:
    """Loss masks in token space, from the tokens the engine saw and produced: the generated
    tokens of the last turn, and the earlier assistant turns found in the prompt's tokens by the
    training template's header and end-of-turn tokens, each span through its end-of-turn (and
    the newline training adds after it)."""

    def __init__(self, tokenizer, template_name: str):

        fmt = TRAIN_TEMPLATES[template_name].fmt
        encode = lambda text: tokenizer.encode(text, add_special_tokens=False)  # noqa: E731
        self.header, self.end_of_turn = encode(fmt.assistant_header), encode(fmt.end_of_turn)
        self.after_eos = encode(fmt.after_eos)

    def __call__(self, prompt_ids: list[int], completion_ids: list[int], finished: bool) -> tuple[list[int], list[int]]:
        mask = [0] * len(prompt_ids)
        i, header, eot = 0, self.header, self.end_of_turn
        while i <= len(prompt_ids) - len(header):
            if prompt_ids[i:i + len(header)] != header:
                i += 1
                continue
            start = j = i + len(header)
            while j < len(prompt_ids) and prompt_ids[j:j + len(eot)] != eot:
                j += 1
            end = min(j + len(eot), len(prompt_ids))
            mask[start:end] = [1] * (end - start)
            i = max(end, i + 1)
        tail = self.after_eos if finished else []
        return prompt_ids + completion_ids + tail, mask + [1] * (len(completion_ids) + len(tail))


def export_tokens(data_dir: str | Path, out: str | Path, tokenizer_dir: str | Path,
                  template_name: str = "qwen3-thinking") -> ExportResult:
    """``{"id", "input_ids", "loss_mask"}`` per conversation, from the tokens the engine returned:
    what offline drafter training (EAGLE-3, DFlash) reads, with no re-tokenized text in it."""

    masker = TokenMasker(load_tokenizer(str(tokenizer_dir)), template_name)

    def record(row: dict) -> tuple[dict | None, str | None]:
        if row.get("error") is not None:
            return None, "failed"
        prompt_ids, completion_ids = row.get("prompt_token_ids"), row.get("completion_token_ids")
        if prompt_ids is None or completion_ids is None:
            return None, "no token ids (the engine did not return them)"
        ids, mask = masker(list(prompt_ids), list(completion_ids), row.get("finish_reason") == "stop")
        return {"id": str(row["id"]), "input_ids": ids, "loss_mask": mask}, None

    return _export(data_dir, out, record)


def _export(data_dir: str | Path, out: str | Path, record) -> ExportResult:
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    result = ExportResult(out)
    with atomic_file(out) as fh:
        for rows in iter_batches(RunLayout.from_data_arg(data_dir)):
            for row in rows:
                doc, reason = record(row)
                if reason:
                    result.left_out[reason] += 1
                    continue
                fh.write(json.dumps(doc, ensure_ascii=False) + "\n")
                result.written += 1
    return result
