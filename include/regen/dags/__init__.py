"""Airflow's side of regen: what the DAG files and the plugin import, and nothing the stages need.

definitions (which DAGs a deployment has, from REGEN_CONFIG_DIR or the demo), params (the
trigger form from the run's schema), schedule (REGEN_SCHEDULE and a config file's
``schedule:``), notify (failed tasks raise alerts) and runpage (the run page of the plugin).
Only notify and runpage import Airflow; the rest is plain Python the CLI uses too.
"""
