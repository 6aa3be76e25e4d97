"""A real Celery cluster: PostgreSQL metadata DB, Redis broker, API server, scheduler, DAG
processor and two Celery workers (each with its own queue, standing for a GPU node, and the
shared `gpu` queue regen's tasks go to). Shards spread over both workers; one worker is killed
with SIGKILL in the middle of a shard, the shard is retried on the other, and the dataset ends
with every id exactly once. The test starts and stops every process it needs (about 2 minutes).
"""

from __future__ import annotations

import os
import signal
import subprocess
import uuid
from pathlib import Path

import httpx
import pandas as pd
import pytest

from conftest import (BIN, ROOT, AirflowProcesses, airflow_env, free_port_base, read_ids,
                      trigger_run, wait_run, wait_until)
from regen.layout import shard_name
from regen.store import Journal

PG = "postgresql+psycopg2://postgres@127.0.0.1:5432"


def psql(sql: str) -> None:
    subprocess.run(["psql", "-h", "127.0.0.1", "-U", "postgres", "-c", sql], check=True,
                   capture_output=True)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    home = tmp_path_factory.mktemp("celery")
    db = f"regen_celery_{uuid.uuid4().hex[:8]}"
    psql(f"CREATE DATABASE {db}")
    port = free_port_base(1)
    redis_db = str(8 + os.getpid() % 7)
    subprocess.run(["redis-cli", "-h", "127.0.0.1", "-n", redis_db, "flushdb"], check=True,
                   capture_output=True)
    env = airflow_env(
        home, port, PYTHONPATH=str(ROOT / "tests" / "fixtures"),
        AIRFLOW__CORE__EXECUTOR="CeleryExecutor",
        AIRFLOW__DATABASE__SQL_ALCHEMY_CONN=f"{PG}/{db}",
        AIRFLOW__CELERY__BROKER_URL=f"redis://127.0.0.1:6379/{redis_db}",
        AIRFLOW__CELERY__RESULT_BACKEND=f"db+postgresql+psycopg2://postgres@127.0.0.1:5432/{db}",
        AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_ALL_ADMINS="True",
        AIRFLOW__CORE__HOSTNAME_CALLABLE="worker_name.hostname",
        AIRFLOW__SCHEDULER__TASK_INSTANCE_HEARTBEAT_TIMEOUT="20",
        REGEN_QUEUE="gpu")
    migrate = subprocess.run([str(BIN / "airflow"), "db", "migrate"], env=env, capture_output=True, text=True)
    assert migrate.returncode == 0, migrate.stderr[-3000:] + migrate.stdout[-2000:]
    cluster = AirflowProcesses(home, env)
    cluster.start("api-server", "api-server")
    cluster.start("scheduler", "scheduler")
    cluster.start("dag-processor", "dag-processor")
    for worker, queue in (("worker-a", "node-a"), ("worker-b", "node-b")):
        cluster.start(worker, "celery", "worker", "--queues", f"gpu,{queue}", "--concurrency", "2",
                      "--celery-hostname", f"{worker}@%h", REGEN_WORKER_NAME=worker)
    base = f"http://127.0.0.1:{port}"
    try:
        cluster.wait_api(base)
        yield {"base": base, "procs": cluster.procs, "home": home}
    finally:
        cluster.stop()
        psql(f"DROP DATABASE IF EXISTS {db} WITH (FORCE)")


@pytest.mark.slow
def test_shards_spread_over_two_workers_and_survive_one_killed(cluster, make_config):
    api = httpx.Client(base_url=f"{cluster['base']}/api/v2", timeout=30)
    cfg = make_config(num_shards=4, num_servers=2, sim_tokens_per_second=60, concurrency_per_server=4)
    run_id = trigger_run(api, cfg)
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
