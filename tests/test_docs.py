"""README tells the truth: every Param and every audit finding is documented, and CI runs README's test command."""

from __future__ import annotations

import re

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
