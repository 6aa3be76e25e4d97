"""The servers' key typed into a run's conf, removed from what Airflow stores.

Airflow keeps a run's conf and returns it, unredacted, to everyone who may read the DAG's runs
(its REST API and the UI). regen refuses a conf that holds the key (regen.config.deployment), but
by then the run is stored: this listener, loaded by the regen plugin into the scheduler, replaces
the value as the run starts (before any task reads it), so the refusal still names the field.
"""

from __future__ import annotations

import logging

from airflow.listeners import hookimpl

log = logging.getLogger("regen.dags")

SECRET_FIELDS = ("api_key",)
REDACTED = "<redacted>"


def scrubbed(conf: object) -> dict | None:
    """The conf with every secret field's value replaced; None when there is nothing to replace."""
    if not isinstance(conf, dict) or not any(conf.get(name) not in (None, "", REDACTED) for name in SECRET_FIELDS):
        return None
    return {**conf, **{name: REDACTED for name in SECRET_FIELDS if conf.get(name) not in (None, "", REDACTED)}}


@hookimpl
def on_dag_run_running(dag_run, msg: str) -> None:
    try:
        clean = scrubbed(dag_run.conf)
        if clean is not None:
            dag_run.conf = clean
            log.warning("run %s of %s: the servers' key in its conf was replaced by %s (the deployment "
                        "sets the key; the run is refused at preflight)", dag_run.run_id, dag_run.dag_id, REDACTED)
    except Exception:  # a listener never stops the scheduler
        log.exception("regen: could not scrub the conf of run %s", getattr(dag_run, "run_id", "?"))
