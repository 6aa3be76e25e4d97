"""What the engine installed on the node says: its parser names, and its verdict on regen's
launch command (regen.engines.launch_check, run with ``engine_python``). Where the engine does not
import, that is the finding (``import_error``): the servers could not start, so preflight refuses;
the pinned release's names stand in only for the messages."""

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
    checked: str = "its own flags"  # which of the engine's own checks of the command ran
    not_checked: tuple[str, ...] = ()  # each of its checks that cannot run here, one line each
    import_error: str | None = None  # why the engine could not be asked with this interpreter


def ask_engine(cfg: RunConfig, launch_argv: list[str]) -> InstalledEngine:
    """``launch_argv``: the server's argv (interpreter, -m, module, then the engine's flags)."""
    adapter = engine(cfg.engine)
    python = adapter.python(cfg)
    if cfg.engine == "sim":
        return InstalledEngine("regen's simulator", adapter.reasoning_parsers, adapter.tool_call_parsers)

    def not_asked(why: str) -> InstalledEngine:
        return InstalledEngine(f"{adapter.name} {adapter.version}'s list", adapter.reasoning_parsers,
                               adapter.tool_call_parsers, import_error=why)
    try:
        out = subprocess.run([python, str(CHECKER), adapter.name, *launch_argv[3:]], capture_output=True,
                             text=True, timeout=300, stdin=subprocess.DEVNULL)
    except (OSError, subprocess.SubprocessError) as exc:
        return not_asked(f"{type(exc).__name__}: {exc}")
    try:
        found = json.loads(out.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        tail = (out.stderr.strip().splitlines() or [f"exit {out.returncode}, no output"])[-1]
        return not_asked(f"the check did not run: {tail[:300]}")
    if not found.get("engine"):
        return not_asked(found.get("error") or f"{adapter.name} does not import")
    return InstalledEngine(f"{adapter.name} {found['version']} at {python}", frozenset(found["reasoning_parsers"]),
                           frozenset(found["tool_call_parsers"]), found.get("error"),
                           found.get("checked") or "its argument parser", tuple(found.get("not_checked") or ()))
