"""Alerts: a failed run, or one running well past the canary's estimate, tells someone.

Where an alert goes is the deployment's choice, by environment, with no code change:
``REGEN_ALERT_URL`` (a webhook: Slack-compatible JSON ``{"text": ...}`` plus the fields below),
``REGEN_ALERT_FILE`` (one JSON line per alert). Every alert is also logged. The DAG wires
:class:`AlertNotifier` as its tasks' failure callback, so the alert names the stage that failed
and why.
"""

from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from regen.layout import RunLayout

log = logging.getLogger("regen.alerts")

OVERDUE_FACTOR = 2.0  # a run this many times past the canary's estimate raises an alert, once


def send(stage: str, reason: str, **fields) -> dict:
    alert = {"text": f"regen: {stage} {reason}", "stage": stage, "reason": reason,
             "time": time.time(), **fields}
    log.error("ALERT %s", alert["text"])
    path = os.environ.get("REGEN_ALERT_FILE")
    if path:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        with open(path, "a") as fh:
            fh.write(json.dumps(alert, default=str) + "\n")
    url = os.environ.get("REGEN_ALERT_URL")
    if url:
        import httpx

        try:
            httpx.post(url, json=alert, timeout=10).raise_for_status()
        except httpx.HTTPError as exc:  # an alert that cannot be delivered must not fail the run
            log.warning("alert not delivered to %s: %s", url, exc)
    return alert


def failure_reason(exception: BaseException | None) -> str:
    if exception is None:
        return "failed"
    text = str(exception).strip().splitlines()
    return f"failed: {type(exception).__name__}: {text[0] if text else ''}"[:1000]


def check_overdue(output: "RunLayout | str | Path") -> dict | None:
    """Once per run: alert when generation has gone on OVERDUE_FACTOR times the canary's
    estimate of the whole run (counted from when the canary measured it)."""
    from regen.layout import RunLayout
    from regen.progress import format_duration, read_json

    layout = output if isinstance(output, RunLayout) else RunLayout(output)
    canary = read_json(layout.progress_part("canary")) or {}
    eta, since = (canary.get("estimate") or {}).get("eta_s"), canary.get("updated")
    if not eta or not since:
        return None
    elapsed = time.time() - since
    marker = layout.alerts / f"overdue-{int(since)}"
    if elapsed < OVERDUE_FACTOR * eta or marker.exists():
        return None
    marker.parent.mkdir(parents=True, exist_ok=True)
    marker.touch()
    return send("generate", f"is running {elapsed / eta:.1f}x past the canary's estimate "
                f"({format_duration(elapsed)} so far, estimated {format_duration(eta)})",
                output=str(layout.root))


def notifier():
    """An Airflow notifier for task failures: the failed task is the stage, its exception the
    reason. Built on demand so regen imports without Airflow."""
    from airflow.sdk import BaseNotifier

    class AlertNotifier(BaseNotifier):
        def notify(self, context) -> None:
            ti = context.get("ti") or context.get("task_instance")
            stage = getattr(ti, "task_id", "run")
            label = getattr(ti, "rendered_map_index", None)
            if label:
                stage = f"{stage} ({label})"
            dag_run = context.get("dag_run")
            send(stage, failure_reason(context.get("exception")),
                 dag_id=getattr(dag_run, "dag_id", None), run_id=getattr(dag_run, "run_id", None))

    return AlertNotifier()
