"""Airflow deployments of this project for a test: standalone, Celery components, the DAG."""

import contextlib
import json
import os
import subprocess
from pathlib import Path

from regen.servers.probe import port_is_free
from support.paths import BIN, DAG_FILE, ROOT
from regen.servers.probe import free_port_base
from support.processes import processes_with_args, processes_with_env, wait_until


def airflow_env(home: Path, port: int, **extra: str) -> dict[str, str]:
    """An Airflow deployment of this project on loopback: its own home, API port, our DAG."""
    env = dict(os.environ, PATH=f"{BIN}:{os.environ['PATH']}", AIRFLOW_HOME=str(home),
               AIRFLOW__API__PORT=str(port), AIRFLOW__API__HOST="127.0.0.1",
               AIRFLOW__CORE__LOAD_EXAMPLES="False",
               AIRFLOW__CORE__DAGS_FOLDER=str(ROOT / "dags"),
               AIRFLOW__CORE__PLUGINS_FOLDER=str(ROOT / "plugins"),
               AIRFLOW__CORE__EXECUTION_API_SERVER_URL=f"http://127.0.0.1:{port}/execution/",
               AIRFLOW__DAG_PROCESSOR__REFRESH_INTERVAL="5",
               # A task's calls to the API server wait 5 s by default, then retry: on a fresh CI
               # machine's first minutes the server once answered after 35 s, every retry of the
               # task's start was refused and the task killed (Airflow: "increase under high load").
               AIRFLOW__WORKERS__EXECUTION_API_TIMEOUT="90")
    env.pop("REGEN_CONFIG_DIR", None)
    return {**env, **extra}


class AirflowProcesses:
    """Airflow components started for a test, each in its own session with a log; all stopped."""

    def __init__(self, home: Path, env: dict[str, str], separate_homes: bool = False):
        """``separate_homes``: each component in an AIRFLOW_HOME of its own, as containers are (the
        secrets they must share then come from the environment, as docker-compose.yaml gives them)."""
        self.home, self.env, self.separate_homes = home, env, separate_homes
        self.procs: dict[str, subprocess.Popen] = {}

    def start(self, name: str, *argv: str, **extra_env: str | None) -> None:
        """``extra_env``: settings over the deployment's; None removes one (a container without it)."""
        log = open(self.home / f"{name}.log", "wb")
        if self.separate_homes:
            (self.home / "homes" / name).mkdir(parents=True, exist_ok=True)
            extra_env = {"AIRFLOW_HOME": str(self.home / "homes" / name), **extra_env}
        env = {k: v for k, v in {**self.env, **extra_env}.items() if v is not None}
        self.procs[name] = subprocess.Popen([str(BIN / "airflow"), *argv], env=env,
                                            stdout=log, stderr=subprocess.STDOUT, start_new_session=True)

    def wait_api(self, base: str, timeout: float = 360) -> None:
        """A component that dies fails this at once; the deadline is for one that hangs. It is
        long because the suite starts its heavy fixtures together on 2 cores: a landing's CI once
        waited over 180 s for a standalone that needs 19 s alone."""
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
        components in sessions of their own) and whatever else runs in this home (a task the
        scheduler started as it was stopped), SIGKILL what is left after 20 s; again for what
        they started meanwhile."""
        import psutil

        home = str(self.env["AIRFLOW_HOME"])
        for _ in range(3):
            procs = []
            for pid in [proc.pid for proc in self.procs.values()] + processes_with_env("AIRFLOW_HOME", home):
                try:
                    parent = psutil.Process(pid)
                    procs += [parent, *parent.children(recursive=True)]
                except psutil.NoSuchProcess:
                    pass
            procs = [proc for proc in procs if _running(proc)]
            if not procs:
                break
            for proc in procs:
                try:
                    proc.terminate()
                except psutil.NoSuchProcess:
                    pass
            _, alive = psutil.wait_procs(procs, timeout=20)
            for proc in alive:
                try:
                    proc.kill()
                except psutil.NoSuchProcess:
                    pass
            psutil.wait_procs(alive, timeout=10)
        for proc in self.procs.values():
            proc.wait()
        left = processes_with_env("AIRFLOW_HOME", home)
        assert left == [], f"Airflow processes left behind: {left}"


def _running(proc) -> bool:
    import psutil

    try:
        return proc.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _config_file(config_dir: Path, dag_id: str) -> Path:
    return config_dir / f"{dag_id.removeprefix('regenerate_')}.yaml"


def deploy(cfg, config_dir: Path, dag_id: str = "regenerate_dataset") -> None:
    """``cfg`` as the deployment's config file of ``dag_id``: its deployment fields (staging,
    output root, engine, connections, key) are then the deployment's, as a team would set them."""
    _config_file(config_dir, dag_id).write_text(cfg.to_yaml())


def undeploy(config_dir: Path, dag_id: str) -> None:
    """``dag_id`` gone from the deployment: its config file removed."""
    _config_file(config_dir, dag_id).unlink(missing_ok=True)


def trigger_run(api, cfg, config_dir: Path, dag_id: str = "regenerate_dataset") -> str:
    """Deploy ``cfg`` (its file in ``config_dir``), wait for the DAG to be parsed, unpause it,
    trigger a run of ``cfg`` through the REST API as the trigger form sends it."""
    deploy(cfg, config_dir, dag_id)
    wait_until(lambda: _answered(api, f"/dags/{dag_id}", lambda r: r.status_code == 200), 180, "DAG parsed")
    assert api.patch(f"/dags/{dag_id}", json={"is_paused": False}).status_code == 200
    created = api.post(f"/dags/{dag_id}/dagRuns", json={"logical_date": None, "conf": _conf(cfg)})
    assert created.status_code == 200, created.text
    return created.json()["dag_run_id"]


def trigger_runs(api, configs: dict, config_dir: Path) -> dict[str, str]:
    """A run of each DAG id's config, all deployed before the first is triggered, so that one
    parse of the DAG file brings every new DAG: the run id of each DAG id."""
    for dag_id, cfg in configs.items():
        deploy(cfg, config_dir, dag_id)
    return {dag_id: trigger_run(api, cfg, config_dir, dag_id) for dag_id, cfg in configs.items()}


def _answered(api, path: str, read):
    """``read`` of the API's answer to GET ``path``; None when it did not answer in the client's
    timeout: a loaded API server (2 cores, the suite's other workers, every task's start
    deserialising the DAG) once took 39 s for one request; a dead one fails the wait's deadline."""
    import httpx

    try:
        return read(api.get(path))
    except httpx.TimeoutException:
        return None


def wait_run(api, run_id: str, timeout: float, dag_id: str = "regenerate_dataset") -> str:
    """The run's end state, once the scheduler has moved past it. A clear sent while the scheduler
    still handles the run's last executor events gives the cleared task instances new ids under
    it, and Airflow 3.3's scheduler dies on the stale row ("expected to update 1 row(s); 0 were
    matched"), as a person's click could make it: wait for a heartbeat after the run ended."""
    from datetime import datetime, timedelta, timezone

    path = f"/dags/{dag_id}/dagRuns/{run_id}"

    def ended() -> bool:
        health = _answered(api, "/monitor/health", lambda r: r.json())
        beat = health and health["scheduler"]["latest_scheduler_heartbeat"]
        silent = (datetime.now(timezone.utc) - datetime.fromisoformat(beat)).total_seconds() if beat else 0
        assert silent < 120, f"the scheduler's last heartbeat was {silent:.0f} s ago: it died (its log is in the home)"
        return bool(health) and _answered(api, path, lambda r: r.json()["state"] in ("success", "failed"))

    wait_until(ended, timeout, "the run")
    run = api.get(path).json()
    settled = datetime.fromisoformat(run["end_date"]) + timedelta(seconds=2)

    def past_it() -> bool:
        beat = _answered(api, "/monitor/health", lambda r: r.json()["scheduler"]["latest_scheduler_heartbeat"])
        return beat is not None and datetime.fromisoformat(beat) > settled

    wait_until(past_it, 60, "a scheduler heartbeat after the run ended")
    return run["state"]


def shard_states(api, run_id: str, dag_id: str = "regenerate_dataset") -> dict[tuple[str, int], str]:
    """Every task instance's state, by (task_id, map_index)."""
    tis = api.get(f"/dags/{dag_id}/dagRuns/{run_id}/taskInstances", params={"limit": 100}).json()
    return {(t["task_id"], t["map_index"]): t["state"] for t in tis["task_instances"]}


def assert_clean_success(api, run_id: str, cfg, dag_id: str = "regenerate_dataset") -> None:
    """The run ends green with every prompt's row once, none an error, and no server left."""
    import pandas as pd

    from support.data import read_ids

    assert wait_run(api, run_id, 300, dag_id) == "success", sorted(shard_states(api, run_id, dag_id).items())
    df = pd.read_parquet(Path(cfg.output) / "data")
    assert sorted(df["id"]) == sorted(read_ids(Path(cfg.prompts))) and df["id"].is_unique
    assert df["error"].isna().all()
    wait_until(lambda: processes_with_args("--port", str(cfg.servers.base_port)) == [], 30, "no server left")


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


SHARD_POOL = "regen_shards"  # the standalone's REGEN_POOL (tests/conftest.py)


@contextlib.contextmanager
def airflow_standalone(home: Path, **env: str):
    """`airflow standalone` on loopback (PostgreSQL, LocalExecutor) in ``home``, its environment
    extended by ``env``; about 20 s to start. Users: admin, and `trigger`, who may only read and
    trigger DAGs (the simple auth manager's `user` role). Yields its base URL, a token of each,
    its home and its deployment's config folder (REGEN_CONFIG_DIR, holding `dataset.yaml`);
    every process it started is stopped afterwards, its database dropped.

    PostgreSQL, as a team's deployment has it: on SQLite, one writer at a time, runs side by side
    stalled every task's start and heartbeat behind the scheduler's writes (a task's start took
    39 s, the API server answered 500 "database is locked")."""
    from support.services import services

    (home / "services").mkdir(exist_ok=True)
    with services(home / "services") as found, found.database() as db:
        with _standalone(home, AIRFLOW__DATABASE__SQL_ALCHEMY_CONN=found.sql_url(db), **env) as deployment:
            yield deployment


@contextlib.contextmanager
def _standalone(home: Path, **env: str):
    import json

    import httpx

    port = free_port_base(1)
    if "REGEN_CONFIG_DIR" not in env:
        (home / "regen-configs").mkdir()
        (home / "regen-configs" / "dataset.yaml").write_text("{}\n")
    env = {"REGEN_CONFIG_DIR": str(home / "regen-configs"),
           "AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_USERS": "admin:admin,trigger:user", **env}
    config_dir = Path(env["REGEN_CONFIG_DIR"])
    cluster = AirflowProcesses(home, airflow_env(home, port, **env))
    cluster.start("standalone", "standalone")
    base = f"http://127.0.0.1:{port}"
    try:
        cluster.wait_api(base)
        passwords = home / "simple_auth_manager_passwords.json.generated"
        wait_until(passwords.exists, 60, "admin password")
        wait_until(lambda: "trigger" in json.loads(passwords.read_text() or "{}"), 60, "users' passwords")
        tokens = {user: httpx.post(f"{base}/auth/token", json={"username": user, "password": password},
                                   timeout=30).json()["access_token"]
                  for user, password in json.loads(passwords.read_text()).items()}
        yield {"base": base, "token": tokens["admin"], "trigger_token": tokens["trigger"], "home": home,
               "config_dir": config_dir}
    finally:
        cluster.stop()


def load_dag(dag_id: str = "regenerate_dataset"):
    from airflow.dag_processing.dagbag import DagBag

    bag = DagBag(dag_folder=str(DAG_FILE))
    assert bag.import_errors == {}
    return bag.dags[dag_id]


def _conf(cfg) -> dict:
    """The conf the trigger form sends for ``cfg``: every Param (no key, no node)."""
    return {k: v for k, v in json.loads(cfg.model_dump_json()).items() if k not in ("node", "api_key")}


def _states(run) -> dict[str, list[str]]:
    states: dict[str, list[str]] = {}
    for ti in run.get_task_instances():
        states.setdefault(ti.task_id, []).append(str(ti.state))
    return states


def asset_events(uri: str) -> list[dict]:
    """The extras of the asset events recorded in the metadata DB for ``uri``."""
    from airflow.models.asset import AssetEvent, AssetModel
    from airflow.utils.session import create_session
    from sqlalchemy import select

    with create_session() as session:
        rows = session.execute(select(AssetEvent.extra).join(AssetModel, AssetEvent.asset_id == AssetModel.id)
                               .where(AssetModel.uri == uri)).all()
    return [row[0] for row in rows]


def assert_no_server_left(cfg) -> None:
    """No process serving any of the run's ports, and every port free."""
    for i in range(cfg.servers.num_servers):
        port = cfg.servers.base_port + i
        assert processes_with_args("--port", str(port)) == [], f"a server on port {port} is alive"
        assert port_is_free(cfg.servers.host, port), f"port {port} still bound"


def fault_config(make_config, tmp_path, name):
    """A run whose shards fail for good while the fault file exists (the canary's prompts are
    spared): 280 demo prompts plus 12 that the simulator answers with HTTP 500."""
    prompts = tmp_path / f"{name}.jsonl"
    extra = [json.dumps({"id": f"fault-{i}", "prompt": f"[sim-fault] question {i}?"}) for i in range(12)]
    prompts.write_text((ROOT / "demo" / "prompts.jsonl").read_text() + "\n".join(extra) + "\n")
    fault = tmp_path / f"{name}.fault"
    fault.touch()
    cfg = make_config(prompts=str(prompts), output=str(tmp_path / name), num_shards=3, num_servers=1,
                      max_attempts=2, max_error_fraction=0.0, sim_tokens_per_second=3000,
                      extra_server_args=["--sim-fail-while", str(fault)])
    return cfg, fault
