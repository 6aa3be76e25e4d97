"""Other processes a test started or waits for: /proc look-ups, polling."""

import os
from pathlib import Path


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


def wait_until(predicate, timeout: float, what: str = "condition", max_pause: float = 0.5) -> None:
    """Poll a condition with a deadline: the way to wait for another process, never a bare sleep.
    The pause grows from 20 ms to half a second: a condition met at once costs no latency, and a
    long wait does not hammer what it asks (polled every 20 ms, an Airflow API server spent a
    core answering the suite's waits). A wait that must act the moment it holds (a kill mid-way)
    keeps ``max_pause`` small."""
    import time

    deadline, pause = time.monotonic() + timeout, 0.02
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} not met within {timeout} s")
        time.sleep(pause)
        pause = min(pause * 1.5, max_pause)


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
