"""Server processes, identified so that a reused PID is never signalled.

A process is its PID *and* its start time (``/proc/PID/stat`` field 22, in clock ticks since
boot): a record whose PID now belongs to another process no longer matches. Each server leads its
own session, so its whole tree (SGLang's scheduler children included) is signalled together; the
kernel does not hand out a PID that is still a live session's id, so the members of a session
whose leader died are still that server's.
"""

from __future__ import annotations

import logging
import os
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

from regen.errors import RegenError

log = logging.getLogger("regen.procs")

_children: dict[int, subprocess.Popen] = {}  # reaped here when this process started them


class KeyDirError(RegenError):
    """The node user's private folder is not this user's alone."""


def private_dir() -> Path:
    """This user's owner-only folder on the node (``REGEN_KEY_DIR``, else ~/.cache/regen/keys):
    the servers' keys and seals, and the working folder of every child regen starts. A child
    started with ``-m`` or ``-c`` imports from its working folder first, so that folder must be
    one no output, temp folder or other user can write. An existing one must be this user's alone."""
    root = Path(os.environ.get("REGEN_KEY_DIR") or Path.home() / ".cache" / "regen" / "keys")
    root.mkdir(parents=True, exist_ok=True, mode=0o700)
    st = root.lstat()
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o077:
        raise KeyDirError(f"key folder {root}: must be a directory of this user's alone (it is "
                          f"{'a symlink' if stat.S_ISLNK(st.st_mode) else oct(st.st_mode & 0o777)}, owner uid "
                          f"{st.st_uid}); `chmod 700 {root}` or set REGEN_KEY_DIR to one")
    return root


def own_python(module: str) -> list[str]:
    """regen's interpreter running ``module``, with no script or working folder on its import
    path (``-P``): only regen's installed package (and PYTHONPATH, the deployment's) is imported."""
    return [sys.executable, "-P", "-m", module]


def _stat_fields(pid: int) -> list[str] | None:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None


def start_ticks(pid: int) -> int | None:
    """When the process started (clock ticks since boot); None when there is no such process."""
    fields = _stat_fields(pid)
    return int(fields[19]) if fields else None


def is_running(pid: int, ticks: int | None) -> bool:
    """The process that was recorded, and not a zombie (a reused PID has another start time)."""
    fields = _stat_fields(pid)
    if fields is None or fields[0] == "Z":
        return False
    return ticks is None or int(fields[19]) == ticks


def session_pids(sid: int) -> list[int]:
    """Live (non-zombie) processes of a session: whatever a server left behind."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        fields = _stat_fields(int(entry.name))
        if fields and int(fields[3]) == sid and fields[0] != "Z":
            pids.append(int(entry.name))
    return pids


def session_is_ours(pid: int, ticks: int | None) -> bool:
    """The session ``pid`` leads is the recorded server's: its leader is the recorded process, or
    the leader is gone and members remain (whose session id cannot have been reused)."""
    if is_running(pid, ticks):
        return True
    fields = _stat_fields(pid)
    return (fields is None or fields[0] == "Z") and bool(session_pids(pid))


def signal_session(pid: int, ticks: int | None, sig: int) -> bool:
    """Signal the server's session; False (and nothing signalled) when it is not ours any more."""
    if not session_is_ours(pid, ticks):
        return False
    try:
        os.killpg(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass
    for member in session_pids(pid):  # children that changed process group, still in the session
        try:
            os.kill(member, sig)
        except (ProcessLookupError, PermissionError):
            pass
    return True


def spawn(argv: list[str], log_path: Path, env: dict[str, str], secret: str | None = None) -> subprocess.Popen:
    """A server in a session of its own, its output appended to ``log_path`` (owner-only),
    working in :func:`private_dir`; with a ``secret``, through a pipe to :mod:`regen.logrelay`
    (a process of its own beside the server, not around it), which takes the secret out of the log."""
    cwd = private_dir()
    fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    os.chmod(log_path, 0o600)
    with os.fdopen(fd, "ab") as log_fh:
        if not secret:
            proc = subprocess.Popen(argv, stdout=log_fh, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                    env=env, start_new_session=True, cwd=cwd)
        else:
            read_end, write_end = os.pipe()
            try:
                relay = subprocess.Popen([*own_python("regen.logrelay"), str(log_path)], stdin=read_end,
                                         stdout=subprocess.DEVNULL, stderr=log_fh,
                                         env={**env, "REGEN_LOG_SECRET": secret}, start_new_session=True, cwd=cwd)
                _children[relay.pid] = relay
                proc = subprocess.Popen(argv, stdout=write_end, stderr=subprocess.STDOUT,
                                        stdin=subprocess.DEVNULL, env=env, start_new_session=True, cwd=cwd)
            finally:
                os.close(read_end)
                os.close(write_end)
    _children[proc.pid] = proc
    return proc


def reap(pid: int | None = None) -> None:
    """Collect the exit status of children that ended (``pid``: that one), so none is left a zombie."""
    for child_pid, proc in list(_children.items()):
        if (pid is None or child_pid == pid) and proc.poll() is not None:
            _children.pop(child_pid, None)


def stop_sessions(sessions: list[tuple[int, int | None, str]], grace_s: float) -> dict[str, list[int]]:
    """SIGTERM every (pid, start ticks, name) session at once, SIGKILL what is left after
    ``grace_s``; per name, the PIDs still alive after that."""
    ours = [(pid, name) for pid, ticks, name in sessions if signal_session(pid, ticks, signal.SIGTERM)]
    deadline = time.monotonic() + grace_s
    for pid, name in ours:
        while session_pids(pid) and time.monotonic() < deadline:
            reap(pid)
            time.sleep(0.1)
        if session_pids(pid):
            log.warning("%s ignored SIGTERM for %.0f s: SIGKILL", name, grace_s)
            signal_session(pid, None, signal.SIGKILL)  # members left: the session id is still its
            kill_deadline = time.monotonic() + 10
            while session_pids(pid) and time.monotonic() < kill_deadline:
                time.sleep(0.05)
        reap(pid)
    reap()  # the servers' log relays end with them
    return {name: session_pids(pid) for pid, name in ours}
