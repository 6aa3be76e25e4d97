"""Airflow plugin: the regen run page, as an external view on every dag run.

The page itself (and its access check) lives in the regen package: regen.dags.runpage.
"""

from __future__ import annotations

from airflow.plugins_manager import AirflowPlugin

from regen.dags.runpage import create_app


class RegenPlugin(AirflowPlugin):
    name = "regen"
    fastapi_apps = [{"app": create_app(), "url_prefix": "/regen", "name": "regen run page"}]
    external_views = [{
        "name": "Regeneration",
        "href": "regen/runs/{DAG_ID}/{RUN_ID}",
        "destination": "dag_run",
        "url_route": "regen",
    }]
