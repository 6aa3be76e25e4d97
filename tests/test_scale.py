"""Runs of real size inside Airflow: 10,000 prompts through `airflow standalone`, the audit in
worker processes inside the task (LocalExecutor's supervisor sets a database URL that a child
importing Airflow dies on), and a run whose servers go bad stopped by the live quality guard in
generation. About 2 minutes: a run of 10,000 prompts and a stopped one on the shared standalone.
"""

from __future__ import annotations

import json

import httpx
import pytest

from support.airflow import trigger_run, wait_run
from support.data import write_prompts

PROMPTS = 10_000


def _task_log(api, run_id: str, task_id: str) -> str:
    path = f"/dags/regenerate_dataset/dagRuns/{run_id}/taskInstances/{task_id}/logs/1"
    return api.get(path, params={"full_content": True}).text


@pytest.mark.slow
@pytest.mark.timeout(1200)  # its run took 8 min on a slow, loaded CI machine (600 s ran out)
def test_a_run_of_ten_thousand_prompts_is_audited_in_parallel_inside_its_task(airflow, make_config, tmp_path):
    api = httpx.Client(base_url=f"{airflow['base']}/api/v2",
                       headers={"Authorization": f"Bearer {airflow['token']}"}, timeout=60)
    prompts = write_prompts(tmp_path / "prompts.jsonl", PROMPTS)
    good = make_config(prompts=str(prompts), output=str(tmp_path / "good"), num_shards=4,
                       concurrency_per_server=64, max_tokens=256)
    run_id = trigger_run(api, good, airflow["config_dir"])
    assert wait_run(api, run_id, 900) == "success", _task_log(api, run_id, "audit")[-3000:]
    log = _task_log(api, run_id, "audit")
    assert f"auditing {PROMPTS:,} rows in 2 worker process(es)" in log
    summary = json.loads(good.layout.audit.summary_json.read_text())
    assert summary["verdict"] == "PASS" and summary["counts"]["degenerate"] == 0
    assert summary["samples"] >= PROMPTS

    # Each server stops thinking after 500 requests (the canary's among them): the live quality
    # guard drains both and stops the run in generation, before a fifth of the requests are sent;
    # no audit is needed to find it.
    requests = tmp_path / "requests-{port}.jsonl"
    bad = make_config(prompts=str(prompts), output=str(tmp_path / "bad"), num_shards=4,
                      concurrency_per_server=64, max_tokens=256,
                      extra_server_args=["--sim-ignore-thinking-after", "500", "--sim-request-log", str(requests)])
    run_id = trigger_run(api, bad, airflow["config_dir"])
    assert wait_run(api, run_id, 900) == "failed"
    tis = api.get(f"/dags/regenerate_dataset/dagRuns/{run_id}/taskInstances").json()["task_instances"]
    states = {ti["task_id"]: ti["state"] for ti in tis if ti["map_index"] in (-1, 0)}
    assert states["canary"] == "success" and states["generate"] == "failed" and states["audit"] != "success", (
        states, _task_log(api, run_id, "preflight")[-3000:])
    sent = sum(len(p.read_text().splitlines()) for p in tmp_path.glob("requests-*.jsonl"))
    assert sent < PROMPTS / 5, sent
    progress = json.loads((tmp_path / "bad" / "progress.json").read_text())
    assert "every server drained" in progress["quality"]["stopped"]["why"] or \
        "the run's rows" in progress["quality"]["stopped"]["why"]
    shard_log = api.get(f"/dags/regenerate_dataset/dagRuns/{run_id}/taskInstances/generate/logs/1",
                        params={"full_content": True, "map_index": 0}).text
    assert "quality guard" in shard_log
