"""README and the docs site tell the truth: the site builds with --strict (no broken link), its Params
reference is what the schema writes, every audit finding is documented, and CI runs README's test
command."""

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


DOCS = ROOT / "docs"


def test_the_params_reference_is_what_the_schema_writes():
    """docs/params.md is `make docs`'s output of the schema: a field added, renamed or described
    anew without `make docs` fails here."""
    from regen.config.reference import params_reference

    page = (DOCS / "params.md").read_text()
    assert page == params_reference(), "docs/params.md differs from the schema: run `make docs`"
    documented = {name: section for section, name in re.findall(r"^\| (\w+) \| `(\w+)` \|", page, flags=re.M)}
    assert list(documented.items()) == [(name, field.section) for name, field in run_fields().items()]


def test_the_docs_site_builds_strict_and_readme_links_only_to_what_exists(tmp_path):
    """mkdocs --strict: a link to a page or an anchor that does not exist fails the build (about 2 s)."""
    built = subprocess.run([str(Path(sys.executable).parent / "mkdocs"), "build", "--strict", "--quiet",
                            "--config-file", str(ROOT / "mkdocs.yml"), "--site-dir", str(tmp_path / "site")],
                           capture_output=True, text=True, timeout=300)
    assert built.returncode == 0, built.stdout[-3000:] + built.stderr[-3000:]
    assert (tmp_path / "site" / "params" / "index.html").exists()
    readme = (ROOT / "README.md").read_text()
    targets = [t for t in re.findall(r"\]\(([^)\s#]+)(?:#[^)]*)?\)", readme) if not t.startswith("http")]
    assert targets and [t for t in targets if not (ROOT / t).exists()] == []


def test_ci_runs_the_readme_test_command():
    readme = (ROOT / "README.md").read_text()
    assert "make test    # the test suite (what CI runs through .ci/run)" in readme
    ci = (ROOT / ".ci" / "run").read_text().strip().splitlines()
    assert ci[-1] == "make test"


def test_the_docs_document_every_audit_finding_in_the_codes_order():
    page = (DOCS / "outputs.md").read_text()
    section = page.split("## The audit's findings", 1)[1].split("\n## ", 1)[0]
    assert re.findall(r"^\| `(\w+)` \|", section, flags=re.M) == list(FINDINGS)


def test_the_docs_operating_point_example_is_what_the_dry_run_prints(tmp_path):
    """docs/gpus.md's `regen serve --dry-run --gpu H200` lines, run on the page's own run.yaml with
    the Qwen3.6-shaped fixture as its model (the example was once 0.827 / 524,206 / 22 against the
    code's 0.841 / 535,886 / 23)."""
    readme = (DOCS / "gpus.md").read_text()
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


def test_the_readmes_commands_are_commands_as_written():
    """Every command line of README's code blocks: a `make` target the Makefile has, a `regen`
    command line regen's own parser takes, a `docker compose` file that exists."""
    import shlex

    from regen.cli import build_parser

    lines, fence = [], None
    for line in (ROOT / "README.md").read_text().splitlines():
        if line.startswith("```"):
            fence = None if fence is not None else line[3:]
        elif fence == "":  # a plain block: commands (a yaml block is a file)
            lines.append(line.split("  #", 1)[0].strip())
    targets = set(re.findall(r"^([\w-]+):", (ROOT / "Makefile").read_text(), flags=re.M))
    checked = 0
    for line in lines:
        words = shlex.split(line) if line else []
        if words[:1] == ["make"]:
            assert words[1] in targets, line
        elif words[:1] in (["regen"], [".venv/bin/regen"]):
            build_parser().parse_args(words[1:])  # exits (fails the test) on a command regen refuses
        elif words[:2] == ["docker", "compose"]:
            files = [words[i + 1] for i, w in enumerate(words) if w == "-f"]
            assert all((ROOT / f).exists() for f in files), line
        else:
            continue
        checked += 1
    assert checked >= 3  # make demo, make test, the quickstart's regen preflight
