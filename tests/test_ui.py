"""The run page in a real Airflow: `airflow standalone` on loopback, a run triggered through the
REST API, the page checked in headless Chromium (Debian's), and refused without a token.

Costs about four minutes (seven runs side by side, each on a DAG of its own, one of them cleared
twice; 229 s while a whole `.ci/run` shared the machine). Saves screenshots to
test-artifacts/: run-page.png, samples-viewer.png, run-page-preflight-failed.png, run-page-canary-failed.png,
run-page-failed-shards.png, run-page-audit-failed.png, run-page-stopped.png, trigger-form.png and dag-docs-deployment.png.
"""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest

from regen.config.deployment import DEPLOYMENT_FIELDS
from support.airflow import (assert_clean_success, assert_no_server_left, fault_config, shard_states,
                             trigger_runs, undeploy, wait_run)
from support.paths import ROOT
from support.processes import wait_until

ARTIFACTS = ROOT / "test-artifacts"
CHROMIUM = "/usr/bin/chromium"


def test_the_report_route_reads_no_file_through_a_symlink(make_config, tmp_path):
    """The output is a path the run's conf chose: a report (or an audit folder) that is a symlink
    to another file is not read by the API server."""
    from regen.dags.runpage import read_report

    secret = tmp_path / "secret.txt"
    secret.write_text("not for the run page")
    cfg = make_config(output=str(tmp_path / "out"))
    report = cfg.layout.audit.report_html
    report.parent.mkdir(parents=True)
    report.symlink_to(secret)
    with pytest.raises(OSError):
        read_report(cfg)
    other = make_config(output=str(tmp_path / "out2"))
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "elsewhere" / report.name).symlink_to(secret)
    other.layout.audit.report_html.parent.parent.mkdir(parents=True)
    other.layout.audit.report_html.parent.symlink_to(tmp_path / "elsewhere")
    with pytest.raises(PermissionError, match="is a symlink"):
        read_report(other)
    report.unlink()
    report.write_text("<p>the report</p>")
    assert read_report(cfg) == "<p>the report</p>"


def test_the_status_and_regen_summary_say_what_failed_and_what_to_do(sim_servers, make_config, tmp_path):
    """A canary that catches the seed's disaster, and shards whose prompts the servers fail: each
    comes first, with its reason, its last error and the next step, in the status the run page
    reads and in `regen summary`."""
    import subprocess

    from regen.canary import CanaryFailed, canary
    from regen.errors import ShardFailed
    from regen.generate import ShardRun
    from regen.status import status
    from support.paths import BIN

    cfg, records = sim_servers(num_servers=1, sim_ignore_thinking=True, output=str(tmp_path / "thinking-off"))
    with pytest.raises(CanaryFailed):
        canary(cfg)
    first = status(cfg).attention[0]
    assert first["what"].startswith("canary failed: ") and "no shard started" in first["what"]
    assert any("without reasoning while enable_thinking is on" in d for d in first["details"])
    config = tmp_path / "thinking-off.yaml"
    config.write_text(cfg.to_yaml())
    out = subprocess.run([str(BIN / "regen"), "summary", "--config", str(config)], capture_output=True, text=True)
    assert out.returncode != 0 and "canary:   FAILED" in out.stdout and "! canary failed" in out.stdout
    assert "without reasoning" in out.stdout and "    next: fix what each problem names" in out.stdout

    faulty, _ = fault_config(make_config, tmp_path, "faults")
    fields = ("prompts", "output", "max_attempts", "max_error_fraction", "extra_server_args")
    faulty, servers = sim_servers(num_servers=1, num_shards=1, **{k: faulty.flat_value(k) for k in fields})
    with pytest.raises(ShardFailed):
        ShardRun(faulty, [(r.url, r.api_key) for r in servers], 0, "m").run()
    [shard] = status(faulty).attention
    assert shard["what"] == "1 shard failed (0/1)" and "prompts failed (more than max_error_fraction" \
        in shard["details"][0]
    assert shard["details"][1].startswith("shard 0/1 on ") and "last failed prompt: fault-" in shard["details"][1]
    assert "HTTP 500" in shard["details"][1]
    assert shard["next"].startswith("the servers failed on these requests: read their logs")
    assert shard["next"].endswith("each resumes from what it finished")
    config = tmp_path / "faults.yaml"
    config.write_text(faulty.to_yaml())
    out = subprocess.run([str(BIN / "regen"), "progress", "--config", str(config)], capture_output=True, text=True)
    lines = out.stdout.splitlines()  # for people by default: a few lines, the failure and what to do
    assert out.returncode == 0 and lines[0].startswith("rows:    ") and "shards:  1 failed" in out.stdout
    assert "! 1 shard failed (0/1)" in out.stdout and "audit:   not run yet" in out.stdout and len(lines) < 12
    machine = subprocess.run([str(BIN / "regen"), "progress", "--config", str(config), "--json"],
                             capture_output=True, text=True)
    assert json.loads(machine.stdout)["attention"][0]["what"] == "1 shard failed (0/1)"


@pytest.mark.slow
@pytest.mark.timeout(1200)  # seven runs at once: 371 s on a loaded CI machine, whose held run then ran out of 300 s
def test_the_run_page_shows_shards_and_the_verdict_and_needs_a_token(airflow, make_config, tmp_path):
    api = httpx.Client(base_url=f"{airflow['base']}/api/v2", headers={"Authorization": f"Bearer {airflow['token']}"},
                       timeout=30)
    # Seven runs at once, each on a DAG of its own (a deployment file each, and max_active_runs=1
    # would queue a DAG's runs one behind the other): the test waits for the slowest, not the sum.
    cfg = make_config(num_shards=3, sim_tokens_per_second=2000)
    evil = tmp_path / "<img src=x onerror=window.pwned=1>"  # an output path that is markup
    faulty, _ = fault_config(make_config, tmp_path, "faults")
    # A server loses thinking after the canary (its fault flags are the deployment's).
    lost = make_config(output=str(tmp_path / "thinking-lost"), sim_tokens_per_second=2000)
    lost = lost.model_copy(update={
        "servers": lost.servers.model_copy(update={"extra_server_args": [
            "--sim-ignore-thinking-after", "6", "--sim-faults-on-port", str(lost.servers.base_port + 1)]}),
        "audit": lost.audit.model_copy(update={"max_degenerate_fraction": 0.002})})
    # A run held under way while its hold file exists: 12 of its prompts are retried until then.
    held, hold = fault_config(make_config, tmp_path, "stopped")
    held = held.model_copy(update={"generation": held.generation.model_copy(update={"max_attempts": 10_000})})
    # The held run is triggered first: the test waits on it first, and on a loaded CI machine the
    # last of seven runs triggered once took more than 300 s to get a shard under way.
    configs = {"regenerate_ui_stopped": held, "regenerate_dataset": cfg,
               "regenerate_ui_xss": make_config(output=str(evil), num_shards=1, sim_tokens_per_second=2000),
               "regenerate_ui_preflight": make_config(output=str(tmp_path / "no-prompts"),
                                                      prompts=str(tmp_path / "missing.jsonl")),
               "regenerate_ui_thinking_off": make_config(output=str(tmp_path / "thinking-off"), sim_ignore_thinking=True,
                                                         sim_tokens_per_second=2000),
               "regenerate_ui_faults": faulty, "regenerate_ui_lost": lost}
    try:
        runs = trigger_runs(api, configs, airflow["config_dir"])
        _check_run_pages(api, airflow, runs, configs, hold)
    finally:  # the other tests on this standalone parse no DAG of this one
        for dag_id in configs:
            if dag_id != "regenerate_dataset":
                undeploy(airflow["config_dir"], dag_id)


def _check_run_pages(api, airflow, runs: dict[str, str], configs: dict, hold: Path) -> None:
    """Each run's page, as its run ends (``runs`` and ``configs`` by DAG id); ``hold`` holds the
    run marked failed under way."""
    from playwright.sync_api import sync_playwright

    base, headers = airflow["base"], {"Authorization": f"Bearer {airflow['token']}"}
    cfg, held, lost = configs["regenerate_dataset"], configs["regenerate_ui_stopped"], configs["regenerate_ui_lost"]
    run_id, stopped = runs["regenerate_dataset"], runs["regenerate_ui_stopped"]

    def shards_under_way() -> bool:
        shards = httpx.get(f"{base}/regen/runs/regenerate_ui_stopped/{stopped}/data", headers=headers,
                           timeout=30).json()["progress"].get("shards", {})
        return any(s["state"] == "running" and s.get("done", 0) > 0 for s in shards.values())

    # A run a person marks failed mid-shard (the UI's PATCH): it ends failed, not green by
    # Airflow's teardown rule, its servers stopped and its unfinished shards shown stopped.
    wait_until(shards_under_way, 600, "the held run's shards under way")
    marked = api.patch(f"/dags/regenerate_ui_stopped/dagRuns/{stopped}", json={"state": "failed"})
    assert marked.status_code == 200, marked.text

    assert wait_run(api, run_id, 300) == "success"
    page_url = f"{base}/regen/runs/regenerate_dataset/{run_id}"
    assert httpx.get(page_url).status_code in (401, 403)  # no token: refused
    assert httpx.get(f"{page_url}/data").status_code in (401, 403)
    for unguarded in ("openapi.json", "docs", "redoc"):  # FastAPI's own pages: none on the plugin
        assert httpx.get(f"{base}/regen/{unguarded}").status_code == 404
    views = api.get("/plugins").json()["plugins"]
    assert any(v["destination"] == "dag_run" for p in views for v in p["external_views"])

    ARTIFACTS.mkdir(exist_ok=True)
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=[
            "--no-sandbox", "--disable-gpu", "--disable-background-networking",
            "--disable-component-update", "--disable-sync", "--no-first-run"])
        context = browser.new_context(viewport={"width": 1200, "height": 1400})
        refused = context.new_page().goto(page_url)
        assert refused.status in (401, 403)
        context.add_cookies([{"name": "_token", "value": airflow["token"], "url": base}])
        page = context.new_page()
        response = page.goto(page_url)
        assert response.status == 200
        page.wait_for_selector("#verdict", timeout=30000)
        assert page.inner_text("#verdict") == "PASS"
        shards = page.inner_text("#shards")
        for i in range(3):
            assert f"shard {i}/3" in shards
        summary = page.inner_text("#summary")  # a finished run: what it made, how long, how fast
        assert "280 of 280 rows" in summary and "generated in" in summary and "tok/s on average" in summary
        assert "ETA" not in summary and "run success" in summary
        assert set(page.locator("#servers td:nth-child(2)").all_inner_texts()) == {"stopped"}
        assert f"regen export --data {cfg.output} --format specforge" in page.inner_text("#next")
        axes = page.locator("#chart text").all_text_contents()  # the chart's axes and units
        assert "tok/s" in axes and "time since the first point" in axes and "0" in axes
        page.screenshot(path=str(ARTIFACTS / "run-page.png"), full_page=True)
        assert "script-src 'nonce-" in response.headers["content-security-policy"]

        # The samples viewer, in the report the page embeds: conversations as training sees them.
        report = page.context.new_page()
        csp = report.goto(f"{page_url}/report").headers["content-security-policy"]
        assert csp.startswith("default-src 'none'") and csp.endswith("; sandbox")
        assert page.locator("iframe[sandbox='']").count() == 1
        report.click("details.sample-view >> nth=0")
        assert report.locator("details.sample-view").count() >= 5
        assert report.locator("details.sample-view[open] mark").count() >= 1  # the loss spans
        report.screenshot(path=str(ARTIFACTS / "samples-viewer.png"), full_page=True)

        # Airflow's own trigger form: the run fields, none of the deployment's (Airflow 3.3's form
        # has no read-only input); the DAG's docs list the deployment's values instead.
        form = context.new_page()
        form.goto(f"{base}/dags/regenerate_dataset")
        form.get_by_role("button", name="Trigger").first.click()
        form.locator("[role=dialog][data-state=open]").get_by_role("button", name="Run", exact=True).click()
        form.wait_for_selector("#element_output", timeout=90000)
        fields = set(form.locator("[id^=element_], [name^=element_]").evaluate_all(
            "els => els.map(e => (e.id.startsWith('element_') ? e.id : e.getAttribute('name')).slice(8))"))
        assert {"output", "prompts", "max_tokens", "enable_thinking"} <= fields, fields
        assert not fields & set(DEPLOYMENT_FIELDS), fields
        opened = "() => getComputedStyle(document.querySelector('[role=dialog][data-state=open]')).opacity === '1'"
        form.wait_for_function(opened)  # its fade-in ended
        form.screenshot(path=str(ARTIFACTS / "trigger-form.png"), full_page=True)
        form.keyboard.press("Escape")
        form.get_by_role("button", name="Dag Docs").click()
        docs = form.locator("[role=dialog][data-state=open]")
        heading = docs.get_by_text("Set by the deployment, not in the trigger form")
        heading.wait_for(timeout=30000)
        assert f"staging_dir\t{cfg.flat_value('staging_dir')}" in docs.inner_text()
        form.wait_for_function(opened)
        heading.evaluate("e => e.scrollIntoView()")
        docs.screenshot(path=str(ARTIFACTS / "dag-docs-deployment.png"))

        # A run whose output path is markup: shown as text, no script runs.
        assert wait_run(api, runs["regenerate_ui_xss"], 300, "regenerate_ui_xss") == "success"
        dialogs = []
        page = context.new_page()
        page.on("dialog", lambda d: (dialogs.append(d.message), d.dismiss()))
        page.goto(f"{base}/regen/runs/regenerate_ui_xss/{runs['regenerate_ui_xss']}")
        page.wait_for_selector("#verdict", timeout=30000)
        assert "<img src=x onerror=window.pwned=1>" in page.inner_text("#output")
        assert page.evaluate("window.pwned") is None and dialogs == []
        assert page.locator("#summary img").count() == 0

        def open_run(dag_id: str, end_state: str, selector: str):
            """The run's page in a new tab once the run has ended in ``end_state`` and ``selector``
            shows (the page's data has come: on a loaded machine the API server may answer the
            first request late, and the page asks again)."""
            assert wait_run(api, runs[dag_id], 300, dag_id) == end_state
            tab = context.new_page()
            tab.goto(f"{base}/regen/runs/{dag_id}/{runs[dag_id]}")
            tab.wait_for_selector(selector, timeout=90000)
            return tab

        # What went wrong, first on the page: the seed's disaster caught by the canary, then
        # shards whose prompts the servers fail, each with its error and the next step.
        page = open_run("regenerate_ui_preflight", "failed", "#attention .problem")  # the reason on the page, not in a log
        alert = page.inner_text("#attention")
        assert alert.startswith("preflight failed: preflight found") and "missing.jsonl" in alert
        assert "next: fix what each problem names" in alert
        assert page.inner_text("#summary").startswith("no shard started") and "run failed" in page.inner_text("#summary")
        page.screenshot(path=str(ARTIFACTS / "run-page-preflight-failed.png"), full_page=True)

        page = open_run("regenerate_ui_thinking_off", "failed", "#canary-verdict")
        assert page.inner_text("#canary-verdict") == "failed"
        alert = page.inner_text("#attention")
        assert "canary failed" in alert and "without reasoning while enable_thinking is on" in alert
        assert "next: fix what each problem names" in alert and "run failed" in page.inner_text("#summary")
        page.screenshot(path=str(ARTIFACTS / "run-page-canary-failed.png"), full_page=True)
        page = open_run("regenerate_ui_faults", "failed", "#attention .problem")
        alert = page.inner_text("#attention")
        assert "3 shards failed (0/3, 1/3, 2/3)" in alert and "HTTP 500: simulated internal error" in alert
        assert "next: the servers failed on these requests" in alert
        assert "HTTP 500" in page.inner_text("#shards") and page.inner_text("#canary-verdict") == "passed"
        page.screenshot(path=str(ARTIFACTS / "run-page-failed-shards.png"), full_page=True)

        # The server that lost thinking: the live guard drains it (the page names it and why), the
        # run ends on the other, and the audit fails on the rows it made before.
        page = open_run("regenerate_ui_lost", "failed", "#verdict")
        assert page.inner_text("#verdict") == "FAIL" and page.inner_text("#canary-verdict") == "passed"
        alert = page.inner_text("#attention")
        assert "audit FAIL: the data is not fit to train on" in alert and "next: read the report" in alert
        assert "drained by the quality guard" in alert and f":{lost.servers.base_port + 1}" in alert
        page.screenshot(path=str(ARTIFACTS / "run-page-audit-failed.png"), full_page=True)

        # The run marked failed mid-shard.
        page = open_run("regenerate_ui_stopped", "failed", "#attention .stopped")
        states = shard_states(api, stopped, "regenerate_ui_stopped")
        assert states[("audit", -1)] == "skipped" and states[("stop_servers", -1)] == "failed", states
        assert "failed" in {states.get(("generate", i)) for i in range(held.num_shards)}, states
        assert_no_server_left(held)
        alert = page.inner_text("#attention .stopped")
        assert "stopped unfinished" in alert and "the run is failed in Airflow" in alert
        assert "next: clear the whole run ('only failed' unticked" in alert
        summary = page.inner_text("#summary")
        assert "stopped" in page.inner_text("#shards") and "run failed" in summary and "ETA" not in summary
        page.screenshot(path=str(ARTIFACTS / "run-page-stopped.png"), full_page=True)
        browser.close()

    # Cleared with "only failed" ticked, the failed shards resume but the skipped audit would not
    # run: the teardown fails the run again, saying why. The whole run's Clear, as the page says,
    # resumes every shard and audits.
    hold.unlink()
    assert api.post(f"/dags/regenerate_ui_stopped/dagRuns/{stopped}/clear",
                    json={"dry_run": False, "only_failed": True}).status_code == 200
    assert wait_run(api, stopped, 300, "regenerate_ui_stopped") == "failed"
    states = shard_states(api, stopped, "regenerate_ui_stopped")
    assert states[("audit", -1)] == "skipped" and states[("stop_servers", -1)] == "failed", states
    assert "failed" not in {states.get(("generate", i)) for i in range(held.num_shards)}, states
    assert api.post(f"/dags/regenerate_ui_stopped/dagRuns/{stopped}/clear",
                    json={"dry_run": False, "only_failed": False}).status_code == 200
    assert_clean_success(api, stopped, held, "regenerate_ui_stopped")
    assert shard_states(api, stopped, "regenerate_ui_stopped")[("audit", -1)] == "success"

    # Another DAG's run: not served, whatever its conf says.
    wait_until(lambda: api.get("/dags/not_regen").status_code == 200, 120, "the other DAG parsed")
    created = api.post("/dags/not_regen/dagRuns", json={"logical_date": None, "conf": {"output": "/"}})
    assert created.status_code == 200, created.text
    other = httpx.get(f"{base}/regen/runs/not_regen/{created.json()['dag_run_id']}/data", headers=headers)
    assert other.status_code == 404 and "not a regen DAG" in other.text


def test_the_run_pages_data_reads_no_file_through_a_symlink_and_within_bounds(tmp_path):
    """A viewer polls /data: progress.json linked to a secret, history.jsonl linked to
    /dev/zero, a huge history: the page answers at once with what is the run's own, bounded."""
    import time

    from regen.layout import RunLayout
    from regen.status import HISTORY_MAX_BYTES, run_data

    secret = tmp_path / "passwords.json"
    secret.write_text('{"admin": "hunter2"}')
    layout = RunLayout(tmp_path / "out")
    layout.history.parent.mkdir(parents=True)
    layout.progress_file.symlink_to(secret)
    layout.history.symlink_to("/dev/zero")
    started = time.monotonic()
    data = run_data(layout)
    assert data["progress"] == {} and data["history"] == [] and "hunter2" not in str(data)
    layout.history.unlink()
    with layout.history.open("w") as fh:  # more history than a poll reads: its last lines
        for t in range(200_000):
            fh.write(f'{{"t": {t}, "tokens_per_s": 1.0}}\n')
    assert layout.history.stat().st_size > HISTORY_MAX_BYTES
    points = run_data(layout)["history"]
    assert points[-1]["t"] == 199_999 and len(points) == 2000
    assert time.monotonic() - started < 5


def test_a_folder_swapped_for_a_symlink_while_it_is_read_never_reads_through_it(tmp_path, monkeypatch):
    """The output's audit/ folder replaced by a link to another folder just as the reader opens
    (a check of each folder, then an open of the path, read the link's target): the report
    read is refused or its own, never the other folder's file."""
    import os

    from regen.files import read_in_folder

    root, other = tmp_path / "out", tmp_path / "other"
    (root / "audit").mkdir(parents=True)
    (root / "audit" / "report.html").write_text("the run's report")
    other.mkdir()
    (other / "report.html").write_text("another folder's secret")
    real_open = os.open

    def swap_then_open(*args, **kwargs):
        monkeypatch.setattr(os, "open", real_open)
        (root / "audit").rename(tmp_path / "moved")
        (root / "audit").symlink_to(other)
        return real_open(*args, **kwargs)

    monkeypatch.setattr(os, "open", swap_then_open)
    try:
        read = read_in_folder(root, root / "audit" / "report.html", 1024)
    except PermissionError as refused:
        assert "symlink" in str(refused)
    else:
        assert read == b"the run's report"


def test_a_multi_day_runs_history_spans_the_whole_run_within_a_bounded_file(tmp_path, monkeypatch):
    """A day of points every 5 s (17,280; a multi-day run thins the same way): the file stays
    within HISTORY_POINTS lines, the chart starts at the run's start and ends now, the last
    minutes keep every point, older hours are thinned evenly, never dropped."""
    import json

    from regen import progress
    from regen.layout import RunLayout
    from regen.progress import HISTORY_POINTS, HISTORY_RECENT, RunProgress
    from regen.status import run_data

    DAY = 86_400
    layout = RunLayout(tmp_path / "out")
    layout.history.parent.mkdir(parents=True)
    start = progress.time.time() + 60  # ahead of the file's real mtime, which gates a point every_s
    now = [start]
    monkeypatch.setattr(progress.time, "time", lambda: now[0])
    writer = RunProgress(layout)
    for i in range(DAY // 5):
        now[0] = start + 5 * i
        writer._append_history({"done": i, "failed": 0, "total": 10**6, "tokens_per_s": 1.0}, every_s=0)
    lines = layout.history.read_text().splitlines()
    assert len(lines) <= HISTORY_POINTS and layout.history.stat().st_size < 256 * 1024
    points = [json.loads(line) for line in lines]
    assert points[0]["done"] == 0 and points[-1]["done"] == DAY // 5 - 1  # start to now
    times = [p["t"] for p in points]
    assert times == sorted(times) and all(round(b - a, 1) == 5 for a, b in zip(times[-HISTORY_RECENT:], times[-HISTORY_RECENT + 1:]))
    assert max(b - a for a, b in zip(times, times[1:])) <= 4 * DAY / (HISTORY_POINTS // 2)  # evenly thinned
    assert [p["t"] for p in run_data(layout)["history"]] == times  # the page draws all of it


def test_progress_of_64_shards_costs_o_shards_per_round_and_a_state_change_shows_at_once(tmp_path, monkeypatch):
    """64 shard processes reporting in the same interval: progress.json is rebuilt about once, not
    once per report (64 x 64 part reads, 15 s per report in a 64-server fleet); a shard that ends
    is in progress.json at once."""
    from regen import progress
    from regen.layout import RunLayout
    from regen.progress import RunProgress

    layout = RunLayout(tmp_path / "out")
    reads = []
    real = progress.read_json
    monkeypatch.setattr(progress, "read_json", lambda path, *a, **k: reads.append(path) or real(path, *a, **k))
    for shard in range(64):  # each its own process and RunProgress, as on a fleet
        RunProgress(layout).write_shard(shard, {"state": "running", "total": 10, "done": 1, "failed": 0})
    assert len(reads) <= 2 * 64, f"{len(reads)} part reads for one round of 64 reports"
    assert progress.read_json(layout.progress_file)["total"] > 0
    RunProgress(layout).write_shard(7, {"state": "done", "total": 10, "done": 10, "failed": 0})
    folded = progress.read_json(layout.progress_file)
    assert folded["shards"]["shard-00007"]["state"] == "done" and folded["done"] == 63 + 10


def test_a_failed_server_start_is_named_with_its_next_step_until_it_passes(make_config, tmp_path):
    """start_servers failing (a model folder that is not one): `regen summary` and the run page's
    status lead with its one-line reason and the next step; a start that passes clears it."""
    import subprocess

    from regen.errors import RegenError
    from regen.pipeline import run
    from regen.status import status
    from support.paths import BIN

    broken = make_config(num_servers=1, model_path=str(tmp_path / "no-model-here"), stage_weights=False)
    with pytest.raises(RegenError):
        run("start_servers", broken)
    first = status(broken).attention[0]
    assert first["what"].startswith("start_servers failed: ") and first["next"].startswith("read the servers' logs")
    config = tmp_path / "broken.yaml"
    config.write_text(broken.to_yaml())
    out = subprocess.run([str(BIN / "regen"), "summary", "--config", str(config)], capture_output=True, text=True)
    assert "! start_servers failed: " in out.stdout and "    next: read the servers' logs" in out.stdout
    fixed = broken.model_copy(update={"model_path": make_config().model_path})
    try:
        run("start_servers", fixed)
        assert not [i for i in status(fixed).attention if "start_servers failed" in i["what"]]
    finally:
        run("stop_servers", fixed)
