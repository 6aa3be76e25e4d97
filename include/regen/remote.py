"""Running a stage on a GPU node reached by SSH (an Airflow SSH connection).

Each stage runs there as the node's own ``regen`` command, with the run's config passed as one
quoted JSON argument: staging, servers, canary, generation and audit all happen where the GPUs,
the RAM disk and the data are. Why generation runs on the node rather than through SSH tunnels
from the Airflow worker: the servers stay bound to the node's loopback; days of request traffic
do not ride one SSH connection whose loss would abort every request in flight; and the journal
and shards are written to the node's disk, next to the servers, so a retry resumes there.

The command gets a pseudo-terminal, so when the Airflow task is killed and the SSH session
closes, the remote process gets SIGHUP and dies with it instead of generating on, unseen; a
per-shard lock on the node guards the rest. Output is streamed to the task log line by line,
which also keeps a long, quiet stage from looking like a dead connection. Host keys are checked
as the SSH provider does (the connection's ``host_key`` extra, or known_hosts).
"""

from __future__ import annotations

import logging
import shlex
from dataclasses import dataclass

from regen.config import RunConfig

log = logging.getLogger("regen.remote")


class RemoteError(RuntimeError):
    """The remote command failed; the message carries the end of its output."""


@dataclass
class RemoteResult:
    exit_code: int
    lines: list[str]

    def tail(self, count: int = 30) -> str:
        return "\n".join(self.lines[-count:])


def remote_argv(cfg: RunConfig, *args: str) -> list[str]:
    """The node's regen command line: the config (minus the SSH hop) travels as JSON."""
    local = cfg.model_copy(update={"ssh_conn_id": None})
    # The pty makes the node's regen think a person watches: no progress bar in the task log.
    return [cfg.remote_regen, "--no-progress-bar", *args, "--config-json", local.model_dump_json()]


def run(conn_id: str, argv: list[str], keep_lines: int = 500) -> RemoteResult:
    from airflow.providers.ssh.hooks.ssh import SSHHook

    command = shlex.join(argv)  # every argument quoted: nothing from a Param is parsed by a shell
    hook = SSHHook(ssh_conn_id=conn_id, cmd_timeout=None)
    lines: list[str] = []
    with hook.get_conn() as client:
        channel = client.get_transport().open_session()
        channel.get_pty(width=250)
        channel.exec_command(command)
        pending = b""
        while True:
            chunk = channel.recv(65536)
            if not chunk:
                break
            pending += chunk
            *complete, pending = pending.split(b"\n")
            for raw in complete:
                line = raw.decode("utf-8", "replace").rstrip("\r")
                log.info("[%s] %s", conn_id, line)
                lines.append(line)
            del lines[:-keep_lines]
        if pending:
            lines.append(pending.decode("utf-8", "replace").rstrip("\r"))
        code = channel.recv_exit_status()
    return RemoteResult(code, lines)


def run_regen(cfg: RunConfig, *args: str, check: bool = True) -> RemoteResult:
    result = run(cfg.ssh_conn_id, remote_argv(cfg, *args))
    if check and result.exit_code != 0:
        raise RemoteError(f"`regen {' '.join(args)}` on {cfg.ssh_conn_id} exited with "
                          f"{result.exit_code}:\n{result.tail()}")
    return result
