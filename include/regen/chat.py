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


QWEN = ChatFormat()


def assistant_spans(text: str, fmt: ChatFormat = QWEN) -> list[tuple[int, int]]:
    """Character [start, end) of each assistant span: after the header, through the end-of-turn
    marker, or to the end of the text. The same spans as SpecForge's regex, found with str.find
    (a lazy regex over a long trace is the slowest step of the audit)."""
    spans = []
    header, eot = fmt.assistant_header, fmt.end_of_turn
    at = text.find(header)
    while at != -1:
        start = at + len(header)
        stop = text.find(eot, start)
        end = len(text) if stop == -1 else stop + len(eot)
        spans.append((start, end))
        at = text.find(header, end)
    return spans


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
            first = _token_starting_at(enc, len(text), start)
            last = _token_starting_at(enc, len(text), end)
            if first is None or last is None:
                first = len(tokenizer.encode(text[:start], add_special_tokens=False))
                last = len(tokenizer.encode(text[:end], add_special_tokens=False))
            spans.append((first, max(first, last)))
        out.append(spans)
    return out


def _token_starting_at(enc, text_len: int, char: int) -> int | None:
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


def loss_token_counts(tokenizer, texts: Sequence[str], fmt: ChatFormat = QWEN) -> list[int]:
    """Loss tokens of each rendered conversation: counted piece by piece where the tokenizer
    allows it (see PieceCounter), else from one batched encoding."""
    counter = PieceCounter.for_tokenizer(tokenizer)
    counts: list[int | None] = [None] * len(texts)
    if counter is not None:
        for i, text in enumerate(texts):
            counts[i] = counter.count_spans(text, assistant_spans(text, fmt))
    rest = [i for i, n in enumerate(counts) if n is None]
    if rest:
        for i, spans in zip(rest, loss_spans(tokenizer, [texts[i] for i in rest], fmt)):
            counts[i] = sum(last - first for first, last in spans)
    return counts  # type: ignore[return-value]


# GPT-2's pre-tokenizer pattern: what a ByteLevel pre-tokenizer with use_regex applies.
_GPT2_SPLIT = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""


def _bytes_to_unicode() -> list[str]:
    """The byte-level BPE alphabet: each byte as the printable character BPE vocabularies use."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(
        range(ord("®"), ord("ÿ") + 1))
    table, extra = {}, 0
    for byte in range(256):
        if byte in printable:
            table[byte] = chr(byte)
        else:
            table[byte] = chr(256 + extra)
            extra += 1
    return [table[b] for b in range(256)]


class PieceCounter:
    """Counts a byte-level BPE tokenizer's tokens without building encodings.

    A byte-level BPE never merges across the pieces its pre-tokenizer splits (nor across added
    tokens), so the tokens of a span are the sum of its pieces' tokens, and a piece's count can be
    cached: natural text repeats its pieces. That makes the audit's count several times cheaper
    than encoding. It applies only to tokenizers whose pipeline it reproduces exactly (BPE model;
    NFC or no normalizer; a ByteLevel pre-tokenizer, alone or after one regex Split; plain added
    tokens); a span edge inside a piece, or text that NFC would change, returns None and the
    caller encodes that sample instead.
    """

    _cache: dict[int, "PieceCounter | None"] = {}
    MAX_PIECES = 1_000_000

    def __init__(self, model, split_pattern: str, added: list[str], nfc: bool):
        import regex

        self.model = model
        self.split = regex.compile(split_pattern)
        self.added = regex.compile("|".join(regex.escape(a) for a in sorted(added, key=len, reverse=True)))
        self.nfc = nfc
        self.byte_chars = _bytes_to_unicode()
        self.counts: dict[str, int] = {}

    @classmethod
    def for_tokenizer(cls, tokenizer) -> "PieceCounter | None":
        key = id(tokenizer)
        if key not in cls._cache:
            cls._cache[key] = cls._build(tokenizer)
        return cls._cache[key]

    @classmethod
    def _build(cls, tokenizer) -> "PieceCounter | None":
        import json

        from tokenizers import models

        rust = tokenizer._tokenizer
        model = rust.model
        if not isinstance(model, models.BPE) or model.dropout or model.byte_fallback:
            return None
        normalizer = json.loads(rust.normalizer.__getstate__()) if rust.normalizer else None
        if normalizer is not None and normalizer.get("type") != "NFC":
            return None
        pre = json.loads(rust.pre_tokenizer.__getstate__()) if rust.pre_tokenizer else {}
        pattern = None
        if pre.get("type") == "ByteLevel" and pre.get("use_regex") and not pre.get("add_prefix_space"):
            pattern = _GPT2_SPLIT
        elif pre.get("type") == "Sequence" and len(pre.get("pretokenizers", [])) == 2:
            split, byte_level = pre["pretokenizers"]
            if (split.get("type") == "Split" and "Regex" in split.get("pattern", {})
                    and split.get("behavior") == "Isolated" and not split.get("invert")
                    and byte_level.get("type") == "ByteLevel" and not byte_level.get("use_regex")
                    and not byte_level.get("add_prefix_space")):
                pattern = split["pattern"]["Regex"]
        added = list(rust.get_added_tokens_decoder().values())
        if pattern is None or any(a.lstrip or a.rstrip or a.single_word or a.normalized for a in added):
            return None
        return cls(model, pattern, [a.content for a in added], nfc=normalizer is not None)

    def _piece_tokens(self, piece: str) -> int:
        count = self.counts.get(piece)
        if count is None:
            if len(self.counts) >= self.MAX_PIECES:
                self.counts.clear()
            mapped = "".join(self.byte_chars[b] for b in piece.encode("utf-8"))
            count = self.counts[piece] = len(self.model.tokenize(mapped))
        return count

    def count_spans(self, text: str, spans: list[tuple[int, int]]) -> int | None:
        """Tokens inside the spans; None where that cannot be told exactly without encoding."""
        import bisect
        import unicodedata

        # Units: the added tokens, and the plain segments between them (start, end, tokens).
        units: list[tuple[int, int, int, list[str] | None]] = []
        pos = 0
        for match in [*self.added.finditer(text), None]:
            seg_end = match.start() if match else len(text)
            if seg_end > pos:
                segment = text[pos:seg_end]
                if self.nfc and not unicodedata.is_normalized("NFC", segment):
                    return None
                pieces = self.split.findall(segment)
                if sum(map(len, pieces)) != len(segment):  # the pattern left a gap
                    return None
                known = list(map(self.counts.get, pieces))
                if None in known:
                    known = [self._piece_tokens(p) if n is None else n for p, n in zip(pieces, known)]
                units.append((pos, seg_end, sum(known), pieces))
            if match:
                units.append((match.start(), match.end(), 1, None))
                pos = match.end()
        starts = [u[0] for u in units]
        before = [0]
        for unit in units:
            before.append(before[-1] + unit[2])

        def tokens_before(char: int) -> int | None:
            k = bisect.bisect_right(starts, char) - 1
            if k < 0 or char >= len(text):
                return before[-1] if char >= len(text) else 0
            unit_start, _, _, pieces = units[k]
            if char == unit_start:
                return before[k]
            if pieces is None:
                return None  # inside an added token
            offset, count = unit_start, before[k]
            for piece in pieces:
                if offset == char:
                    return count
                if offset > char:
                    return None  # inside a piece
                offset += len(piece)
                count += self.counts.get(piece) or self._piece_tokens(piece)
            return count if offset == char else None

        total = 0
        for start, end in spans:
            first, last = tokens_before(start), tokens_before(end)
            if first is None or last is None:
                return None
            total += last - first
        return total


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
    spans = [full[start:end] for start, end in assistant_spans(full, fmt)]
    if not spans:
        problems.append(f"rendered conversation has no assistant span {fmt.assistant_header!r}")
    elif enable_thinking and "Two plus two is four." not in spans[-1]:
        problems.append("chat template drops reasoning_content from the final assistant turn")
    elif not spans[-1].endswith(fmt.end_of_turn):
        problems.append(f"assistant turn does not end with {fmt.end_of_turn!r}")
    return problems
