"""One owner per output: the DAG run that holds it, from its preflight to its teardown.

Two runs on one output would stop each other's servers and publish over each other's rows, so
a run's preflight claims the output (``work/owner.json``: its DAG and run) and is refused while
another run holds it, naming that run. The teardown releases it. A holder is gone, and its claim
taken over, when nothing of it lives: no live lease of its run (a shard, the canary), no pending
approval, no running server of its own, and its claim older than ``CLAIM_GRACE_S`` (the time
from its preflight to its servers, staging included). The CLI with ``--config`` (the operator's
own shell) claims nothing.
"""

from __future__ import annotations

import time

from collections.abc import Collection

from regen.errors import RegenError
from regen.files import atomic_write_json, read_json
from regen.layout import RunLayout

CLAIM_GRACE_S = 1800.0  # preflight to the first lease: staging the weights and loading the servers


class OutputHeld(RegenError):
    """Another run holds the output."""


def claim_output(layout: RunLayout, run_id: str, live_runs: Collection[str]) -> None:
    """This run holds the output from now on; OutputHeld while another, alive, does.
    ``live_runs``: the runs that hold a live lease, a pending approval or a running server of
    the output (the caller reads them, on every node)."""
    holder = read_json(layout.owner) or {}
    young = time.time() - float(holder.get("since") or 0) < CLAIM_GRACE_S
    if holder.get("run_id") not in (None, run_id) and (young or holder["run_id"] in live_runs):
        held_since = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(float(holder.get("since") or 0)))
        raise OutputHeld(f"output {layout.root}: held by run {holder['run_id']} since {held_since}; two runs on "
                         f"one output would stop each other's servers and rows. Let it end, or stop it (mark it "
                         f"failed: its teardown releases the output), or choose another output")
    layout.work.mkdir(parents=True, exist_ok=True)
    atomic_write_json(layout.owner, {"run_id": run_id, "since": time.time()})


def release_output(layout: RunLayout, run_id: str) -> None:
    """The run's end: the output is free (only its own claim is released)."""
    if (read_json(layout.owner) or {}).get("run_id") == run_id:
        layout.owner.unlink(missing_ok=True)
