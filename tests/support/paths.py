"""Where the project, the tests' scratch space and this interpreter's commands are."""

import sys
from pathlib import Path

from support.workers import claim

ROOT = Path(__file__).resolve().parents[2]
TEST_VAR = claim(ROOT / "var" / "test")  # this xdist worker's own (support/workers.py)
AIRFLOW_HOME = TEST_VAR / "airflow"
BIN = Path(sys.executable).parent
DAG_FILE = ROOT / "dags" / "regenerate_dataset.py"
