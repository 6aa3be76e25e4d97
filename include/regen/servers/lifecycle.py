"""One inference server per GPU: launch, health wait, re-entry, and a teardown that leaves nothing.

Each server runs in its own session (``setsid``), so the whole process tree, SGLang's scheduler
children included, is signalled as one group and outlives the Airflow task that started it. A
recorded server (regen.servers.records) is reused only when it is the same process, healthy,
launched with the same arguments and serving the same model; a teardown stops only the servers
its run owns. What is launched (argv, environment, GPUs) is planned in :mod:`regen.servers.plan`
from the engine's adapter; ports and health are probed with :mod:`regen.servers.probe`. The
node's watchdog (:mod:`regen.servers.watchdog`) is started with the first server and stopped
with the last.
"""

from __future__ import annotations

import logging
import os
import secrets
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Sequence

import httpx2

from regen import procs
from regen.config import RunConfig
from regen.coordination import FileLock, Lease, end_approval_hold, release_output
from regen.engines import engine
from regen.errors import RegenError
from regen.files import atomic_write_json, read_json
from regen.layout import RunLayout
from regen.machine import node_name
from regen.manifest import Manifest, model_fingerprint
from regen.results import ServerLogs, ServersStopped, ServersUp
from regen.quality import clear_quality_marks
from regen.servers.plan import build_command, server_env
from regen.servers.probe import is_healthy, log_tail, port_is_free
from regen.servers.gpus import server_devices
from regen.servers.records import ServerRecord, read_state, watchdog_file, write_state

log = logging.getLogger("regen.servers")
START_LEASE = "start-servers"  # held while servers start: a starter killed mid-way leaves it behind


class ServerError(RegenError):
    """A server that could not be started or stopped; the message says which and why."""


@contextmanager
def node_lock(layout: RunLayout):
    """One process at a time starts or stops this output's servers on this node."""
    layout.servers.mkdir(parents=True, exist_ok=True)
    os.chmod(layout.servers, 0o700)  # logs and servers.json hold what only the owner may read
    with FileLock(layout.servers_lock):
        yield


def mismatch(record: ServerRecord, cfg: RunConfig, model_path: str, fingerprint: str | None) -> str | None:
    """Why a recorded server cannot serve this config (None when it can)."""
    if record.model_fingerprint != fingerprint:
        return (f"it serves model {record.model_fingerprint} ({record.model_path}), this run "
                f"{fingerprint} ({model_path})")
    wanted = build_command(cfg, model_path, record.port)
    if record.launch != wanted:
        changed = sorted(set(wanted) ^ set(record.launch or []))[:6]
        return f"it was launched with other arguments (differing: {' '.join(changed)})"
    if cfg.servers.api_key and cfg.servers.api_key != record.api_key:
        return "it requires another API key"
    return None


def launch_servers(cfg: RunConfig, model_path: str, run_id: str = "cli",
                  fingerprint: str | None = None) -> list[ServerRecord]:
    """Healthy servers of this config, reusing what already serves it; idempotent."""
    layout = cfg.layout
    fingerprint = fingerprint or model_fingerprint(model_path)
    with node_lock(layout):
        previous = {r.index: r for r in refuse_other_nodes(read_state(layout))}
        records: list[ServerRecord] = []
        to_launch: list[tuple[int, str | None, int]] = []
        for index, gpu in enumerate(server_devices(cfg)):
            port = cfg.servers.base_port + index
            old = previous.pop(index, None)
            if old is not None and old.port == port and old.running():
                why = mismatch(old, cfg, model_path, fingerprint)
                if why is None and is_healthy(old.url):
                    log.info("server %d (port %d, run %s) is healthy and serves this config: reused",
                             index, port, old.owner)
                    records.append(old)
                    continue
                if why is not None and old.owner != run_id:
                    raise ServerError(
                        f"server {index} on port {port} belongs to run {old.owner!r} and cannot serve "
                        f"this one: {why}. Stop it (`regen serve --stop --run-id {old.owner}` with "
                        f"this config) or choose another base_port/output")
                log.info("server %d (port %d): %s; relaunching", index, port, why or "not healthy")
            if old is not None:
                stop_records([old])
            to_launch.append((index, gpu, port))
        for extra in previous.values():  # more servers recorded than this config has
            if extra.owner == run_id or not extra.running():
                stop_records([extra])
            else:
                records.append(extra)
        taken = [port for _, _, port in to_launch if not port_is_free(cfg.servers.host, port)]
        if taken:
            raise ServerError(
                f"port{'s' if len(taken) > 1 else ''} {', '.join(map(str, taken))} on {cfg.servers.host} "
                f"already in use: stop what holds {'them' if len(taken) > 1 else 'it'} or change base_port")
        api_key = cfg.servers.api_key or (records[0].api_key if records else None) or secrets.token_hex(24)
        # The lease keeps the watchdog from idling the servers out while they load (minutes); if
        # this process dies meanwhile, the lease dies with it and the watchdog stops them.
        with Lease(layout, START_LEASE, run_id) as lease:
            launched = _launch(cfg, layout, model_path, fingerprint, run_id, api_key, to_launch, records, lease)
        # Again after the launch: a watchdog that _launch found alive may have been on its way out
        # (its servers had just been torn down) and exited since.
        ensure_watchdog(layout, cfg.servers.idle_shutdown_s)
    clear_quality_marks(cfg.layout, [r.url for r in launched])  # servers started again: judged afresh
    return launched


def relaunch(layout: RunLayout, index: int) -> ServerRecord | None:
    """Start a recorded server again in place (same port, arguments, key), if it is still dead."""
    with node_lock(layout):
        records = read_state(layout)
        record = next((r for r in refuse_other_nodes(records) if r.index == index), None)
        if record is None or record.running() or procs.session_pids(record.pid):
            return record
        adapter = engine(record.engine)
        proc = procs.spawn(adapter.server_argv(record.launch or []), Path(record.log_path),
                           server_env(record.gpu, record.env, adapter.key_env(record.api_key or "")),
                           record.api_key)
        record.pid, record.start_ticks = proc.pid, procs.start_ticks(proc.pid)
        write_state(layout, records)
        log.info("server %d relaunched: pid %d, port %d", index, proc.pid, record.port)
        return record


def ensure_watchdog(layout: RunLayout, idle_shutdown_s: float | None) -> None:
    """One watchdog (regen.servers.watchdog) per output's servers, with this idle shutdown."""
    current = read_json(watchdog_file(layout)) or {}
    if procs.is_running(current.get("pid", 0), current.get("start_ticks")):
        if current.get("idle_shutdown_s") == idle_shutdown_s:
            return
        procs.stop_sessions([(current["pid"], current.get("start_ticks"), "watchdog")], grace_s=5)
    argv = [*procs.own_python("regen.servers.watchdog"), "--output", str(layout.root)]
    if layout.node:
        argv += ["--node", layout.node]
    if idle_shutdown_s:
        argv += ["--idle-shutdown-s", str(idle_shutdown_s)]
    proc = procs.spawn(argv, layout.watchdog_log, dict(os.environ))  # regen's own: its alerts use Airflow's notifiers
    atomic_write_json(watchdog_file(layout), {"pid": proc.pid, "start_ticks": procs.start_ticks(proc.pid),
                                              "idle_shutdown_s": idle_shutdown_s}, private=True)


def stop_watchdog(layout: RunLayout) -> None:
    path = watchdog_file(layout)
    current = read_json(path) or {}
    if current.get("pid") and current.get("pid") != os.getpid():
        procs.stop_sessions([(current["pid"], current.get("start_ticks"), "watchdog")], grace_s=5)
    path.unlink(missing_ok=True)


def _launch(cfg: RunConfig, layout: RunLayout, model_path: str, fingerprint: str | None, run_id: str,
            api_key: str, to_launch: list[tuple[int, str | None, int]],
            records: list[ServerRecord], lease: Lease) -> list[ServerRecord]:
    started: list[tuple[ServerRecord, subprocess.Popen]] = []
    # Before the first server: a starter killed at any point after this leaves nothing unwatched.
    ensure_watchdog(layout, cfg.servers.idle_shutdown_s)
    try:
        adapter = engine(cfg.engine)
        for index, gpu, port in to_launch:
            launch = build_command(cfg, model_path, port)
            log_path = layout.server_log(index)
            env = adapter.launch_env(gpu)
            proc = procs.spawn(adapter.server_argv(launch), log_path, server_env(gpu, env, adapter.key_env(api_key)),
                               api_key)
            record = ServerRecord(index, gpu, cfg.servers.host, port, proc.pid, str(log_path), api_key,
                                  procs.start_ticks(proc.pid), node_name(), run_id, launch, model_path,
                                  fingerprint, env=env or None, engine=cfg.engine)
            log.info("server %d: pid %d, port %d%s, log %s", index, proc.pid, port,
                     f", GPU {gpu}" if gpu is not None else "", log_path)
            started.append((record, proc))
            records.append(record)
        records.sort(key=lambda r: r.index)
        write_state(layout, records)
        wait_healthy(started, cfg.servers.startup_timeout_s, lease.renew)
        for record, _ in started:
            record.served_model = served_model_name(record)
        write_state(layout, records)
    except BaseException:
        stop_records([r for r, _ in started])
        write_state(layout, [r for r in records if all(r is not s for s, _ in started)])
        raise
    return records


def served_model_name(record: ServerRecord) -> str | None:
    try:
        response = httpx2.get(f"{record.url}/v1/models", timeout=10,
                              headers={"Authorization": f"Bearer {record.api_key}"} if record.api_key else {})
        return response.json()["data"][0]["id"]
    except (httpx2.HTTPError, ValueError, KeyError, IndexError):
        return None


def wait_healthy(launched: list[tuple[ServerRecord, subprocess.Popen]], timeout_s: float,
                 waiting: Callable[[], None] = lambda: None) -> None:
    """Ready means /health 200. A process that exits while starting fails at once, with its log.
    ``waiting`` is called at every poll (the caller renews its lease)."""
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
            waiting()
            time.sleep(0.25)


def stop_records(records: Sequence[ServerRecord], grace_s: float = 30.0) -> list[str]:
    """SIGTERM each server's session, SIGKILL after ``grace_s``; return what is still left."""
    left = procs.stop_sessions([(r.pid, r.start_ticks, f"server {r.index}") for r in records], grace_s)
    problems = []
    for record in records:
        if left.get(f"server {record.index}"):
            problems.append(f"server {record.index}: processes {left[f'server {record.index}']} still alive")
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


def stop_recorded(layout: RunLayout, run_id: str = "cli", every: bool = False,
                 grace_s: float = 30.0, keep_watchdog: bool = False) -> tuple[int, list[ServerRecord]]:
    """Teardown: stop this run's servers (``every``: whoever owns them) and check that nothing
    of them is left; (how many stopped, the others' records). Safe to repeat."""
    with node_lock(layout):
        records = read_state(layout)
        # A PID means nothing on another machine: servers recorded there are its teardown's.
        here = [r for r in records if r.is_here()]
        mine = [r for r in here if every or r.owner == run_id or not r.running()]
        others = [r for r in records if r not in mine]
        problems = stop_records(mine, grace_s)
        if problems:
            raise ServerError("teardown left something behind:\n" + "\n".join(problems))
        write_state(layout, others)
        if not others and not keep_watchdog:
            stop_watchdog(layout)
    stopped = len(mine)
    if others:
        log.info("left %d server(s) of run(s) %s running", len(others), sorted({r.owner for r in others}))
    log.info("stopped %d server(s); no process or port of them left", stopped)
    return stopped, others


def refuse_other_nodes(records: list[ServerRecord]) -> list[ServerRecord]:
    """``records`` when they are this machine's; ServerError naming both machines when any is
    another node's (a task that landed on the wrong worker: it must signal, start and record
    nothing here, or that node's servers would end up recorded nowhere)."""
    elsewhere = sorted({r.node for r in records if not r.is_here()})
    if elsewhere:
        raise ServerError(
            f"this output's servers run on node {', '.join(elsewhere)}; this task runs on {node_name()}, "
            f"which touches none of them: send the run's tasks to that node's own queue (config `queue`, "
            f"or nodes.N.queue), or stop them there (`regen serve --stop --every` on {elsewhere[0]})")
    return records


def recorded(cfg: RunConfig) -> list[ServerRecord]:
    """The servers start_servers recorded for this output, on this node; a clear message when
    there are none, or when they run on another node."""
    layout = cfg.layout
    records = read_state(layout)
    if not records:
        raise ServerError(
            f"no servers recorded in {layout.servers}: start_servers has not run for this output, "
            f"or stop_servers already ran. Clear the run from start_servers (untick 'only failed'), "
            f"or start them with `regen serve --config ...`"
        )
    return refuse_other_nodes(records)


# --- the stages ---------------------------------------------------------------------------------

def start_servers(cfg: RunConfig, served_model_path: str | None = None, run_id: str = "cli") -> ServersUp:
    """The start_servers stage: healthy servers serving ``served_model_path`` (the staged copy),
    owned by ``run_id``; the model's identity goes into the run manifest."""
    model_path = served_model_path or cfg.model_path
    manifest = Manifest(cfg.layout)
    staged = manifest.read().get("model") or {}
    fingerprint = staged.get("fingerprint") if staged.get("path") == model_path else None
    records = launch_servers(cfg, model_path, run_id, fingerprint)
    manifest.update(model={**staged, "path": model_path, "fingerprint": records[0].model_fingerprint,
                           "served": [r.public() for r in records],
                           "launch": records[0].launch})
    urls = [r.url for r in records]
    return ServersUp(urls=urls, servers=[r.public() for r in records],
                     summary=f"{len(urls)} server(s) healthy: {', '.join(urls)}")


def stop_servers(cfg: RunConfig, run_id: str = "cli", every: bool = False) -> ServersStopped:
    """The stop_servers stage: this run's servers (``every``: all recorded ones), and the hold of
    an approval that was rejected or never answered."""
    end_approval_hold(cfg.layout)
    stopped, others = stop_recorded(cfg.layout, run_id, every)
    release_output(cfg.layout, run_id)
    summary = f"stopped {stopped} server(s)"
    if others:
        summary += f"; left {len(others)} of run(s) {', '.join(sorted({r.owner for r in others}))}"
    return ServersStopped(stopped=stopped, left=[r.public() for r in others], summary=summary)


def server_logs(cfg: RunConfig, lines: int = 40) -> ServerLogs:
    """The last lines of every recorded server's log; once the servers are stopped (no record
    left), of the logs they left in the servers folder: what a post-mortem needs."""
    records = read_state(cfg.layout)
    if records:
        text = "\n".join(f"==> server {r.index} (port {r.port}, pid {r.pid}): {r.log_path}\n"
                         f"{log_tail(r.log_path, lines)}" for r in records)
        count = len(records)
    else:
        left = sorted(cfg.layout.servers.glob("server-*.log"), key=lambda p: (len(p.name), p.name))
        text = "\n".join(f"==> {p.stem} (stopped): {p}\n{log_tail(str(p), lines)}" for p in left)
        count = len(left)
    return ServerLogs(servers=count, logs=text,
                      summary=text or f"no server logs in {cfg.layout.servers} (no server started for this output)")
