"""Leases on a node's servers: who is using them right now, and how much they want.

A lease is a file held with ``flock`` by the process that uses the servers (a shard, the canary)
for as long as it runs, and renewed (its mtime, its demand) while that process makes progress. The
kernel drops the lock when the process dies, however it dies, so a lease is live only while its
holder is; a holder that hangs stops renewing and its lease goes stale. The watchdog
(:mod:`regen.watchdog`) stops servers that have had no live lease for ``idle_shutdown_s``, and the
shards share each server's in-flight budget in proportion to the demands their leases state.
"""

from __future__ import annotations

import fcntl
import json
import os
import time
from pathlib import Path

from regen.layout import RunLayout

STALE_AFTER_S = 60.0  # a holder renews every few seconds; one that stops for a minute has hung


class Lease:
    """This process's lease, from ``with Lease(...)`` to its end."""

    def __init__(self, layout: RunLayout, name: str, run_id: str = "", demand: int = 0):
        self.path = layout.leases / f"{name}.lease"
        self.info = {"name": name, "pid": os.getpid(), "run_id": run_id, "demand": demand}
        self._fh = None

    def __enter__(self) -> "Lease":
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_name(f".{self.path.name}.{os.getpid()}")
        self._fh = open(tmp, "w")
        fcntl.flock(self._fh, fcntl.LOCK_EX)  # held before anyone can see the file
        self._write()
        os.replace(tmp, self.path)
        return self

    def _write(self) -> None:
        # Overwritten in place, never emptied first: a reader sees the old or the new document,
        # or (rarely) a mix that does not parse and is skipped.
        self._fh.seek(0)
        self._fh.write(json.dumps(self.info))
        self._fh.truncate()
        self._fh.flush()
        os.utime(self._fh.fileno())

    def renew(self, demand: int | None = None) -> None:
        if demand is not None:
            self.info["demand"] = demand
        self._write()

    def __exit__(self, *exc) -> None:
        try:
            self.path.unlink(missing_ok=True)
        finally:
            self._fh.close()


def live_leases(layout: RunLayout, stale_after_s: float = STALE_AFTER_S) -> list[dict]:
    """The leases whose holder is alive and renewing; the files of dead holders are removed."""
    found = []
    if not layout.leases.is_dir():
        return found
    now = time.time()
    for path in layout.leases.glob("*.lease"):
        try:
            fh = open(path)
        except OSError:
            continue
        with fh:
            try:
                fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:  # held: the holder is alive
                try:
                    info = json.loads(fh.read() or "{}")
                    age = now - os.fstat(fh.fileno()).st_mtime
                except (OSError, ValueError):
                    continue
                if age <= stale_after_s and isinstance(info, dict):
                    found.append({"demand": 0, **info, "name": path.stem, "age_s": round(age, 1)})
                continue
            path.unlink(missing_ok=True)  # we got the lock: its holder is gone
    return found


def water_fill(capacity: int, demands: dict[str, int]) -> dict[str, int]:
    """Max-min fair shares of ``capacity`` slots: nobody gets more than it asks, the rest is
    split evenly, remainders to the first names in order (the same answer in every process)."""
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
    return shares


def lease_name(kind: str, shard: int | None = None) -> str:
    return f"{kind}-{shard:05d}" if shard is not None else f"{kind}-{os.getpid()}"


def path_is_locked(path: Path) -> bool:
    """Someone holds ``path`` locked (a slot, a lease)."""
    try:
        with open(path) as fh:
            fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return False
    except BlockingIOError:
        return True
    except OSError:
        return False
