"""Files written so that a reader never sees half of one, and read without tripping on a missing one.

Every file regen publishes (progress, manifests, state, shard files, exports) is written beside its
final path and renamed over it once complete and flushed to disk; the directory is flushed too,
so that a machine that crashes right after keeps either the old file or the new one. A file
written with ``private`` is created owner-only, never follows a symlink planted at its temporary
name, and never reuses an existing temporary file.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import socket
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
def scratch_file(folder: Path, name: str, private: bool = False) -> Iterator[Path]:
    """A new temporary file for writing ``name`` in ``folder``, removed when the block ends. Its
    name says which host and process writes it: a killed writer's leftovers of ``name`` go the next
    time one is made (another node's on a shared folder stay)."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    host = socket.gethostname().replace(".", "-")
    for leftover in folder.glob(f".{name}.{host}-*.tmp"):
        pid = leftover.name[len(f".{name}.{host}-"):].split(".", 1)[0]
        if pid.isdigit() and not _alive(int(pid)):
            leftover.unlink(missing_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{name}.{host}-{os.getpid()}.", suffix=".tmp", dir=folder)
    os.close(fd)  # mkstemp created it owner-only with O_EXCL: nothing else can own this name
    tmp_path = Path(tmp)
    if not private:
        os.chmod(tmp_path, 0o644 & ~_umask())
    try:
        yield tmp_path
    finally:
        tmp_path.unlink(missing_ok=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # somebody else's: alive
        return True
    return True


@contextlib.contextmanager
def atomic_path(path: Path, private: bool = False, work_dir: Path | None = None,
                durable: bool = True) -> Iterator[Path]:
    """A temporary path for the caller to write, beside ``path`` or in ``work_dir`` (on the same
    filesystem: what must never show half-written in a folder is written elsewhere); renamed over
    ``path`` when the block ends without an exception, removed otherwise. ``durable=False`` skips
    the fsyncs: for what is only informative (progress), a crash may lose the last write, never
    show half of one."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with scratch_file(Path(work_dir) if work_dir is not None else path.parent, path.name, private) as tmp:
        yield tmp
        install(tmp, path, durable)


def install(tmp: Path, path: Path, durable: bool = True) -> None:
    """A complete file at ``tmp`` renamed over ``path`` (same filesystem), flushed first and after."""
    if durable:
        with open(tmp, "rb") as fh:
            os.fsync(fh.fileno())
    os.replace(tmp, path)
    if durable:
        fsync_dir(path.parent)


@contextlib.contextmanager
def atomic_file(path: Path, mode: str = "w", private: bool = False, durable: bool = True) -> Iterator[Any]:
    """An open file that becomes ``path`` once the block ends without an exception."""
    with atomic_path(path, private, durable=durable) as tmp:
        with open(tmp, mode, encoding=None if "b" in mode else "utf-8") as fh:
            yield fh


def atomic_write_json(path: Path, data: Any, private: bool = False, durable: bool = True) -> None:
    with atomic_file(path, "w", private, durable) as fh:
        json.dump(data, fh, indent=1, default=str)


def atomic_write_text(path: Path, text: str, private: bool = False) -> None:
    with atomic_file(path, "w", private) as fh:
        fh.write(text)


def sha256_file(path: Path) -> str:
    """A file's SHA-256, read a MiB at a time (weights, a shard file run to gigabytes)."""
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        while chunk := fh.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


# regen's own JSON files are kilobytes; one past this is not one of them (a link to /dev/zero, a sparse file).
MAX_JSON_BYTES = 64 << 20


def read_json(path: Path, max_bytes: int = MAX_JSON_BYTES) -> Any:
    """The JSON document at ``path``; None when it is missing, not (yet) whole, not a regular
    file or over ``max_bytes``: files in an output or a model folder are anyone's to replace,
    and a reader must not hang on a FIFO or fill its memory from a device."""
    try:
        return json.loads(read_bounded(path, max_bytes))
    except (OSError, ValueError):
        return None


def read_bounded(path: Path | str, max_bytes: int) -> bytes:
    """The bytes of the regular file ``path``; ValueError naming it when it is larger than
    ``max_bytes`` or not a regular file (a FIFO, a device), without reading more than that."""
    import stat

    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise ValueError(f"{path}: not a regular file")
        if st.st_size > max_bytes:
            raise ValueError(f"{path}: {st.st_size:,} bytes, more than the {max_bytes:,} it may hold")
        with os.fdopen(os.dup(fd), "rb") as fh:
            data = fh.read(max_bytes + 1)
        if len(data) > max_bytes:
            raise ValueError(f"{path}: more than the {max_bytes:,} bytes it may hold")
        return data
    finally:
        os.close(fd)


def read_in_folder(root: Path, path: Path, max_bytes: int, tail: bool = False) -> bytes:
    """At most ``max_bytes`` of ``path`` (its last ones with ``tail``), read only when neither
    it nor a folder between ``root`` and it is a symlink, and it is a regular file: the output
    is a folder anyone with the dataset's share may write, and a link there must not make a
    reader (the API server, for a viewer) open another file, nor a device grow the read for ever.
    Each folder is opened from the one before it (openat, no symlink followed), so nothing can
    be swapped in between a check and the open. PermissionError names what was refused;
    FileNotFoundError as usual."""
    import stat

    root = os.path.abspath(root)
    names = os.path.relpath(os.path.abspath(path), root).split(os.sep)
    if ".." in names:
        raise PermissionError(f"{path} is outside {root}: not read")

    def opened(name: str, flags: int, at: int, shown: str) -> int:
        try:
            return os.open(name, flags | os.O_NOFOLLOW, dir_fd=at)
        except OSError as exc:
            if exc.errno == errno.ELOOP or (exc.errno == errno.ENOTDIR and os.path.islink(shown)):
                raise PermissionError(f"{shown} is a symlink: not read") from None
            raise

    folder, part = os.open(root, os.O_RDONLY | os.O_DIRECTORY), root
    try:
        for name in names[:-1]:
            part = os.path.join(part, name)
            inner = opened(name, os.O_RDONLY | os.O_DIRECTORY, folder, part)
            os.close(folder)
            folder = inner
        fd = opened(names[-1], os.O_RDONLY | os.O_NONBLOCK, folder, str(path))
    finally:
        os.close(folder)
    with os.fdopen(fd, "rb") as fh:
        st = os.fstat(fh.fileno())
        if not stat.S_ISREG(st.st_mode):
            raise PermissionError(f"{path} is not a regular file: not read")
        if tail and st.st_size > max_bytes:
            fh.seek(st.st_size - max_bytes)
        return fh.read(max_bytes)


def json_lines(data: bytes, last: int | None = None, cut_first: bool = False) -> list[Any]:
    """The JSON lines of ``data`` (its ``last`` ones), skipping any line that does not parse: a
    writer killed mid-line leaves a cut line (cut inside a UTF-8 character, too), which must
    not hide the others. ``cut_first``: the data starts mid-file, so its first line is a part."""
    lines = data.decode("utf-8", errors="replace").splitlines()
    if cut_first:
        lines = lines[1:]
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
