"""Files written so that a reader never sees half of one, and read without tripping on a missing one.

Every file regen publishes (progress, manifests, state, shard files, exports) is written beside its
final path and renamed over it once complete and flushed to disk; the directory is flushed too,
so that a machine that crashes right after keeps either the old file or the new one. A file
written with ``private`` is created owner-only, never follows a symlink planted at its temporary
name, and never reuses an existing temporary file.
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
from pathlib import Path
from typing import Any, Iterator


def fsync_dir(directory: Path) -> None:
    """Flush a directory's entries (a rename in it) to disk; a no-op where that is unsupported."""
    try:
        fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


@contextlib.contextmanager
def atomic_path(path: Path, private: bool = False, work_dir: Path | None = None) -> Iterator[Path]:
    """A temporary path for the caller to write, beside ``path`` or in ``work_dir`` (on the same
    filesystem: what must never show half-written in a folder is written elsewhere); renamed over
    ``path`` when the block ends without an exception, removed otherwise."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp_dir = Path(work_dir) if work_dir is not None else path.parent
    tmp_dir.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=tmp_dir)
    os.close(fd)  # mkstemp created it owner-only with O_EXCL: nothing else can own this name
    tmp_path = Path(tmp)
    if not private:
        os.chmod(tmp_path, 0o644 & ~_umask())
    try:
        yield tmp_path
        with open(tmp_path, "rb") as fh:
            os.fsync(fh.fileno())
        os.replace(tmp_path, path)
    except BaseException:
        tmp_path.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)


@contextlib.contextmanager
def atomic_file(path: Path, mode: str = "w", private: bool = False) -> Iterator[Any]:
    """An open file that becomes ``path`` once the block ends without an exception."""
    with atomic_path(path, private) as tmp:
        with open(tmp, mode, encoding=None if "b" in mode else "utf-8") as fh:
            yield fh


def atomic_write_json(path: Path, data: Any, private: bool = False) -> None:
    with atomic_file(path, "w", private) as fh:
        json.dump(data, fh, indent=1, default=str)


def atomic_write_text(path: Path, text: str, private: bool = False) -> None:
    with atomic_file(path, "w", private) as fh:
        fh.write(text)


def read_json(path: Path) -> Any:
    """The JSON document at ``path``; None when it is missing or not (yet) whole."""
    try:
        return json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return None


def read_json_lines(path: Path, last: int | None = None) -> list[Any]:
    """The JSON lines of a file (its ``last`` ones), skipping any line that does not parse: a
    writer killed mid-line leaves a cut line (cut inside a UTF-8 character, too), which must
    not hide the others."""
    try:
        lines = Path(path).read_text(errors="replace").splitlines()
    except OSError:
        return []
    out = []
    for line in lines[-last:] if last else lines:
        try:
            out.append(json.loads(line))
        except ValueError:
            continue
    return out


def _umask() -> int:
    """This process's umask, read without changing it (os.umask would, for every thread)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    return 0o022
