"""Every benchmark, run at a tiny size so none can rot between measurements: it must finish, agree
with its baseline where it checks that (same rows, same loss tokens), and write its section with
a table, into a scratch RESULTS file (REGEN_BENCH_RESULTS), never bench/RESULTS.md. About 6
minutes together; the numbers mean nothing at this size."""

from __future__ import annotations

import os
import re
import subprocess

import pytest

from support.paths import BIN, ROOT

TINY = {
    "bench_audit.py": ["--samples", "20", "--rounds", "1"],
    "bench_balance.py": ["--prompts", "70"],
    "bench_client.py": ["--requests", "100", "--rounds", "1"],
    "bench_engine.py": ["--engine", "sim", "--rounds", "2", "--times", "1"],
    "bench_fleet.py": ["--rows", "16", "--servers", "3", "--slots", "8", "--median", "40", "--max-tokens", "512",
                       "--rounds", "1"],
    "bench_nodes.py": ["--rounds", "1", "--shards", "2", "--prompts", "20"],
    "bench_objectstore.py": ["--rows", "2000", "--part-rows", "500", "--rounds", "1", "--kills", "1"],
    "bench_preflight.py": ["--prompts", "2000"],
    "bench_resume.py": ["--prompts", "2000", "--shards", "4", "--id-prompts", "400", "--id-shards", "4", "--ids", "200"],
    "bench_scale.py": ["--prompts", "600", "--id-rows", "20", "--shards", "2"],
    "bench_share.py": ["--prompts", "60", "--rounds", "1"],
    "bench_stage.py": ["--shards", "2", "--shard-mb", "4", "--rounds", "1"],
}


def test_every_bench_script_has_a_tiny_run_here():
    scripts = sorted(p.name for p in (ROOT / "bench").glob("bench_*.py"))
    assert scripts == sorted(TINY)


@pytest.mark.slow
@pytest.mark.parametrize("script", sorted(TINY))
def test_the_bench_runs_at_a_tiny_size(script, tmp_path, request):
    if script == "bench_preflight.py":
        request.getfixturevalue("airflow_db")  # it triggers the DAG with `airflow dags test`
    results = tmp_path / "RESULTS.md"
    env = {**os.environ, "REGEN_BENCH_RESULTS": str(results), "PYTHONPATH": str(ROOT / "include")}
    done = subprocess.run([str(BIN / "python"), str(ROOT / "bench" / script), *TINY[script]],
                          capture_output=True, text=True, timeout=600, env=env, cwd=tmp_path)
    assert done.returncode == 0, (done.stdout[-2000:], done.stderr[-4000:])
    text = results.read_text()
    assert re.search(r"^## .+\n\n`\.venv/bin/python bench/" + re.escape(script), text, re.M), text[:500]
    table = [line for line in text.splitlines() if line.startswith("| ")]
    assert len(table) >= 3 and "regen" in text  # a header, its rule and at least one measured row
