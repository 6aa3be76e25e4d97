"""The loss mask, computed as SpecForge's training computes it.

Training (SpecForge's parser with the run's template) renders the whole conversation, then trains
on every assistant span: from just after the assistant header through the end-of-turn marker and
its newline. A sample's *loss tokens* are the tokens of those spans. SpecForge counts them as
``len(encode(text[:end])) - len(encode(text[:start]))``; here token positions are counted piece
by piece (regen.chat.pieces) or taken from one batched encoding, and a span edge that falls inside
a token falls back to SpecForge's own prefix arithmetic, so the two never disagree.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator, Sequence

from regen.chat.pieces import PieceCounter
from regen.chat.templates import QWEN, ChatFormat


def assistant_spans(text: str, fmt: ChatFormat = QWEN) -> list[tuple[int, int]]:
    """Character [start, end) of each assistant span: after the header (and the format's
    ``skip_after_header`` when it follows), through the first end marker, or to the end of the
    text. The same spans as SpecForge's regex, found with str.find (a lazy regex over a long
    trace is the slowest step of the audit)."""
    spans = []
    header, skip = fmt.assistant_header, fmt.skip_after_header
    ends = (fmt.end_of_turn, *fmt.also_ends)
    at = text.find(header)
    while at != -1:
        start = at + len(header)
        if skip and text.startswith(skip, start):
            start += len(skip)
        end = len(text)
        for marker in ends:
            stop = text.find(marker, start, end)
            if stop != -1:
                end = stop + len(marker)
        spans.append((start, end))
        at = text.find(header, end)
    return spans


def loss_spans(tokenizer, texts: Sequence[str], fmt: ChatFormat = QWEN) -> list[list[tuple[int, int]]]:
    """Per rendered conversation, the [first, last) token index of each assistant span.

    One batched encoding (Rust, every core); each span edge maps to a token in O(1). An edge that
    falls inside a token falls back to SpecForge's prefix arithmetic for that span, so the two
    never disagree.
    """
    if not texts:
        return []
    encodings = tokenizer._tokenizer.encode_batch(list(texts), add_special_tokens=False)
    out = []
    for text, enc in zip(texts, encodings):
        spans = []
        for start, end in assistant_spans(text, fmt):
            first = token_starting_at(enc, len(text), start)
            last = token_starting_at(enc, len(text), end)
            if first is None or last is None:
                first = len(tokenizer.encode(text[:start], add_special_tokens=False))
                last = len(tokenizer.encode(text[:end], add_special_tokens=False))
            spans.append((first, max(first, last)))
        out.append(spans)
    return out


def token_starting_at(enc, text_len: int, char: int) -> int | None:
    """Index of the token that starts exactly at ``char`` (the token count at the end of the
    text); None when ``char`` falls inside a token."""
    if char >= text_len:
        return len(enc)
    index = enc.char_to_token(char)
    if index is None or enc.token_to_chars(index)[0] != char:
        return None
    return index


def loss_masks(tokenizer, texts: Sequence[str], fmt: ChatFormat = QWEN) -> list[list[int]]:
    """Per token of each rendered conversation: 1 where training learns, else 0."""
    encodings = tokenizer._tokenizer.encode_batch(list(texts), add_special_tokens=False)
    masks = []
    for enc, spans in zip(encodings, loss_spans(tokenizer, texts, fmt)):
        mask = [0] * len(enc)
        for first, last in spans:
            mask[first:last] = [1] * (last - first)
        masks.append(mask)
    return masks


def training_tokens(tokenizer, text: str, fmt: ChatFormat = QWEN, ignore: Sequence[str] = (),
                    last_turn_only: bool = False) -> tuple[list[int], list[int], list[tuple[int, int]]]:
    """(input_ids, loss_mask, the token range of each trained span) of one rendered conversation,
    as SpecForge's parser makes them: the whole text encoded, the spans set, ``ignore`` strings'
    tokens cleared (positions by its own prefix arithmetic where an edge falls inside a token)."""
    enc = tokenizer._tokenizer.encode(text, add_special_tokens=False)

    def token_at(char: int) -> int:
        index = token_starting_at(enc, len(text), char)
        return index if index is not None else len(tokenizer.encode(text[:char], add_special_tokens=False))

    spans = assistant_spans(text, fmt)
    ranges = [(token_at(a), token_at(b)) for a, b in (spans[-1:] if last_turn_only else spans)]
    mask = [0] * len(enc.ids)
    for first, last in ranges:
        mask[first:last] = [1] * max(0, min(last, len(mask)) - first)
    for token in ignore:
        for at in _occurrences(text, token):
            first, last = token_at(at), token_at(at + len(token))
            mask[first:last] = [0] * max(0, min(last, len(mask)) - first)
    return list(enc.ids), mask, ranges


@dataclass(frozen=True)
class LossCount:
    """A rendered conversation's loss tokens as training sees them (after the cut at its max
    length), before the cut, and its length in tokens."""

    loss: int
    uncut: int
    total: int


def loss_token_counts(tokenizer, texts: Sequence[str], fmt: ChatFormat = QWEN, max_length: int | None = None,
                      ignore: Sequence[str] = (), last_turn_only: bool = False) -> list[LossCount]:
    """Loss tokens of each rendered conversation, as SpecForge's parser computes them: assistant
    spans set (only the last with ``train_only_last_turn``), ``ignore`` strings' tokens cleared,
    everything from ``max_length`` on cut. Token positions are counted piece by piece where the
    tokenizer allows it (see PieceCounter), else taken from one batched encoding, else from
    SpecForge's own prefix arithmetic."""
    counter = PieceCounter.for_tokenizer(tokenizer)
    plans = []
    for text in texts:
        spans = assistant_spans(text, fmt)
        spans = spans[-1:] if last_turn_only else spans
        ignored = [(at, at + len(token)) for token in ignore for at in _occurrences(text, token)]
        chars = sorted({c for span in spans + ignored for c in span} | {len(text)})
        plans.append((spans, ignored, chars))
    positions: list[dict[int, int] | None] = [None] * len(texts)
    if counter is not None:
        for i, (text, (_, _, chars)) in enumerate(zip(texts, plans)):
            found = counter.positions(text, chars)
            positions[i] = dict(zip(chars, found)) if found is not None else None
    rest = [i for i, p in enumerate(positions) if p is None]
    if rest:
        encodings = tokenizer._tokenizer.encode_batch([texts[i] for i in rest], add_special_tokens=False)
        for i, enc in zip(rest, encodings):
            text, found = texts[i], {}
            for char in plans[i][2]:
                index = token_starting_at(enc, len(text), char)
                found[char] = index if index is not None else len(
                    tokenizer.encode(text[:char], add_special_tokens=False))
            positions[i] = found
    out = []
    for text, (spans, ignored, _), pos in zip(texts, plans, positions):
        total = pos[len(text)]
        tokens = [(pos[a], pos[b]) for a, b in spans]
        cleared = [(pos[a], pos[b]) for a, b in ignored]
        out.append(LossCount(_covered(tokens, cleared, min(total, max_length or total)),
                             _covered(tokens, cleared, total), total))
    return out


def _occurrences(text: str, token: str) -> Iterator[int]:
    at = text.find(token)
    while at != -1:
        yield at
        at = text.find(token, at + len(token))


def _covered(spans: list[tuple[int, int]], cleared: list[tuple[int, int]], limit: int) -> int:
    """Token positions under ``limit`` inside a span and outside every cleared range."""
    marks = bytearray(limit)
    for first, last in spans:
        marks[min(first, limit):min(last, limit)] = b"\x01" * max(0, min(last, limit) - min(first, limit))
    for first, last in cleared:
        marks[min(first, limit):min(last, limit)] = bytes(max(0, min(last, limit) - min(first, limit)))
    return marks.count(1)
