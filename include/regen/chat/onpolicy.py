"""The on-policy certificate: is the sample training will see exactly what the engine was served
and generated, token for token?

A drafter learns the target's behaviour on the contexts it is trained on. A sample is token-exact
on-policy when its training render, up to where the last assistant turn's generation starts,
is the engine's ``prompt_token_ids``, and the rest of that turn is its ``completion_token_ids``
(then the end-of-turn's trailing newline the engine does not generate). When it is not, the
first of these says why:

- ``retokenization``: the same text, other tokens (the render re-encodes what was generated);
- ``history_reasoning``: they differ only inside think blocks (earlier reasoning sent back
  where the training template drops it, or the reverse);
- ``system_prompt``: one is the other with a system prompt before it (the training template's
  default, SpecForge's ``qwen3-thinking`` adds one, that the engine never saw);
- ``template_drift``: anything else (the training template is not the one the engine served).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Sequence

from regen.chat.loss import assistant_spans, token_starting_at
from regen.chat.templates import ChatFormat

REASONS = {
    "retokenization": "the same text, re-encoded to other tokens",
    "history_reasoning": "earlier reasoning the engine was sent and training drops (or the reverse)",
    "system_prompt": "a system prompt on one side only (the training template's default)",
    "template_drift": "the training template renders what the engine was served differently",
}


@dataclass(frozen=True)
class Served:
    """What the engine was served and generated for a sample's last assistant turn."""

    prompt_ids: Sequence[int] | None
    completion_ids: Sequence[int] | None
    ended: bool  # it generated the end of its turn (finish_reason stop or tool_calls)
    prefill: str  # what the generation prompt put after the assistant header


@dataclass(frozen=True)
class Certificate:
    """The verdict on one sample; ``generation`` is the token range of the last turn's
    generated part in the training ids."""

    prompt_exact: bool | None  # None: the engine returned no prompt ids, nothing to certify
    completion_exact: bool
    prompt_reason: str | None
    completion_reason: str | None
    generation: tuple[int, int]

    @property
    def verdict(self) -> str | None:
        """``exact``, the reason it is not, or None when it cannot be told."""
        if self.prompt_exact is None:
            return None
        return "exact" if self.prompt_exact and self.completion_exact else self.prompt_reason or self.completion_reason


def certify(tokenizer, texts: Sequence[str], fmt: ChatFormat, served: Sequence[Served | None]) -> list[Certificate | None]:
    """Per rendered sample, its certificate; None where the engine returned no token ids or the
    text has no assistant turn. One batched encoding for all of them."""
    todo = [i for i, s in enumerate(served) if s is not None and (s.prompt_ids is not None or s.completion_ids is not None)
            and assistant_spans(texts[i], fmt)]
    out: list[Certificate | None] = [None] * len(texts)
    encodings = tokenizer._tokenizer.encode_batch([texts[i] for i in todo], add_special_tokens=False) if todo else []
    after_eos = tokenizer.encode(fmt.after_eos, add_special_tokens=False) if fmt.after_eos else []
    for i, enc in zip(todo, encodings):
        out[i] = _certify_one(tokenizer, texts[i], enc, fmt, served[i], after_eos)
    return out


def _certify_one(tokenizer, text: str, enc, fmt: ChatFormat, served: Served, after_eos: list[int]) -> Certificate:
    ids = enc.ids
    start, end = assistant_spans(text, fmt)[-1]
    if served.prefill and text.startswith(served.prefill, start):
        start += len(served.prefill)

    def token_at(char: int) -> int:
        index = token_starting_at(enc, len(text), char)
        return index if index is not None else len(tokenizer.encode(text[:char], add_special_tokens=False))

    g, last = token_at(start), token_at(end)
    prompt = list(served.prompt_ids) if served.prompt_ids is not None else None
    prompt_exact = None if prompt is None else token_starting_at(enc, len(text), start) is not None and ids[:g] == prompt
    completion = list(served.completion_ids) if served.completion_ids is not None else None
    if completion is None:
        completion_exact, generated = True, []
    elif served.ended:
        generated = completion + after_eos
        completion_exact = ids[g:last] == generated
    else:
        generated = completion
        completion_exact = ids[g:g + len(completion)] == completion
    prompt_reason = why_differs(text[:start], tokenizer.decode(prompt), fmt) if prompt_exact is False else None
    completion_reason = None
    if not completion_exact:
        rendered = text[start:end] if served.ended else tokenizer.decode(ids[g:g + len(generated)])
        completion_reason = "retokenization" if tokenizer.decode(generated) == rendered else "template_drift"
    return Certificate(prompt_exact, completion_exact, prompt_reason, completion_reason, (g, last))


def why_differs(training: str, served: str, fmt: ChatFormat) -> str:
    """Why the training render's prompt part is not the served prompt, by the first explanation
    that fits their texts."""
    if training == served:
        return "retokenization"
    if _without_thinking(training, fmt) == _without_thinking(served, fmt):
        return "history_reasoning"
    if training.endswith(served) or served.endswith(training):
        return "system_prompt"
    return "template_drift"


def _without_thinking(text: str, fmt: ChatFormat) -> str:
    """The text with every closed think block removed."""
    return re.sub(re.escape(fmt.think_start) + ".*?" + re.escape(fmt.think_end) + r"\s*", "", text, flags=re.S)
