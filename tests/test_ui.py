"""The run page in a real Airflow: `airflow standalone` on loopback, a run triggered through the
REST API, the page checked in headless Chromium (Debian's), and refused without a token.

Costs about a minute (standalone start-up, a scheduled run). Saves a screenshot to
test-artifacts/run-page.png.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import httpx
import pytest

from conftest import BIN, ROOT, free_port_base, wait_until

ARTIFACTS = ROOT / "test-artifacts"
CHROMIUM = "/usr/bin/chromium"


@pytest.fixture(scope="module")
def airflow(tmp_path_factory):
    home = tmp_path_factory.mktemp("standalone")
    port = free_port_base(1)
    env = dict(os.environ, PATH=f"{BIN}:{os.environ['PATH']}", AIRFLOW_HOME=str(home), AIRFLOW__API__PORT=str(port),
               AIRFLOW__API__HOST="127.0.0.1", AIRFLOW__CORE__LOAD_EXAMPLES="False",
               AIRFLOW__CORE__DAGS_FOLDER=str(ROOT / "dags"),
               AIRFLOW__CORE__PLUGINS_FOLDER=str(ROOT / "plugins"),
               AIRFLOW__CORE__EXECUTION_API_SERVER_URL=f"http://127.0.0.1:{port}/execution/",
               AIRFLOW__DAG_PROCESSOR__REFRESH_INTERVAL="5",
               AIRFLOW__SCHEDULER__MIN_FILE_PROCESS_INTERVAL="5")
    log = open(home / "standalone.log", "wb")
    proc = subprocess.Popen([str(BIN / "airflow"), "standalone"], env=env, stdout=log,
                            stderr=subprocess.STDOUT, start_new_session=True)
    base = f"http://127.0.0.1:{port}"

    def up() -> bool:
        assert proc.poll() is None, (home / "standalone.log").read_text()[-3000:]
        try:
            return httpx.get(f"{base}/api/v2/monitor/health", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    try:
        wait_until(up, 180, "airflow standalone")
        passwords = home / "simple_auth_manager_passwords.json.generated"
        wait_until(passwords.exists, 60, "admin password")
        password = json.loads(passwords.read_text())["admin"]
        token = httpx.post(f"{base}/auth/token", json={"username": "admin", "password": password},
                           timeout=30).json()["access_token"]
        yield {"base": base, "token": token, "home": home}
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


@pytest.mark.slow
def test_the_run_page_shows_shards_and_the_verdict_and_needs_a_token(airflow, make_config):
    from playwright.sync_api import sync_playwright

    base, headers = airflow["base"], {"Authorization": f"Bearer {airflow['token']}"}
    api = httpx.Client(base_url=f"{base}/api/v2", headers=headers, timeout=30)
    wait_until(lambda: api.get("/dags/regenerate_dataset").status_code == 200, 120, "DAG parsed")
    assert api.patch("/dags/regenerate_dataset", json={"is_paused": False}).status_code == 200
    cfg = make_config(num_shards=3, sim_tokens_per_second=2000)
    created = api.post("/dags/regenerate_dataset/dagRuns",
                       json={"logical_date": None, "conf": json.loads(cfg.model_dump_json())})
    assert created.status_code == 200, created.text
    run_id = created.json()["dag_run_id"]

    def finished() -> bool:
        return api.get(f"/dags/regenerate_dataset/dagRuns/{run_id}").json()["state"] in ("success", "failed")

    wait_until(finished, 300, "the run")
    assert api.get(f"/dags/regenerate_dataset/dagRuns/{run_id}").json()["state"] == "success"
    page_url = f"{base}/regen/runs/regenerate_dataset/{run_id}"
    assert httpx.get(page_url).status_code in (401, 403)  # no token: refused
    assert httpx.get(f"{page_url}/data").status_code in (401, 403)
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
        assert "280" in page.inner_text("#summary")
        page.screenshot(path=str(ARTIFACTS / "run-page.png"), full_page=True)
        browser.close()
