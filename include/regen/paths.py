"""Where the project's own files live, so that the embedded default runs from any directory."""

import os
from pathlib import Path

PROJECT_ROOT = Path(__file__).resolve().parents[2]
# Generated state (demo model, datasets, Airflow home); gitignored. REGEN_VAR_DIR moves it.
VAR_DIR = Path(os.environ.get("REGEN_VAR_DIR", PROJECT_ROOT / "var"))
DEMO_DIR = PROJECT_ROOT / "demo"
DEMO_PROMPTS = DEMO_DIR / "prompts.jsonl"
DEMO_MODEL = VAR_DIR / "demo-model"
DAGS_DIR = PROJECT_ROOT / "dags"
PACKAGE_DIR = Path(__file__).resolve().parent
