"""Fair shares of each server's request slots among the processes using a node's servers.

Each shard (and the canary) holds a lease stating its demand (requests still to make) and, on
each server, about its max-min fair share of the server's request slots: it takes free slots up
to its share and hands back idle ones above it as shards come and go.
"""

from __future__ import annotations

from typing import Any

from regen.coordination.leases import Lease, live_leases
from regen.coordination.slots import request_slots
from regen.layout import RunLayout


def water_fill(capacity: int, demands: dict[str, int]) -> dict[str, int]:
    """Max-min fair shares of ``capacity`` slots: nobody gets more than it asks, the rest is
    split evenly, remainders to the first names in order (the same answer in every process).
    Slots nobody asks for are split the same way among those that ask for any: a demand is
    spread over the servers evenly, but a conversation's next turn goes where its prefix is, so
    the slots a server has spare must not be withheld from the process whose turns land there
    (a newcomer takes them back at the next rebalance)."""
    shares = {name: 0 for name in demands}
    left, wanting = capacity, sorted(demands, key=lambda n: (demands[n], n))
    while left > 0 and wanting:
        even = left // len(wanting)
        small = [n for n in wanting if demands[n] - shares[n] <= even]
        if small:
            for name in small:
                left -= demands[name] - shares[name]
                shares[name] = demands[name]
            wanting = [n for n in wanting if n not in small]
            continue
        for name in wanting:
            shares[name] += even
        left -= even * len(wanting)
        for name in sorted(wanting)[:left]:
            shares[name] += 1
        left = 0
    asking = sorted(n for n in demands if demands[n] > 0)
    if left > 0 and asking:
        even, rest = divmod(left, len(asking))
        for index, name in enumerate(asking):
            shares[name] += even + (index < rest)
    return shares


class FairShare:
    """This process's part of the node's request slots, and its lease on the servers.

    ``endpoints``: objects with ``url``, ``size`` (the server's budget), ``healthy``,
    ``in_flight``; each gets ``slots`` (its SlotPool) and ``limit`` (the slots held now).
    ``rebalance`` (a few times a second) renews the lease with the demand, reads every live lease,
    and holds on each server the fair share of its slots."""

    def __init__(self, layout: RunLayout, name: str, run_id: str, endpoints: list[Any]):
        self.layout, self.name, self.endpoints = layout, name, endpoints
        self.lease = Lease(layout, name, run_id).hold()
        for endpoint in endpoints:
            endpoint.slots = request_slots(layout, endpoint.url, endpoint.size)

    def rebalance(self, demand: int) -> None:
        self.lease.renew(demand)
        leases = {lease["name"]: lease.get("demand", 0) for lease in live_leases(self.layout)}
        leases[self.name] = demand
        usable = [e for e in self.endpoints if e.healthy] or self.endpoints
        for endpoint in self.endpoints:
            per_server = {name: -(-d // len(usable)) for name, d in leases.items()}
            share = water_fill(endpoint.size, per_server)[self.name] if endpoint in usable else 0
            if endpoint.slots.held < share:
                endpoint.slots.take(share)
            elif endpoint.slots.held > share:
                endpoint.slots.give_back(max(share, endpoint.in_flight))
            endpoint.limit = endpoint.slots.held

    def close(self) -> None:
        for endpoint in self.endpoints:
            endpoint.slots.close()
        self.lease.release()
