"""Broken regen run configs (REGEN_CONFIG_DIR) in Airflow's import-error list.

regenerate_dataset.py makes one DAG per valid `NAME.yaml` and skips the broken ones; this file
fails to import, naming each broken file and field, so that Airflow lists them without hiding
(or marking stale) the DAGs of the valid files. It defines no DAG.
"""

from regen.config import ConfigError
from regen.dags.definitions import run_definitions

_problems = run_definitions()[1]
if _problems:
    raise ConfigError("regen: broken run configs, their DAGs are not defined:\n" + "\n".join(_problems))
