"""The simulator's prefix cache: what SGLang's radix cache saves, at message boundaries.

A request's prompt is its messages (and tools) in order; each message boundary is a node keyed by
the hash of everything before it. A request whose first k messages a recent request also sent
finds those k in the cache, and only the rest is prefilled. Capacity is in tokens (the simulator's
words), evicted least recently used, as the radix cache evicts unused prefixes to make room.
"""

from __future__ import annotations

import hashlib
import json
from collections import OrderedDict


class PrefixCache:
    def __init__(self, capacity_tokens: int):
        self.capacity = capacity_tokens
        self.held = 0
        self._nodes: OrderedDict[bytes, int] = OrderedDict()  # prefix hash -> tokens its last message adds

    def lookup(self, messages: list[dict], tools: list[dict] | None, tokens_of) -> tuple[int, int]:
        """(cached tokens, prompt tokens) of a request; its prefixes are then the most recently
        used. ``tokens_of(message)``: a message's tokens."""
        digest = hashlib.sha256(json.dumps(tools, sort_keys=True).encode() if tools else b"")
        keys, sizes = [], []
        for message in messages:
            digest.update(json.dumps(message, sort_keys=True, ensure_ascii=False).encode())
            keys.append(digest.copy().digest())
            sizes.append(tokens_of(message))
        cached = 0
        for key, size in zip(keys, sizes):
            if key not in self._nodes:
                break
            cached += size
        if self.capacity > 0:
            for key, size in zip(keys, sizes):
                if key in self._nodes:
                    self._nodes.move_to_end(key)
                else:
                    self._nodes[key] = size
                    self.held += size
            while self.held > self.capacity and self._nodes:
                _, size = self._nodes.popitem(last=False)
                self.held -= size
        return cached, sum(sizes)
