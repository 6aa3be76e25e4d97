"""Other processes a test started or waits for: free ports, /proc look-ups, polling."""

import os
import random
from pathlib import Path

from regen.servers.probe import port_is_free


def _below_ephemeral() -> int:
    """The first port the kernel hands to outgoing connections: a listener chosen above it can
    be taken by any client's socket between the check and the bind (seen: Airflow's API server)."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_port_base(count: int) -> int:
    """A base port with ``count`` free ports after it, below the ephemeral range; random so
    parallel runs rarely collide."""
    rng = random.Random()
    top = min(_below_ephemeral(), 65000) - count - 10
    for _ in range(200):
        base = rng.randrange(20000, max(top, 20010), 10)
        if all(port_is_free("127.0.0.1", base + i) for i in range(count)):
            return base
    raise RuntimeError("no free port range found")


def processes_with_args(*args: str) -> list[int]:
    """Live processes whose argv holds ``args`` consecutively (e.g. "--port", "31000")."""
    needle = "\0".join(args).encode()
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes()
            state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if state != "Z" and (b"\0" + needle + b"\0") in (b"\0" + cmdline):
            found.append(int(entry.name))
    return found


def wait_until(predicate, timeout: float, what: str = "condition") -> None:
    """Poll a condition with a deadline: the way to wait for another process, never a bare sleep."""
    import time

    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} not met within {timeout} s")
        time.sleep(0.02)


def processes_with_env(name: str, value: str) -> list[int]:
    """Live processes whose environment has name=value (what a test started, and its children)."""
    needle = f"{name}={value}".encode()
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            environ = (entry / "environ").read_bytes().split(b"\0")
            state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if state != "Z" and needle in environ:
            found.append(int(entry.name))
    return found
