"""What the engine installed on the node says: its parser names, and its verdict on regen's
launch command (regen.engines.launch_check, run with ``engine_python``). Where no engine is
installed, the names of the release regen pins, said to be that."""

from __future__ import annotations

import json
import subprocess
from dataclasses import dataclass
from pathlib import Path

from regen.config import RunConfig
from regen.engines import engine

CHECKER = Path(__file__).with_name("launch_check.py")


@dataclass
class InstalledEngine:
    source: str  # who said it, for messages: the installed engine, or the pinned release's list
    reasoning_parsers: frozenset[str]
    tool_call_parsers: frozenset[str]
    launch_error: str | None = None  # the engine's own parser on the launch command
    checked: str = "nothing (no engine to ask)"  # how far the engine's own checks of the command went


def ask_engine(cfg: RunConfig, launch_argv: list[str]) -> InstalledEngine:
    """``launch_argv``: the server's argv (interpreter, -m, module, then the engine's flags)."""
    adapter = engine(cfg.engine)
    python = adapter.python(cfg)
    pinned = InstalledEngine(f"{adapter.name} {adapter.version}'s list (no {adapter.name} imports with {python})",
                             adapter.reasoning_parsers, adapter.tool_call_parsers)
    if cfg.engine == "sim":
        return InstalledEngine("regen's simulator", adapter.reasoning_parsers, adapter.tool_call_parsers)
    try:
        out = subprocess.run([python, str(CHECKER), adapter.name, *launch_argv[3:]], capture_output=True,
                             text=True, timeout=300, stdin=subprocess.DEVNULL)
        found = json.loads(out.stdout.strip().splitlines()[-1])
    except (OSError, subprocess.SubprocessError, ValueError, IndexError):
        return pinned
    if not found.get("engine"):
        return pinned
    return InstalledEngine(f"{adapter.name} {found['version']} at {python}", frozenset(found["reasoning_parsers"]),
                           frozenset(found["tool_call_parsers"]), found.get("error"),
                           found.get("checked") or "its argument parser")
