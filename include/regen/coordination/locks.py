"""One file lock: ``flock`` on a file opened read-write (NFSv4 grants an exclusive lock only on
a descriptor open for writing; a read-only one gets EBADF)."""

from __future__ import annotations

import fcntl
import os
from pathlib import Path


def open_for_lock(path: Path) -> int:
    """A descriptor of ``path`` (created if missing) that an exclusive flock can be taken on."""
    return os.open(path, os.O_RDWR | os.O_CREAT, 0o600)


def is_locked(path: Path) -> bool:
    """Someone holds ``path`` locked. A file that cannot be opened or tested counts as held:
    a caller counting free slots must not hand out one it cannot check."""
    try:
        fd = os.open(path, os.O_RDWR)
    except FileNotFoundError:
        return False
    except OSError:
        return True
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return False
    except OSError:
        return True
    finally:
        os.close(fd)


class LockHeld(Exception):
    """Another process holds the lock; its text (who) is the message."""


class FileLock:
    """An exclusive lock on ``path``; with ``note``, the holder writes it into the file, so
    whoever finds the lock taken can say who holds it."""

    def __init__(self, path: Path, note: str | None = None):
        self.path = Path(path)
        self.note = note
        self._fd: int | None = None

    def acquire(self, blocking: bool = True) -> None:
        """Take the lock; LockHeld (naming the holder) when ``blocking`` is off and it is taken."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = open_for_lock(self.path)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | (0 if blocking else fcntl.LOCK_NB))
        except BlockingIOError:
            holder = os.pread(fd, 4096, 0).decode("utf-8", "replace").strip()
            os.close(fd)
            raise LockHeld(holder or "another process") from None
        except BaseException:
            os.close(fd)
            raise
        if self.note is not None:
            os.ftruncate(fd, 0)
            os.pwrite(fd, self.note.encode(), 0)
        self._fd = fd

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # closing the descriptor drops the lock
            self._fd = None

    def __enter__(self) -> "FileLock":
        self.acquire()
        return self

    def __exit__(self, *exc) -> None:
        self.release()
