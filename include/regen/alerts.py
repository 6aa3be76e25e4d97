"""Alerts: a failed run, a server that died, or a run well past the canary's estimate tells someone.

Where an alert goes is the deployment's choice, by environment, with no code change:

- ``REGEN_NOTIFIERS``: Airflow notifiers the deployment already configures, as a JSON list of
  ``{"class": "dotted.path.Notifier", "kwargs": {...}, "message_field": "body"}`` (the field that
  carries the text: ``body`` for the apprise provider's AppriseNotifier, ``text`` for Slack's
  SlackNotifier). Each alert builds the notifier with its text and calls it;
- ``REGEN_ALERT_FILE``: one JSON line per alert (an audit trail; what the tests read).

Every alert is also logged. Deliveries run on a background thread, never on the caller's event
loop (a shard's generator calls this); the process waits for them at exit. The DAG wires
:func:`regen.dags.notifier` as its tasks' failure callback, so the alert names the stage that failed and why.
"""

from __future__ import annotations

import importlib
import json
import logging
import os
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from regen.files import read_json
from regen.layout import RunLayout
from regen.units import format_duration

log = logging.getLogger("regen.alerts")

OVERDUE_FACTOR = 2.0  # a run this many times past the canary's estimate raises an alert, once
_deliveries = ThreadPoolExecutor(max_workers=2, thread_name_prefix="regen-alert")


def configured_notifiers() -> list[dict[str, Any]]:
    """REGEN_NOTIFIERS, checked: a bad value is an error naming the variable, raised where the
    deployment will see it (the alert is still logged and filed)."""
    raw = os.environ.get("REGEN_NOTIFIERS", "").strip()
    if not raw:
        return []
    try:
        specs = json.loads(raw)
        assert isinstance(specs, list) and all(isinstance(s, dict) and "class" in s for s in specs)
    except (ValueError, AssertionError):
        raise ValueError("REGEN_NOTIFIERS: a JSON list of {\"class\": \"dotted.path\", \"kwargs\": {...}, "
                         "\"message_field\": \"body\"}") from None
    return specs


def _deliver(spec: dict[str, Any], text: str, title: str) -> None:
    try:
        module, _, name = spec["class"].rpartition(".")
        cls = getattr(importlib.import_module(module), name)
        kwargs = {**spec.get("kwargs", {}), spec.get("message_field", "body"): text}
        if spec.get("title_field"):
            kwargs[spec["title_field"]] = title
        cls(**kwargs).notify({})
    except Exception as exc:  # an alert that cannot be delivered must not fail the run
        log.warning("alert not delivered through %s: %s: %s", spec.get("class"), type(exc).__name__, exc)


def send(stage: str, reason: str, **fields) -> dict:
    alert = {"text": f"regen: {stage} {reason}", "stage": stage, "reason": reason,
             "time": time.time(), **fields}
    log.error("ALERT %s", alert["text"])
    path = os.environ.get("REGEN_ALERT_FILE")
    if path:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        with open(path, "a") as fh:
            fh.write(json.dumps(alert, default=str) + "\n")
    for spec in configured_notifiers():
        _deliveries.submit(_deliver, spec, alert["text"], f"regen: {stage}")
    return alert


def wait_for_deliveries() -> None:
    """Block until every alert sent so far is delivered (or failed): before a process exits on
    its own terms, or in a test."""
    global _deliveries
    _deliveries.shutdown(wait=True)
    _deliveries = ThreadPoolExecutor(max_workers=2, thread_name_prefix="regen-alert")


REASON_MAX_CHARS = 4000  # a preflight listing many problems fits; a runaway message does not flood chat


def failure_reason(exception: BaseException | None) -> str:
    """The whole reason (a preflight failure lists every problem, one per line: the first line
    alone says only how many), cut at REASON_MAX_CHARS with a note saying so."""
    if exception is None:
        return "failed"
    text = f"failed: {type(exception).__name__}: {str(exception).strip()}"
    if len(text) > REASON_MAX_CHARS:
        text = text[:REASON_MAX_CHARS] + f" ... ({len(text) - REASON_MAX_CHARS:,} more characters in the task log)"
    return text


def check_overdue(output: RunLayout | str | Path) -> dict | None:
    """Once per run: alert when generation has gone on OVERDUE_FACTOR times the canary's
    estimate of the whole run (counted from when the canary measured it)."""
    layout = output if isinstance(output, RunLayout) else RunLayout(output)
    canary = read_json(layout.progress_part("canary")) or {}
    eta, since = (canary.get("estimate") or {}).get("eta_s"), canary.get("updated")
    if not eta or not since:
        return None
    elapsed = time.time() - since
    marker = layout.alert_marker(f"overdue-{int(since)}")
    if elapsed < OVERDUE_FACTOR * eta or marker.exists():
        return None
    marker.parent.mkdir(parents=True, exist_ok=True)
    marker.touch()
    return send("generate", f"is running {elapsed / eta:.1f}x past the canary's estimate "
                f"({format_duration(elapsed)} so far, estimated {format_duration(eta)})",
                output=str(layout.root))
