"""Leases on a node's servers: who is using them right now, and how much they want.

A lease is a file held with ``flock`` by the process that uses the servers (a shard, the canary,
a pending approval) for as long as it runs, and renewed (its mtime, its demand) while that
process makes progress. The kernel drops the lock when the process dies, however it dies, so a
lease is live only while its holder is; a holder that hangs stops renewing and its lease goes
stale. The watchdog stops servers that have had no live lease for ``idle_shutdown_s``, and the
shards share each server's request slots in proportion to the demands their leases state.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import time

from regen.coordination.locks import open_for_lock
from regen.files import atomic_write_json
from regen.layout import RunLayout

log = logging.getLogger("regen.coordination")

STALE_AFTER_S = 60.0  # a holder renews every few seconds; one that stops for a minute has hung


class Lease:
    """This process's lease, from ``with Lease(...)`` (or :meth:`hold`) to its end."""

    def __init__(self, layout: RunLayout, name: str, run_id: str = "", demand: int = 0):
        self.path = layout.lease(name)
        self.info = {"name": name, "pid": os.getpid(), "run_id": run_id, "demand": demand}
        self._fd: int | None = None

    def hold(self) -> "Lease":
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_name(f".{self.path.name}.{os.getpid()}")
        fd = open_for_lock(tmp)
        fcntl.flock(fd, fcntl.LOCK_EX)  # held before anyone can see the file
        self._fd = fd
        self._write()
        os.replace(tmp, self.path)
        return self

    def __enter__(self) -> "Lease":
        return self.hold()

    def _write(self) -> None:
        # Overwritten in place, never emptied first: a reader sees the old or the new document,
        # or (rarely) a mix that does not parse and is skipped.
        data = json.dumps(self.info).encode()
        os.pwrite(self._fd, data, 0)
        os.ftruncate(self._fd, len(data))
        os.utime(self._fd)

    def renew(self, demand: int | None = None) -> None:
        if demand is not None:
            self.info["demand"] = demand
        self._write()

    def release(self) -> None:
        if self._fd is None:
            return
        try:
            if _same_file(self._fd, self.path):
                self.path.unlink(missing_ok=True)
        finally:
            os.close(self._fd)
            self._fd = None

    def __exit__(self, *exc) -> None:
        self.release()


def _same_file(fd: int, path) -> bool:
    """``path`` is still the file ``fd`` is open on (not one a new holder put in its place)."""
    try:
        st, here = os.fstat(fd), os.stat(path)
    except OSError:
        return False
    return (st.st_dev, st.st_ino) == (here.st_dev, here.st_ino)


def live_leases(layout: RunLayout, stale_after_s: float = STALE_AFTER_S) -> list[dict]:
    """The leases whose holder is alive and renewing. A dead holder's file is left where it is
    (a few bytes, under a name its own retry takes over): removing it could remove the lease a
    retried holder has just put in its place. A lease that cannot be opened or tested
    (permissions, a filesystem refusing the lock) is skipped and logged, never taken for free
    or for live."""
    found: list[dict] = []
    folder = layout.leases
    if not folder.is_dir():
        return found
    now = time.time()
    for path in folder.glob("*.lease"):
        try:
            fd = os.open(path, os.O_RDWR)
        except FileNotFoundError:
            continue
        except OSError as exc:
            log.warning("lease %s cannot be opened (%s): skipped", path, exc.strerror or exc)
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:  # held: the holder is alive
            try:
                age = now - os.fstat(fd).st_mtime
            except OSError:
                continue
            try:  # caught mid-renewal, the text may not parse: the lease is live all the same
                info = json.loads(os.pread(fd, 65536, 0) or b"{}")
            except (OSError, ValueError):
                info = {}
            if age <= stale_after_s:
                found.append({"demand": 0, **(info if isinstance(info, dict) else {}), "name": path.stem,
                              "age_s": round(age, 1)})
        except OSError as exc:
            log.warning("lease %s cannot be tested (%s): skipped", path, exc.strerror or exc)
        finally:
            os.close(fd)
    return found


def abandoned(layout: RunLayout, name: str) -> bool:
    """Whether the lease ``name`` was left by a holder that died holding it: its file is there
    (a holder that ends removes it) and nobody holds it (a retry would have put its own in place)."""
    path = layout.lease(name)
    try:
        fd = os.open(path, os.O_RDWR)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:  # held: its holder is alive (or the lock cannot be tested: not judged dead)
        return False
    else:
        return _same_file(fd, path)
    finally:
        os.close(fd)


# A run waiting for a person's approval has no process to hold a lease, so its hold is a file with
# a deadline: the canary writes it, the first shard or the teardown removes it; past the deadline
# (nobody ever answered) the servers idle out as usual.
APPROVAL_HOLD_S = 24 * 3600.0


def hold_for_approval(layout: RunLayout, run_id: str, hold_s: float = APPROVAL_HOLD_S) -> None:
    layout.servers.mkdir(parents=True, exist_ok=True)
    atomic_write_json(layout.approval_hold, {"run_id": run_id, "until": time.time() + hold_s})


def approval_pending(layout: RunLayout) -> bool:
    try:
        hold = json.loads(layout.approval_hold.read_text())
        return float(hold["until"]) > time.time()
    except (OSError, ValueError, KeyError, TypeError):
        return False


def end_approval_hold(layout: RunLayout) -> None:
    layout.approval_hold.unlink(missing_ok=True)
