"""What each pytest-xdist worker has to itself: a scratch folder (its Airflow home among it) and a
slice of the port range. Workers share one machine and one clone; anything two of them could both
create or bind is named by the worker here, so two workers never meet on it."""

from __future__ import annotations

import os
from pathlib import Path

# The ports regen may pick for listeners (regen.servers.probe): below the kernel's ephemeral range.
# REGEN_SUITE_PORTS narrows it: the collision test divides its own worker's slice, which no other
# worker of the running suite binds in.
PORTS = tuple(int(part) for part in os.environ.get("REGEN_SUITE_PORTS", "20000-32760").split("-"))


def worker_name() -> str:
    """``gw0``, ``gw1``, ... under xdist; ``main`` when pytest runs without workers."""
    return os.environ.get("PYTEST_XDIST_WORKER", "main")


def worker_count() -> int:
    return int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))


def port_range(name: str, count: int, ports: tuple[int, int] = PORTS) -> tuple[int, int]:
    """Worker ``name``'s slice of ``ports`` (all of it for ``main``); disjoint from every other
    worker's of the same run."""
    low, high = ports
    if name == "main":
        return low, high
    index, width = int(name.removeprefix("gw")), (high - low) // max(count, 1)
    return low + index * width, low + (index + 1) * width - 1


def scratch(root: Path, name: str) -> Path:
    """The worker's own folder under the suite's scratch root."""
    return root / name


def claim(root: Path) -> Path:
    """Set this process's environment to its worker's share; returns its scratch folder. Called
    by conftest before anything reads the environment (Airflow reads its home once, at import)."""
    name = worker_name()
    low, high = port_range(name, worker_count())
    os.environ["REGEN_PORT_RANGE"] = f"{low}-{high}"
    return scratch(root, name)
