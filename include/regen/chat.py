"""The chat template and the loss mask, computed as SpecForge's training computes it.

Training (SpecForge ``ThinkingParser`` with the ``qwen3-thinking`` template) renders the whole
conversation with the model's chat template and the run's ``enable_thinking``, then trains on every
assistant span: from just after the assistant header through the end-of-turn marker and its
newline. A sample's *loss tokens* are the tokens of those spans. SpecForge counts them as
``len(encode(text[:end])) - len(encode(text[:start]))``; here one batched encoding with offsets
gives the same numbers, and a span whose edge falls inside a token falls back to SpecForge's own
prefix arithmetic so the two never disagree.
"""

from __future__ import annotations

import bisect
import re
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any, Sequence


@dataclass(frozen=True)
class ChatFormat:
    """The markers that delimit what training learns from (Qwen/ChatML family)."""

    assistant_header: str = "<|im_start|>assistant\n"
    end_of_turn: str = "<|im_end|>\n"
    think_start: str = "<think>"
    think_end: str = "</think>"

    @property
    def assistant_span(self) -> re.Pattern[str]:
        return re.compile(
            re.escape(self.assistant_header) + r"([\s\S]*?(?:" + re.escape(self.end_of_turn) + r"|$))"
        )


QWEN = ChatFormat()


@lru_cache(maxsize=8)
def load_tokenizer(model_dir: str):
    """A Hugging Face fast tokenizer with its chat template, from a local directory only."""
    from transformers import AutoTokenizer

    path = Path(model_dir)
    if not path.is_dir():
        raise FileNotFoundError(f"{model_dir}: tokenizer directory not found")
    tokenizer = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    if not tokenizer.is_fast:
        raise ValueError(f"{model_dir}: needs a fast tokenizer (tokenizer.json) for offsets")
    if not tokenizer.chat_template:
        raise ValueError(f"{model_dir}: the tokenizer has no chat template")
    return tokenizer


def training_messages(messages: Sequence[dict[str, Any]], reasoning: str | None,
                      content: str | None) -> list[dict[str, Any]]:
    """The conversation as training sees it: the request plus the generated assistant turn."""
    assistant: dict[str, Any] = {"role": "assistant", "content": content or ""}
    if reasoning is not None:
        assistant["reasoning_content"] = reasoning
    return [{"role": m["role"], "content": m["content"]} for m in messages] + [assistant]


def render(tokenizer, conversations: Sequence[list[dict[str, Any]]], enable_thinking: bool) -> list[str]:
    if not conversations:
        return []
    rendered = tokenizer.apply_chat_template(
        list(conversations), tokenize=False, add_generation_prompt=False,
        enable_thinking=enable_thinking,
    )
    return rendered if isinstance(rendered, list) else [rendered]


def render_generation_prompt(tokenizer, messages: list[dict[str, Any]], enable_thinking: bool) -> str:
    return tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True, enable_thinking=enable_thinking
    )


def loss_masks(tokenizer, texts: Sequence[str], fmt: ChatFormat = QWEN) -> list[list[int]]:
    """Per token of each rendered conversation: 1 where training learns, else 0.

    One batched encoding with offsets; a span edge that falls inside a token falls back to
    SpecForge's prefix arithmetic for that span, so the two never disagree.
    """
    if not texts:
        return []
    encodings = tokenizer._tokenizer.encode_batch(list(texts), add_special_tokens=False)
    pattern = fmt.assistant_span
    masks = []
    for text, enc in zip(texts, encodings):
        offsets = enc.offsets
        starts = [s for s, _ in offsets]
        mask = [0] * len(offsets)
        for match in pattern.finditer(text):
            first = _token_at(starts, offsets, match.start(1))
            last = _token_at(starts, offsets, match.end(1))
            if first is None or last is None:
                first = len(tokenizer.encode(text[: match.start(1)], add_special_tokens=False))
                last = len(tokenizer.encode(text[: match.end(1)], add_special_tokens=False))
            mask[first:last] = [1] * max(0, min(last, len(mask)) - first)
        masks.append(mask)
    return masks


def loss_token_counts(tokenizer, texts: Sequence[str], fmt: ChatFormat = QWEN) -> list[int]:
    return [sum(mask) for mask in loss_masks(tokenizer, texts, fmt)]


def _token_at(starts: list[int], offsets: list[tuple[int, int]], char: int) -> int | None:
    """Index of the first token starting at or after ``char``; None when ``char`` splits a token."""
    i = bisect.bisect_left(starts, char)
    if i > 0 and offsets[i - 1][1] > char:
        return None
    return i


def template_problems(tokenizer, enable_thinking: bool, fmt: ChatFormat = QWEN) -> list[str]:
    """What in the chat template would make the loss mask wrong; empty when it is fine."""
    probe = [{"role": "user", "content": "What is 2 + 2?"}]
    problems = []
    try:
        prompt = render_generation_prompt(tokenizer, probe, enable_thinking)
        full = render(tokenizer, [training_messages(probe, "Two plus two is four.", "4")],
                      enable_thinking)[0]
    except Exception as exc:  # a template error is a finding, whatever its type
        return [f"chat template fails to render: {type(exc).__name__}: {exc}"]
    if not prompt.endswith(fmt.assistant_header) and fmt.assistant_header not in prompt:
        problems.append(f"generation prompt has no assistant header {fmt.assistant_header!r}")
    empty_think = f"{fmt.think_start}\n\n{fmt.think_end}"
    if enable_thinking and prompt.rstrip().endswith(empty_think):
        problems.append(
            "chat template pre-fills an empty think block with enable_thinking=true: "
            "the model would answer without reasoning"
        )
    spans = [m.group(1) for m in fmt.assistant_span.finditer(full)]
    if not spans:
        problems.append(f"rendered conversation has no assistant span {fmt.assistant_header!r}")
    elif enable_thinking and "Two plus two is four." not in spans[-1]:
        problems.append("chat template drops reasoning_content from the final assistant turn")
    elif not spans[-1].endswith(fmt.end_of_turn):
        problems.append(f"assistant turn does not end with {fmt.end_of_turn!r}")
    return problems
