"""What start_servers would launch, started nowhere: each server's argv (from the engine's
adapter), environment, port and GPUs, and the operating point planned for its GPU, checked
against what the server reports once it runs."""

from __future__ import annotations

import os
from dataclasses import asdict
from pathlib import Path

import httpx2

from regen.config import RunConfig
from regen.engines import engine
from regen.results import PlannedServer, ServerPlan
from regen.secrets import is_secret_name
from regen.servers import capacity
from regen.servers.gpus import detect_gpu_memory_mib, server_devices
from regen.servers.records import ServerRecord
from regen.weights import staged_path


def build_command(cfg: RunConfig, model_path: str, port: int) -> list[str]:
    """The launch argv of one server, from the engine's adapter: a list, never a shell string,
    and never the key (it reaches the server through its environment)."""
    return engine(cfg.engine).launch_argv(cfg, model_path, port)


def server_environ() -> dict[str, str]:
    """What a model server inherits of this process's environment:
    not Airflow's settings (its database, its connections, its signing keys) nor any variable
    named as a secret (cloud keys, tokens): a server needs its GPUs, paths and engine settings."""
    return {k: v for k, v in os.environ.items() if not k.upper().startswith("AIRFLOW") and not is_secret_name(k)}


def server_env(gpu: str | int | None, engine_env: dict[str, str] | None = None,
               key_env: dict[str, str] | None = None) -> dict[str, str]:
    """The node's environment without its secrets (:func:`server_environ`), with the engine's
    defaults under it, the server's GPUs and its key."""
    env = server_environ()
    for name, value in (engine_env or {}).items():
        env.setdefault(name, value)
    env.update(key_env or {})
    if gpu is not None:
        env["CUDA_VISIBLE_DEVICES"] = str(gpu)
    env.setdefault("PYTHONUNBUFFERED", "1")
    return env


def server_plan(cfg: RunConfig, model_path: str | None = None, gpu: str | None = None) -> ServerPlan:
    """What start_servers would launch on this node, started nowhere: each server's port, GPUs
    and command line (as the process will show it: without its key), and on a named or detected
    GPU what each server can run and what limits it."""
    if model_path is None:  # what start_servers will be given: the staged copy when staging is on
        model_path = str(staged_path(Path(cfg.model_path), Path(cfg.staging_dir))) if cfg.stage_weights \
            else cfg.model_path
    adapter = engine(cfg.engine)
    return ServerPlan(servers=[
        PlannedServer(index=index, port=cfg.servers.base_port + index, cuda_visible_devices=devices,
                      argv=adapter.server_argv(build_command(cfg, model_path, cfg.servers.base_port + index)))
        for index, devices in enumerate(server_devices(cfg))], operating_point=operating_point(cfg, gpu))


def operating_point(cfg: RunConfig, gpu: str | None = None) -> dict | None:
    """The plan of :mod:`regen.servers.capacity` for this config's model, as the dry run shows it;
    None without a GPU or a config.json to plan from."""
    detected = detect_gpu_memory_mib()
    if gpu is None and detected is None:
        return None
    if not (Path(cfg.model_path) / "config.json").is_file():
        return None
    try:
        point = capacity.plan_for(cfg, cfg.model_path, gpu or str(detected), cfg.sampling.max_tokens)
    except (ValueError, KeyError, TypeError) as exc:  # weights too large, or a config it cannot read
        return {"problem": f"{cfg.model_path}: no operating point: {exc}"}
    idle = capacity.under_use(cfg.generation.concurrency_per_server, point.max_running_requests)
    return {**asdict(point), "under_use": idle, "summary": point.lines() + ([f"warning: {idle}"] if idle else [])}


def against_plan(cfg: RunConfig, record: ServerRecord) -> str | None:
    """After launch, on a GPU node: a sentence when this server sized its pools far from the plan
    (its ``/server_info``), None when close or when there is no plan."""
    planned = operating_point(cfg)
    if not planned or "kv_tokens" not in planned:
        return None
    info = server_info(cfg, record)
    if info is None:
        return None
    states = [s for s in info.get("internal_states") or [] if isinstance(s, dict)] or [{}]
    tokens = (states[0].get("memory_usage") or {}).get("token_capacity")
    note = capacity.compare(planned, tokens, engine(cfg.engine).effective_limit(info, None))
    return f"server {record.url}: {note}; plan: {' / '.join(planned['summary'])}" if note else None


def reported_under_use(cfg: RunConfig, record: ServerRecord) -> str | None:
    """After launch: a sentence when the run's concurrency leaves more than half of what the
    server says it runs at once (``/server_info``) unused; None otherwise or when it does not say."""
    if not cfg.generation.concurrency_per_server:
        return None
    info = server_info(cfg, record)
    return None if info is None else capacity.under_use(
        cfg.generation.concurrency_per_server, engine(cfg.engine).effective_limit(info, None),
        f"as server {record.url} reports")


def server_info(cfg: RunConfig, record: ServerRecord) -> dict | None:
    """The server's own account of itself (SGLang's ``/server_info``, or the engine's equivalent)."""
    headers = {"Authorization": f"Bearer {record.api_key}"} if record.api_key else {}
    for path in engine(cfg.engine).info_paths:
        try:
            info = httpx2.get(f"{record.url}{path}", headers=headers, timeout=10).json()
        except (httpx2.HTTPError, ValueError):
            continue
        if isinstance(info, dict):
            return info
    return None
