"""A real Celery cluster: PostgreSQL metadata DB, Redis broker, API server, scheduler, DAG
processor and two Celery workers (each with its own queue, standing for a GPU node, and the
shared `gpu` queue regen's tasks go to). The deployment has two DAGs: `regenerate_dataset` (one
node) and `regenerate_two_nodes` (`nodes` a and b, each staged, served and torn down on its own
queue). Two-node runs: node b serving at half speed, the work splits by capacity; node b's worker
and servers SIGKILLed mid-run, the run completes on node a. One-node run: one worker is killed
with SIGKILL in the middle of a shard, the shard is retried on the other. Every dataset ends with
every id exactly once. Each component has an AIRFLOW_HOME of its own, as a container has, and
shares only the secrets docker-compose.yaml's init draws and its settings read. The module starts and stops every process it needs (about 7 minutes).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import pandas as pd
import pytest
import yaml

from regen.files import read_json
from regen.layout import shard_name
from regen.servers.records import read_state
from regen.status import node_balance, status
from regen.store import Journal
from support.airflow import AirflowProcesses, airflow_env, trigger_run, wait_run
from support.data import read_ids
from support.paths import BIN, ROOT
from regen.servers.probe import free_port_base
from support.processes import wait_until
from support.services import Services, services


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    home = tmp_path_factory.mktemp("celery")
    with services(tmp_path_factory.mktemp("services")) as found, found.database() as db:
        yield from _cluster(home, found, db)


SECRET_SETTINGS = ("_CMD", "PASSWORDS_FILE")
WORKERS = {"worker-a": "node-a", "worker-b": "node-b"}  # each with its node's queue
WORKER_SLOTS = 2  # each worker's Celery concurrency


def compose_secrets(home: Path) -> tuple[dict[str, str], dict[str, str | None]]:
    """The secrets docker-compose.yaml's services read, drawn by its own init script: (the settings
    of Airflow's services, a Celery worker's over them; None where a worker has none), their
    paths moved under ``home``."""
    folders = {"/opt/airflow/secrets": home / "secrets", "/opt/airflow/worker-secrets": home / "worker-secrets"}
    subprocess.run(["bash", str(ROOT / "deploy" / "compose-init.sh")], check=True, capture_output=True,
                   env=dict(os.environ, SECRETS_DIR=str(folders["/opt/airflow/secrets"]),
                            WORKER_SECRETS_DIR=str(folders["/opt/airflow/worker-secrets"]),
                            DATA_DIR=str(home / "data"), KEYS_DIR=str(home / "keys"), WORKER_UID=str(os.getuid()),
                            PYTHON=sys.executable, PATH=f"{BIN}:{os.environ['PATH']}"))
    services = yaml.safe_load((ROOT / "docker-compose.yaml").read_text())["services"]

    def secrets_of(service: str) -> dict[str, str]:
        settings = {k: v for k, v in services[service]["environment"].items() if k.endswith(SECRET_SETTINGS)}
        for container, here in folders.items():
            settings = {k: v.replace(container + "/", f"{here}/") for k, v in settings.items()}
        return settings

    airflow, worker = secrets_of("airflow-apiserver"), secrets_of("airflow-gpu-worker")
    return airflow, {**{k: None for k in airflow}, **worker}


def _cluster(home: Path, found: Services, db: str):
    port = free_port_base(1)
    redis_db = 8 + os.getpid() % 7
    subprocess.run(["redis-cli", "-h", "127.0.0.1", "-p", str(found.redis_port), "-n", str(redis_db), "flushdb"],
                   check=True, capture_output=True)
    airflow_secrets, worker_secrets = compose_secrets(home)
    env = airflow_env(
        home, port, PYTHONPATH=str(ROOT / "tests" / "fixtures"),
        AIRFLOW__CORE__EXECUTOR="CeleryExecutor",
        AIRFLOW__DATABASE__SQL_ALCHEMY_CONN=found.sql_url(db),
        AIRFLOW__CELERY__BROKER_URL=found.redis_url(redis_db),
        AIRFLOW__CELERY__RESULT_BACKEND=f"db+{found.sql_url(db)}",
        AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_ALL_ADMINS="True",
        AIRFLOW__CORE__HOSTNAME_CALLABLE="worker_name.hostname",
        AIRFLOW__SCHEDULER__TASK_INSTANCE_HEARTBEAT_TIMEOUT="20",
        # A worker killed as it takes a task holds that task's Celery message unacknowledged (Redis
        # gives it back after hours): Airflow requeues a task queued this long (default 600 s).
        # The pool as large as the workers' slots keeps every other task from waiting that long.
        AIRFLOW__SCHEDULER__TASK_QUEUED_TIMEOUT="120",
        AIRFLOW__SCHEDULER__TASK_QUEUED_TIMEOUT_CHECK_INTERVAL="10",
        REGEN_POOL="regen_shards",
        REGEN_CONFIG_DIR=str(deployment(home)),
        REGEN_QUEUE="gpu", **airflow_secrets)
    (home / "homes" / "init").mkdir(parents=True)
    migrate = subprocess.run([str(BIN / "airflow"), "db", "migrate"], capture_output=True, text=True,
                             env={**env, "AIRFLOW_HOME": str(home / "homes" / "init")})
    assert migrate.returncode == 0, migrate.stderr[-3000:] + migrate.stdout[-2000:]
    pool = subprocess.run([str(BIN / "airflow"), "pools", "set", "regen_shards", str(len(WORKERS) * WORKER_SLOTS), "shards"],
                          capture_output=True, text=True, env={**env, "AIRFLOW_HOME": str(home / "homes" / "init")})
    assert pool.returncode == 0, pool.stderr[-3000:]
    # Each component in a home of its own, as containers are: a secret drawn per home would fail
    # every task ("Invalid auth token"); the compose file's shared ones must carry the run.
    cluster = AirflowProcesses(home, env, separate_homes=True)
    cluster.start("api-server", "api-server")
    cluster.start("scheduler", "scheduler")
    cluster.start("dag-processor", "dag-processor")
    def start_worker(worker: str, queue: str) -> None:
        cluster.start(worker, "celery", "worker", "--queues", f"gpu,{queue}", "--concurrency", str(WORKER_SLOTS),
                      "--celery-hostname", f"{worker}@%h", REGEN_WORKER_NAME=worker, **worker_secrets)

    for worker, queue in WORKERS.items():
        start_worker(worker, queue)
    base = f"http://127.0.0.1:{port}"
    try:
        cluster.wait_api(base)
        yield {"base": base, "procs": cluster.procs, "home": home, "start_worker": start_worker,
               "config_dir": Path(env["REGEN_CONFIG_DIR"])}
    finally:
        cluster.stop()


def test_a_machine_without_postgres_or_redis_gets_its_own(tmp_path):
    """The path of a fresh machine (REGEN_TEST_SERVICES=own forces it here): PostgreSQL and Redis
    from Debian's binaries on ports of their own, a database made, Redis answering, nothing left
    running afterwards (about 5 s)."""
    from support.services import own_services

    with own_services(tmp_path) as own:
        assert own.own and (own.postgres_port, own.redis_port) != (5432, 6379)
        with own.database() as db:
            out = subprocess.run(["psql", "-h", "127.0.0.1", "-p", str(own.postgres_port), "-U", "postgres", "-d", db,
                                  "-tAc", "select current_database()"], capture_output=True, text=True, timeout=60)
            assert out.stdout.strip() == db
        ping = subprocess.run(["redis-cli", "-p", str(own.redis_port), "ping"], capture_output=True, text=True)
        assert ping.stdout.strip() == "PONG"
        ports = (own.postgres_port, own.redis_port)
    from support.services import answers

    assert not any(answers(port) for port in ports)


def deployment(home: Path) -> Path:
    """The deployment's config folder: the one-node DAG and the two-node one (names, queues)."""
    folder = home / "regen-configs"
    folder.mkdir()
    (folder / "dataset.yaml").write_text("{}\n")
    (folder / "two_nodes.yaml").write_text(yaml.safe_dump({"nodes": [{"name": "a", "queue": "node-a"},
                                                                     {"name": "b", "queue": "node-b"}]}))
    return folder


def two_node_config(make_config, tmp_path, speed: float, num_shards: int = 24):
    """Nodes a and b, one server each, b at half a's speed; two shards at once per node."""
    nodes = [{"name": name, "queue": f"node-{name}", "base_port": free_port_base(1), "num_servers": 1,
              "staging_dir": str(tmp_path / f"shm-{name}"), "sim_tokens_per_second": tokens_per_s,
              "max_shards": 2} for name, tokens_per_s in (("a", speed), ("b", speed / 2))]
    return make_config(num_shards=num_shards, num_servers=1, concurrency_per_server=4,
                       sim_tokens_per_second=speed, nodes=nodes)


def dataset_ids(cfg) -> pd.DataFrame:
    df = pd.read_parquet(Path(cfg.output) / "data")
    assert len(df) == 280 and df["id"].is_unique
    assert sorted(df["id"]) == sorted(read_ids(ROOT / "demo" / "prompts.jsonl"))
    return df


@pytest.mark.slow
@pytest.mark.timeout(1200)  # 24 shards through 4 slots took over 600 s on a slow, loaded CI machine
def test_two_nodes_split_the_work_by_capacity(cluster, make_config, tmp_path):
    api = httpx.Client(base_url=f"{cluster['base']}/api/v2", timeout=30)
    cfg = two_node_config(make_config, tmp_path, speed=60)
    run_id = trigger_run(api, cfg, cluster["config_dir"], "regenerate_two_nodes")
    state = wait_run(api, run_id, 1000, "regenerate_two_nodes")
    instances = api.get(f"/dags/regenerate_two_nodes/dagRuns/{run_id}/taskInstances",
                        params={"limit": 100}).json()["task_instances"]
    assert state == "success", [(t["task_id"], t["map_index"], t["state"]) for t in instances]
    # Each node's setup and teardown ran on that node's worker.
    hosts = {t["task_id"]: t["hostname"] for t in instances if t["map_index"] == -1}
    for node in ("a", "b"):
        for task in ("stage_weights", "start_servers", "stop_servers"):
            assert hosts[f"{task}_{node}"] == f"worker-{node}", (task, node, hosts)
    df = dataset_ids(cfg)
    urls = {node: f"http://127.0.0.1:{spec.base_port}" for node, spec in zip("ab", cfg.nodes)}
    on_a = (df["server"] == urls["a"]).sum()
    assert on_a + (df["server"] == urls["b"]).sum() == 280
    assert on_a > 280 * 0.55, on_a  # the faster node did more (ideal: two thirds)
    balance = node_balance(json.loads((Path(cfg.output) / "progress.json").read_text())["shards"])
    # Each node was busy about as long as the ideal split (all tokens over both nodes' rates)
    # takes: neither took more than its share. The makespan adds the cluster's gaps between tasks,
    # which a loaded machine (the suite's other workers) stretches; it is not the split's doing.
    assert max(n["busy_s"] for n in balance["nodes"].values()) <= 1.15 * balance["ideal_s"], balance
    # One run page: both nodes, their servers (stopped by now) and their shards.
    view = {n["node"]: n for n in status(cfg).nodes}
    assert view["a"]["shards_done"] + view["b"]["shards_done"] == 24
    assert view["a"]["reached_by"] == "queue node-a" and view["a"]["shards_done"] > view["b"]["shards_done"]


@pytest.mark.slow
@pytest.mark.timeout(900)  # a loaded CI machine took 600 s: every shard left runs on node a alone
def test_two_nodes_one_lost_mid_run(cluster, make_config, tmp_path):
    api = httpx.Client(base_url=f"{cluster['base']}/api/v2", timeout=30)
    # Half the shards of the split test: after the loss each is a task on one worker's two slots.
    cfg = two_node_config(make_config, tmp_path, speed=60, num_shards=12)
    run_id = trigger_run(api, cfg, cluster["config_dir"], "regenerate_two_nodes")
    b = cfg.for_node("b")

    def b_half_way() -> bool:
        data = read_json(Path(cfg.output) / "progress.json") or {}
        return sum(s.get("done", 0) for s in data.get("shards", {}).values() if s.get("node") == "b") >= 10

    wait_until(b_half_way, 300, "node b generating")
    os.killpg(cluster["procs"]["worker-b"].pid, signal.SIGKILL)  # the worker and the shards it runs
    cluster["procs"]["worker-b"].wait()
    for record in read_state(b.layout):  # and the node's servers
        os.kill(record.pid, signal.SIGKILL)
    kept = {row["id"] for path in (Path(cfg.output) / "work" / "journal").glob("*.jsonl")
            for row in Journal.rows(path)}
    tis = f"/dags/regenerate_two_nodes/dagRuns/{run_id}/taskInstances"

    def state_of(task_id: str) -> str | None:
        return api.get(f"{tis}/{task_id}").json().get("state")

    try:
        # The shards and the audit complete on node a alone ...
        wait_until(lambda: state_of("audit") in ("success", "failed", "upstream_failed"), 600, "the audit")
        instances = api.get(tis, params={"limit": 100}).json()["task_instances"]
        assert state_of("audit") == "success", [(t["task_id"], t["map_index"], t["state"]) for t in instances]
        df = dataset_ids(cfg)
        assert kept <= set(df["id"])  # nothing finished before the loss was generated again
        shards = [t for t in instances if t["task_id"] == "generate"]
        assert all(t["state"] == "success" for t in shards)
        retried = [t for t in shards if t["try_number"] >= 2]
        assert retried and all(t["hostname"] == "worker-a" for t in retried)
        # ... while the lost node's teardown waits on its queue for the node to come back.
        assert state_of("stop_servers_b") in ("queued", "scheduled")  # requeued (task_queued_timeout)
    finally:
        cluster["start_worker"]("worker-b", "node-b")  # the next test kills a worker of its own
    assert wait_run(api, run_id, 300, "regenerate_two_nodes") == "success"
    assert state_of("stop_servers_b") == "success"


@pytest.mark.slow
def test_shards_spread_over_two_workers_and_survive_one_killed(cluster, make_config):
    api = httpx.Client(base_url=f"{cluster['base']}/api/v2", timeout=30)
    cfg = make_config(num_shards=4, num_servers=2, sim_tokens_per_second=60, concurrency_per_server=4)
    run_id = trigger_run(api, cfg, cluster["config_dir"])
    tis = f"/dags/regenerate_dataset/dagRuns/{run_id}/taskInstances"

    def running_shard():
        for ti in api.get(tis, params={"limit": 100}).json().get("task_instances", []):
            if ti["task_id"] != "generate":
                continue
            journal = Path(cfg.output) / "work" / "journal" / f"{shard_name(ti['map_index'], 4)}.jsonl"
            if ti["state"] == "running" and ti["hostname"] and journal.exists() \
                    and journal.read_bytes().count(b"\n") >= 10:
                return ti
        return None

    wait_until(lambda: running_shard() is not None, 240, "a shard half way")
    victim = running_shard()
    worker = victim["hostname"]
    os.killpg(cluster["procs"][worker].pid, signal.SIGKILL)  # the worker and the task it runs
    cluster["procs"][worker].wait()
    kept = {row["id"] for row in Journal.rows(
        Path(cfg.output) / "work" / "journal" / f"{shard_name(victim['map_index'], 4)}.jsonl")}

    state = wait_run(api, run_id, 420)
    instances = api.get(tis, params={"limit": 100}).json()["task_instances"]
    assert state == "success", [(t["task_id"], t["map_index"], t["state"]) for t in instances]
    shards = [t for t in instances if t["task_id"] == "generate"]
    retried = next(t for t in shards if t["map_index"] == victim["map_index"])
    survivor = "worker-b" if worker == "worker-a" else "worker-a"
    assert retried["try_number"] >= 2 and retried["hostname"] == survivor
    assert {t["hostname"] for t in shards} | {worker} == {"worker-a", "worker-b"}
    df = pd.read_parquet(Path(cfg.output) / "data")
    assert len(df) == 280 and df["id"].is_unique
    assert sorted(df["id"]) == sorted(read_ids(ROOT / "demo" / "prompts.jsonl"))
    assert kept <= set(df["id"])
