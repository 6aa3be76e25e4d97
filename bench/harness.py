"""What every benchmark shares: its inputs (a tiny model, prompts, simulated servers), rounds in
alternating order, timing, and its section of bench/RESULTS.md with the commit and the command.

A bench script is then what it measures and its table. Run one as ``.venv/bin/python bench/NAME.py``
(its folder is on ``sys.path`` that way, so ``from harness import ...`` needs nothing more).
"""

from __future__ import annotations

import contextlib
import json
import os
import platform
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

from regen.paths import DEMO_PROMPTS
from regen.prompts import Prompt, read_prompts
from regen.servers.lifecycle import wait_healthy
from regen.servers.probe import free_port_base
from regen.servers.records import ServerRecord

# The suite runs every bench at a tiny size (tests/test_bench.py) and points this elsewhere, so a
# smoke run never overwrites a measurement.
RESULTS = Path(os.environ.get("REGEN_BENCH_RESULTS") or Path(__file__).resolve().parent / "RESULTS.md")
HEADER = ("# Benchmark results\n\nEach section is written by the script it names (after `make setup`), which measures "
          "regen against a baseline in the same run. Numbers are from the machine and the commit named in the "
          "section.\n")


def machine() -> str:
    return f"{os.cpu_count()} cores, {platform.machine()}, Python {platform.python_version()}"


def commit() -> str:
    """The commit measured, with `+changes` when the working tree differs from it."""
    root = Path(__file__).resolve().parents[1]
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True,
                              text=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no", "--", ".",
                                ":(exclude)bench/RESULTS.md"],  # the results file is not what is measured
                               cwd=root, capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown commit"
    return head + ("+changes" if dirty else "")


def write_section(name: str, command: str, body: str) -> None:
    """Replace (or add) the section ``name``, keeping every other section."""
    text = RESULTS.read_text() if RESULTS.exists() else HEADER
    section = (f"## {name}\n\n`{command}` (commit {commit()}, {time.strftime('%Y-%m-%d')}, {machine()})\n\n"
               f"{body.strip()}\n")
    pattern = re.compile(rf"^## {re.escape(name)}\n.*?(?=^## |\Z)", re.S | re.M)
    if pattern.search(text):
        text = pattern.sub(lambda _: section + "\n", text)
    else:
        text = text.rstrip("\n") + "\n\n" + section
    RESULTS.write_text(text.rstrip("\n") + "\n")
    print(section)


def alternating(modes: Sequence[str], rounds: int) -> Iterator[tuple[int, str]]:
    """(round, mode) with the order reversed every other round, so neither side always goes
    first on a warm (or a cold) machine."""
    for r in range(rounds):
        for mode in (modes if r % 2 == 0 else list(modes)[::-1]):
            yield r, mode


def make_prompts(path: Path, count: int) -> list[Prompt]:
    """``count`` prompts cycling through the demo's, ids b0..; written to ``path`` and returned."""
    base = [p for p in read_prompts(DEMO_PROMPTS) if isinstance(p, Prompt)]
    with path.open("w") as fh:
        for i in range(count):
            fh.write(json.dumps({"id": f"b{i}", "messages": base[i % len(base)].messages}) + "\n")
    return [p for p in read_prompts(path) if isinstance(p, Prompt)]


@contextlib.contextmanager
def workspace() -> Iterator[tuple[Path, Path]]:
    """A scratch folder and the tiny model built in it: (folder, model)."""
    from regen.tinymodel import build_tiny_model

    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        yield tmp, build_tiny_model(tmp / "model")


@contextlib.contextmanager
def simulated_servers(model: Path, servers: Sequence[list[str]]) -> Iterator[list[str]]:
    """`regen sim` with each server's flags, all healthy; yields their URLs, stops them after.
    Ports are picked free and below the ephemeral range: a fixed one was once taken in CI."""
    launched = []
    base = free_port_base(len(servers))
    try:
        for port, flags in enumerate(servers, start=base):
            argv = [sys.executable, "-m", "regen", "sim", "--port", str(port), "--model-path", str(model), *flags]
            log = model.parent / f"sim-{port}.log"  # named in the error when a server does not start
            with log.open("w") as out:
                proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT)
            launched.append((ServerRecord(0, None, "127.0.0.1", port, proc.pid, str(log), None), proc))
        wait_healthy(launched, 60)
        yield [record.url for record, _ in launched]
    finally:
        for _, proc in launched:
            proc.terminate()
            proc.wait()
