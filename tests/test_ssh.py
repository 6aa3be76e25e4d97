"""A GPU node reached over SSH: a real sshd on loopback, an Airflow SSH connection with the node's
host key, and every stage run there by the node's own regen."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from regen.pipeline import run
from regen.servers.probe import port_is_free
from support.data import read_ids, turn_requests
from support.paths import BIN, ROOT
from regen.servers.probe import free_port_base
from support.processes import processes_with_args, wait_until

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
        return make_config(**{"ssh_conn_id": "gpu_node", "remote_regen": str(BIN / "regen"), **overrides})

    return config


def test_stage_serve_health_logs_and_teardown_run_on_the_node(node, tmp_path):
    cfg = node(num_servers=2)
    staged = run("stage_weights", cfg).path
    assert staged.startswith(str(tmp_path / "shm"))
    assert (Path(staged) / "config.json").exists()
    assert run("stage_weights", cfg).path == staged  # a second staging is a no-op
    urls = run("start_servers", cfg, served_model_path=staged).urls
    assert urls == [f"http://127.0.0.1:{cfg.servers.base_port + i}" for i in range(2)]
    try:
        text = run("server_logs", cfg).logs
        assert "==> server 0" in text and "regen sim:" in text
        assert run("canary", cfg).passed is True
        assert "shard 0/2" in run("generate", cfg, shards=[0]).summary[0]
        from regen.dags.runpage import config_data

        page = config_data(cfg)  # what the run page shows for a run on the node
        assert page["output"] == f"gpu_node:{cfg.output}"
        assert page["progress"]["shards"]["shard-00000"]["state"] == "done"
        assert page["progress"]["canary"]["passed"] is True
    finally:
        run("stop_servers", cfg)
    for i in range(2):
        assert processes_with_args("--port", str(cfg.servers.base_port + i)) == []
        assert port_is_free("127.0.0.1", cfg.servers.base_port + i)
    assert run("stop_servers", cfg).stopped == 0  # a second teardown is harmless


# Values that differ between any two runs (timings, rates) or name this run's own resources (its
# output, ports, pids): masked before local and remote documents are compared field by field.
VOLATILE = {"seconds", "elapsed_s", "updated", "tokens_per_s", "rows_per_s", "eta_s", "pid",
            "latency_s", "text", "tokens_per_sample", "summary", "history", "alone_tokens_per_s",
            "batch_slowdown", "limit", "started_at",  # limit: the budget slots a shard held at its last report
            "attempt",  # which process made a shard's part (node, pid, start)
            "launch"}  # a row maker's hash of its server's launch arguments, which hold this run's own paths


def normalized(doc, cfg):
    """The document with this run's own names replaced by placeholders and timings masked."""
    def walk(value, key=None):
        if key in VOLATILE:
            return "<volatile>"
        if isinstance(value, dict):
            return {walk(k): walk(v, k) for k, v in value.items()}
        if isinstance(value, list):
            return [walk(v) for v in value]
        if isinstance(value, str):
            for i in range(cfg.servers.num_servers):
                value = value.replace(str(cfg.servers.base_port + i), f"<port{i}>")
            value = re.sub(r"pid \d+", "pid <pid>", value)
            return value.replace(cfg.output, "<output>").replace(cfg.staging_dir, "<staging>")
        if key == "port" and isinstance(value, int):  # the server plan preflight reports
            return f"<port{value - cfg.servers.base_port}>"
        return value

    return walk(doc)


def differences(a, b, path="") -> list[str]:
    """Where two documents differ, field by field (paths like `progress.shards.shard-00000`)."""
    if isinstance(a, dict) and isinstance(b, dict):
        return [d for k in sorted(set(a) | set(b)) for d in (
            differences(a[k], b[k], f"{path}.{k}") if k in a and k in b else [f"{path}.{k}: only one side"])]
    if isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
        return [d for i, (x, y) in enumerate(zip(a, b)) for d in differences(x, y, f"{path}[{i}]")]
    return [] if a == b else [f"{path}: {a!r} != {b!r}"]


def every_stage(cfg) -> dict[str, dict]:
    """Each stage of a run, in the DAG's order, as its result document."""
    results = {"preflight": run("preflight", cfg)}
    results["stage_weights"] = run("stage_weights", cfg)
    results["serve"] = run("start_servers", cfg, served_model_path=results["stage_weights"].path)
    try:
        results["logs"] = run("server_logs", cfg, lines=1)
        results["canary"] = run("canary", cfg)
        for shard in range(cfg.num_shards):
            results[f"generate {shard}"] = run("generate", cfg, shards=[shard])
        results["audit"] = run("audit", cfg)
        results["progress"] = run("status", cfg)
    finally:
        results["stop"] = run("stop_servers", cfg)
    return {name: result.model_dump(mode="json") for name, result in results.items()}


@pytest.mark.slow
def test_every_stage_gives_the_same_document_locally_and_on_the_node(node, make_config, tmp_path):
    common = dict(num_servers=1, num_shards=2, sim_tokens_per_second=5000, seed=3)
    here = make_config(output=str(tmp_path / "here"), staging_dir=str(tmp_path / "shm-here"), **common)
    there = node(output=str(tmp_path / "there"), staging_dir=str(tmp_path / "shm-there"), **common)
    local, remote = every_stage(here), every_stage(there)
    assert list(local) == list(remote)
    for name in local:
        assert differences(normalized(local[name], here), normalized(remote[name], there)) == [], name
    # The audit's section of progress.json is written wherever the audit runs.
    sections = [json.loads((Path(c.output) / "progress.json").read_text())["audit"] for c in (here, there)]
    assert differences(normalized(sections[0], here), normalized(sections[1], there)) == []
    # one sample per assistant turn (the events layout): the demo's 280 prompts, some multi-turn
    assert sections[1]["verdict"] == "PASS" and sections[1]["samples"] == sum(
        turn_requests(ROOT / "demo" / "prompts.jsonl").values()) > 280


def test_a_warning_printed_after_the_result_does_not_break_it(node, tmp_path, make_config):
    """The node's interpreter, a profile or a library may print after the stage returns."""
    wrapper = tmp_path / "regen-then-warn"
    wrapper.write_text(f'#!/bin/sh\n"{BIN / "regen"}" "$@"\ncode=$?\n'
                       f'echo "WARNING: something printed after the result {{not json}}"\nexit $code\n')
    wrapper.chmod(0o755)
    cfg = node(remote_regen=str(wrapper))
    assert Path(run("stage_weights", cfg).path).is_dir()
    from regen.preflight import PreflightFailed

    bad = node(remote_regen=str(wrapper), prompts=str(tmp_path / "none.jsonl"))
    with pytest.raises(PreflightFailed) as err:
        run("preflight", bad, code=False)
    assert err.value.problems == [f"prompts {tmp_path / 'none.jsonl'}: file not found"]


@pytest.mark.parametrize("fault, says", [
    ("wrong host key", r"the node's host key is not the one the connection names \(ssh-ed25519 "),
    ("malformed host key", r"extras \(host_key, key_file, private_key\) cannot be used: "),
    ("wrong client key", r"authentication failed .*check the connection's login and key"),
    ("closed port", r"cannot connect: .*"),
    ("unknown connection", r"no such Airflow connection \(add it: airflow connections add"),
])
def test_each_way_ssh_fails_is_one_line_naming_the_connection_and_what_to_fix(
        fault, says, sshd, monkeypatch, make_config):
    """Nothing runs on the node (the host key is checked before anything is sent), and the task log
    shows one line, not a paramiko traceback."""
    from regen.errors import RemoteError

    conn = json.loads(connection(sshd))
    other = sshd["home"] / "other_key"
    if not other.exists():
        subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(other)], check=True)
    if fault == "wrong host key":
        conn["extra"]["host_key"] = " ".join(other.with_suffix(".pub").read_text().split()[:2])
    elif fault == "malformed host key":
        conn["extra"]["host_key"] = "ssh-ed25519 not-base64!"
    elif fault == "wrong client key":
        conn["extra"]["key_file"] = str(other)
    elif fault == "closed port":
        conn["port"] = free_port_base(1)
    if fault != "unknown connection":
        monkeypatch.setenv("AIRFLOW_CONN_GPU_NODE", json.dumps(conn))
    cfg = make_config(ssh_conn_id="gpu_node", remote_regen=str(BIN / "regen"))
    with pytest.raises(RemoteError) as error:
        run("stage_weights", cfg)
    message = str(error.value)
    assert "\n" not in message and message.startswith("ssh_conn_id gpu_node"), message
    assert re.search(says, message), message
    if fault not in ("unknown connection", "malformed host key"):  # those fail before the hook knows the node
        assert f"root@127.0.0.1:{conn['port']}" in message
    assert error.value.__cause__ is None and error.value.__suppress_context__
    assert not Path(cfg.staging_dir).exists()


def test_shell_metacharacters_in_params_run_no_command_on_the_node(node, tiny_model, tmp_path):
    evil = tmp_path / "model; touch PWNED; $(touch PWNED2) `touch PWNED3`"
    shutil.copytree(tiny_model, evil)
    cfg = node(model_path=str(evil), num_servers=1)
    staged = run("stage_weights", cfg).path
    assert Path(staged).exists()
    assert not list(tmp_path.rglob("PWNED*")) and not list(Path.cwd().glob("PWNED*"))
    assert not list(Path("/root").glob("PWNED*"))


def test_the_config_reaches_the_node_in_a_private_file_not_on_a_command_line(node, tmp_path):
    """Any local user of the node reads /proc/PID/cmdline: the stage's command line holds no config
    value (the API key here), the config arrives in an owner-only file that the stage removes."""
    import threading

    key = "regen-ssh-test-key-" + "z9" * 10
    cfg = node(api_key=key)
    seen: list[bytes] = []
    done = threading.Event()

    def watch() -> None:  # sample every process's command line while the stage runs
        while not done.is_set():
            for entry in Path("/proc").iterdir():
                try:
                    cmdline = (entry / "cmdline").read_bytes()
                except OSError:
                    continue
                if b"run-stage" in cmdline:
                    seen.append(cmdline)

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        run("preflight", cfg)
    finally:
        done.set()
        watcher.join()
    assert seen and all(key.encode() not in c and b"--config-json-file" in c for c in seen)
    inputs = Path("/root/.cache/regen/stage-input")
    assert oct(inputs.stat().st_mode & 0o777) == "0o700" and list(inputs.iterdir()) == []


def test_a_hung_node_does_not_hang_the_run_page(sshd, monkeypatch, make_config):
    """A node that accepts the connection and never answers: the run page's data answers within
    its deadline, naming the node, and the next poll does too."""
    import socket
    import time

    from regen.dags.runpage import config_data

    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(8)
    hung = json.loads(connection(sshd))
    hung["port"] = listener.getsockname()[1]
    monkeypatch.setenv("AIRFLOW_CONN_HUNG_NODE", json.dumps(hung))
    cfg = make_config(ssh_conn_id="hung_node", remote_regen=str(BIN / "regen"))
    try:
        for _ in range(2):
            started = time.monotonic()
            with pytest.raises(TimeoutError, match="node hung_node did not answer within 2 s"):
                config_data(cfg, deadline_s=2)
            assert time.monotonic() - started < 4
    finally:
        listener.close()


class Relay:
    """A TCP relay to the node's sshd, the link a test breaks: :meth:`hang` makes the connections
    it holds a black hole (connected, nothing delivered either way), :meth:`drop` resets them;
    ``hang_new`` black-holes the connections to come too (a node gone silent)."""

    def __init__(self, port: int):
        import socket
        import threading

        self.target, self.held, self.connections, self.hang_new = port, [], 0, False
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        import socket
        import threading

        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            self.connections += 1
            upstream = socket.create_connection(("127.0.0.1", self.target))
            hung = threading.Event()
            if self.hang_new:
                hung.set()
            self.held.append((hung, client, upstream))
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pump, args=(a, b, hung), daemon=True).start()

    @staticmethod
    def _pump(src, dst, hung) -> None:
        try:
            while chunk := src.recv(65536):
                if not hung.is_set():
                    dst.sendall(chunk)
        except OSError:
            pass
        for sock in (src, dst):
            try:
                sock.close()
            except OSError:
                pass

    def hang(self) -> None:
        for hung, _, _ in self.held:
            hung.set()

    def drop(self) -> None:
        import socket

        for _, *sockets in self.held:
            for sock in sockets:
                try:
                    sock.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def close(self) -> None:
        self.listener.close()


@pytest.fixture
def flaky_node(sshd, monkeypatch, make_config, tmp_path):
    """A node behind a :class:`Relay`, its servers up, a shard of 24 two-turn conversations to
    generate (about 36 s of work); every request the node's server gets is logged."""
    from regen import remote
    from support.data import write_conversations

    relay = Relay(sshd["port"])
    flaky = json.loads(connection(sshd))
    flaky["port"] = relay.port
    monkeypatch.setenv("AIRFLOW_CONN_FLAKY_NODE", json.dumps(flaky))
    monkeypatch.setattr(remote, "KEEPALIVE_S", 1.0)
    monkeypatch.setattr(remote, "LINK_SILENT_S", 2.0)
    log = tmp_path / "requests.jsonl"
    prompts = write_conversations(tmp_path / "p.jsonl", 24, turns=2)
    cfg = make_config(ssh_conn_id="flaky_node", remote_regen=str(BIN / "regen"), prompts=str(prompts),
                      num_servers=1, num_shards=1, concurrency_per_server=4, sim_tokens_per_second=60,
                      extra_server_args=["--sim-request-log", str(log)])
    run("start_servers", cfg, served_model_path=run("stage_weights", cfg).path)
    try:
        yield relay, cfg, log
    finally:
        run("stop_servers", cfg)
        relay.close()


def requested_turns(log: Path):
    from collections import Counter

    requested = Counter()
    for line in log.read_text().splitlines():
        users = [m["content"] for m in json.loads(line)["messages"] if m["role"] == "user"]
        requested[(users[0].split(",")[0], len(users) - 1)] += 1
    return requested


EVERY_TURN_ONCE = {(f"Conversation {i}", k): 1 for i in range(24) for k in range(2)}


def journaled(cfg) -> int:
    from regen.layout import RunLayout
    from regen.store import Journal

    return len(list(Journal.rows(RunLayout(cfg.output).journal(0, 1))))


def output_ids(cfg) -> list[str]:
    import pandas as pd

    return sorted(pd.read_parquet(Path(cfg.output) / "data")["id"])


@pytest.mark.slow
@pytest.mark.parametrize("failure", ["drop", "hang"])
def test_a_link_that_drops_or_goes_silent_mid_shard_is_reattached_and_the_shard_ends_in_the_same_attempt(
        flaky_node, failure, caplog):
    """The shard runs detached on the node: when the link is reset, or goes silent (a keepalive
    unanswered), the attempt reconnects, follows the job's log from where it was left, and
    returns the shard's result; no request is sent twice, no retry is needed. About 40 s each."""
    import threading

    relay, cfg, log = flaky_node
    outcome: dict = {}

    def attempt() -> None:
        try:
            outcome["result"] = run("generate", cfg, shards=[0])
        except Exception as exc:  # noqa: BLE001 - the assertion below shows it
            outcome["error"] = exc

    worker = threading.Thread(target=attempt)
    worker.start()
    wait_until(lambda: journaled(cfg) >= 3, 60, "conversations finished on the node")
    getattr(relay, failure)()
    worker.join(timeout=180)
    assert "result" in outcome, outcome
    assert (outcome["result"].done, outcome["result"].failed) == (24, 0)
    assert relay.connections >= 2  # a new connection carried the rest
    assert any("re-attached at byte" in r.getMessage() for r in caplog.records)
    assert requested_turns(log) == EVERY_TURN_ONCE
    assert output_ids(cfg) == sorted(f"c{i}" for i in range(24))


def attempt_in_a_process(cfg, tmp_path) -> subprocess.Popen:
    """A generate attempt at shard 0 in its own process, as an Airflow task runs one."""
    import signal
    import sys

    config = tmp_path / "run.json"
    config.write_text(cfg.model_dump_json())
    return subprocess.Popen([sys.executable, "-c", "import sys; from regen.config import RunConfig; "
                             "from regen.pipeline import run; "
                             "run('generate', RunConfig.model_validate_json(open(sys.argv[1]).read()), shards=[0])",
                             str(config)], env={**os.environ, "PYTHONPATH": str(ROOT / "include")},
                            # SIGINT as a task process has it, whatever this one inherited
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))


@pytest.mark.slow
@pytest.mark.parametrize("signal_name", ["SIGINT", "SIGTERM"])
def test_an_attempt_airflow_stops_stops_its_job_on_the_node(flaky_node, tmp_path, signal_name):
    """Airflow stops a task (a timeout, a task marked failed) with SIGINT, then SIGTERM, then
    SIGKILL, and a worker started in the background ignores SIGINT (CI's `nohup ... &` did):
    on either signal the detached job on the node must stop with the attempt, not generate on
    unseen. About 15 s each."""
    import signal

    _, cfg, _ = flaky_node
    attempt = attempt_in_a_process(cfg, tmp_path)
    try:
        wait_until(lambda: journaled(cfg) >= 1, 60, "a conversation finished on the node")
        attempt.send_signal(getattr(signal, signal_name))
        assert attempt.wait(timeout=30) != 0
    finally:
        attempt.kill()
    wait_until(lambda: processes_with_args("run-stage", "generate") == [], 30, "the node's job stopped")
    assert journaled(cfg) < 24


@pytest.mark.slow
def test_a_retry_follows_the_shard_its_killed_attempt_left_running_on_the_node(flaky_node, tmp_path, caplog):
    """The Airflow side of an attempt dies without a word (SIGKILL: no teardown reaches the node):
    the shard goes on there, and the retry follows that job to its end instead of starting a
    second generator; each turn is requested once. About 40 s."""
    import signal

    relay, cfg, log = flaky_node
    first = attempt_in_a_process(cfg, tmp_path)
    try:
        wait_until(lambda: journaled(cfg) >= 3, 60, "conversations finished on the node")
    finally:
        first.send_signal(signal.SIGKILL)
        first.wait()
    assert processes_with_args("run-stage", "generate") != []  # the node's job outlived its follower
    result = run("generate", cfg, shards=[0])
    assert (result.done, result.failed) == (24, 0)  # the job the killed attempt started
    assert any("still runs there: following it" in r.getMessage() for r in caplog.records)
    assert requested_turns(log) == EVERY_TURN_ONCE
    assert output_ids(cfg) == sorted(f"c{i}" for i in range(24))


@pytest.mark.slow
def test_a_node_gone_silent_fails_the_attempt_at_its_deadline_and_its_job_goes_on_there(
        flaky_node, monkeypatch):
    """The link to the node goes silent for good (new connections too) as the shard starts, before
    the follower's command has its answer (paramiko would wait an hour for it): the attempt fails at its deadline (plus the grace the node gets to stop by itself), naming the
    node. The node's own job is healthy: its rows keep coming in, so its deadline moves with its
    pace and it finishes the shard there, journal and publish included; once the node answers
    again the retry sends nothing. A deadline the node's log moves (while the link lives) moves
    the follower's too. About 60 s."""
    import threading
    import time

    from regen import remote
    from regen.errors import RemoteError

    follower = remote.Follower("n", "f", ends=100.0, started=50.0)
    follower.take(b"shard-00000-of-00001: deadline moved to 600 s, 4x what its 9 rows left take")
    assert follower.ends == 50.0 + 600 + remote.DEADLINE_GRACE_S

    relay, cfg, log = flaky_node
    monkeypatch.setattr(remote, "DEADLINE_GRACE_S", 5.0)
    deadline_s = 20.0  # the shard is about 36 s of work
    outcome: dict = {}

    def attempt() -> None:
        try:
            outcome["result"] = run("generate", cfg, shards=[0], deadline_s=deadline_s)
        except RemoteError as exc:
            outcome["error"] = exc

    def silent_from_here(*args):  # the job is launched; the link dies as the follower asks for its log
        relay.hang_new = True
        relay.hang()
        return follow_script(*args)

    follow_script = remote.follow_script
    monkeypatch.setattr(remote, "follow_script", silent_from_here)
    worker = threading.Thread(target=attempt)
    started = time.monotonic()
    worker.start()
    worker.join(timeout=120)
    elapsed = time.monotonic() - started
    assert "error" in outcome, outcome
    assert "on flaky_node did not end within 25 s" in str(outcome["error"])
    assert deadline_s + 5 <= elapsed < deadline_s + 5 + 15  # the job's stop is tried, briefly
    wait_until(lambda: processes_with_args("run-stage", "generate") == [], 120, "the node's job finished")
    assert output_ids(cfg) == sorted(f"c{i}" for i in range(24))  # past its first deadline

    log.unlink()
    monkeypatch.setattr(remote, "follow_script", follow_script)
    relay.hang_new = False
    run("generate", cfg, shards=[0])  # the retry: a new connection, which the link carries again
    assert not log.exists() or requested_turns(log) == {}
    assert output_ids(cfg) == sorted(f"c{i}" for i in range(24))


def test_a_remote_failure_carries_the_nodes_message_and_type(node, tmp_path):
    from regen.weights import StageError

    cfg = node(model_path=str(tmp_path / "missing"))
    with pytest.raises(StageError, match="not a model directory"):
        run("stage_weights", cfg)


def test_preflight_on_the_node_lists_its_problems(node, tmp_path):
    from regen.preflight import PreflightFailed

    cfg = node(prompts=str(tmp_path / "none.jsonl"))
    with pytest.raises(PreflightFailed) as err:
        run("preflight", cfg)
    assert err.value.problems == [f"prompts {tmp_path / 'none.jsonl'}: file not found"]


@pytest.mark.slow
def test_the_dag_runs_end_to_end_on_the_ssh_node(node, airflow_db, deployed_dag):
    from support.airflow import _conf, _states, assert_no_server_left

    cfg = node(num_shards=2, sim_tokens_per_second=2000)
    run = deployed_dag(cfg).test(run_conf=_conf(cfg))
    assert run.state == "success", _states(run)
    import pandas as pd

    df = pd.read_parquet(Path(cfg.output) / "data")
    assert sorted(df["id"]) == sorted(read_ids(ROOT / "demo" / "prompts.jsonl"))
    assert_no_server_left(cfg)
    assert os.path.exists(Path(cfg.output) / "audit" / "report.html")
