"""A key typed into a run's conf, removed before Airflow stores it.

Airflow keeps a run's conf and returns it, unredacted, to everyone who may read the DAG's runs
(its REST API and the UI), from the moment the run is created: a queued run may wait for days.
regen refuses a conf that holds the key (regen.config.deployment); the key itself must never be
stored. So the API server's requests that create runs (the UI's trigger form and the REST API,
``POST .../dags/DAG/dagRuns``) have their conf scrubbed on the way in (:class:`ScrubRunConf`, a
root middleware the regen plugin installs), under every spelling of the key and inside other
fields' values (regen.secrets); the run then fails at preflight naming the field. A run created
another way (``airflow dags trigger`` writes the database itself) is scrubbed by the listener as
it starts, before any task reads it.
"""

from __future__ import annotations

import json
import logging
import re

from airflow.listeners import hookimpl

from regen.secrets import scrubbed

log = logging.getLogger("regen.dags")

_CREATES_RUNS = re.compile(r"/api/v2/dags/[^/]+/dagRuns/?$")


def scrubbed_conf(conf: object) -> dict | None:
    """The conf with every secret replaced; None when there is nothing to replace."""
    if not isinstance(conf, dict):
        return None
    clean = scrubbed(conf)
    return clean if clean != conf else None


class ScrubRunConf:
    """ASGI middleware: a request that creates a run has the secrets of its conf replaced before
    Airflow reads it."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope.get("type") != "http" or scope.get("method") != "POST" or not _CREATES_RUNS.search(scope.get("path", "")):
            return await self.app(scope, receive, send)
        chunks, more = [], True
        while more:
            message = await receive()
            if message["type"] != "http.request":  # the client went away: hand on what came
                return await self.app(scope, _replay([message]), send)
            chunks.append(message.get("body", b""))
            more = message.get("more_body", False)
        body = b"".join(chunks)
        try:
            doc = json.loads(body)
            clean = scrubbed_conf(doc.get("conf")) if isinstance(doc, dict) else None
        except ValueError:  # not JSON: Airflow answers it as it would
            clean = None
        if clean is not None:
            body = json.dumps({**doc, "conf": clean}).encode()
            log.warning("a run of %s was created with a secret in its conf: replaced before it was stored (the "
                        "deployment sets the key; the run fails at preflight naming the field)", scope["path"])
            headers = [(k, v) for k, v in scope.get("headers", []) if k.lower() != b"content-length"]
            scope = {**scope, "headers": [*headers, (b"content-length", str(len(body)).encode())]}
        return await self.app(scope, _replay([{"type": "http.request", "body": body, "more_body": False}]), send)


def _replay(messages: list[dict]):
    pending = list(messages)

    async def receive():
        if pending:
            return pending.pop(0)
        return {"type": "http.disconnect"}

    return receive


@hookimpl
def on_dag_run_running(dag_run, msg: str) -> None:
    try:
        clean = scrubbed_conf(dag_run.conf)
        if clean is not None:
            dag_run.conf = clean
            log.warning("run %s of %s: the secrets in its conf were replaced (the deployment sets the key; the "
                        "run is refused at preflight)", dag_run.run_id, dag_run.dag_id)
    except Exception:  # a listener never stops the scheduler
        log.exception("regen: could not scrub the conf of run %s", getattr(dag_run, "run_id", "?"))
