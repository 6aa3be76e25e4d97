"""Airflow's side of what a person is told: a failed task's alert (through regen.alerts)."""

from __future__ import annotations

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
