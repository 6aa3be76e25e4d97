"""The one seam between what asks for a stage (a DAG task, a CLI command) and where it runs.

A caller names a stage and hands over the run's config; :func:`run` decides where the stage
runs (:class:`regen.stages.Where`): here, on the run's SSH node, on one node of the run, on the
node a shard claims, or on every node; it brings nothing up and tears nothing down that the
stage's placement does not say. On an SSH node the node's ``regen run-stage`` runs the very same
function and sends its result back on a line marked with a one-time token (:mod:`regen.remote`).
A stage's result is its typed document (regen.results), read back into the same type wherever
the stage ran; its expected failure (a :class:`regen.errors.RegenError`) is raised here as the
same exception.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import sys
import traceback
from typing import Any

from regen.config import NodeSpec, RunConfig
from regen.coordination import holding_output
from regen.errors import RegenError
from regen.objectstore import is_store_url, local_copy
from regen.placement import NODE_LOST_AFTER_S, claim_node
from regen.progress import RunProgress
from regen.remote import run_stage
from regen.results import StageResult
from regen.stages import Stage, Where, stage

log = logging.getLogger("regen")


@contextlib.contextmanager
def log_group(title: str):
    """Airflow's task log folds what is logged between these markers: the detail of a long
    stage stays one click away, and its summary, logged after, is what a person sees. In a
    person's terminal they are noise: left out there."""
    if sys.stderr.isatty() and not os.environ.get("AIRFLOW_CTX_DAG_ID"):
        yield
        return
    log.info("::group::%s", title)
    try:
        yield
    finally:
        log.info("::endgroup::")


def run(name: str, cfg: RunConfig, node: str | None = None, run_id: str | None = None,
        log_summary: bool = True, **kwargs: Any) -> StageResult:
    """Run the stage ``name`` where its placement says; its result, or its RegenError raised.
    ``node``: which of the run's nodes, for a per-node stage (default: the run's first node).
    ``run_id``: the DAG run that owns what the stage starts (the CLI's own is "cli").
    ``log_summary``: off where the caller prints the summary itself (a command's one summary)."""
    entry = stage(name)
    if entry.takes_run_id and run_id is not None:
        kwargs["run_id"] = run_id
    if entry.holds_output and run_id not in (None, "cli"):
        kwargs["held_by"] = run_id
    try:
        result = _dispatch(entry, cfg, node, run_id, kwargs)
    except RegenError as exc:
        if name in SETUP_NEXT_STEP:  # the reason, before Airflow's traceback
            log.error("%s failed: %s", name, setup_failure(name, exc)["reason"])
        raise
    if log_summary:
        for line in result.summary_lines():
            log.info("%s", line)
    return result


# Stages whose failure nothing else shows on the run page and in `regen summary` (the canary, the
# shards and the audit write their own): their reason and next step. Staging's and the servers'
# are kept in progress.json, by the node that ran them (where the output is), one part per stage
# and node, until the stage passes there (the run holds the output by then); a failed preflight's
# goes to its task's XCom instead (the output may be another run's: dags/).
SETUP_FAILED = "setup_failed"
SETUP_DETAILS = 12
KEPT_IN_OUTPUT = ("stage_weights", "start_servers")
SETUP_NEXT_STEP = {
    "preflight": "fix what each problem names (a field: trigger a new run with it changed), then run again",
    "stage_weights": "make room or fix model_path / staging_dir as named, then clear stage_weights",
    "start_servers": "read the servers' logs (`regen logs`, or the task log), fix what they name, then clear "
                     "start_servers",
}


def setup_failure(name: str, exc: BaseException) -> dict:
    """A setup stage's failure as the run page and `regen summary` show it: one line of reason,
    the lines after it, the next step."""
    lines = [line for line in str(exc).strip().splitlines() if line.strip()] or [type(exc).__name__]
    return {"stage": name, "reason": lines[0], "details": lines[1:SETUP_DETAILS + 1], "next": SETUP_NEXT_STEP[name]}


def _dispatch(entry: Stage, cfg: RunConfig, node: str | None, run_id: str | None, kwargs: dict) -> StageResult:
    if entry.where is Where.NODE:
        result = _run_at(entry, cfg.for_node(_spec(cfg, node)), kwargs)
    elif entry.where is Where.CLAIM and not kwargs.get("endpoints"):
        with claim_node(cfg, kwargs["shards"]) as spec:
            if not spec.is_run_node:
                kwargs.setdefault("give_up_after_s", NODE_LOST_AFTER_S)
            result = _run_at(entry, cfg.for_node(spec), kwargs)
    elif entry.where is Where.EVERY_NODE:
        result = entry.result.merged([_run_at(entry, cfg.for_node(spec), kwargs) for spec in cfg.node_specs()])
    else:
        if entry.where is Where.AFTER_GENERATION and run_id is not None:
            _stop_servers_shards_started(cfg, run_id)
        result = _run_at(entry, cfg, kwargs)
    return result


def _spec(cfg: RunConfig, node: str | None) -> NodeSpec:
    specs = cfg.node_specs()
    if node is None:
        return cfg.this_node()
    found = [s for s in specs if s.name == node] or ([] if cfg.nodes else specs)  # the run's own node
    if not found:  # goes by the machine's name, which may be another machine's where the DAG was parsed
        raise RegenError(f"node {node!r} is not one of this run's nodes ({', '.join(s.name for s in specs)})")
    return found[0]


def _stop_servers_shards_started(cfg: RunConfig, run_id: str) -> None:
    """Generation is over: the run's own servers go, also when a shard brought them up itself
    after the teardown had run (a run cleared with "only failed" does not run the teardown
    again). A listed node's shards never start servers, and its teardown runs on that node."""
    own = [spec for spec in cfg.node_specs() if spec.is_run_node]
    for spec in own:
        _run_at(stage("stop_servers"), cfg.for_node(spec), {"run_id": run_id})


def _run_at(entry: Stage, cfg: RunConfig, kwargs: dict[str, Any]) -> StageResult:
    """The stage with this (node's) config: here, or on its SSH node."""
    where = cfg.ssh_conn_id
    with log_group(entry.name + (f" on {where}" if where else "") + (f" (node {cfg.node})" if cfg.node else "")):
        if where:
            doc = run_stage(cfg, entry.name, kwargs)
            if not doc.get("ok"):
                raise RegenError.from_doc(doc.get("error") or {}, where=where)
            return entry.result.model_validate(doc["result"])
        return entry.result.model_validate(_call(entry, cfg, kwargs))


def _call(entry: Stage, cfg: RunConfig, kwargs: dict[str, Any]) -> dict:
    """The stage's function here, holding the run's output while it works when a DAG run asks
    (``held_by``); its result as a document."""
    kwargs = dict(kwargs)
    held_by = kwargs.pop("held_by", None)
    with holding_output(cfg.layout, held_by) if held_by else contextlib.nullcontext():
        try:
            result = entry.function()(_here(cfg), **kwargs)
        except RegenError as exc:
            _keep_setup_failure(entry.name, cfg, exc)
            raise
        _keep_setup_failure(entry.name, cfg, None)
        return _as_document(result)


def _keep_setup_failure(name: str, cfg: RunConfig, exc: RegenError | None) -> None:
    """A setup stage's failure kept in the output's progress (None: it passed, the part goes)."""
    if name not in KEPT_IN_OUTPUT:
        return
    part = f"{SETUP_FAILED}.{name}.{cfg.node or 'run'}"
    if exc is None:
        RunProgress(cfg.layout).clear_section(part)
    else:
        RunProgress(cfg.layout).write_section(part, setup_failure(name, exc))


def _here(cfg: RunConfig) -> RunConfig:
    """The config a stage runs with on this machine: prompts on an object store as a local copy."""
    if not is_store_url(cfg.prompts):
        return cfg
    return cfg.model_copy(update={"prompts": str(local_copy(cfg.prompts, cfg.layout.prompt_copies))})


def execute(name: str, cfg: RunConfig, kwargs: dict) -> dict:
    """What a node does for :func:`run`: the stage here, its outcome as one document."""
    try:
        return {"stage": name, "ok": True, "result": _call(stage(name), cfg, kwargs)}
    except RegenError as exc:
        return {"stage": name, "ok": False, "error": exc.to_doc()}
    except Exception as exc:  # a bug: its type, message and traceback reach the Airflow side
        return {"stage": name, "ok": False, "error": {
            "type": type(exc).__name__, "message": f"{exc}\n{traceback.format_exc(limit=8)}",
            "detail": {}}}


def _as_document(result: StageResult) -> dict:
    """Exactly what would cross the wire: a stage's result means the same everywhere."""
    return json.loads(json.dumps(result.model_dump(mode="json"), default=str))
