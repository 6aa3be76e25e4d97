"""Schedules set by the deployment, and alerts a deployment can point anywhere."""

from __future__ import annotations

import json
import time

import pytest

from regen.alerts import check_overdue, send
from regen.config import ConfigError
from regen.dags.schedule import schedule_spec
from regen.progress import RunProgress


@pytest.mark.parametrize("value, spec", [
    (None, None), ("", None), ("none", None), ("@weekly", "@weekly"), ("0 3 * * 6", "0 3 * * 6"),
    ("asset:file:///data/prompts.jsonl", ["file:///data/prompts.jsonl"]),
    ("asset:s3://ckpt/qwen3 | asset:file:///p.jsonl", ["s3://ckpt/qwen3", "file:///p.jsonl"]),
])
def test_schedule_from_the_environment(value, spec):
    assert schedule_spec(value) == spec


def test_a_malformed_asset_schedule_is_refused():
    with pytest.raises(ConfigError, match="REGEN_SCHEDULE"):
        schedule_spec("asset:s3://a|@daily")


def test_the_dag_takes_its_schedule_from_the_environment(monkeypatch):
    import runpy

    from support.paths import ROOT

    monkeypatch.setenv("REGEN_SCHEDULE", "asset:file:///data/prompts.jsonl|asset:s3://ckpt/latest")
    dag = runpy.run_path(str(ROOT / "dags" / "regenerate_dataset.py"))["regenerate_dataset"]
    uris = sorted(asset.uri for asset in dag.timetable.asset_condition.objects)
    assert uris == ["file:///data/prompts.jsonl", "s3://ckpt/latest"]
    monkeypatch.setenv("REGEN_SCHEDULE", "0 3 * * 6")
    dag = runpy.run_path(str(ROOT / "dags" / "regenerate_dataset.py"))["regenerate_dataset"]
    assert dag.timetable.expression == "0 3 * * 6"


def test_alerts_go_to_the_configured_file(tmp_path, monkeypatch):
    monkeypatch.setenv("REGEN_ALERT_FILE", str(tmp_path / "alerts.jsonl"))
    send("audit", "failed: AuditFailed: 870 of 1,000 samples degenerate", run_id="r1")
    alert = json.loads((tmp_path / "alerts.jsonl").read_text())
    assert alert["text"] == "regen: audit failed: AuditFailed: 870 of 1,000 samples degenerate"
    assert alert["run_id"] == "r1"


def test_a_run_well_past_the_canary_estimate_alerts_once(tmp_path, monkeypatch):
    monkeypatch.setenv("REGEN_ALERT_FILE", str(tmp_path / "alerts.jsonl"))
    progress = RunProgress(tmp_path / "out")
    progress.write_section("canary", {"estimate": {"eta_s": 100}})
    assert check_overdue(tmp_path / "out") is None  # just started
    canary = tmp_path / "out" / "work" / "progress" / "canary.json"
    data = json.loads(canary.read_text())
    data["updated"] = time.time() - 250  # 2.5x the estimate has passed
    canary.write_text(json.dumps(data))
    alert = check_overdue(tmp_path / "out")
    assert alert["stage"] == "generate" and "2.5x past the canary's estimate" in alert["reason"]
    assert check_overdue(tmp_path / "out") is None  # once
    assert len((tmp_path / "alerts.jsonl").read_text().splitlines()) == 1


def test_alerts_go_through_the_deployments_airflow_notifier_off_the_callers_thread(monkeypatch):
    """The apprise provider's AppriseNotifier, configured by environment only, posting to a real
    HTTP endpoint on loopback that holds the request: send() returns before the delivery ends."""
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    from regen.alerts import wait_for_deliveries

    received, got, release = [], threading.Event(), threading.Event()

    class Endpoint(BaseHTTPRequestHandler):
        def do_POST(self):
            received.append(json.loads(self.rfile.read(int(self.headers["Content-Length"]))))
            got.set()
            release.wait(30)
            self.send_response(200)
            self.end_headers()

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Endpoint)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    monkeypatch.setenv("AIRFLOW_CONN_REGEN_ALERTS", json.dumps({
        "conn_type": "apprise", "extra": {"config": {"path": f"json://127.0.0.1:{server.server_port}/"}}}))
    monkeypatch.setenv("REGEN_NOTIFIERS", json.dumps([{
        "class": "airflow.providers.apprise.notifications.apprise.AppriseNotifier",
        "kwargs": {"apprise_conn_id": "regen_alerts"}, "message_field": "body", "title_field": "title"}]))
    try:
        send("servers", "server 1 (port 30001) died; restart 1 of 3")
        assert got.wait(30)  # the endpoint has the alert and holds it ...
        assert not release.is_set()  # ... while send() has long returned to its caller
        release.set()
        wait_for_deliveries()
    finally:
        release.set()
        server.shutdown()
    assert received[0]["message"] == "regen: servers server 1 (port 30001) died; restart 1 of 3"
    assert received[0]["title"] == "regen: servers"


def test_a_malformed_notifier_setting_is_named(monkeypatch):
    monkeypatch.setenv("REGEN_NOTIFIERS", "{not json")
    with pytest.raises(ValueError, match="REGEN_NOTIFIERS"):
        send("audit", "failed")


def test_an_alert_carries_the_whole_reason_not_its_first_line():
    from regen.alerts import REASON_MAX_CHARS, failure_reason
    from regen.preflight import PreflightFailed

    problems = ["max_tokens: 400000 is beyond the model's context length 262144",
                "prompts /data/p.jsonl:17: not valid JSON"]
    reason = failure_reason(PreflightFailed(problems))
    assert all(problem in reason for problem in problems), reason
    flood = failure_reason(RuntimeError("x" * (REASON_MAX_CHARS * 3)))
    assert len(flood) < REASON_MAX_CHARS + 100 and flood.endswith("more characters in the task log)")
