"""A GPU node reached over SSH: a real sshd on loopback, an Airflow SSH connection with the node's
host key, and every stage run there by the node's own regen."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from conftest import BIN, ROOT, free_port_base, processes_with_args, read_ids, wait_until
from regen import pipeline
from regen.remote import RemoteError
from regen.servers import port_is_free

SSHD = shutil.which("sshd") or "/usr/sbin/sshd"


@pytest.fixture(scope="module")
def sshd(tmp_path_factory):
    """sshd on 127.0.0.1 with its own host key; root logs in with a generated key only."""
    assert Path(SSHD).exists(), "openssh-server is installed by `make test`"
    home = tmp_path_factory.mktemp("sshd")
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(home / "host_key")], check=True)
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(home / "client_key")], check=True)
    shutil.copy(home / "client_key.pub", home / "authorized_keys")
    port = free_port_base(1)
    (home / "sshd_config").write_text(f"""Port {port}
ListenAddress 127.0.0.1
HostKey {home / 'host_key'}
AuthorizedKeysFile {home / 'authorized_keys'}
PermitRootLogin prohibit-password
PasswordAuthentication no
KbdInteractiveAuthentication no
UsePAM no
StrictModes no
PidFile {home / 'sshd.pid'}
""")
    Path("/run/sshd").mkdir(exist_ok=True)
    proc = subprocess.Popen([SSHD, "-D", "-e", "-f", str(home / "sshd_config")],
                            stdout=subprocess.DEVNULL, stderr=open(home / "sshd.log", "wb"))
    wait_until(lambda: not port_is_free("127.0.0.1", port) or proc.poll() is not None, 30, "sshd")
    assert proc.poll() is None, (home / "sshd.log").read_text()
    host_key = " ".join((home / "host_key.pub").read_text().split()[:2])
    yield {"port": port, "key_file": str(home / "client_key"), "host_key": host_key, "home": home}
    proc.terminate()
    proc.wait(timeout=10)


def connection(sshd, host_key=None) -> str:
    return json.dumps({"conn_type": "ssh", "host": "127.0.0.1", "port": sshd["port"], "login": "root",
                       "extra": {"key_file": sshd["key_file"], "host_key": host_key or sshd["host_key"]}})


@pytest.fixture
def node(sshd, monkeypatch, make_config):
    monkeypatch.setenv("AIRFLOW_CONN_GPU_NODE", connection(sshd))

    def config(**overrides):
        return make_config(ssh_conn_id="gpu_node", remote_regen=str(BIN / "regen"), **overrides)

    return config


def test_stage_serve_health_logs_and_teardown_run_on_the_node(node, tmp_path):
    cfg = node(num_servers=2)
    staged = pipeline.stage_weights(cfg)
    assert staged.startswith(str(tmp_path / "shm"))
    assert (Path(staged) / "config.json").exists()
    assert pipeline.stage_weights(cfg) == staged  # a second staging is a no-op
    urls = pipeline.start_servers(cfg, staged)
    assert urls == [f"http://127.0.0.1:{cfg.base_port + i}" for i in range(2)]
    try:
        logs = pipeline.server_logs(cfg)
        assert "==> server 0" in logs and "regen sim:" in logs
        assert pipeline.canary(cfg)["text"].startswith("canary passed")
        assert "shard 0/2" in pipeline.generate(cfg, 0)
        from regen.web import config_data

        page = config_data(cfg)  # what the run page shows for a run on the node
        assert page["output"] == f"gpu_node:{cfg.output}"
        assert page["progress"]["shards"]["shard-00000"]["state"] == "done"
        assert page["progress"]["canary"]["passed"] is True
    finally:
        pipeline.stop_servers(cfg)
    for i in range(2):
        assert processes_with_args("--port", str(cfg.base_port + i)) == []
        assert port_is_free("127.0.0.1", cfg.base_port + i)
    pipeline.stop_servers(cfg)  # a second teardown is harmless


def test_a_wrong_host_key_is_refused(sshd, monkeypatch, make_config):
    other = sshd["home"] / "other_key"
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(other)], check=True)
    wrong = " ".join((other.with_suffix(".pub")).read_text().split()[:2])
    monkeypatch.setenv("AIRFLOW_CONN_GPU_NODE", connection(sshd, host_key=wrong))
    cfg = make_config(ssh_conn_id="gpu_node", remote_regen=str(BIN / "regen"))
    with pytest.raises(Exception, match="(?i)host key|not found in known_hosts|BadHostKey"):
        pipeline.stage_weights(cfg)
    assert not Path(cfg.staging_dir).exists()


def test_shell_metacharacters_in_params_run_no_command_on_the_node(node, tiny_model, tmp_path):
    evil = tmp_path / "model; touch PWNED; $(touch PWNED2) `touch PWNED3`"
    shutil.copytree(tiny_model, evil)
    cfg = node(model_path=str(evil), num_servers=1)
    staged = pipeline.stage_weights(cfg)
    assert Path(staged).exists()
    assert not list(tmp_path.rglob("PWNED*")) and not list(Path.cwd().glob("PWNED*"))
    assert not list(Path("/root").glob("PWNED*"))


def test_a_remote_failure_carries_the_nodes_message(node, tmp_path):
    cfg = node(model_path=str(tmp_path / "missing"))
    with pytest.raises(RemoteError, match="not a model directory"):
        pipeline.stage_weights(cfg)


def test_preflight_on_the_node_lists_its_problems(node, tmp_path):
    from regen.preflight import PreflightFailed

    cfg = node(prompts=str(tmp_path / "none.jsonl"))
    with pytest.raises(PreflightFailed) as err:
        pipeline.preflight(cfg)
    assert err.value.problems == [f"gpu_node: prompts {tmp_path / 'none.jsonl'}: file not found"]


@pytest.mark.slow
def test_the_dag_runs_end_to_end_on_the_ssh_node(node, airflow_db):
    from test_dag import _conf, _states, assert_no_server_left, load_dag

    cfg = node(num_shards=2, sim_tokens_per_second=2000)
    run = load_dag().test(run_conf=_conf(cfg))
    assert run.state == "success", _states(run)
    import pandas as pd

    df = pd.read_parquet(Path(cfg.output) / "data")
    assert sorted(df["id"]) == sorted(read_ids(ROOT / "demo" / "prompts.jsonl"))
    assert_no_server_left(cfg)
    assert os.path.exists(Path(cfg.output) / "audit" / "report.html")
