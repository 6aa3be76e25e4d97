"""The one seam between the stages and where they run.

Each stage is a plain function of a RunConfig in its own module (``regen.preflight.preflight``,
``regen.generate.generate``, ...) that does the work where it runs and returns one JSON result
document. :func:`run` executes it here, or, when the config names an SSH node, on that node,
where the node's ``regen run-stage`` calls the very same function and sends its result document
back on a line marked with a one-time token (:mod:`regen.remote`): whatever else the node prints
cannot be taken for the result. A stage's expected failure (a :class:`regen.errors.RegenError`)
is raised here as the same exception, wherever the stage ran.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import logging
import traceback
from typing import Any, Callable

from regen.config import RunConfig
from regen.errors import RegenError

log = logging.getLogger("regen")

# Every function that may run as a stage, local or remote: a node runs nothing else by name.
STAGES = frozenset({
    "regen.preflight:preflight",
    "regen.preflight:node_preflight",
    "regen.stage:stage_weights",
    "regen.servers:serve",
    "regen.servers:stop",
    "regen.servers:logs",
    "regen.canary:canary",
    "regen.generate:generate",
    "regen.audit:audit",
    "regen.progress:progress",
})

Stage = Callable[..., dict]


@contextlib.contextmanager
def log_group(title: str):
    """Airflow's task log folds what is logged between these markers: the detail of a long
    stage stays one click away, and its summary, logged after, is what a person sees."""
    log.info("::group::%s", title)
    try:
        yield
    finally:
        log.info("::endgroup::")


def stage_id(stage: Stage) -> str:
    sid = f"{stage.__module__}:{stage.__name__}"
    if sid not in STAGES:
        raise ValueError(f"{sid} is not a stage")
    return sid


def resolve(sid: str) -> Stage:
    if sid not in STAGES:
        raise ValueError(f"{sid!r} is not a stage (known: {', '.join(sorted(STAGES))})")
    module, name = sid.split(":")
    return getattr(importlib.import_module(module), name)


def run(stage: Stage, cfg: RunConfig, **kwargs: Any) -> dict:
    """Run ``stage`` where the config says; its result document, or its RegenError raised."""
    sid = stage_id(stage)
    where = cfg.ssh_conn_id
    with log_group(f"{stage.__name__}" + (f" on {where}" if where else "")):
        if where:
            from regen.remote import run_stage

            doc = run_stage(cfg, sid, kwargs)
            if not doc.get("ok"):
                raise RegenError.from_doc(doc.get("error") or {}, where=where)
            result = doc["result"]
        else:
            result = _as_document(stage(cfg, **kwargs))
    summary = result.get("summary")
    for line in summary if isinstance(summary, list) else [summary] if summary else []:
        log.info("%s", line)
    return result


def execute(sid: str, cfg: RunConfig, kwargs: dict) -> dict:
    """What a node does for :func:`run`: the stage here, its outcome as one document."""
    try:
        return {"stage": sid, "ok": True, "result": _as_document(resolve(sid)(cfg, **kwargs))}
    except RegenError as exc:
        return {"stage": sid, "ok": False, "error": exc.to_doc()}
    except Exception as exc:  # a bug: its type, message and traceback reach the Airflow side
        return {"stage": sid, "ok": False, "error": {
            "type": type(exc).__name__, "message": f"{exc}\n{traceback.format_exc(limit=8)}",
            "detail": {}}}


def _as_document(result: dict) -> dict:
    """Exactly what would cross the wire: a stage's result means the same everywhere."""
    return json.loads(json.dumps(result, default=str))
