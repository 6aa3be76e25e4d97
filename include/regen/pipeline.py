"""The six stages as plain functions of a RunConfig: what each DAG task and each CLI command runs.

Stage modules are imported inside each function, so a broken module fails its own stage (and
preflight, which compiles them all) without breaking the import of the others. With
``ssh_conn_id`` set, each stage runs on that node instead, as the node's own ``regen`` command
(:mod:`regen.remote`), and this side only relays its output and its verdict.
"""

from __future__ import annotations

import contextlib
import logging
from pathlib import Path

from regen.config import RunConfig

log = logging.getLogger("regen")


class AuditFailed(RuntimeError):
    pass


@contextlib.contextmanager
def log_group(title: str):
    """Airflow's task log folds what is logged between these markers: the detail of a long
    stage stays one click away, and its summary, logged after, is what a person sees."""
    log.info("::group::%s", title)
    try:
        yield
    finally:
        log.info("::endgroup::")


def state_dir(cfg: RunConfig) -> Path:
    return Path(cfg.output) / "work" / "servers"


def report_dir(cfg: RunConfig) -> Path:
    return Path(cfg.output) / "audit"


def _remote(cfg: RunConfig, *args: str, check: bool = True):
    from regen.remote import run_regen

    with log_group(f"regen {args[0]} on {cfg.ssh_conn_id}"):
        return run_regen(cfg, *args, check=check)


def preflight(cfg: RunConfig) -> list[int]:
    """Raise PreflightFailed listing every problem; return the shard indices to map over."""
    from regen.preflight import PreflightFailed, run_preflight

    if cfg.ssh_conn_id:
        # The node's regen compiles and imports with the node's interpreter: the one that runs.
        result = _remote(cfg, "preflight", check=False)
        if result.exit_code != 0:
            raise PreflightFailed([f"{cfg.ssh_conn_id}: {line}" for line in result.lines
                                   if line and not line.startswith("preflight:")])
        return list(range(cfg.num_shards))
    with log_group("preflight checks"):
        report = run_preflight(cfg, state_dir(cfg))
        for key, value in report.info.items():
            log.info("preflight: %s = %s", key, value)
    if not report.ok:
        for problem in report.problems:
            log.error("preflight: %s", problem)
        raise PreflightFailed(report.problems)
    log.info("preflight passed in %.1f s: %s prompts, %d shards", report.seconds,
             f"{report.info.get('prompts', 0):,}", cfg.num_shards)
    return list(range(cfg.num_shards))


def stage_weights(cfg: RunConfig) -> str:
    """The model path the servers load: the staged copy, or the source when staging is off."""
    if not cfg.stage_weights:
        return cfg.model_path
    if cfg.ssh_conn_id:
        return _remote(cfg, "stage").lines[-1].strip()
    from regen.stage import stage_model

    return str(stage_model(cfg.model_path, cfg.staging_dir).path)


def start_servers(cfg: RunConfig, served_model_path: str | None = None) -> list[str]:
    model = served_model_path or cfg.model_path
    if cfg.ssh_conn_id:
        lines = _remote(cfg, "serve", "--served-model-path", model).lines
        return [line.strip() for line in lines if line.startswith("http://")]
    from regen.servers import start_servers as start

    with log_group("launch and health checks"):
        urls = [r.url for r in start(cfg, model, state_dir(cfg))]
    log.info("%d server(s) healthy: %s", len(urls), ", ".join(urls))
    return urls


def stop_servers(cfg: RunConfig) -> int:
    if cfg.ssh_conn_id:
        _remote(cfg, "serve", "--stop")
        return 0
    from regen.servers import stop_servers as stop

    return stop(state_dir(cfg))


def server_logs(cfg: RunConfig, lines: int = 40) -> str:
    if cfg.ssh_conn_id:
        return "\n".join(_remote(cfg, "logs", "--lines", str(lines)).lines)
    from regen.servers import log_tail, read_state

    return "\n".join(f"==> server {r.index} (port {r.port}, pid {r.pid}): {r.log_path}\n"
                     f"{log_tail(r.log_path, lines)}" for r in read_state(state_dir(cfg)))


def endpoints(cfg: RunConfig) -> list[tuple[str, str | None]]:
    """The servers start_servers recorded for this run; a clear message when there are none."""
    from regen.servers import read_state

    records = read_state(state_dir(cfg))
    if not records:
        raise RuntimeError(
            f"no servers recorded in {state_dir(cfg)}: start_servers has not run for this output, "
            f"or stop_servers already ran. Clear the run from start_servers (untick 'only failed'), "
            f"or start them with `regen serve --config ...`"
        )
    return [(r.url, r.api_key) for r in records]


def canary(cfg: RunConfig) -> dict:
    from regen.canary import CanaryFailed, run_canary

    if cfg.ssh_conn_id:
        result = _remote(cfg, "canary", check=False)
        if result.exit_code != 0:
            raise CanaryFailed(result.tail())
        return {"text": result.lines[-1] if result.lines else ""}
    with log_group("canary requests and audit"):
        result = run_canary(cfg, endpoints(cfg))
    if result.problems:
        raise CanaryFailed("\n".join(result.problems))
    log.info("canary passed: %d samples; estimate: %s", len(result.rows),
             result.estimate.get("text", "n/a"))
    return result.estimate


def generate(cfg: RunConfig, shard: int) -> str:
    from regen.generate import GenerationSettings, ShardFailed, generate_shard

    if cfg.ssh_conn_id:
        result = _remote(cfg, "generate", "--shard", str(shard), check=False)
        if result.exit_code != 0:
            raise ShardFailed(result.tail())
        return next((line for line in reversed(result.lines) if line.startswith("shard ")), "")
    with log_group(f"shard {shard}/{cfg.num_shards}: progress"):
        summary = generate_shard(cfg.prompts, cfg.output, endpoints(cfg), shard, cfg.num_shards,
                                 GenerationSettings.from_config(cfg)).summary()
    log.info(summary)
    return summary


def audit(cfg: RunConfig) -> dict:
    """The audit's summary; AuditFailed (with the five-line summary) when the data fails."""
    if cfg.ssh_conn_id:
        import json

        result = _remote(cfg, "audit", "--summary-json", check=False)
        if result.exit_code != 0:
            raise AuditFailed(result.tail(8))
        return json.loads(result.lines[-1])
    from regen.audit import AuditThresholds, audit_dataset
    from regen.progress import RunProgress

    with log_group("audit progress"):
        report = audit_dataset(Path(cfg.output) / "data", cfg.model_path, report_dir(cfg),
                               AuditThresholds(cfg.min_loss_tokens, cfg.max_degenerate_fraction),
                               default_thinking=cfg.enable_thinking)
    RunProgress(cfg.output).write_section("audit", report.to_json())
    for line in report.lines():
        log.info(line)
    if not report.passed:
        raise AuditFailed("\n".join(report.lines()))
    return report.to_json()
