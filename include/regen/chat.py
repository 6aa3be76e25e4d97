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
from typing import Any, Iterator, Sequence


@dataclass(frozen=True)
class ChatFormat:
    """The markers that delimit what training learns from (Qwen/ChatML family)."""

    assistant_header: str = "<|im_start|>assistant\n"
    end_of_turn: str = "<|im_end|>\n"
    think_start: str = "<think>"
    think_end: str = "</think>"

    @property
    def after_eos(self) -> str:
        """What training renders after the end-of-turn token, which the engine does not generate
        (the newline of ``<|im_end|>\n``)."""
        return self.end_of_turn[len(self.end_of_turn.rstrip("\n")):]


QWEN = ChatFormat()


@dataclass(frozen=True)
class TrainTemplate:
    """What SpecForge's data parser does with a conversation for one ``--chat-template`` name:
    the markers of what it trains on, the system prompt it adds when there is none, whether its
    parser keeps ``reasoning_content`` (ThinkingParser) or drops it (the general parser), whether
    it renders with ``enable_thinking=True``, and strings whose tokens it takes out of the mask."""

    fmt: ChatFormat
    system_prompt: str | None
    keeps_reasoning: bool
    enable_thinking: bool
    ignore: tuple[str, ...] = ()

    @property
    def message_keys(self) -> frozenset[str]:
        base = {"role", "content", "tool_calls"}
        return frozenset(base | {"reasoning_content", "name", "tool_call_id"} if self.keeps_reasoning else base)


_HELPFUL = "You are a helpful assistant."
TRAIN_TEMPLATES: dict[str, TrainTemplate] = {
    "qwen3-thinking": TrainTemplate(QWEN, _HELPFUL, keeps_reasoning=True, enable_thinking=True),
    "qwen3-next-thinking": TrainTemplate(ChatFormat(assistant_header="<|im_start|>assistant\n<think>\n"),
                                         _HELPFUL, keeps_reasoning=True, enable_thinking=True),
    "qwen": TrainTemplate(QWEN, _HELPFUL, keeps_reasoning=False, enable_thinking=False),
    "qwen3-instruct": TrainTemplate(QWEN, _HELPFUL, keeps_reasoning=False, enable_thinking=False,
                                    ignore=("<think>\n\n</think>\n\n",)),
}
DEFAULT_TRAIN_TEMPLATE = TRAIN_TEMPLATES["qwen3-thinking"]


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


def training_messages(messages: Sequence[dict[str, Any]], reasoning: str | None, content: str | None,
                      template: TrainTemplate = DEFAULT_TRAIN_TEMPLATE) -> list[dict[str, Any]]:
    """The conversation as training prepares it: the messages (earlier assistant turns with their
    own reasoning) and the final assistant turn; the template's system prompt when there is none;
    cut where the roles stop alternating; each message with only the keys its parser keeps."""
    final: dict[str, Any] = {"role": "assistant", "content": content or ""}
    if reasoning is not None:
        final["reasoning_content"] = reasoning
    turns = [*messages, final]
    out: list[dict[str, Any]] = []
    if turns[0]["role"] == "system":
        out.append({"role": "system", "content": turns[0].get("content") or ""})
        turns = turns[1:]
    elif template.system_prompt:
        out.append({"role": "system", "content": template.system_prompt})
    while turns and turns[0]["role"] != "user":
        turns = turns[1:]
    follows = {"tool": ("assistant", "tool"), "assistant": ("user", "tool")}
    for j, message in enumerate(turns):
        role = message["role"]
        if (j == 0 and role != "user") or (j and role in follows and turns[j - 1]["role"] not in follows[role]):
            break
        out.append({k: v for k, v in message.items()
                    if k in template.message_keys and not (k == "reasoning_content" and v is None)}
                   | {"content": message.get("content") or ""})
    return out


def render(tokenizer, conversations: Sequence[list[dict[str, Any]]], enable_thinking: bool | None) -> list[str]:
    """``enable_thinking`` None: the template's own default (SpecForge's general parser)."""
    if not conversations:
        return []
    kwargs = {} if enable_thinking is None else {"enable_thinking": enable_thinking}
    rendered = tokenizer.apply_chat_template(
        list(conversations), tokenize=False, add_generation_prompt=False, **kwargs)
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


@dataclass(frozen=True)
class LossCount:
    """A rendered conversation's loss tokens as training sees them (after the cut at its max
    length), before the cut, and its length in tokens."""

    loss: int
    uncut: int
    total: int


def loss_token_counts(tokenizer, texts: Sequence[str], fmt: ChatFormat = QWEN, max_length: int | None = None,
                      ignore: Sequence[str] = ()) -> list[LossCount]:
    """Loss tokens of each rendered conversation, as SpecForge's parser computes them: assistant
    spans set, ``ignore`` strings' tokens cleared, everything from ``max_length`` on cut. Token
    positions are counted piece by piece where the tokenizer allows it (see PieceCounter), else
    taken from one batched encoding, else from SpecForge's own prefix arithmetic."""
    counter = PieceCounter.for_tokenizer(tokenizer)
    plans = []
    for text in texts:
        spans = assistant_spans(text, fmt)
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
                index = _token_starting_at(enc, len(text), char)
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

    def positions(self, text: str, chars: list[int]) -> list[int] | None:
        """The token index at each character position; None where one cannot be told exactly
        without encoding (inside a piece or an added token, or text NFC would change)."""
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

        found = [tokens_before(char) for char in chars]
        return None if None in found else found  # type: ignore[return-value]


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
