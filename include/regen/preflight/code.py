"""The code check: every file that will run compiled, then every entry point imported, in a
*separate* interpreter (the one that will run it), so a SyntaxError such as the one that idled
seven B200s (``name 'MAX_OUTPUT_TOKENS' is used prior to global declaration``) is reported as
file:line before a single server starts."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from regen.paths import DAGS_DIR, PACKAGE_DIR
from regen.procs import private_dir
from regen.stages import entry_modules

# Runs in the target interpreter: compiles each file, prints one JSON problem per failure.
_COMPILE_SCRIPT = r"""
import json, sys
for path in sys.argv[1:]:
    try:
        with open(path, "rb") as fh:
            compile(fh.read(), path, "exec", dont_inherit=True)
    except SyntaxError as exc:
        print(json.dumps({"file": exc.filename or path, "line": exc.lineno, "msg": f"{type(exc).__name__}: {exc.msg}"}))
    except (OSError, ValueError) as exc:
        print(json.dumps({"file": path, "line": 0, "msg": f"{type(exc).__name__}: {exc}"}))
"""

_IMPORT_SCRIPT = r"""
import importlib, json, sys
for module in sys.argv[1:]:
    try:
        importlib.import_module(module)
    except BaseException as exc:
        print(json.dumps({"module": module, "error": f"{type(exc).__name__}: {exc}"}), flush=True)
"""


def code_files(extra: list[str] | None = None) -> list[Path]:
    files = sorted(PACKAGE_DIR.rglob("*.py"))
    if DAGS_DIR.exists():
        files += sorted(DAGS_DIR.rglob("*.py"))
    return files + [Path(p) for p in extra or []]


def check_code(python: str = sys.executable, files: list[Path] | None = None,
               entry_points: list[str] | None = None) -> list[str]:
    """Compile, then import, in a fresh ``python``: what the stages will really run (default:
    every module of the stage registry and every program regen starts)."""
    files = files if files is not None else code_files()
    entry_points = entry_points if entry_points is not None else entry_modules()
    # In the node user's private folder: a ``-c`` script imports from its working folder first.
    try:
        cwd = private_dir()
        out = subprocess.run([python, "-c", _COMPILE_SCRIPT, *map(str, files)], capture_output=True,
                             text=True, timeout=120, cwd=cwd)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return [f"{python}: cannot run the interpreter: {exc}"]
    problems = []
    for line in out.stdout.splitlines():
        item = json.loads(line)
        problems.append(f"{item['file']}:{item['line']}: {item['msg']}")
    if out.returncode != 0:
        problems.append(f"{python}: compile check crashed: {out.stderr.strip()[-500:]}")
    if problems:
        return problems  # imports would only repeat the same errors
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(PACKAGE_DIR.parent), env.get("PYTHONPATH", "")])
    # Every entry point in one fresh interpreter, each in its own try: one start-up, and a broken
    # module is named without hiding the others.
    out = subprocess.run([python, "-c", _IMPORT_SCRIPT, *entry_points], capture_output=True,
                         text=True, timeout=300, env=env, cwd=cwd)
    for line in out.stdout.splitlines():
        item = json.loads(line)
        problems.append(f"import {item['module']} fails in {python}: {item['error']}")
    if out.returncode != 0:
        problems.append(f"{python}: import check crashed: {out.stderr.strip()[-500:]}")
    return problems
