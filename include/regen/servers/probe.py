"""What a node answers without starting anything: a port free, a server healthy, a log's tail."""

from __future__ import annotations

import os
import random
import socket
from pathlib import Path

import httpx2


def port_is_free(host: str, port: int) -> bool:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError:
            return False
    return True


def _first_ephemeral_port() -> int:
    """The first port the kernel hands to outgoing connections: a listener chosen above it can
    be taken by any client's socket between the check and the bind (seen: Airflow's API server,
    and a bench's fixed port in CI)."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_port_base(count: int, host: str = "127.0.0.1") -> int:
    """A base port with ``count`` free ports after it, below the ephemeral range; random so
    parallel runs rarely collide. ``REGEN_PORT_RANGE=LO-HI`` narrows the choice: processes given
    disjoint ranges (the test suite's workers) never pick the same port between check and bind."""
    rng = random.Random()
    low, high = _port_range()
    top = high - count - 10
    for _ in range(200):
        base = rng.randrange(low, max(top, low + 10), 10)
        if all(port_is_free(host, base + i) for i in range(count)):
            return base
    raise RuntimeError(f"no free range of {count} ports found in {low}-{high}")


def _port_range() -> tuple[int, int]:
    top = min(_first_ephemeral_port(), 65000)
    raw = os.environ.get("REGEN_PORT_RANGE", "")
    if not raw:
        return 20000, top
    try:
        low, high = (int(part) for part in raw.split("-"))
    except ValueError:
        raise ValueError(f"REGEN_PORT_RANGE={raw!r}: expected LO-HI, e.g. 20000-21000") from None
    return low, min(high, top)


def is_healthy(url: str, timeout: float = 5.0) -> bool:
    try:
        return httpx2.get(f"{url}/health", timeout=timeout).status_code == 200
    except httpx2.HTTPError:
        return False


def log_tail(path: str | Path, lines: int = 20) -> str:
    try:
        with open(path, "rb") as fh:
            fh.seek(0, os.SEEK_END)
            fh.seek(max(0, fh.tell() - 16384))
            return "\n".join(fh.read().decode("utf-8", "replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"
