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
    parallel runs rarely collide."""
    rng = random.Random()
    top = min(_first_ephemeral_port(), 65000) - count - 10
    for _ in range(200):
        base = rng.randrange(20000, max(top, 20010), 10)
        if all(port_is_free(host, base + i) for i in range(count)):
            return base
    raise RuntimeError("no free port range found")


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
