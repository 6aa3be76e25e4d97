"""The six stages as plain functions of a RunConfig: what each DAG task and each CLI command runs.

Stage modules are imported inside each function, so a broken module fails its own stage (and
preflight, which compiles them all) without breaking the import of the others.
"""

from __future__ import annotations

import logging
from pathlib import Path

from regen.config import RunConfig

log = logging.getLogger("regen")


def state_dir(cfg: RunConfig) -> Path:
    return Path(cfg.output) / "work" / "servers"


def report_dir(cfg: RunConfig) -> Path:
    return Path(cfg.output) / "audit"


def preflight(cfg: RunConfig) -> list[int]:
    """Raise PreflightFailed listing every problem; return the shard indices to map over."""
    from regen.preflight import PreflightFailed, run_preflight

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
    from regen.stage import stage_model

    return str(stage_model(cfg.model_path, cfg.staging_dir).path)


def start_servers(cfg: RunConfig, served_model_path: str | None = None) -> list[str]:
    from regen.servers import start_servers as start

    records = start(cfg, served_model_path or cfg.model_path, state_dir(cfg))
    return [r.url for r in records]


def stop_servers(cfg: RunConfig) -> int:
    from regen.servers import stop_servers as stop

    return stop(state_dir(cfg))


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


def canary(cfg: RunConfig):
    from regen.canary import CanaryFailed, run_canary

    result = run_canary(cfg, endpoints(cfg))
    if result.problems:
        raise CanaryFailed("\n".join(result.problems))
    log.info("canary passed: %d samples; estimate: %s", len(result.rows),
             result.estimate.get("text", "n/a"))
    return result.estimate


def generate(cfg: RunConfig, shard: int):
    from regen.generate import GenerationSettings, generate_shard

    result = generate_shard(cfg.prompts, cfg.output, endpoints(cfg), shard, cfg.num_shards,
                            GenerationSettings.from_config(cfg))
    return result


def audit(cfg: RunConfig):
    from regen.audit import AuditThresholds, audit_dataset
    from regen.progress import RunProgress

    report = audit_dataset(Path(cfg.output) / "data", cfg.model_path, report_dir(cfg),
                           AuditThresholds(cfg.min_loss_tokens, cfg.max_degenerate_fraction),
                           default_thinking=cfg.enable_thinking)
    RunProgress(cfg.output).write_section("audit", report.to_json())
    for line in report.lines():
        log.info(line)
    return report


class AuditFailed(RuntimeError):
    pass


def require_pass(report) -> None:
    if not report.passed:
        raise AuditFailed("\n".join(report.lines()))
