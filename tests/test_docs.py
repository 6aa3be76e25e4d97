"""README tells the truth: every Param and every audit finding is documented, and CI runs README's test command."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import yaml

from regen.audit.findings import FINDINGS
from regen.config import run_fields
from support.paths import ROOT


def test_readme_documents_every_param_in_its_section():
    readme = (ROOT / "README.md").read_text()
    documented = {name: section for section, name in re.findall(r"^\| (\w+) \| `(\w+)` \|", readme, flags=re.M)}
    assert documented == {name: field.section for name, field in run_fields().items()}
    assert list(documented) == list(run_fields())  # in the schema's order


def test_ci_runs_the_readme_test_command():
    readme = (ROOT / "README.md").read_text()
    assert "make test    # the test suite (what CI runs through .ci/run)" in readme
    ci = (ROOT / ".ci" / "run").read_text().strip().splitlines()
    assert ci[-1] == "make test"


def test_readme_documents_every_audit_finding_in_the_codes_order():
    readme = (ROOT / "README.md").read_text()
    section = readme.split("### The audit's findings", 1)[1].split("\n### ", 1)[0]
    assert re.findall(r"^\| `(\w+)` \|", section, flags=re.M) == list(FINDINGS)


def test_readmes_operating_point_example_is_what_the_dry_run_prints(tmp_path):
    """README's `regen serve --dry-run --gpu H200` lines, run on README's own run.yaml with the
    Qwen3.6-shaped fixture as its model (the example was once 0.827 / 524,206 / 22 against the
    code's 0.841 / 535,886 / 23)."""
    readme = (ROOT / "README.md").read_text()
    run_yaml = yaml.safe_load(readme.split("# run.yaml\n", 1)[1].split("```", 1)[0])
    command = "$ regen serve --config run.yaml --dry-run --gpu H200\n"
    shown = readme.split(command, 1)[1].split("```", 1)[0].splitlines()
    run_yaml.update(model_path=str(ROOT / "tests" / "fixtures" / "qwen36-27b-shape"), engine_python=sys.executable,
                    prompts=str(ROOT / "demo" / "prompts.jsonl"), output=str(tmp_path / "out"))
    (tmp_path / "run.yaml").write_text(json.dumps(run_yaml))
    out = subprocess.run([str(Path(sys.executable).parent / "regen"), "serve", "--config", str(tmp_path / "run.yaml"),
                          "--dry-run", "--gpu", "H200"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert [line for line in out.stderr.splitlines() if line.startswith("per server: ")] == shown
