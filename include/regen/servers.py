"""One inference server per GPU: launch, health wait, re-entry and a teardown that leaves nothing.

Each server runs in its own session (``setsid``), so the whole process tree, SGLang's scheduler
children included, is signalled as one group and outlives the Airflow task that started it. What
was started is recorded in ``servers.json`` in the run's state directory; every later task (canary,
shards, teardown) and every re-run reads it from there.
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
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Sequence

import httpx

from regen.config import RunConfig

log = logging.getLogger("regen.servers")

STATE_FILE = "servers.json"


class ServerError(RuntimeError):
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
    """The launch argv of one server. A list, never a shell string: no value is ever parsed."""
    python = cfg.engine_python or sys.executable
    common_flag = lambda flag, value: [flag, str(value)] if value is not None else []  # noqa: E731
    if cfg.engine == "vllm":
        argv = [python, "-m", "vllm.entrypoints.openai.api_server", "--model", model_path,
                "--host", cfg.host, "--port", str(port)]
        argv += common_flag("--api-key", api_key)
        argv += common_flag("--reasoning-parser", cfg.reasoning_parser)
        argv += common_flag("--max-num-seqs", cfg.max_running_requests)
        argv += common_flag("--gpu-memory-utilization", cfg.mem_fraction_static)
        argv += common_flag("--max-model-len", cfg.context_length)
        if cfg.speculative_algorithm:
            argv += ["--speculative-config", json.dumps(vllm_speculative_config(cfg))]
        return argv + list(cfg.extra_server_args)
    if cfg.engine == "sglang":
        argv = [python, "-m", "sglang.launch_server"]
    else:
        argv = [python, "-m", "regen", "sim"]
    argv += ["--model-path", model_path, "--host", cfg.host, "--port", str(port), "--enable-metrics"]
    argv += common_flag("--api-key", api_key)
    argv += common_flag("--reasoning-parser", cfg.reasoning_parser)
    argv += common_flag("--speculative-algorithm", cfg.speculative_algorithm)
    argv += common_flag("--speculative-num-steps", cfg.speculative_num_steps)
    argv += common_flag("--speculative-eagle-topk", cfg.speculative_eagle_topk)
    argv += common_flag("--speculative-num-draft-tokens", cfg.speculative_num_draft_tokens)
    argv += common_flag("--mem-fraction-static", cfg.mem_fraction_static)
    argv += common_flag("--max-running-requests", cfg.max_running_requests)
    argv += common_flag("--max-mamba-cache-size", cfg.max_mamba_cache_size)
    argv += common_flag("--context-length", cfg.context_length)
    if cfg.seed is not None:
        argv += ["--random-seed", str(cfg.seed)]
    if cfg.engine == "sim":
        argv += ["--sim-tokens-per-second", str(cfg.sim_tokens_per_second),
                 "--sim-ttft", str(cfg.sim_ttft_s),
                 "--sim-failure-rate", str(cfg.sim_failure_rate),
                 "--sim-hang-rate", str(cfg.sim_hang_rate)]
        if cfg.sim_ignore_thinking:
            argv.append("--sim-ignore-thinking")
    return argv + list(cfg.extra_server_args)


def vllm_speculative_config(cfg: RunConfig) -> dict:
    method = {"EAGLE": "eagle", "EAGLE3": "eagle3", "NEXTN": "mtp", "NGRAM": "ngram",
              "STANDALONE": "draft_model"}[cfg.speculative_algorithm]
    spec: dict = {"method": method}
    if cfg.speculative_num_steps is not None:
        spec["num_speculative_tokens"] = cfg.speculative_num_steps
    return spec


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


def read_state(state_dir: Path) -> list[ServerRecord]:
    path = Path(state_dir) / STATE_FILE
    if not path.exists():
        return []
    return [ServerRecord(**item) for item in json.loads(path.read_text())["servers"]]


def write_state(state_dir: Path, records: Sequence[ServerRecord]) -> None:
    path = Path(state_dir) / STATE_FILE
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


def start_servers(cfg: RunConfig, model_path: str, state_dir: str | Path) -> list[ServerRecord]:
    """Start what is not already healthy, wait for all; idempotent, so a re-run reuses servers."""
    state_dir = Path(state_dir)
    state_dir.mkdir(parents=True, exist_ok=True)
    previous = {r.index: r for r in read_state(state_dir)}
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
            log_path = state_dir / f"server-{index}.log"
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
        write_state(state_dir, sorted(records, key=lambda r: r.index))
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


def stop_servers(state_dir: str | Path, grace_s: float = 30.0) -> int:
    """Teardown: stop every recorded server and check that nothing is left. Safe to repeat."""
    state_dir = Path(state_dir)
    records = read_state(state_dir)
    if not records:
        log.info("no servers recorded in %s: nothing to stop", state_dir)
        return 0
    problems = stop_records(records, grace_s)
    if problems:
        raise ServerError("teardown left something behind:\n" + "\n".join(problems))
    (state_dir / STATE_FILE).unlink(missing_ok=True)
    log.info("stopped %d server(s); no process or port left", len(records))
    return len(records)

