"""Airflow plugin: the regen run page, as an external view on every dag run, and what removes
a key typed into a run's conf before Airflow stores it (a middleware of the API server that
creates runs, a listener for runs created another way).

The page itself (and its access check) lives in the regen package: regen.dags.runpage; the
middleware and the listener are regen.dags.conf_scrub.
"""

from __future__ import annotations

from airflow.plugins_manager import AirflowPlugin

from regen.dags import conf_scrub
from regen.dags.runpage import create_app


class RegenPlugin(AirflowPlugin):
    name = "regen"
    fastapi_apps = [{"app": create_app(), "url_prefix": "/regen", "name": "regen run page"}]
    listeners = [conf_scrub]
    fastapi_root_middlewares = [{"middleware": conf_scrub.ScrubRunConf, "name": "regen conf scrub"}]
    external_views = [{
        "name": "Regeneration",
        "href": "regen/runs/{DAG_ID}/{RUN_ID}",
        "destination": "dag_run",
        "url_route": "regen",
    }]
