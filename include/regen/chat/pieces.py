"""Token counts of a byte-level BPE tokenizer without building encodings (the audit's hot path)."""

from __future__ import annotations


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
