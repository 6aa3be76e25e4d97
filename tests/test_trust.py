"""What a person who may only trigger a DAG can make the deployment do: the deployment's fields
(executables, connections, hosts, directory roots, the key) are refused in a run's conf before
anything runs, and the key never travels through Airflow."""

from __future__ import annotations

import json
import os
from pathlib import Path

import httpx
import pytest

from regen.config import ConfigError
from regen.config.deployment import DEPLOYMENT_FIELDS, DeploymentFieldError, triggered_run_config
from support.airflow import _conf, deploy, wait_run
from support.processes import wait_until

WHERE = "/etc/regen/dataset.yaml"


@pytest.fixture
def deployment(make_config, tmp_path):
    return make_config(output=str(tmp_path / "datasets" / "chat"), api_key="deploy-key-" + "z" * 30,
                       extra_server_args=["--sim-tokens-per-second", "500"])


@pytest.fixture
def payload(tmp_path) -> tuple[Path, Path]:
    """A program a trigger-only user names; it would leave a marker file if anything ran it."""
    marker = tmp_path / "payload-ran"
    script = tmp_path / "payload.sh"
    script.write_text(f"#!/bin/sh\ntouch {marker}\n")
    script.chmod(0o755)
    return script, marker


def refusals(deployment, conf, **others) -> str:
    with pytest.raises(DeploymentFieldError) as err:
        triggered_run_config(deployment, WHERE, conf, others)
    return str(err.value)


@pytest.mark.parametrize("field, value", [
    ("engine_python", "/tmp/payload.sh"), ("remote_regen", "/tmp/payload.sh"), ("ssh_conn_id", "other_team_node"),
    ("host", "0.0.0.0"), ("staging_dir", "/home/someone"), ("queue", "another-node"), ("output_root", "/"),
    ("nodes", [{"name": "a", "ssh_conn_id": "other_team_node"}]), ("approvers", ["the-trigger-user"]),
    ("work_dir", "/home/someone"), ("output_conn_id", "another_teams_bucket"),
])
def test_a_conf_that_changes_a_deployment_field_is_refused_naming_it_and_where_it_is_set(deployment, field, value):
    message = refusals(deployment, {field: value})
    assert f"{field}: set by the deployment ({WHERE}" in message and "--config" in message
    assert message.count("\n- ") == 1  # that field alone


def test_a_conf_that_repeats_or_leaves_out_the_deployment_fields_runs_with_the_deployments_values(deployment):
    same = {name: json.loads(deployment.model_dump_json())[name] for name in DEPLOYMENT_FIELDS if name != "api_key"}
    cfg = triggered_run_config(deployment, WHERE, {**same, "num_shards": 5, "temperature": 0.3})
    assert (cfg.num_shards, cfg.sampling.temperature) == (5, 0.3)  # run fields are the run's
    assert cfg.servers.api_key == deployment.servers.api_key  # the key comes from the deployment only
    stale = triggered_run_config(deployment, WHERE, {"num_shards": 5})
    assert all(stale.flat_value(n) == deployment.flat_value(n) for n in DEPLOYMENT_FIELDS)


def test_a_misspelt_field_in_a_conf_is_refused_with_the_field_it_resembles(deployment):
    with pytest.raises(ConfigError, match=r"'max_token' \(did you mean 'max_tokens'\?\)"):
        triggered_run_config(deployment, WHERE, {"max_token": 100})


def test_a_bucket_output_is_a_prefix_under_the_deployments_bucket_output(make_config):
    deployment = make_config(output="s3://team-bucket/regen/chat")
    assert triggered_run_config(deployment, WHERE, {"output": "s3://team-bucket/regen/run-2"}).output == \
        "s3://team-bucket/regen/run-2"
    for elsewhere in ("s3://other-bucket/regen/run-2", "s3://team-bucket/regen", "/data/regen/run-2"):
        assert "a triggered run writes in a folder under the deployment's output root" in refusals(
            deployment, {"output": elsewhere})


def test_the_key_in_a_conf_is_refused_and_never_echoed(deployment):
    message = refusals(deployment, {"api_key": "conf-key-" + "q" * 30, "engine_python": "/x"})
    assert message.startswith("run conf refused:") and "api_key:" in message and "engine_python:" in message
    assert "q" * 30 not in message and deployment.servers.api_key not in message
    with pytest.raises(ConfigError) as err:  # an invalid key: not echoed either
        triggered_run_config(deployment, WHERE, {"api_key": "short"})
    assert "short" not in str(err.value)


def test_server_flags_a_run_may_add_are_tuning_flags_only(deployment):
    cfg = triggered_run_config(deployment, WHERE, {"extra_server_args": [
        "--sim-tokens-per-second", "500", "--max-running-requests", "8", "--sim-batch-slowdown=0.1"]})
    assert cfg.servers.extra_server_args[-1] == "--sim-batch-slowdown=0.1"
    for refused in (["--tool-parser-plugin", "/tmp/p.py"], ["--trust-remote-code"], ["--host=0.0.0.0"],
                    ["--sim-request-log", "/etc/cron.d/x"], ["--chat-template", "/tmp/t.jinja"]):
        message = refusals(deployment, {"extra_server_args": refused})
        assert f"extra_server_args: {refused[0].split('=')[0]} may not be added" in message
    vllm = deployment.model_copy(update={"engine": "vllm", "extra_server_args": ["--enforce-eager"]})
    assert triggered_run_config(vllm, WHERE, {"extra_server_args": ["--enforce-eager", "--max-num-seqs", "4"]})
    assert "--tool-parser-plugin may not" in refusals(vllm, {"extra_server_args": ["--tool-parser-plugin", "x"]})


def test_a_runs_output_is_a_folder_under_the_root_and_never_another_dags_dataset(deployment, tmp_path):
    root = tmp_path / "datasets"
    assert triggered_run_config(deployment, WHERE, {"output": str(root / "mine")}).output == str(root / "mine")
    (tmp_path / "elsewhere").mkdir()
    (root / "link").parent.mkdir(parents=True, exist_ok=True)
    (root / "link").symlink_to(tmp_path / "elsewhere")
    for outside in ("/var/lib/other", str(root / ".." / "escape"), str(root), str(root / "link" / "x")):
        assert f"output {outside}: a triggered run writes in a folder under" in refusals(deployment, {"output": outside})
    message = refusals(deployment, {"output": str(root / "other" / "data")}, regenerate_other=str(root / "other"))
    assert "holds the dataset of DAG regenerate_other" in message
    rooted = deployment.model_copy(update={"output_root": str(tmp_path / "team")})
    assert triggered_run_config(rooted, WHERE, {"output": str(tmp_path / "team" / "a")})


def test_the_cli_with_its_own_config_keeps_full_control(deployment, payload, tmp_path):
    """The operator's shell is not a trigger: `regen preflight --config` takes any engine_python
    (and runs it: the operator chose it)."""
    import subprocess

    from support.paths import BIN

    script, marker = payload
    (tmp_path / "op.yaml").write_text(deployment.model_copy(update={"engine": "sglang", "engine_python": str(script),
                                                                    "staging_dir": str(tmp_path / "own")}).to_yaml())
    out = subprocess.run([str(BIN / "regen"), "preflight", "--config", str(tmp_path / "op.yaml")],
                         capture_output=True, text=True, timeout=300)
    assert "set by the deployment" not in out.stdout + out.stderr
    assert marker.exists()


@pytest.mark.slow
def test_a_trigger_only_user_cannot_choose_what_runs_and_never_sees_the_key(airflow, make_config, tmp_path, payload):
    """Under `airflow standalone`, through the REST API with the token of a user who may only read
    and trigger DAGs: each conf that names a program or reaches past the deployment fails at
    preflight, naming the field, and the program never runs; a plain run succeeds; the key is in
    no REST answer about the DAG, its runs or their logs, nor in an import error; a key typed into a
conf (any spelling, or inside another field) is refused and never stored, not even while the run
is queued. About 2 min."""
    script, marker = payload
    key = "regen-deploy-key-" + "x7" * 16
    typed = "typed-into-a-conf-" + "q9" * 16
    root = tmp_path / "datasets"
    cfg = make_config(output=str(root / "chat"), api_key=key, num_shards=1, sim_tokens_per_second=4000)
    deploy(cfg, airflow["config_dir"])
    broken = airflow["config_dir"] / "broken_keyed.yaml"
    broken.write_text(f"api_key: {key}\nmax_tokens: -5\nextra_server_args: '--api-key {key}'\n")
    user = httpx.Client(base_url=f"{airflow['base']}/api/v2", timeout=30,
                        headers={"Authorization": f"Bearer {airflow['trigger_token']}"})
    admin = httpx.Client(base_url=f"{airflow['base']}/api/v2", timeout=30,
                         headers={"Authorization": f"Bearer {airflow['token']}"})
    assert user.get("/connections").status_code == 403  # this user manages no connection
    wait_until(lambda: admin.get("/dags/regenerate_dataset").status_code == 200, 180, "DAG parsed")
    assert admin.patch("/dags/regenerate_dataset", json={"is_paused": False}).status_code == 200
    try:
        attempts = {
            "engine_python": {"engine": "sglang", "engine_python": str(script)},
            "remote_regen": {"remote_regen": str(script), "ssh_conn_id": cfg.ssh_conn_id},
            "ssh_conn_id": {"ssh_conn_id": "no_such_node"},
            "extra_server_args": {"engine": "vllm", "extra_server_args": ["--tool-parser-plugin", str(script)]},
            "output": {"output": str(tmp_path / "outside")},
            "api_key": {"api_key": typed},  # typed into the conf: refused, and never stored
        }
        # The key under other spellings and inside another field: never stored either (the run is refused).
        spelled = user.post("/dags/regenerate_dataset/dagRuns", json={"logical_date": None, "conf": {
            **_conf(cfg), "API_KEY": typed, "extra_server_args": ["--api-key", typed]}})
        assert spelled.status_code == 200 and typed not in spelled.text
        assert typed not in user.get(f"/dags/regenerate_dataset/dagRuns/{spelled.json()['dag_run_id']}").text
        runs = {}
        for field, change in [*attempts.items(), ("none", {})]:
            created = user.post("/dags/regenerate_dataset/dagRuns",
                                json={"logical_date": None, "conf": {**_conf(cfg), **change}})
            assert created.status_code == 200, created.text  # the trigger itself is theirs to make
            runs[field] = created.json()["dag_run_id"]
            queued = user.get(f"/dags/regenerate_dataset/dagRuns/{runs[field]}")  # before it starts
            assert typed not in created.text and typed not in queued.text
        path = "/dags/regenerate_dataset/dagRuns"
        for field, run_id in runs.items():
            state = wait_run(admin, run_id, 300)
            tis = {t["task_id"]: t["state"]
                   for t in admin.get(f"{path}/{run_id}/taskInstances").json()["task_instances"]}
            log = user.get(f"{path}/{run_id}/taskInstances/preflight/logs/1", params={"full_content": True}).text
            assert key not in log
            if field == "none":
                assert state == "success", tis
                for task_id in tis:
                    assert key not in admin.get(f"{path}/{run_id}/taskInstances/{task_id}/logs/1",
                                                params={"full_content": True}).text
                continue
            assert typed not in log
            assert state == "failed" and tis["preflight"] == "failed", (field, tis)
            assert tis["stage_weights"] == "upstream_failed"
            assert f"- {field}" in log and "run conf refused" in log, (field, log[-3000:])
        assert not marker.exists()  # no conf made anything run the program
        assert not (tmp_path / "outside").exists()
        for answer in (user.get("/dags/regenerate_dataset/details"), user.get(path),
                       *(user.get(f"{path}/{run_id}") for run_id in runs.values())):
            assert answer.status_code == 200 and key not in answer.text and typed not in answer.text
        assert "api_key" not in user.get("/dags/regenerate_dataset/details").json()["params"]

        def import_errors() -> str:
            return json.dumps(admin.get("/importErrors").json())

        wait_until(lambda: "broken_keyed.yaml" in import_errors(), 120, "the broken file reported")
        assert "max_tokens" in import_errors() and key not in import_errors()
    finally:
        os.unlink(broken)


def test_the_run_page_and_every_task_read_the_deployment_as_its_files_say_now(deployment, monkeypatch, tmp_path):
    """What a run page shows and a task runs come from one function: the DAG's file as it is
    when they read it, the conf's run fields over it; a DAG the deployment has not is refused."""
    from regen.dags.definitions import NotRegenDag, triggered_config

    folder = tmp_path / "regen-configs"
    folder.mkdir()
    deploy(deployment, folder, "regenerate_chat")
    deploy(deployment.model_copy(update={"output": str(tmp_path / "datasets" / "code")}), folder, "regenerate_code")
    monkeypatch.setenv("REGEN_CONFIG_DIR", str(folder))
    assert triggered_config("regenerate_chat", {"num_shards": 3}).num_shards == 3
    with pytest.raises(DeploymentFieldError, match=r"ssh_conn_id: set by the deployment \(.*chat.yaml"):
        triggered_config("regenerate_chat", {"ssh_conn_id": "other", "remote_regen": "/tmp/x"})
    with pytest.raises(DeploymentFieldError, match="holds the dataset of DAG regenerate_code"):
        triggered_config("regenerate_chat", {"output": str(tmp_path / "datasets" / "code")})
    with pytest.raises(NotRegenDag):
        triggered_config("regenerate_dataset", {})


def test_a_run_may_not_inject_faults_nor_keep_servers_up_longer_than_the_deployment(deployment):
    for fault in (["--sim-orphan-child"], ["--sim-hang-rate", "1"], ["--sim-ignore-thinking"],
                  ["--sim-startup-delay=600"], ["--sim-fail-while", "/tmp/x"]):
        message = refusals(deployment, {"extra_server_args": fault})
        assert f"extra_server_args: {fault[0].split('=')[0]} may not be added" in message
    assert triggered_run_config(deployment, WHERE, {"extra_server_args": ["--sim-reasoning-median", "50"]})
    ceiling = deployment.servers.idle_shutdown_s
    for asked in (None, ceiling * 10):
        assert "idle_shutdown_s: a triggered run's servers stop after at most" in refusals(
            deployment, {"idle_shutdown_s": asked})
    assert triggered_run_config(deployment, WHERE, {"idle_shutdown_s": ceiling / 2}).servers.idle_shutdown_s == ceiling / 2


def test_a_runs_output_is_never_inside_another_dataset(deployment, tmp_path):
    root = tmp_path / "datasets"
    mine = root / "mine"
    (mine / "work").mkdir(parents=True)
    (mine / "work" / "manifest.json").write_text("{}")
    for inside in (mine / "data", mine / "data" / "x", mine / "sub"):
        assert f"inside the dataset {mine}" in refusals(deployment, {"output": str(inside)})
    assert triggered_run_config(deployment, WHERE, {"output": str(root / "theirs")})


def test_a_conf_of_megabytes_is_refused_whole_and_not_echoed(deployment):
    with pytest.raises(ConfigError) as err:
        triggered_run_config(deployment, WHERE, {"extra_server_args": ["--sim-reasoning-median", "9" * 30_000_000]})
    assert "more than the 262,144 a run's conf may hold" in str(err.value) and len(str(err.value)) < 200


def test_the_conf_scrub_replaces_every_spelling_of_a_key_and_only_a_key_that_is_there():
    from regen.dags.conf_scrub import scrubbed_conf
    from regen.secrets import REDACTED

    key = "sk-" + "z" * 40
    assert scrubbed_conf({"api_key": key, "max_tokens": 5}) == {"api_key": REDACTED, "max_tokens": 5}
    for name in ("API_KEY", "apikey", "apiKey", "api-key", "token"):
        assert scrubbed_conf({name: key}) == {name: REDACTED}
    assert scrubbed_conf({"servers": {"api_key": key}}) == {"servers": {"api_key": REDACTED}}
    assert scrubbed_conf({"extra_server_args": ["--api-key", key, "--tp", "2"]}) == {
        "extra_server_args": ["--api-key", REDACTED, "--tp", "2"]}
    assert scrubbed_conf({"extra_server_args": f"--tp 2 --api-key={key}"}) == {
        "extra_server_args": f"--tp 2 --api-key={REDACTED}"}
    assert scrubbed_conf({"api_key": None, "max_tokens": 5}) is None  # `regen config --json` prints it empty
    assert scrubbed_conf({"api_key": REDACTED}) is None and scrubbed_conf(None) is None
