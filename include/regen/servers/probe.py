"""What a node answers without starting anything: a port free, a server healthy, a log's tail."""

from __future__ import annotations

import os
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
