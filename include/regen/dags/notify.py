"""Airflow's side of what a person is told: a failed task's alert (through regen.alerts), and
model text made safe for the approval's Markdown body."""

from __future__ import annotations

import re

from airflow.sdk import BaseNotifier

from regen.alerts import failure_reason, send


class AlertNotifier(BaseNotifier):
    """The failed task is the stage, its exception the reason."""

    def notify(self, context) -> None:
        ti = context.get("ti") or context.get("task_instance")
        stage = getattr(ti, "task_id", "run")
        label = getattr(ti, "rendered_map_index", None)
        if label:
            stage = f"{stage} ({label})"
        dag_run = context.get("dag_run")
        send(stage, failure_reason(context.get("exception")),
             dag_id=getattr(dag_run, "dag_id", None), run_id=getattr(dag_run, "run_id", None))


_MARKDOWN_PUNCTUATION = re.compile(r"([\\`*_{}\[\]()<>#+\-.!|~&\"'=:])")


def markdown_literal(text: str | None, limit: int = 400) -> str:
    """Model output shown as itself in a Markdown body: one line, cut at ``limit`` characters,
    every punctuation mark escaped, so a link, an image (fetched by the reviewer's browser), a
    heading or raw HTML the model wrote stays text."""
    flat = " ".join((text or "").split())
    if len(flat) > limit:
        flat = flat[:limit] + "..."
    return _MARKDOWN_PUNCTUATION.sub(r"\\\1", flat)
