"""One owner per output: the DAG run that holds it, from its preflight to its teardown.

Two runs on one output would stop each other's servers and publish over each other's rows, so
a run's preflight claims the output (``work/owner.json``: its run, when it claimed and when it
last showed life) under a file lock, so that of two preflights at once exactly one wins; on an
object-store output the claim is also a create-only record in the bucket
(``URL/_regen/owners/oNNNNNN.json``, the highest is the holder), so that nodes sharing only the
bucket see one owner too. Every stage of the run then holds the output (:func:`holding_output`):
it checks the claim is still its own, renews it while it works, and every write of rows checks it
again (:func:`check_held`). The teardown releases it.

A holder is taken over only once it has ended: Airflow says its run is over (the DAG asks it
about the holder a refusal names: ``ended_runs``), or, where nothing can be asked, no sign of it
lives (no lease, approval or server of its run) and it has not renewed its claim for
``CLAIM_STALE_S``. The CLI with
``--config`` (the operator's own shell) claims nothing.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import threading
import time
from collections.abc import Collection, Iterator

from regen.coordination.locks import FileLock
from regen.errors import RegenError
from regen.files import atomic_write_json, read_json
from regen.layout import RunLayout
from regen.objectstore import META

CLAIM_STALE_S = 1800.0  # no renewal for this long, no sign of life, no one to ask: gone
RENEW_EVERY_S = 60.0
OWNERS = f"{META}/owners"


class OutputHeld(RegenError):
    """Another run (``holder``) holds the output."""

    def __init__(self, message: str, holder: str | None = None):
        super().__init__(message)
        self.holder = holder


class OutputLost(OutputHeld):
    """This run's claim on its output was taken over: it must write nothing more."""


def _when(seconds: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(seconds))


def claim_output(layout: RunLayout, run_id: str, live_runs: Collection[str],
                 ended_runs: Collection[str] | None = None) -> None:
    """This run holds the output from now on; OutputHeld (naming the holder) while another,
    alive, does. ``live_runs``: the runs with a live lease, a pending approval or a running
    server of the output (the caller reads them, on every node). ``ended_runs``: the runs Airflow
    says are over (the DAG asks it about the holder OutputHeld names, then claims again); None
    when there is no one to ask."""
    layout.work.mkdir(parents=True, exist_ok=True)
    with FileLock(layout.owner_lock, note=run_id):
        holder = read_json(layout.owner) or {}
        other = holder.get("run_id")
        if other not in (None, run_id):
            _refuse_if_alive(layout, other, float(holder.get("renewed") or holder.get("since") or 0),
                             float(holder.get("since") or 0), live_runs, ended_runs)
        if layout.dataset:
            _claim_bucket(layout, run_id, live_runs, ended_runs)
        since = holder.get("since") if other == run_id else time.time()
        atomic_write_json(layout.owner, {"run_id": run_id, "since": since, "renewed": time.time()})


def _refuse_if_alive(layout: RunLayout, holder: str, renewed: float, since: float, live_runs: Collection[str],
                     ended_runs: Collection[str] | None) -> None:
    if ended_runs is not None:  # Airflow judges: only a run it says has ended is taken over
        alive = holder not in ended_runs or holder in live_runs
    else:
        alive = holder in live_runs or time.time() - renewed < CLAIM_STALE_S
    if alive:
        raise OutputHeld(f"output {layout.dataset or layout.root}: held by run {holder} since {_when(since)} "
                         f"(last sign of life {_when(renewed)}); two runs on one output would stop each other's "
                         f"servers and rows. Let it end, or stop it (mark it failed: its teardown releases the "
                         f"output), or choose another output", holder=holder)


def _bucket_claims(layout: RunLayout) -> tuple[int, dict]:
    """The bucket's top claim (its number, its record with its last sign of life)."""
    store = layout.store()
    numbers = sorted(int(n.rsplit("/", 1)[-1][1:7]) for n in store.names(OWNERS) if n.endswith(".json"))
    if not numbers:
        return 0, {}
    top = json.loads(store.read(f"{OWNERS}/o{numbers[-1]:06d}.json"))
    with contextlib.suppress(FileNotFoundError):
        top.update(json.loads(store.read(f"{OWNERS}/o{numbers[-1]:06d}.alive")))
    return numbers[-1], top


def _claim_bucket(layout: RunLayout, run_id: str, live_runs: Collection[str],
                  ended_runs: Collection[str] | None) -> None:
    """The bucket's claim: the next create-only record, unless the top one is this run's; of two
    runs claiming at once, the one whose record lands first holds it."""
    number, top = _bucket_claims(layout)
    if top.get("run_id") == run_id and not top.get("released"):
        return
    if top and not top.get("released"):
        _refuse_if_alive(layout, top["run_id"], float(top.get("renewed") or top.get("since") or 0),
                         float(top.get("since") or 0), live_runs, ended_runs)
    doc = json.dumps({"run_id": run_id, "since": time.time()}).encode()
    if not layout.store().create(f"{OWNERS}/o{number + 1:06d}.json", doc):
        winner = _bucket_claims(layout)[1].get("run_id")
        raise OutputHeld(f"output {layout.dataset}: run {winner} claimed it at the same moment", holder=winner)


def _mark_bucket(layout: RunLayout, run_id: str, **fields: object) -> bool:
    """This run's sign of life (or release) on its bucket claim; False when the claim is not its own."""
    number, top = _bucket_claims(layout)
    if top.get("run_id") != run_id or top.get("released"):
        return False
    layout.store().put(f"{OWNERS}/o{number:06d}.alive", json.dumps({"renewed": time.time(), **fields}).encode())
    return True


_lost: dict[str, str] = {}  # output root -> why this process's run lost it (a bucket claim taken over)
_held: dict[str, str] = {}  # output root -> the run a stage of this process holds it for
_checked: dict[str, tuple | None] = {}  # output root -> its owner.json as last checked (inode, mtime, size)


def check_held(layout: RunLayout) -> None:
    """Before rows are written: OutputLost when a stage of this process holds ``layout``'s output
    and another run has taken it over. Nothing to check when no stage holds it (the CLI)."""
    key = str(layout.root)
    run_id = _held.get(key)
    if run_id is None:
        return
    try:  # read again only when the file changed (a renewal a minute): this runs for every row
        st = os.stat(layout.owner)
        seen = (st.st_ino, st.st_mtime_ns, st.st_size)
    except FileNotFoundError:
        seen = None
    if seen is not None and _checked.get(key) == seen and key not in _lost:
        return
    holder = (read_json(layout.owner) or {}).get("run_id")
    _checked[key] = seen
    if holder not in (None, run_id) or key in _lost:  # none: a teardown released it; the next renewal claims it
        why = _lost.get(str(layout.root)) or f"run {holder or 'none'} holds it now"
        raise OutputLost(f"output {layout.dataset or layout.root}: {why}, not this run ({run_id}); nothing more "
                         f"of this run is written there")


def _renew(layout: RunLayout, run_id: str) -> None:
    """The claim's sign of life; the claim again when no one holds it (a shard cleared after its
    run's teardown released the output)."""
    with FileLock(layout.owner_lock, note=run_id):
        current = read_json(layout.owner) or {}
        if current.get("run_id") in (None, run_id):
            atomic_write_json(layout.owner, {"run_id": run_id, "since": current.get("since") or time.time(),
                                             "renewed": time.time()})
    if layout.dataset and not _mark_bucket(layout, run_id):
        _lost[str(layout.root)] = f"run {_bucket_claims(layout)[1].get('run_id')} holds it on the bucket now"


def _renew_until(stop: threading.Event, layout: RunLayout, run_id: str) -> None:
    while not stop.wait(RENEW_EVERY_S):
        try:
            _renew(layout, run_id)
        except Exception as exc:  # a bucket outage: the next renewal tries again, the stage goes on
            logging.getLogger("regen").warning("could not renew the claim on %s: %s", layout.dataset or layout.root, exc)


@contextlib.contextmanager
def holding_output(layout: RunLayout, run_id: str) -> Iterator[None]:
    """A stage of ``run_id`` working on the output: OutputLost at once if another run holds it
    (claimed again when no one does), the claim renewed every ``RENEW_EVERY_S`` while the stage
    works (a busy stage stays alive), and checked before every write (:func:`check_held`)."""
    key = str(layout.root)
    _held[key] = run_id
    _lost.pop(key, None)
    try:
        layout.work.mkdir(parents=True, exist_ok=True)
        if layout.dataset:  # the bucket's claim taken again when released, never from another run
            try:
                claim_output(layout, run_id, (), ended_runs=[])
            except OutputHeld as exc:
                raise OutputLost(str(exc), exc.holder) from None
        _renew(layout, run_id)
        check_held(layout)
        stop = threading.Event()
        thread = threading.Thread(target=_renew_until, args=(stop, layout, run_id), name="regen-owner", daemon=True)
        thread.start()
        try:
            yield
        finally:
            stop.set()
            thread.join()
    finally:
        _held.pop(key, None)
        _lost.pop(key, None)
        _checked.pop(key, None)


def release_output(layout: RunLayout, run_id: str) -> None:
    """The run's end: the output is free (only its own claim is released)."""
    if not layout.work.is_dir():
        return
    with FileLock(layout.owner_lock, note=run_id):
        if (read_json(layout.owner) or {}).get("run_id") == run_id:
            layout.owner.unlink(missing_ok=True)
    if layout.dataset:
        _mark_bucket(layout, run_id, released=True)
