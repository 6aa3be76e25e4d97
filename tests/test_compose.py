"""docker-compose.yaml, checked without a Docker engine: every service, build, path, variable and
command it names exists and agrees with the project."""

from __future__ import annotations

import re
import subprocess

import pytest
import yaml

from support.paths import BIN, ROOT

COMPOSE = yaml.safe_load((ROOT / "docker-compose.yaml").read_text())
SERVICES = COMPOSE["services"]
AIRFLOW_SERVICES = [name for name in SERVICES if name.startswith("airflow-")]
DOCKERFILE = (ROOT / "Dockerfile").read_text()


def test_the_official_shape_plus_a_gpu_worker():
    assert set(SERVICES) >= {"postgres", "redis", "airflow-apiserver", "airflow-scheduler",
                             "airflow-dag-processor", "airflow-triggerer", "airflow-worker",
                             "airflow-init", "airflow-gpu-worker"}
    for name in AIRFLOW_SERVICES:
        env = SERVICES[name]["environment"]
        assert env["AIRFLOW__CORE__EXECUTOR"] == "CeleryExecutor"
        assert "redis:6379" in env["AIRFLOW__CELERY__BROKER_URL"]
        assert env["AIRFLOW__DATABASE__SQL_ALCHEMY_CONN"].startswith("postgresql")
        assert "/opt/airflow/include" in env["PYTHONPATH"].split(":")  # regen importable everywhere


def test_builds_point_at_real_files_and_stages():
    stages = set(re.findall(r"^FROM \S+ AS (\w+)", DOCKERFILE, flags=re.M))
    for name, service in SERVICES.items():
        build = service.get("build")
        if build:
            assert (ROOT / build["context"] / build["dockerfile"]).exists(), name
            assert build["target"] in stages, name
    for sources in re.findall(r"^COPY (?:--\S+ )*(.+) \S+$", DOCKERFILE, flags=re.M):
        for source in sources.split():
            assert (ROOT / source).exists(), source
    assert "requirements.txt" in DOCKERFILE and "-c /opt/regen/constraints.txt" in DOCKERFILE
    pins = (ROOT / "requirements-gpu.txt").read_text()
    assert re.search(r"^sglang==\d", pins, flags=re.M)


def test_volumes_mount_the_project_where_the_environment_says():
    for name in AIRFLOW_SERVICES:
        service = SERVICES[name]
        mounts = {}
        for volume in service["volumes"]:
            source, target = volume.split(":")[:2]
            if source.startswith("."):
                assert (ROOT / source).exists(), source
            else:
                assert source in COMPOSE["volumes"], source
            mounts[target] = source
        env = service["environment"]
        assert mounts["/opt/airflow/include"] == "./include"
        assert mounts[env["AIRFLOW__CORE__DAGS_FOLDER"]] == "./dags"
        assert mounts[env["AIRFLOW__CORE__PLUGINS_FOLDER"]] == "./plugins"


def test_every_airflow_setting_exists_and_every_regen_setting_is_read():
    from airflow.configuration import conf

    known = conf.configuration_description  # Airflow's and its providers' (celery.*) options
    project = "".join(p.read_text() for p in [*(ROOT / "include" / "regen").rglob("*.py"),
                                              *(ROOT / "dags").glob("*.py")])
    for name in AIRFLOW_SERVICES:
        for key in SERVICES[name]["environment"]:
            if key.startswith("AIRFLOW__"):
                _, section, option = key.split("__", 2)
                assert option.lower() in known.get(section.lower(), {}).get("options", {}), key
            elif key.startswith("REGEN_"):
                assert f'"{key}"' in project, f"{key} is not read by regen"


@pytest.mark.parametrize("name", [n for n in SERVICES if n.startswith("airflow-") and n != "airflow-init"])
def test_every_command_is_an_airflow_command(name):
    command = SERVICES[name]["command"].split()
    words = [w for w in command if not w.startswith("-") and not w.isdigit()][:2]
    words = words[:2] if words[0] == "celery" else words[:1]
    out = subprocess.run([str(BIN / "airflow"), *words, "--help"], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr[-500:]
    for flag in (w for w in command if w.startswith("--")):
        assert flag in out.stdout, f"{name}: {flag}"


@pytest.mark.parametrize("name", ["airflow-gpu-worker", "airflow-gpu-worker-b"])
def test_the_gpu_worker_gets_gpus_shared_memory_and_its_own_queue(name):
    gpu = SERVICES[name]
    devices = gpu["deploy"]["resources"]["reservations"]["devices"]
    assert any("gpu" in d["capabilities"] for d in devices)
    assert gpu.get("ipc") == "host" or gpu.get("shm_size")
    queues = gpu["command"].split("--queues")[1].split()[0].split(",")
    assert gpu["environment"]["REGEN_QUEUE"] in queues  # the DAG sends its tasks there
    assert "default" in SERVICES["airflow-worker"]["command"]
    init = "\n".join(SERVICES["airflow-init"]["command"])
    pool = gpu["environment"]["REGEN_POOL"]
    assert f"airflow pools set {pool} " in init
    out = subprocess.run([str(BIN / "airflow"), "pools", "set", "--help"], capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0


def _serving() -> dict[str, list[str]]:
    """queue -> the workers that serve it."""
    serving: dict[str, list[str]] = {}
    for name, service in SERVICES.items():
        if "--queues" in str(service.get("command", "")):
            for q in service["command"].split("--queues")[1].split()[0].split(","):
                serving.setdefault(q, []).append(name)
    return serving


def test_a_one_node_run_goes_to_one_worker():
    """deploy/dataset.yaml's run has its servers on one machine: every one of its tasks goes to a
    queue exactly one GPU worker serves (the shared `gpu` queue has two: a shard there could land
    on the other worker, beside servers it cannot see)."""
    from regen.dags.definitions import configured_file

    run = configured_file(ROOT / "deploy" / "dataset.yaml")
    assert not run.config.nodes and run.config.queue
    assert len(_serving()[run.config.queue]) == 1
    assert len(_serving()[SERVICES["airflow-gpu-worker"]["environment"]["REGEN_QUEUE"]]) > 1


def test_two_gpu_nodes_one_run_over_both():
    """deploy/two_nodes.yaml: each node's queue is served by exactly one GPU worker, whose host
    name is the address its servers are reached at, on GPUs of its own; the output and the
    servers' keys are on the volume every worker mounts."""
    from pathlib import Path

    from regen.dags.definitions import configured_file

    run = configured_file(ROOT / "deploy" / "two_nodes.yaml")
    env = SERVICES["airflow-gpu-worker"]["environment"]
    assert env["REGEN_CONFIG_DIR"] == "/opt/airflow/deploy" and run.dag_id == "regenerate_two_nodes"
    serving = _serving()
    host_gpus = []
    for spec in run.config.nodes:
        assert len(serving[spec.queue]) == 1
        worker = SERVICES[serving[spec.queue][0]]
        assert worker["hostname"] == spec.host
        devices = worker["deploy"]["resources"]["reservations"]["devices"][0]["device_ids"]
        # inside its container a worker numbers the GPUs it was given from 0: `gpus` are positions
        assert all(0 <= g < len(devices) for g in spec.gpus) and len(spec.gpus) == len(devices)
        host_gpus += devices
        assert "regen-data:/data/regen" in worker["volumes"]
    assert len(host_gpus) == len(set(host_gpus)) == 8  # each host GPU reserved by one worker
    shared = Path("/data/regen")
    assert shared in Path(run.config.output).parents and shared in Path(env["REGEN_KEY_DIR"]).parents
