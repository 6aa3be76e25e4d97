"""The serve stage: one inference server per GPU, health wait, re-entry, and a teardown that
leaves nothing.

Each server runs in its own session (``setsid``), so the whole process tree, SGLang's scheduler
children included, is signalled as one group and outlives the Airflow task that started it. What
was started is recorded in ``servers.json`` (:class:`regen.layout.RunLayout`); every later task
(canary, shards, teardown) and every re-run reads it from there. The launch command comes from the
engine's adapter (:mod:`regen.engines`).
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import shutil
import signal
import socket
import subprocess
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Sequence

import httpx

from regen.config import RunConfig
from regen.engines import engine
from regen.errors import RegenError
from regen.layout import RunLayout

log = logging.getLogger("regen.servers")


class ServerError(RegenError):
    """A server that could not be started or stopped; the message says which and why."""


@dataclass
class ServerRecord:
    index: int
    gpu: int | None
    host: str
    port: int
    pid: int
    log_path: str
    argv: list[str]
    api_key: str | None

    @property
    def url(self) -> str:
        host = "127.0.0.1" if self.host in ("0.0.0.0", "::") else self.host
        return f"http://{host}:{self.port}"


def detect_gpus() -> list[int]:
    """GPU indices from nvidia-smi; empty where there is none."""
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return []
    try:
        out = subprocess.run([smi, "--query-gpu=index", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=30, check=True).stdout
    except (subprocess.SubprocessError, OSError):
        return []
    return [int(line) for line in out.split() if line.strip().isdigit()]


def server_slots(cfg: RunConfig) -> list[int | None]:
    """One entry per server: its GPU index, or None for a CPU server."""
    if cfg.gpus:
        return list(cfg.gpus)
    if cfg.engine != "sim":
        gpus = detect_gpus()
        if gpus:
            return gpus
    return [None] * cfg.num_servers


def build_command(cfg: RunConfig, model_path: str, port: int, api_key: str | None) -> list[str]:
    """The launch argv of one server, from the engine's adapter. A list, never a shell string."""
    return engine(cfg.engine).launch_argv(cfg, model_path, port, api_key)


def server_env(gpu: int | None) -> dict[str, str]:
    env = dict(os.environ)
    if gpu is not None:
        env["CUDA_VISIBLE_DEVICES"] = str(gpu)
    env.setdefault("PYTHONUNBUFFERED", "1")
    return env


def port_is_free(host: str, port: int) -> bool:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError:
            return False
    return True


def is_healthy(url: str, timeout: float = 5.0) -> bool:
    try:
        return httpx.get(f"{url}/health", timeout=timeout).status_code == 200
    except httpx.HTTPError:
        return False


def read_state(layout: RunLayout) -> list[ServerRecord]:
    path = layout.servers_state
    if not path.exists():
        return []
    return [ServerRecord(**item) for item in json.loads(path.read_text())["servers"]]


def write_state(layout: RunLayout, records: Sequence[ServerRecord]) -> None:
    path = layout.servers_state
    tmp = path.with_suffix(".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)  # holds the API key
    with os.fdopen(fd, "w") as fh:
        json.dump({"servers": [asdict(r) for r in records]}, fh, indent=2)
    os.replace(tmp, path)


def log_tail(path: str | Path, lines: int = 20) -> str:
    try:
        with open(path, "rb") as fh:
            fh.seek(0, os.SEEK_END)
            fh.seek(max(0, fh.tell() - 16384))
            return "\n".join(fh.read().decode("utf-8", "replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


_children: dict[int, subprocess.Popen] = {}  # reaped by stop_servers when we are the parent


def start_servers(cfg: RunConfig, model_path: str) -> list[ServerRecord]:
    """Start what is not already healthy, wait for all; idempotent, so a re-run reuses servers."""
    layout = RunLayout(cfg.output)
    state_dir = layout.servers
    state_dir.mkdir(parents=True, exist_ok=True)
    previous = {r.index: r for r in read_state(layout)}
    slots = server_slots(cfg)
    records: list[ServerRecord] = []
    to_launch: list[tuple[int, int | None, int]] = []
    for index, gpu in enumerate(slots):
        port = cfg.base_port + index
        old = previous.get(index)
        if old and old.port == port and _alive(old.pid) and is_healthy(old.url):
            log.info("server %d (port %d) is healthy: reused", index, port)
            records.append(old)
            continue
        if old:
            stop_records([old])
        to_launch.append((index, gpu, port))
    taken = [port for _, _, port in to_launch if not port_is_free(cfg.host, port)]
    if taken:
        raise ServerError(
            f"port{'s' if len(taken) > 1 else ''} {', '.join(map(str, taken))} on {cfg.host} "
            f"already in use: stop what holds {'them' if len(taken) > 1 else 'it'} or change base_port"
        )
    api_key = cfg.api_key or (records[0].api_key if records else None) or secrets.token_hex(24)
    launched: list[tuple[ServerRecord, subprocess.Popen]] = []
    try:
        for index, gpu, port in to_launch:
            argv = build_command(cfg, model_path, port, api_key)
            log_path = layout.server_log(index)
            with open(log_path, "ab") as log_fh:
                proc = subprocess.Popen(argv, stdout=log_fh, stderr=subprocess.STDOUT,
                                        stdin=subprocess.DEVNULL, env=server_env(gpu),
                                        start_new_session=True, cwd=state_dir)
            _children[proc.pid] = proc
            record = ServerRecord(index, gpu, cfg.host, port, proc.pid, str(log_path), argv, api_key)
            log.info("server %d: pid %d, port %d%s, log %s", index, proc.pid, port,
                     f", GPU {gpu}" if gpu is not None else "", log_path)
            launched.append((record, proc))
            records.append(record)
        write_state(layout, sorted(records, key=lambda r: r.index))
        wait_healthy(launched, cfg.startup_timeout_s)
    except BaseException:
        stop_records([r for r, _ in launched])
        raise
    return sorted(records, key=lambda r: r.index)


def wait_healthy(launched: list[tuple[ServerRecord, subprocess.Popen]], timeout_s: float) -> None:
    """Ready means /health 200. A process that exits while starting fails at once, with its log."""
    deadline = time.monotonic() + timeout_s
    pending = list(launched)
    started = time.monotonic()
    while pending:
        for record, proc in list(pending):
            code = proc.poll()
            if code is not None:
                raise ServerError(
                    f"server {record.index} (port {record.port}) exited with code {code} while "
                    f"starting; last lines of {record.log_path}:\n{log_tail(record.log_path)}"
                )
            if is_healthy(record.url, timeout=2.0):
                log.info("server %d healthy after %.1f s", record.index, time.monotonic() - started)
                pending.remove((record, proc))
        if pending and time.monotonic() > deadline:
            names = ", ".join(str(r.index) for r, _ in pending)
            raise ServerError(
                f"server(s) {names} not healthy after {timeout_s:.0f} s (startup_timeout_s); "
                f"last lines of {pending[0][0].log_path}:\n{log_tail(pending[0][0].log_path)}"
            )
        if pending:
            time.sleep(0.25)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return _proc_state(pid) not in (None, "Z")


def _proc_state(pid: int) -> str | None:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rsplit(")", 1)[1].split()[0]


def session_pids(sid: int) -> list[int]:
    """Live (non-zombie) processes of a session: whatever a server left behind."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[3]) == sid and fields[0] != "Z":
            pids.append(int(entry.name))
    return pids


def _signal_session(sid: int, sig: int) -> None:
    try:
        os.killpg(sid, sig)
    except (ProcessLookupError, PermissionError):
        pass
    for pid in session_pids(sid):  # children that changed process group, still in the session
        try:
            os.kill(pid, sig)
        except (ProcessLookupError, PermissionError):
            pass


def stop_records(records: Sequence[ServerRecord], grace_s: float = 30.0) -> list[str]:
    """SIGTERM each server's session, SIGKILL after ``grace_s``; return what is still left."""
    for record in records:
        _signal_session(record.pid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    for record in records:
        while session_pids(record.pid) and time.monotonic() < deadline:
            _reap(record.pid)
            time.sleep(0.1)
        if session_pids(record.pid):
            log.warning("server %d ignored SIGTERM for %.0f s: SIGKILL", record.index, grace_s)
            _signal_session(record.pid, signal.SIGKILL)
            kill_deadline = time.monotonic() + 10
            while session_pids(record.pid) and time.monotonic() < kill_deadline:
                time.sleep(0.05)
        _reap(record.pid)
    problems = []
    for record in records:
        left = session_pids(record.pid)
        if left:
            problems.append(f"server {record.index}: processes {left} still alive")
        if not _port_released(record.host, record.port):
            problems.append(f"server {record.index}: port {record.port} still in use")
    return problems


def _port_released(host: str, port: int, wait_s: float = 5.0) -> bool:
    deadline = time.monotonic() + wait_s
    while not port_is_free(host, port):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)
    return True


def _reap(pid: int) -> None:
    proc = _children.get(pid)
    if proc is not None and proc.poll() is not None:
        _children.pop(pid, None)


def stop_servers(layout: RunLayout, grace_s: float = 30.0) -> int:
    """Teardown: stop every recorded server and check that nothing is left. Safe to repeat."""
    records = read_state(layout)
    if not records:
        log.info("no servers recorded in %s: nothing to stop", layout.servers)
        return 0
    problems = stop_records(records, grace_s)
    if problems:
        raise ServerError("teardown left something behind:\n" + "\n".join(problems))
    layout.servers_state.unlink(missing_ok=True)
    log.info("stopped %d server(s); no process or port left", len(records))
    return len(records)


def recorded_endpoints(cfg: RunConfig) -> list[tuple[str, str | None]]:
    """The servers start_servers recorded for this run; a clear message when there are none."""
    layout = RunLayout(cfg.output)
    records = read_state(layout)
    if not records:
        raise ServerError(
            f"no servers recorded in {layout.servers}: start_servers has not run for this output, "
            f"or stop_servers already ran. Clear the run from start_servers (untick 'only failed'), "
            f"or start them with `regen serve --config ...`"
        )
    return [(r.url, r.api_key) for r in records]


# --- the stages ---------------------------------------------------------------------------------

def serve(cfg: RunConfig, served_model_path: str | None = None) -> dict:
    """The start_servers stage: healthy servers serving ``served_model_path`` (the staged copy)."""
    records = start_servers(cfg, served_model_path or cfg.model_path)
    urls = [r.url for r in records]
    return {"urls": urls, "servers": [_public(r) for r in records],
            "summary": f"{len(urls)} server(s) healthy: {', '.join(urls)}"}


def stop(cfg: RunConfig) -> dict:
    """The stop_servers stage (teardown)."""
    stopped = stop_servers(RunLayout(cfg.output))
    return {"stopped": stopped, "summary": f"stopped {stopped} server(s)"}


def logs(cfg: RunConfig, lines: int = 40) -> dict:
    """The last lines of every recorded server's log."""
    records = read_state(RunLayout(cfg.output))
    text = "\n".join(f"==> server {r.index} (port {r.port}, pid {r.pid}): {r.log_path}\n"
                     f"{log_tail(r.log_path, lines)}" for r in records)
    return {"servers": len(records), "logs": text,
            "summary": text or f"no servers recorded in {RunLayout(cfg.output).servers}"}


def _public(record: ServerRecord) -> dict:
    """A record without its API key: what a result document and a log may carry."""
    return {"index": record.index, "url": record.url, "pid": record.pid, "gpu": record.gpu,
            "log": record.log_path}

