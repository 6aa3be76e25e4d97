"""The SSH transport of :mod:`regen.pipeline`: a stage run by a GPU node's own ``regen``.

The stage runs there as ``regen run-stage``, with the run's config in an owner-only file on the
node (written over the same SSH connection, read and removed by the stage: a command line is
readable by every local user, and the config may hold the servers' key). Staging, servers,
canary, generation and audit all happen where the GPUs, the RAM disk and the data are. Why generation runs on the node rather than through SSH tunnels from the Airflow
worker: the servers stay bound to the node's loopback; days of request traffic do not ride one SSH
connection whose loss would abort every request in flight; and the journal and shards are written
to the node's disk, next to the servers, so a retry resumes there.

The stage runs detached on the node (its own session, no terminal, its output in a job folder
under ~/.cache/regen/jobs) and is followed over SSH: its log is streamed to the task log line by
line, and when the link drops or goes silent (a keepalive unanswered) the follower reconnects and
reads on from the byte it had reached, so a network blip costs neither the requests in flight nor
a retry. A retry of the same stage (same config and arguments) follows the job its attempt left
running instead of starting a second; a task that is stopped stops its job (SIGTERM to its process
group), and a node that cannot be reached stops it at the stage's own deadline; a per-shard lock on
the node guards the rest. The result comes back on the one line that starts with a token drawn
for the job. Host keys are checked as the SSH provider does (the connection's ``host_key`` extra,
or known_hosts).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import re
import secrets
import shlex
import signal
import socket
import threading
import time
from dataclasses import dataclass, field

from regen.config import RunConfig
from regen.errors import RemoteError
from regen.stages import DEADLINE_MOVED

log = logging.getLogger("regen.remote")


@dataclass
class RemoteOutput:
    exit_code: int
    lines: list[str]
    result: str | None  # the text after the result marker, when the node printed one

    def tail(self, count: int = 30) -> str:
        return "\n".join(self.lines[-count:])


CONNECT_TIMEOUT_S = 30
# A remote stage gets its own deadline (regen.stages) plus this long to stop by itself there and
# say so (a shard on the node stops at its deadline with its journal written); after that the
# command is given up, as a hung node's would be.
DEADLINE_GRACE_S = 120.0
UPLOAD_DEADLINE_S = 60.0

# Relative to the SSH user's home, where the command starts.
INPUT_DIR = (".cache", "regen", "stage-input")
JOBS_DIR = (".cache", "regen", "jobs")  # one folder per detached job: pid, log, exit status
# A channel quiet this long gets a keepalive; one unanswered this long means the link is gone.
KEEPALIVE_S = 15.0
LINK_SILENT_S = 20.0
MOVED_DEADLINE = re.compile(re.escape(DEADLINE_MOVED) + r" ([0-9]+) s")


def stage_input(cfg: RunConfig) -> str:
    """The config the node's stage runs with (minus the SSH hop), as the file's content."""
    return cfg.model_copy(update={"ssh_conn_id": None}).model_dump_json()


def stage_argv(cfg: RunConfig, name: str, kwargs: dict, marker: str, config_file: str) -> list[str]:
    """The node's command line: where the config is, the stage's arguments as JSON; no config value."""
    # The task log is no terminal: no progress bar in it.
    return [cfg.remote_regen, "--no-progress-bar", "run-stage", name, "--config-json-file", config_file,
            "--kwargs-json", json.dumps(kwargs), "--result-marker", marker]


def start_command(transport, command: str, within_s: float):
    """A channel running ``command``, or LinkDropped when the node does not answer within
    ``within_s``: paramiko waits for an exec's answer for good (and an hour for the channel),
    so a link that goes silent between two commands would hold the task past every deadline."""
    import paramiko

    watchdog = threading.Timer(within_s, transport.close)  # the waits below then raise
    watchdog.start()
    try:
        channel = transport.open_session(timeout=within_s)
        channel.exec_command(command)
        return channel
    except (paramiko.SSHException, OSError, EOFError) as exc:
        raise LinkDropped(f"the node did not start a command within {within_s:.0f} s ({exc or type(exc).__name__})") from None
    finally:
        watchdog.cancel()


def upload_private(client, content: str) -> str:
    """``content`` in a new owner-only file under the SSH user's home on the node; its path.
    Sent on the stdin of a command without a terminal (nothing echoed, nothing on a command
    line); ``set -C`` refuses an existing file or a link planted under that name."""
    folder = "/".join(INPUT_DIR)
    path = f"{folder}/{secrets.token_hex(16)}.json"
    command = f"umask 077 && mkdir -p {folder} && chmod 700 {folder} && set -C && cat > {path}"
    channel = start_command(client.get_transport(), command, UPLOAD_DEADLINE_S)  # only names regen drew
    try:
        channel.settimeout(UPLOAD_DEADLINE_S)
        channel.sendall(content.encode())
        channel.shutdown_write()
        if not channel.status_event.wait(UPLOAD_DEADLINE_S):
            raise RemoteError(f"writing the stage's config on the node took over {UPLOAD_DEADLINE_S:.0f} s; given up")
        code = channel.recv_exit_status()
        if code != 0:
            raise RemoteError(f"could not write the stage's config on the node ({command!r} exited {code}: "
                              f"{channel.recv_stderr(4096).decode('utf-8', 'replace').strip()})")
    finally:
        channel.close()
    return path


@contextlib.contextmanager
def connected(conn_id: str, timeout_s: float = CONNECT_TIMEOUT_S, attempts: int = 3):
    """An SSH client of the connection ``conn_id``, closed after."""
    client = open_client(conn_id, timeout_s, attempts)
    with client:
        yield client


def open_client(conn_id: str, timeout_s: float = CONNECT_TIMEOUT_S, attempts: int = 3):
    """An SSH client of the connection ``conn_id``, host key verified as the SSH provider does;
    each way it can fail is one RemoteError line that says what to fix (never a traceback).
    ``attempts``: the provider's own tries, a few seconds apart (1 where the caller loops)."""
    import paramiko
    from airflow.providers.ssh.hooks.ssh import SSHHook

    try:
        # A node that does not answer fails the connection in seconds (the command itself may run
        # for hours: generation); so is a hung node's banner.
        hook = SSHHook(ssh_conn_id=conn_id, cmd_timeout=None, conn_timeout=timeout_s,
                       banner_timeout=timeout_s, conn_retry_attempts=attempts)
    except Exception as exc:  # the provider's own: an unknown connection, a malformed extra
        text = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        if type(exc).__name__ == "AirflowNotFoundException":
            raise RemoteError(f"ssh_conn_id {conn_id}: no such Airflow connection (add it: airflow connections "
                              f"add {conn_id} --conn-type ssh ...)") from None
        raise RemoteError(f"ssh_conn_id {conn_id}: the connection's fields or extras (host_key, key_file, "
                          f"private_key) cannot be used: {text}") from None
    where = f"{conn_id} ({hook.username}@{hook.remote_host}:{hook.port or 22})"
    try:
        return hook.get_conn()
    except paramiko.BadHostKeyException as exc:
        raise RemoteError(f"ssh_conn_id {where}: the node's host key is not the one the connection names "
                          f"({exc.key.get_name()} {exc.key.get_base64()[:16]}...): a changed node or another machine "
                          f"answering; update the connection's host_key only once you know why") from None
    except paramiko.AuthenticationException as exc:
        raise RemoteError(f"ssh_conn_id {where}: authentication failed ({exc}); check the connection's login "
                          f"and key") from None
    except (paramiko.SSHException, OSError) as exc:
        text = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise RemoteError(f"ssh_conn_id {where}: cannot connect: {text}") from None


def job_id(name: str, kwargs: dict, content: str) -> str:
    """The same stage with the same config and arguments is the same job: a retry finds the one
    its previous attempt left running and follows it instead of starting a second."""
    return hashlib.sha256("\0".join([name, json.dumps(kwargs, sort_keys=True), content]).encode()).hexdigest()[:24]


def _ours(d: str) -> str:
    """Shell test: the process in ``d``/pid is the job regen started there: its start time (field
    22 of /proc/PID/stat) is the one recorded at launch, and its environment holds the launch's
    nonce. A process that only names the job (a reused PID, a decoy) is not."""
    return (f"P=$(cat {d}/pid 2>/dev/null) && [ -n \"$P\" ] && "
            f"[ \"$(cut -d' ' -f22 /proc/$P/stat 2>/dev/null)\" = \"$(cat {d}/start 2>/dev/null)\" ] && "
            f"tr '\\0' '\\n' < /proc/$P/environ 2>/dev/null | grep -qxF \"REGEN_JOB_NONCE=$(cat {d}/nonce)\"")


def launch_script(folder: str, argv: list[str], config_path: str, result_marker: str) -> str:
    """Start ``argv`` detached on the node (its own session, no terminal: a dropped link does not
    hang up on it), with its output in ``folder``/log and its exit status in ``folder``/exit; or,
    if the job regen started there still runs (:func:`_ours`), only say so."""
    d = shlex.quote(folder)
    wrapped = shlex.quote(f"{shlex.join(argv)}; echo $? > {folder}/exit.part && mv {folder}/exit.part {folder}/exit")
    return (f"umask 077; "
            f"if [ ! -e {d}/exit ] && {_ours(d)}; then "
            f"rm -f {shlex.quote(config_path)}; echo attached; exit 0; fi; "
            f"rm -rf {d} && mkdir -p {d} && printf %s {shlex.quote(result_marker)} > {d}/marker || exit 1; "
            f"N=$(od -An -N16 -tx1 /dev/urandom | tr -d ' \\n') && printf %s \"$N\" > {d}/nonce || exit 1; "
            # a simple command put in the background: $! is the new session's leader, its group's id
            f"REGEN_JOB_NONCE=$N PYTHONUNBUFFERED=1 setsid nohup sh -c {wrapped} > {d}/log 2>&1 < /dev/null & "
            f"echo $! > {d}/pid; cut -d' ' -f22 /proc/$!/stat > {d}/start; echo launched")


def follow_script(folder: str, offset: int, marker: str) -> str:
    """The job's log from byte ``offset`` on, as it grows, until the job ends; then its exit
    status. The first line names the job's result marker; the last starts with ``marker``."""
    d = shlex.quote(folder)
    return (f"P=$(cat {d}/pid 2>/dev/null) || {{ printf '\\n%s lost\\n' {marker}; exit 0; }}; "
            f"printf '%s %s\\n' {marker} \"$(cat {d}/marker)\"; "
            f"tail -c +{offset + 1} --pid=\"$P\" -f {d}/log; "
            f"printf '\\n%s %s\\n' {marker} \"$(cat {d}/exit 2>/dev/null || echo lost)\"")


def stop_job(conn_id: str, folder: str) -> None:
    """The job's process group gets SIGTERM (the stage stops as it does at its deadline, journal
    written): the Airflow task that followed it was stopped. Best effort: a node that cannot be
    reached stops the job at its own deadline."""
    d = shlex.quote(folder)
    try:
        with connected(conn_id, timeout_s=10, attempts=1) as client:
            _, stdout, _ = client.exec_command(f"{_ours(d)} && kill -TERM -$P", timeout=10)
            stdout.channel.recv_exit_status()
    except Exception as exc:  # noqa: BLE001 - the caller is already failing; say why this did not help
        log.warning("could not stop the job %s on %s (%s); it stops at its own deadline", folder, conn_id, exc)


class TaskStopped(BaseException):
    """SIGTERM reached the process that follows a job: the job must stop with it."""


@contextlib.contextmanager
def stopped_by_sigterm():
    """SIGTERM raises TaskStopped while a job is followed, after the handler that was there
    (Airflow's task runner calls the task's on_kill and returns). Airflow stops a task with
    SIGINT, then SIGTERM, then SIGKILL, and SIGINT is ignored by a worker started in the
    background; without this the job would outlive its task. Only the main thread gets signals."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.getsignal(signal.SIGTERM)

    def on_term(signum, frame):
        if callable(previous):
            previous(signum, frame)
        raise TaskStopped(f"signal {signum}")

    signal.signal(signal.SIGTERM, on_term)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


class LinkDropped(Exception):
    """The SSH link to the node broke or went silent; the job on the node goes on."""


def link_alive(transport, within_s: float) -> bool:
    """Whether the node's sshd answers a keepalive within ``within_s``: a quiet stage and a dead
    link look alike on the channel."""
    answered = threading.Event()

    def ask() -> None:
        transport.global_request("keepalive@openssh.com", wait=True)  # OpenSSH answers "failure": still an answer
        if transport.is_active():
            answered.set()

    threading.Thread(target=ask, daemon=True).start()
    return answered.wait(within_s)


@dataclass
class Follower:
    """Reads a detached job's log over one connection after another, from where the last one
    stopped; the lines go to the task log, the result line is kept."""

    conn_id: str
    folder: str
    keep_lines: int = 500
    offset: int = 0
    result_marker: str | None = None
    result: str | None = None
    ends: float | None = None  # monotonic: when to give up on the job (None: never)
    started: float = field(default_factory=time.monotonic)

    def __post_init__(self):
        self.lines: list[str] = []
        self.pending = b""

    def take(self, raw: bytes) -> None:
        line = raw.decode("utf-8", "replace").rstrip("\r")
        if self.result_marker and line.startswith(self.result_marker):
            self.result = line[len(self.result_marker):]
            return
        moved = MOVED_DEADLINE.search(line)
        if moved and self.ends is not None:  # the job's deadline moved with its pace: wait for it
            self.ends = max(self.ends, self.started + float(moved.group(1)) + DEADLINE_GRACE_S)
        if line:
            log.info("[%s] %s", self.conn_id, line)
        self.lines.append(line)
        del self.lines[:-self.keep_lines]

    def attach(self, client) -> str:
        """Follow until the job ends (its exit status, or "lost"), the link drops (LinkDropped) or
        ``ends`` passes (TimeoutError)."""
        marker = f"regen-end-{secrets.token_hex(8)}"
        within = LINK_SILENT_S if self.ends is None else max(0.1, min(self.ends - time.monotonic(), LINK_SILENT_S))
        channel = start_command(client.get_transport(), follow_script(self.folder, self.offset, marker), within)
        head, first = b"", True
        while True:
            ends = self.ends
            if ends is not None and time.monotonic() >= ends:
                channel.close()
                raise TimeoutError
            channel.settimeout(KEEPALIVE_S if ends is None else max(0.1, min(ends - time.monotonic(), KEEPALIVE_S)))
            try:
                chunk = channel.recv(65536)
            except socket.timeout:
                if not link_alive(client.get_transport(), LINK_SILENT_S):
                    raise LinkDropped(f"the node did not answer a keepalive within {LINK_SILENT_S:.0f} s") from None
                continue
            except (OSError, EOFError) as exc:
                raise LinkDropped(str(exc) or type(exc).__name__) from None
            if not chunk:
                raise LinkDropped("the connection closed before the job's end was seen")
            if first:  # the header line: the job's result marker
                head += chunk
                if b"\n" not in head:
                    continue
                line, chunk = head.split(b"\n", 1)
                text = line.decode("utf-8", "replace")
                if not text.startswith(marker):  # no job folder there: "lost" after an empty line
                    return "lost"
                self.result_marker, first = text[len(marker) + 1:], False
            self.offset += len(chunk)
            self.pending += chunk
            *complete, self.pending = self.pending.split(b"\n")
            for raw in complete:
                if raw.startswith(marker.encode()):  # the job ended: its status, then nothing more
                    self.offset -= len(raw) + 1
                    return raw[len(marker):].decode().strip()
                self.take(raw)


def run_detached(conn_id: str, job: str, argv: list[str], upload: str, result_marker: str,
                 deadline_s: float | None = None) -> RemoteOutput:
    """``argv`` as a job detached on the node, followed until it ends: a link that drops or goes
    silent is reconnected and the job re-attached where its log was left; a retry of the same
    stage follows the job its attempt left running. ``upload`` goes to a private file first,
    ``{upload}`` in argv naming it. Given up (RemoteError, the job stopped) after ``deadline_s``
    or when the task is stopped."""
    folder = "/".join((*JOBS_DIR, job))
    follower = Follower(conn_id, folder, ends=None if deadline_s is None else time.monotonic() + deadline_s)
    client = open_client(conn_id)
    launched = False
    try:
        path = upload_private(client, upload)
        argv = [path if arg == "{upload}" else arg for arg in argv]
        channel = start_command(client.get_transport(), launch_script(folder, argv, path, result_marker),
                                UPLOAD_DEADLINE_S)
        channel.settimeout(UPLOAD_DEADLINE_S)
        how = channel.makefile("rb").read().decode().strip()
        if channel.recv_exit_status() != 0 or how not in ("launched", "attached"):
            raise RemoteError(f"could not start `{shlex.join(argv[:4])}` on {conn_id}: "
                              f"{channel.makefile_stderr('rb').read().decode('utf-8', 'replace').strip() or how}")
        launched = True
        if how == "attached":
            log.info("[%s] an earlier attempt's job %s still runs there: following it", conn_id, folder)
        while True:
            try:
                status = follower.attach(client)
                break
            except LinkDropped as exc:
                log.warning("[%s] link lost (%s); the job goes on on the node; re-attaching", conn_id, exc)
            client.close()
            client = reconnect(conn_id, follower.ends)
            log.info("[%s] re-attached at byte %d of the job's log", conn_id, follower.offset)
        with contextlib.suppress(Exception):
            client.exec_command(f"rm -rf {shlex.quote(folder)}", timeout=10)[1].channel.recv_exit_status()
    except LinkDropped as exc:  # on the way to the job: it may have started, and must not run on unseen
        stop_job(conn_id, folder)
        raise RemoteError(f"could not start `{shlex.join(argv[:4])}` on {conn_id}: {exc}") from None
    except TimeoutError:
        stop_job(conn_id, folder)
        raise RemoteError(f"`{shlex.join(argv[:4])}` on {conn_id} did not end within "
                          f"{follower.ends - follower.started:.0f} s "
                          f"(a hung node or command); given up. Last lines:\n" + "\n".join(follower.lines[-10:])) from None
    except BaseException:  # the task was stopped, or this side failed: the job must not generate on, unseen
        if launched:
            stop_job(conn_id, folder)
        raise
    finally:
        client.close()
    if follower.pending:
        follower.take(follower.pending)
    code = int(status) if status.lstrip("-").isdigit() else -1
    return RemoteOutput(code, follower.lines, follower.result)


def reconnect(conn_id: str, ends: float | None):
    """A new client once the node answers again, trying with a growing pause; TimeoutError at ``ends``."""
    wait = 1.0
    while True:
        if ends is not None and time.monotonic() + wait >= ends:
            raise TimeoutError
        time.sleep(wait)  # a pause between attempts, not a synchronisation
        try:
            timeout = CONNECT_TIMEOUT_S if ends is None else max(1.0, min(CONNECT_TIMEOUT_S, ends - time.monotonic()))
            return open_client(conn_id, timeout, attempts=1)
        except RemoteError as exc:
            wait = min(wait * 2, 30.0)
            log.warning("[%s] %s; trying again in %.0f s", conn_id, exc, wait)


def run_stage(cfg: RunConfig, name: str, kwargs: dict) -> dict:
    """The stage's result document, as the node's ``regen run-stage`` wrote it."""
    from regen.stages import stage

    marker = f"regen-result-{secrets.token_hex(16)} "
    deadline = stage(name).deadline(cfg.servers.startup_timeout_s, kwargs) + DEADLINE_GRACE_S
    content = stage_input(cfg)
    with stopped_by_sigterm():
        out = run_detached(cfg.ssh_conn_id, job_id(name, kwargs, content), stage_argv(cfg, name, kwargs, marker, "{upload}"),
                           upload=content, result_marker=marker, deadline_s=deadline)
    if out.result is None:
        raise RemoteError(f"`regen run-stage {name}` on {cfg.ssh_conn_id} exited with "
                          f"{out.exit_code} without a result:\n{out.tail()}")
    try:
        return json.loads(out.result)
    except ValueError as exc:
        raise RemoteError(f"`regen run-stage {name}` on {cfg.ssh_conn_id}: unreadable result "
                          f"({exc})") from None
