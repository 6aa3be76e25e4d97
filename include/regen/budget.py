"""One in-flight budget per server, shared by every shard on the node.

A server runs its effective limit of requests at once; a few more waiting keep its batch full.
That many slots exist per server as files; a shard may have a request in flight only on a slot it
holds with ``flock``, so all shards together never pass the budget, and a shard that dies gives
its slots back with its last breath. Each shard holds about its fair share (max-min over the
demands the live shards' leases state, :func:`regen.leases.water_fill`), takes free slots up to
it, and hands back idle ones above it as shards come and go.
"""

from __future__ import annotations

import fcntl
import os
from pathlib import Path


class SlotBudget:
    """The slots of one server that this process holds."""

    def __init__(self, directory: Path, size: int):
        self.directory = directory
        self.size = size
        directory.mkdir(parents=True, exist_ok=True)
        self._held: dict[int, int] = {}  # slot -> fd

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
            fd = os.open(self.directory / f"slot-{slot:04d}", os.O_RDWR | os.O_CREAT, 0o600)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                continue
            self._held[slot] = fd
        return len(self._held)

    def free(self) -> int:
        """Slots nobody holds now (this process included)."""
        from regen.leases import path_is_locked

        return sum(slot not in self._held and not path_is_locked(self.directory / f"slot-{slot:04d}")
                   for slot in range(self.size))

    def give_back(self, keep: int) -> None:
        """Release slots down to ``keep`` (the caller keeps at least its requests in flight)."""
        for slot in sorted(self._held, reverse=True):
            if len(self._held) <= keep:
                break
            os.close(self._held.pop(slot))  # closing the descriptor drops the lock

    def close(self) -> None:
        self.give_back(0)


class NodeShare:
    """This process's part of the node's server budgets, and its lease on the servers.

    ``rebalance`` (a few times a second) renews the lease with the demand (requests still to
    make), reads every live lease, and holds on each server the fair share of its slots."""

    def __init__(self, layout, name: str, run_id: str, endpoints: list):
        from regen.leases import Lease

        self.layout, self.name, self.endpoints = layout, name, endpoints
        self.lease = Lease(layout, name, run_id).__enter__()
        for endpoint in endpoints:
            slots = layout.servers / "slots" / endpoint.url.split("//", 1)[-1].replace(":", "-")
            endpoint.budget = SlotBudget(slots, endpoint.size)

    def rebalance(self, demand: int) -> None:
        from regen.leases import live_leases, water_fill

        self.lease.renew(demand)
        leases = {lease["name"]: lease.get("demand", 0) for lease in live_leases(self.layout)}
        leases[self.name] = demand
        usable = [e for e in self.endpoints if e.healthy] or self.endpoints
        for endpoint in self.endpoints:
            per_server = {name: -(-d // len(usable)) for name, d in leases.items()}
            share = water_fill(endpoint.size, per_server)[self.name] if endpoint in usable else 0
            if endpoint.budget.held < share:
                endpoint.budget.take(share)
            elif endpoint.budget.held > share:
                endpoint.budget.give_back(max(share, endpoint.in_flight))
            endpoint.limit = endpoint.budget.held

    def close(self) -> None:
        for endpoint in self.endpoints:
            endpoint.budget.close()
        self.lease.__exit__(None, None, None)
