"""The SSH transport of :mod:`regen.pipeline`: a stage run by a GPU node's own ``regen``.

The stage runs there as ``regen run-stage``, with the run's config in an owner-only file on the
node (written over the same SSH connection, read and removed by the stage: a command line is
readable by every local user, and the config may hold the servers' key). Staging, servers,
canary, generation and audit all happen where the GPUs, the RAM disk and the data are. Why generation runs on the node rather than through SSH tunnels from the Airflow
worker: the servers stay bound to the node's loopback; days of request traffic do not ride one SSH
connection whose loss would abort every request in flight; and the journal and shards are written
to the node's disk, next to the servers, so a retry resumes there.

The command gets a pseudo-terminal, so when the Airflow task is killed and the SSH session
closes, the remote process gets SIGHUP and dies with it instead of generating on, unseen; a
per-shard lock on the node guards the rest. Output is streamed to the task log line by line,
which also keeps a long, quiet stage from looking like a dead connection. The result comes back on
the one line that starts with a token drawn for this call. Host keys are checked as the SSH
provider does (the connection's ``host_key`` extra, or known_hosts).
"""

from __future__ import annotations

import contextlib
import json
import logging
import secrets
import shlex
import socket
import time
from dataclasses import dataclass

from regen.config import RunConfig
from regen.errors import RemoteError

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


def stage_input(cfg: RunConfig) -> str:
    """The config the node's stage runs with (minus the SSH hop), as the file's content."""
    return cfg.model_copy(update={"ssh_conn_id": None}).model_dump_json()


def stage_argv(cfg: RunConfig, name: str, kwargs: dict, marker: str, config_file: str) -> list[str]:
    """The node's command line: where the config is, the stage's arguments as JSON; no config value."""
    # The pty makes the node's regen think a person watches: no progress bar in the task log.
    return [cfg.remote_regen, "--no-progress-bar", "run-stage", name, "--config-json-file", config_file,
            "--kwargs-json", json.dumps(kwargs), "--result-marker", marker]


def upload_private(client, content: str) -> str:
    """``content`` in a new owner-only file under the SSH user's home on the node; its path.
    Sent on the stdin of a command without a terminal (nothing echoed, nothing on a command
    line); ``set -C`` refuses an existing file or a link planted under that name."""
    folder = "/".join(INPUT_DIR)
    path = f"{folder}/{secrets.token_hex(16)}.json"
    command = f"umask 077 && mkdir -p {folder} && chmod 700 {folder} && set -C && cat > {path}"
    channel = client.get_transport().open_session()
    try:
        channel.settimeout(UPLOAD_DEADLINE_S)
        channel.exec_command(command)  # only names regen drew: no value of the run's
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
def connected(conn_id: str):
    """An SSH client of the connection ``conn_id``, host key verified as the SSH provider does;
    each way it can fail is one RemoteError line that says what to fix (never a traceback)."""
    import paramiko
    from airflow.providers.ssh.hooks.ssh import SSHHook

    try:
        # A node that does not answer fails the connection in seconds (the command itself may run
        # for hours: generation); a hung node's banner is waited for at most SSHHook's 30 s.
        hook = SSHHook(ssh_conn_id=conn_id, cmd_timeout=None, conn_timeout=CONNECT_TIMEOUT_S)
    except Exception as exc:  # the provider's own: an unknown connection, a malformed extra
        text = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        if type(exc).__name__ == "AirflowNotFoundException":
            raise RemoteError(f"ssh_conn_id {conn_id}: no such Airflow connection (add it: airflow connections "
                              f"add {conn_id} --conn-type ssh ...)") from None
        raise RemoteError(f"ssh_conn_id {conn_id}: the connection's fields or extras (host_key, key_file, "
                          f"private_key) cannot be used: {text}") from None
    where = f"{conn_id} ({hook.username}@{hook.remote_host}:{hook.port or 22})"
    try:
        client = hook.get_conn()
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
    with client:
        yield client


def run_command(conn_id: str, argv: list[str], marker: str, keep_lines: int = 500,
                upload: str | None = None, deadline_s: float | None = None) -> RemoteOutput:
    """``argv`` on the node; with ``upload``, that text first goes to a private file there, and
    ``{upload}`` in argv is replaced by its path. A command still running after ``deadline_s``
    (a hung node: the connection is up, nothing comes back) is given up: RemoteError; closing
    its session hangs up on the command, if the node still listens."""
    lines: list[str] = []
    result = None
    with connected(conn_id) as client:
        if upload is not None:
            path = upload_private(client, upload)
            argv = [path if arg == "{upload}" else arg for arg in argv]
        command = shlex.join(argv)  # every argument quoted: nothing from a Param is parsed by a shell
        channel = client.get_transport().open_session()
        channel.get_pty(width=250)
        channel.exec_command(command)
        ends = None if deadline_s is None else time.monotonic() + deadline_s
        pending = b""
        while True:
            if ends is not None:
                left = ends - time.monotonic()
                if left <= 0:
                    channel.close()
                    raise RemoteError(f"`{shlex.join(argv[:4])}` on {conn_id} did not end within "
                                      f"{deadline_s:.0f} s (a hung node or command); given up. "
                                      f"Last lines:\n" + "\n".join(lines[-10:]))
                channel.settimeout(min(left, 5.0))
            try:
                chunk = channel.recv(65536)
            except socket.timeout:
                continue
            if not chunk:
                break
            pending += chunk
            *complete, pending = pending.split(b"\n")
            for raw in complete:
                line = raw.decode("utf-8", "replace").rstrip("\r")
                if line.startswith(marker):
                    result = line[len(marker):]
                    continue
                log.info("[%s] %s", conn_id, line)
                lines.append(line)
            del lines[:-keep_lines]
        if pending:
            line = pending.decode("utf-8", "replace").rstrip("\r")
            if line.startswith(marker):
                result = line[len(marker):]
            else:
                lines.append(line)
        code = channel.recv_exit_status()
    return RemoteOutput(code, lines, result)


def run_stage(cfg: RunConfig, name: str, kwargs: dict) -> dict:
    """The stage's result document, as the node's ``regen run-stage`` wrote it."""
    from regen.stages import stage

    marker = f"regen-result-{secrets.token_hex(16)} "
    deadline = stage(name).deadline(cfg.servers.startup_timeout_s, kwargs) + DEADLINE_GRACE_S
    out = run_command(cfg.ssh_conn_id, stage_argv(cfg, name, kwargs, marker, "{upload}"), marker,
                      upload=stage_input(cfg), deadline_s=deadline)
    if out.result is None:
        raise RemoteError(f"`regen run-stage {name}` on {cfg.ssh_conn_id} exited with "
                          f"{out.exit_code} without a result:\n{out.tail()}")
    try:
        return json.loads(out.result)
    except ValueError as exc:
        raise RemoteError(f"`regen run-stage {name}` on {cfg.ssh_conn_id}: unreadable result "
                          f"({exc})") from None
