"""docker-compose.yaml (and its second-node override), checked without a Docker engine: every
service, build, path, variable and command it names exists and agrees with the project."""

from __future__ import annotations

import json
import re
import subprocess

import pytest
import yaml

from support.paths import BIN, ROOT

class _ComposeLoader(yaml.SafeLoader):
    """YAML with Compose's merge tags: ``!override`` (replace what the base file has) and ``!reset``."""


class Override(list):
    """A sequence tagged ``!override``: it replaces the base's instead of being appended to it."""


_ComposeLoader.add_constructor("!override", lambda loader, node: Override(loader.construct_sequence(node, deep=True)))
_ComposeLoader.add_constructor("!reset", lambda loader, node: None)


def load_compose(name: str) -> dict:
    return yaml.load((ROOT / name).read_text(), Loader=_ComposeLoader)


def _merge(base, over):
    """Compose's merge rules (compose-file/merge.md): mappings merged key by key, sequences appended
    to, ``command`` and ``!override`` replacing."""
    if isinstance(over, Override):
        return list(over)
    if isinstance(base, dict) and isinstance(over, dict):
        return base | {key: value if key not in base or key == "command" else _merge(base[key], value)
                       for key, value in over.items()}
    if isinstance(base, list) and isinstance(over, list):
        return base + [item for item in over if item not in base]
    return over


def two_node_services() -> dict:
    """docker-compose.yaml with docker-compose.two-nodes.yaml over it (``extends`` resolved)."""
    base, over = COMPOSE["services"], load_compose("docker-compose.two-nodes.yaml")["services"]
    merged = {name: _merge(base[name], service) if name in base else service for name, service in over.items()}
    for name, service in merged.items():
        if "extends" in service:
            assert service["extends"]["file"] == "docker-compose.yaml", name
            merged[name] = _merge(base[service["extends"]["service"]], {k: v for k, v in service.items() if k != "extends"})
    return {**base, **merged}


COMPOSE = load_compose("docker-compose.yaml")
SERVICES = COMPOSE["services"]
TWO_NODES = two_node_services()
AIRFLOW_SERVICES = [name for name in SERVICES if name.startswith("airflow-")]
DOCKERFILE = (ROOT / "Dockerfile").read_text()


def volumes(service: dict) -> list[tuple[str, str]]:
    """(source, target) of each volume, ``${VAR:-default}`` read as its default."""
    out = []
    for volume in service.get("volumes", []):
        volume = resolved(volume, {})
        source, target = volume.split(":")[:2]
        out.append((source, target))
    return out


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
        for source, target in volumes(service):
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
                _, section, option = key.lower().split("__", 2)
                if option.endswith("_cmd"):  # a secret read from a file: only sensitive options take _CMD
                    option = option.removesuffix("_cmd")
                    assert (section, option) in conf.sensitive_config_values, key
                assert option in known.get(section, {}).get("options", {}), key
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


@pytest.mark.parametrize("services, name", [(SERVICES, "airflow-gpu-worker"), (TWO_NODES, "airflow-gpu-worker"),
                                            (TWO_NODES, "airflow-gpu-worker-b")])
def test_the_gpu_worker_gets_gpus_shared_memory_and_its_own_queue(services, name):
    gpu = services[name]
    devices = gpu["deploy"]["resources"]["reservations"]["devices"]
    assert len(devices) == 1 and "gpu" in devices[0]["capabilities"]  # one request: never another node's GPUs
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


def resolved(text: str, env: dict[str, str]) -> str:
    """Compose's ``${VAR:-default}`` (nested too) with ``env`` set and the rest at their defaults;
    ``$$`` left to the shell as ``$``."""
    while match := re.search(r"(?<!\$)\$\{(\w+):-([^${}]*)\}", text):
        text = text[:match.start()] + (env.get(match[1]) or match[2]) + text[match.end():]
    return text.replace("$$", "$")


@pytest.mark.parametrize("services", [SERVICES, TWO_NODES], ids=["one-node", "two-nodes"])
@pytest.mark.parametrize("concurrency", [None, "7"])
def test_the_shard_pool_holds_what_the_gpu_workers_run_at_once(services, concurrency):
    """A shard past the GPU workers' slots would wait in Celery's queue, where Airflow requeues a
    task queued past task_queued_timeout (600 s) twice and then fails it: the pool that
    airflow-init makes is their slots added up, so the rest wait "scheduled" instead."""
    env = {"REGEN_WORKER_CONCURRENCY": concurrency} if concurrency else {}
    queue = services["airflow-gpu-worker"]["environment"]["REGEN_QUEUE"]  # where the shards go
    slots = sum(int(resolved(services[name]["command"], env).split("--concurrency")[1].split()[0])
                for name in _serving(services)[queue])
    init = services["airflow-init"]
    script = "\n".join(init["command"]).replace("\\\n", " ")  # the shell's continued lines joined
    line = next(line for line in script.splitlines() if "pools set" in line)
    command = resolved(line, env).replace("airflow pools set", "printf '%s\\n'", 1)
    init_env = {k: resolved(str(v), env) for k, v in init["environment"].items()}
    out = subprocess.run(["bash", "-c", command], capture_output=True, text=True, env={"PATH": "/usr/bin:/bin", **init_env})
    assert out.returncode == 0, out.stderr
    name, size = out.stdout.splitlines()[:2]
    assert name == services["airflow-gpu-worker"]["environment"]["REGEN_POOL"]
    assert int(size) == slots, (size, slots)


def _serving(services: dict = SERVICES) -> dict[str, list[str]]:
    """queue -> the workers that serve it."""
    serving: dict[str, list[str]] = {}
    for name, service in services.items():
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
    for services in (SERVICES, TWO_NODES):
        assert len(_serving(services)[run.config.queue]) == 1
    assert len(_serving(TWO_NODES)[SERVICES["airflow-gpu-worker"]["environment"]["REGEN_QUEUE"]]) > 1


VARIABLE = re.compile(r"^\$\{(\w+)(?::-([^}]*)|:\?[^}]*)\}$")


def test_one_gpu_worker_takes_the_nodes_gpus_from_a_variable_and_the_ui_stays_on_this_machine():
    """A 7-GPU node: one GPU worker, every GPU by default, a device list from REGEN_GPU_DEVICES
    (Docker hands it to the NVIDIA runtime as NVIDIA_VISIBLE_DEVICES); the UI on loopback unless
    the operator binds it elsewhere; the login's password drawn, not a default."""
    gpu_workers = [name for name, service in SERVICES.items() if "deploy" in service]
    assert gpu_workers == ["airflow-gpu-worker"]
    (ids,) = [d["device_ids"] for d in SERVICES["airflow-gpu-worker"]["deploy"]["resources"]["reservations"]["devices"]]
    assert len(ids) == 1 and VARIABLE.match(ids[0]).groups() == ("REGEN_GPU_DEVICES", "all")
    (published,) = SERVICES["airflow-apiserver"]["ports"]
    bind = re.match(r"^(\$\{[^}]*\}):", published).group(1)
    assert VARIABLE.match(bind).groups() == ("AIRFLOW_UI_BIND", "127.0.0.1")
    password = SERVICES["airflow-init"]["environment"]["_AIRFLOW_WWW_USER_PASSWORD"]
    assert VARIABLE.match(password).groups() == ("_AIRFLOW_WWW_USER_PASSWORD", "")
    # the override: both workers' lists required, no default that would give both all the GPUs
    for name, variable in (("airflow-gpu-worker", "REGEN_GPU_DEVICES"), ("airflow-gpu-worker-b", "REGEN_GPU_DEVICES_B")):
        (ids,) = [d["device_ids"] for d in TWO_NODES[name]["deploy"]["resources"]["reservations"]["devices"]]
        assert ids[0].startswith(f"${{{variable}:?"), name


def test_two_gpu_nodes_one_run_over_both():
    """docker-compose.two-nodes.yaml over docker-compose.yaml: every service sees the DAG of
    deploy/two-nodes/two_nodes.yaml beside the one-node one; each node's queue is served by exactly
    one GPU worker, whose host name is the address its servers are reached at, on GPUs of its own
    (each serves every GPU it was given: no `gpus` to disagree with the device list); the output is
    on the volume every worker mounts, the servers' keys on one only the GPU workers mount (never
    the data volume: anyone who can write the dataset must not read or forge them)."""
    import os
    from pathlib import Path

    from regen.dags.definitions import configured_file

    run = configured_file(ROOT / "deploy" / "two-nodes" / "two_nodes.yaml")
    assert run.dag_id == "regenerate_two_nodes"
    for name in AIRFLOW_SERVICES + ["airflow-gpu-worker-b"]:
        folders = TWO_NODES[name]["environment"]["REGEN_CONFIG_DIR"].split(os.pathsep)
        assert folders == ["/opt/airflow/deploy", "/opt/airflow/deploy/two-nodes"], name
    serving = _serving(TWO_NODES)
    device_variables = []
    for spec in run.config.nodes:
        assert len(serving[spec.queue]) == 1 and spec.gpus is None
        worker = TWO_NODES[serving[spec.queue][0]]
        assert worker["hostname"] == spec.host
        (ids,) = [d["device_ids"] for d in worker["deploy"]["resources"]["reservations"]["devices"]]
        device_variables.append(VARIABLE.match(ids[0]).group(1))
        assert "regen-data:/data/regen" in worker["volumes"]
    assert len(set(device_variables)) == 2  # each worker's GPUs a list of its own
    env = SERVICES["airflow-gpu-worker"]["environment"]
    shared = Path("/data/regen")
    assert shared in Path(run.config.output).parents and shared not in Path(env["REGEN_KEY_DIR"]).parents
    keys = f"regen-keys:{env['REGEN_KEY_DIR']}"
    assert {name for name, service in TWO_NODES.items() if keys in service.get("volumes", [])} == {
        "airflow-gpu-worker", "airflow-gpu-worker-b", "airflow-init"}


def test_a_second_config_folder_adds_its_dags_and_a_repeated_dag_is_a_problem(monkeypatch, tmp_path):
    """REGEN_CONFIG_DIR with two folders (the override's form): both folders' DAGs; a second file
    of one DAG id is reported, naming both files, and the first kept."""
    import os

    from regen.dags.definitions import run_definitions

    first, second = tmp_path / "a", tmp_path / "b"
    for folder in (first, second):
        folder.mkdir()
        (folder / "dataset.yaml").write_text(f"output: {tmp_path / folder.name / 'out'}\n")
    (second / "extra.yaml").write_text(f"output: {tmp_path / 'extra'}\n")
    monkeypatch.setenv("REGEN_CONFIG_DIR", f"{first}{os.pathsep}{second}")
    definitions, problems = run_definitions()
    assert [d.dag_id for d in definitions] == ["regenerate_dataset", "regenerate_extra"]
    assert definitions[0].source == first / "dataset.yaml"
    assert problems == [f"{second / 'dataset.yaml'}: regenerate_dataset is already defined by {first / 'dataset.yaml'}"]


SECRETS = "/opt/airflow/secrets"


WORKERS = [name for name in SERVICES if name.endswith("worker")]
SECRET_SETTINGS = ("AIRFLOW__API_AUTH__JWT_SECRET_CMD", "AIRFLOW__API__SECRET_KEY_CMD", "AIRFLOW__CORE__FERNET_KEY_CMD",
                   "AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_PASSWORDS_FILE")


def test_airflows_services_share_one_config_and_the_secrets_init_draws_and_workers_get_one_key():
    """The official file's JWT failure ("Invalid auth token: Signature verification failed" on every
    Celery task) comes from each container drawing its own secret: here Airflow's services have the
    same AIRFLOW__ settings and read the secrets from files of one volume, drawn once. A Celery
    worker (the GPU node's too) has the same settings without them but the API's key (its log
    server's), from a volume of its own; tests/test_celery.py runs its workers so."""
    common = {k: v for k, v in SERVICES["airflow-apiserver"]["environment"].items() if k.startswith("AIRFLOW__")}
    for key in SECRET_SETTINGS:
        assert common[key].startswith(f"cat {SECRETS}/") or common[key].startswith(f"{SECRETS}/"), key
    for name in AIRFLOW_SERVICES:
        service = SERVICES[name]
        env = {k: v for k, v in service["environment"].items() if k.startswith("AIRFLOW__")}
        if name in WORKERS:
            assert env == {**{k: v for k, v in common.items() if k not in SECRET_SETTINGS},
                           "AIRFLOW__API__SECRET_KEY_CMD": "cat /opt/airflow/worker-secrets/api_secret_key"}, name
            assert [v for v in service["volumes"] if "secrets" in v] == ["worker-secrets:/opt/airflow/worker-secrets"]
        else:
            assert env == common, name
            assert f"airflow-secrets:{SECRETS}" in service["volumes"], name
        assert not any(k.startswith("AIRFLOW__") and not k.endswith("_CMD") and "SECRET" in k
                       for k in service["environment"]), name  # no secret in the file itself
    for name in WORKERS + ["airflow-gpu-worker-b"]:  # the second node's too
        assert "airflow-secrets:/opt/airflow/secrets" not in TWO_NODES[name]["volumes"], name
    init = "\n".join(SERVICES["airflow-init"]["command"])
    assert init.index("bash /opt/airflow/deploy/compose-init.sh") < init.index("airflow db migrate")
    assert SERVICES["airflow-init"]["user"] == "0:0"  # it gives the volumes to the services' uid


def test_compose_init_draws_the_secrets_once_gives_the_volumes_to_the_workers_and_builds_the_model(tmp_path):
    """deploy/compose-init.sh, run here as airflow-init runs it (as root), twice; then Airflow reads
    the JWT secret through the compose file's own _CMD setting."""
    import json
    import os
    import sys

    from cryptography.fernet import Fernet

    secrets, data, keys = tmp_path / "secrets", tmp_path / "data", tmp_path / "keys"
    workers = tmp_path / "worker-secrets"
    uid = int(SERVICES["airflow-worker"]["user"].split(":")[0])
    env = dict(os.environ, SECRETS_DIR=str(secrets), WORKER_SECRETS_DIR=str(workers), DATA_DIR=str(data),
               KEYS_DIR=str(keys), WORKER_UID=str(uid),
               PYTHON=sys.executable, PATH=f"{BIN}:{os.environ['PATH']}")
    env.pop("_AIRFLOW_WWW_USER_PASSWORD", None)
    script = ROOT / "deploy" / "compose-init.sh"
    first = subprocess.run(["bash", str(script)], env=env, capture_output=True, text=True, timeout=300)
    assert first.returncode == 0, first.stderr
    drawn = {p.name: p.read_text() for p in secrets.iterdir()}
    assert set(drawn) == {"jwt_secret", "api_secret_key", "fernet_key", "passwords.json"}
    Fernet(drawn["fernet_key"].strip())  # a key Airflow's Fernet takes
    assert len(drawn["jwt_secret"].strip()) >= 48 and drawn["jwt_secret"] != drawn["api_secret_key"]
    # the login's password drawn (no default to guess) and printed once, in init's log
    password = json.loads(drawn["passwords.json"])["airflow"]
    assert len(password) >= 20 and password != "airflow" and f"airflow / {password}" in first.stdout
    assert {p.name: p.read_text() for p in workers.iterdir()} == {"api_secret_key": drawn["api_secret_key"]}
    for path in [secrets, *secrets.iterdir(), workers, *workers.iterdir(), data, data / "demo-model",
                 data / "demo-model" / "config.json", keys]:
        assert path.stat().st_uid == uid, path
    assert all(p.stat().st_mode & 0o077 == 0 for p in [secrets, *secrets.iterdir(), workers, *workers.iterdir(), keys])
    again = subprocess.run(["bash", str(script)], env={**env, "_AIRFLOW_WWW_USER_PASSWORD": "other"},
                           capture_output=True, text=True, timeout=300)
    assert again.returncode == 0, again.stderr
    assert {p.name: p.read_text() for p in secrets.iterdir()} == drawn  # a second `up` keeps them
    assert "built the demo model" not in again.stdout and password not in again.stdout
    given = tmp_path / "given"
    chosen = subprocess.run(["bash", str(script)], env={**env, "SECRETS_DIR": str(given), "_AIRFLOW_WWW_USER_PASSWORD": "mine",
                                                         "WORKER_SECRETS_DIR": str(tmp_path / "given-workers")},
                            capture_output=True, text=True, timeout=300)
    assert chosen.returncode == 0 and json.loads((given / "passwords.json").read_text()) == {"airflow": "mine"}
    assert "mine" not in chosen.stdout  # a password the operator chose is never printed

    command = SERVICES["airflow-apiserver"]["environment"]["AIRFLOW__API_AUTH__JWT_SECRET_CMD"]
    read = subprocess.run([str(BIN / "airflow"), "config", "get-value", "api_auth", "jwt_secret"],
                          env={**env, "AIRFLOW_HOME": str(tmp_path / "home"),
                               "AIRFLOW__API_AUTH__JWT_SECRET_CMD": command.replace(SECRETS, str(secrets))},
                          capture_output=True, text=True, timeout=120)
    assert read.returncode == 0, read.stderr[-1000:]
    assert read.stdout.strip() == drawn["jwt_secret"].strip()


def test_what_each_deployed_config_names_is_on_a_volume_its_worker_mounts():
    """The model, the output and the staging folder of deploy/*.yaml as the worker reads them (its
    REGEN_ settings: the defaults under REGEN_VAR_DIR), on a volume of each worker serving the
    config's queues: a path outside every mount would vanish with the container, or not exist."""
    import json
    import os

    serving = _serving(TWO_NODES)
    for path in sorted((ROOT / "deploy").rglob("*.yaml")):
        queues = yaml.safe_load(path.read_text()).get("queue"), *[
            n["queue"] for n in yaml.safe_load(path.read_text()).get("nodes", [])]
        for worker in {w for q in queues if q for w in serving[q]}:
            service = TWO_NODES[worker]
            env = dict(os.environ, **{k: str(v) for k, v in service["environment"].items() if k.startswith("REGEN_")})
            out = subprocess.run([str(BIN / "regen"), "config", "--config", str(path), "--json"], env=env,
                                 capture_output=True, text=True, timeout=120)
            assert out.returncode == 0, out.stderr[-1000:]
            cfg = json.loads(out.stdout)
            mounts = [target for _, target in volumes(service)]
            for name in ("model_path", "output"):
                assert any(cfg[name].startswith(m + "/") for m in mounts), f"{path.name}: {name} {cfg[name]} on {worker}"
            for staging in [cfg["staging_dir"], *(n.get("staging_dir") for n in cfg["nodes"])]:
                assert staging is None or staging.startswith("/dev/shm/"), path.name
            assert service.get("shm_size") or service.get("ipc") == "host", worker


def test_the_gpu_image_is_sglangs_own_at_the_pinned_version_with_regen_on_path():
    import tomllib

    pin = re.search(r"^sglang==(\S+)", (ROOT / "requirements-gpu.txt").read_text(), flags=re.M).group(1)
    assert re.search(rf"^ARG SGLANG_VERSION={re.escape(pin)}$", DOCKERFILE, flags=re.M)
    assert re.search(r"^FROM lmsysorg/sglang:v\$\{SGLANG_VERSION\} AS gpu$", DOCKERFILE, flags=re.M)
    for name in ("airflow-gpu-worker", "airflow-gpu-worker-b"):
        assert TWO_NODES[name]["build"]["args"]["SGLANG_VERSION"] == f"${{SGLANG_VERSION:-{pin}}}"
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts["regen"] == "regen.cli:main"
    stages = re.split(r"^FROM ", DOCKERFILE, flags=re.M)[1:]
    for stage in stages:  # each image installs the project: `regen` on its PATH
        assert "pip install --no-cache-dir --no-deps /opt/regen" in stage, stage.splitlines()[0]
    gpu = stages[-1]
    uid = SERVICES["airflow-gpu-worker"]["user"].split(":")[0]
    assert f"--uid {uid} " in gpu and "ENTRYPOINT [\"airflow\"]" in gpu
    two_nodes = yaml.safe_load((ROOT / "deploy" / "two-nodes" / "two_nodes.yaml").read_text())
    assert two_nodes["engine_python"] == "/usr/bin/python3"  # the image's SGLang, not the Airflow venv


# SGLang's image: Ubuntu 22.04 (glibc 2.35), python3 set to 3.12 by update-alternatives (SGLang's
# docker/Dockerfile, read at its 0.5.5 tag; the 0.5.23 image itself cannot be pulled here).
SGLANG_IMAGE_PYTHON, SGLANG_IMAGE_GLIBC_MINOR = "3.12", 35


@pytest.mark.slow
def test_the_gpu_images_airflow_venv_resolves_from_wheels_on_sglangs_python(tmp_path):
    """The gpu stage's `pip install -r requirements.txt -c constraints.txt` in a venv of the
    image's python3: pip resolves every pin for that Python and glibc from wheels alone, against
    PyPI (a pin without such a wheel would need a compiler in the image). About 30 s."""
    gpu = re.split(r"^FROM ", DOCKERFILE, flags=re.M)[-1]
    assert "python3 -m venv /opt/airflow-venv" in gpu
    assert "/opt/airflow-venv/bin/pip install --no-cache-dir -r /opt/regen/requirements.txt -c /opt/regen/constraints.txt" in gpu
    platforms = [arg for minor in range(5, SGLANG_IMAGE_GLIBC_MINOR + 1)
                 for arg in ("--platform", f"manylinux_2_{minor}_x86_64")]
    report = tmp_path / "report.json"
    resolved = subprocess.run(
        [str(BIN / "pip"), "install", "--dry-run", "--ignore-installed", "--quiet", "--target", str(tmp_path / "t"),
         "--python-version", SGLANG_IMAGE_PYTHON, *platforms, "--platform", "manylinux2014_x86_64",
         "--platform", "linux_x86_64", "--only-binary=:all:", "--report", str(report),
         "-r", str(ROOT / "requirements.txt"), "-c", str(ROOT / "constraints.txt")],
        capture_output=True, text=True, timeout=600)
    assert resolved.returncode == 0, resolved.stderr[-3000:]
    def canonical(name: str) -> str:
        return re.sub(r"[-_.]+", "-", name).lower()

    installed = {canonical(p["metadata"]["name"]): p["metadata"]["version"]
                 for p in json.loads(report.read_text())["install"]}
    pins = {canonical(name): version for name, version in
            re.findall(r"^([A-Za-z0-9_.\-]+)==(\S+)$", (ROOT / "constraints.txt").read_text(), flags=re.M)}
    assert installed["apache-airflow"] == pins["apache-airflow"] and "regen" not in installed
    assert {name: v for name, v in installed.items() if name in pins and pins[name] != v} == {}


def test_the_build_context_leaves_out_the_models_and_keeps_what_the_dockerfile_copies():
    """`docker compose build` sends the context to the daemon: a checkpoint in ./models (mounted
    at /models, never copied) would be 55 GB of it. .dockerignore keeps it, the venv and the state
    out, and nothing a COPY needs."""
    import re

    ignored = [line.strip() for line in (ROOT / ".dockerignore").read_text().splitlines()
               if line.strip() and not line.startswith("#")]
    assert {"models/", "var/", ".venv/", ".git/"} <= set(ignored)
    sources = [src for args in re.findall(r"^COPY (.+)$", (ROOT / "Dockerfile").read_text(), re.M)
               for src in [a for a in args.split() if not a.startswith("--")][:-1]]
    assert sources and all((ROOT / src).exists() for src in sources)
    assert not [src for src in sources for pattern in ignored if src.startswith(pattern.rstrip("/").lstrip("*/"))]
