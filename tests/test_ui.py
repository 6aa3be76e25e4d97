"""The run page in a real Airflow: `airflow standalone` on loopback, a run triggered through the
REST API, the page checked in headless Chromium (Debian's), and refused without a token.

Costs about a minute (standalone start-up, a scheduled run). Saves a screenshot to
test-artifacts/run-page.png.
"""

from __future__ import annotations

import httpx
import pytest

from conftest import ROOT, trigger_run, wait_run

ARTIFACTS = ROOT / "test-artifacts"
CHROMIUM = "/usr/bin/chromium"


@pytest.mark.slow
def test_the_run_page_shows_shards_and_the_verdict_and_needs_a_token(airflow, make_config):
    from playwright.sync_api import sync_playwright

    base, headers = airflow["base"], {"Authorization": f"Bearer {airflow['token']}"}
    api = httpx.Client(base_url=f"{base}/api/v2", headers=headers, timeout=30)
    cfg = make_config(num_shards=3, sim_tokens_per_second=2000)
    run_id = trigger_run(api, cfg)
    assert wait_run(api, run_id, 300) == "success"
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
