"""Write one benchmark's section of bench/RESULTS.md, keeping the other sections."""

from __future__ import annotations

import platform
import os
import re
import time
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "RESULTS.md"
HEADER = ("# Benchmark results\n\nEach section is written by the script it names (after `make setup`), which measures "
          "regen against a baseline in the same run. Numbers are from the machine named in the "
          "section.\n")


def machine() -> str:
    return f"{os.cpu_count()} cores, {platform.machine()}, Python {platform.python_version()}"


def write_section(name: str, command: str, body: str) -> None:
    text = RESULTS.read_text() if RESULTS.exists() else HEADER
    section = (f"## {name}\n\n`{command}` ({time.strftime('%Y-%m-%d')}, {machine()})\n\n"
               f"{body.strip()}\n")
    pattern = re.compile(rf"^## {re.escape(name)}\n.*?(?=^## |\Z)", re.S | re.M)
    if pattern.search(text):
        text = pattern.sub(lambda _: section + "\n", text)
    else:
        text = text.rstrip("\n") + "\n\n" + section
    RESULTS.write_text(text.rstrip("\n") + "\n")
    print(section)
