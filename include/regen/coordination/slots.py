"""Numbered slot files of which each process holds some: a budget shared by processes.

Two budgets are slot pools: a server's **request slots** (its effective limit plus the queue
margin; a request may be in flight only on a slot its process holds) and a node's **shard
claims** (``max_shards`` shards generating on it at once). A process that dies gives its slots
back with its last breath (the kernel drops the flocks).
"""

from __future__ import annotations

import fcntl
import os
from pathlib import Path

from regen.coordination.locks import is_locked, open_for_lock
from regen.layout import RunLayout


class SlotPool:
    """The slots of one budget that this process holds."""

    def __init__(self, directory: Path, size: int):
        self.directory = directory
        self.size = size
        directory.mkdir(parents=True, exist_ok=True)
        self._held: dict[int, int] = {}  # slot -> fd

    def _path(self, slot: int) -> Path:
        return self.directory / f"slot-{slot:04d}"

    @property
    def held(self) -> int:
        return len(self._held)

    def take(self, wanted: int) -> int:
        """Hold up to ``wanted`` slots in all, as many as are free; how many are held now."""
        for slot in range(self.size):
            if len(self._held) >= wanted:
                break
            if slot in self._held:
                continue
            fd = open_for_lock(self._path(slot))
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                os.close(fd)
                continue
            self._held[slot] = fd
        return len(self._held)

    def free(self) -> int:
        """Slots nobody holds now (this process included)."""
        return sum(slot not in self._held and not is_locked(self._path(slot)) for slot in range(self.size))

    def give_back(self, keep: int) -> None:
        """Release slots down to ``keep`` (the caller keeps at least its requests in flight)."""
        for slot in sorted(self._held, reverse=True):
            if len(self._held) <= keep:
                break
            os.close(self._held.pop(slot))

    def close(self) -> None:
        self.give_back(0)


def request_slots(layout: RunLayout, url: str, size: int) -> SlotPool:
    """A server's in-flight budget, shared by every process using the node's servers."""
    return SlotPool(layout.request_slots(url), size)


def shard_claims(layout: RunLayout, node: str, size: int) -> SlotPool:
    """A node's shard slots, shared by every shard of the run."""
    return SlotPool(layout.node_claims(node), size)
