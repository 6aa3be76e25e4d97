"""The SSH transport of :mod:`regen.pipeline`: a stage run by a GPU node's own ``regen``.

The stage runs there as ``regen run-stage``, with the run's config passed as one quoted JSON
argument: staging, servers, canary, generation and audit all happen where the GPUs, the RAM disk
and the data are. Why generation runs on the node rather than through SSH tunnels from the Airflow
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

import json
import logging
import secrets
import shlex
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


def stage_argv(cfg: RunConfig, name: str, kwargs: dict, marker: str) -> list[str]:
    """The node's command line: the config (minus the SSH hop) and arguments travel as JSON."""
    local = cfg.model_copy(update={"ssh_conn_id": None})
    # The pty makes the node's regen think a person watches: no progress bar in the task log.
    return [cfg.remote_regen, "--no-progress-bar", "run-stage", name, "--config-json",
            local.model_dump_json(), "--kwargs-json", json.dumps(kwargs), "--result-marker", marker]


def run_command(conn_id: str, argv: list[str], marker: str, keep_lines: int = 500) -> RemoteOutput:
    from airflow.providers.ssh.hooks.ssh import SSHHook

    command = shlex.join(argv)  # every argument quoted: nothing from a Param is parsed by a shell
    hook = SSHHook(ssh_conn_id=conn_id, cmd_timeout=None)
    lines: list[str] = []
    result = None
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
    marker = f"regen-result-{secrets.token_hex(16)} "
    out = run_command(cfg.ssh_conn_id, stage_argv(cfg, name, kwargs, marker), marker)
    if out.result is None:
        raise RemoteError(f"`regen run-stage {name}` on {cfg.ssh_conn_id} exited with "
                          f"{out.exit_code} without a result:\n{out.tail()}")
    try:
        return json.loads(out.result)
    except ValueError as exc:
        raise RemoteError(f"`regen run-stage {name}` on {cfg.ssh_conn_id}: unreadable result "
                          f"({exc})") from None
