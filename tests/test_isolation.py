"""What regen acts on comes only from regen: the code its children run (never a ``regen.py``
planted where they work), the servers' records (sealed on every node that reads them, the
watchdog's own copy when the output's is lost), and what the servers are handed."""

from __future__ import annotations

import contextlib
import os
import sys
from pathlib import Path

import pytest

from regen.layout import RunLayout
from regen.servers.lifecycle import launch_servers, stop_records
from support.processes import wait_until


def test_no_child_regen_starts_imports_a_regen_py_planted_where_it_works(make_config, tmp_path, monkeypatch):
    """A ``regen.py`` in the output's servers folder (any writer of the share) or in the folder
    regen is run from (a world-writable temp folder): the code check, a bounded child, the
    servers' log relays and the watchdog all start, and none of them runs it."""
    from regen.childpool import call_bounded
    from regen.preflight.code import check_code

    marker = tmp_path / "planted-code-ran"
    plant = f"import pathlib\npathlib.Path({str(marker)!r}).write_text('ran')\n"
    cfg = make_config(num_servers=1)
    layout = RunLayout(cfg.output)
    layout.servers.mkdir(parents=True, exist_ok=True)
    (layout.servers / "regen.py").write_text(plant)
    shared_tmp = tmp_path / "shared-tmp"
    shared_tmp.mkdir()
    (shared_tmp / "regen.py").write_text(plant)
    monkeypatch.chdir(shared_tmp)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "cloud-secret-" + "s" * 20)
    monkeypatch.setenv("AIRFLOW_CONN_WAREHOUSE", "postgres://u:db-password@db/x")
    assert check_code() == []
    assert call_bounded("regen.childpool:_nothing", (), 60, 2 << 30) is None
    records = launch_servers(cfg, cfg.model_path, run_id="dag/run")  # a key: through its log relay
    try:
        assert records[0].api_key and records[0].running()
        environ = Path(f"/proc/{records[0].pid}/environ").read_bytes()
        assert b"cloud-secret-" not in environ and b"db-password" not in environ  # a server gets what it needs
    finally:
        stop_records(records, grace_s=5)
    assert not marker.exists()


def test_a_lost_or_edited_servers_json_orphans_no_server(make_config):
    """servers.json changed by one byte, then deleted: the teardown still stops every server, and
    a watchdog whose servers go idle still stops them (its records are its own private copy)."""
    from regen.servers.lifecycle import stop_recorded

    cfg = make_config(num_servers=1, idle_shutdown_s=1)
    layout = RunLayout(cfg.output)
    records = launch_servers(cfg, cfg.model_path, run_id="dag/run")
    try:
        state = layout.servers_state.read_bytes()
        layout.servers_state.write_bytes(state.replace(b'"port": ', b'"port":  ', 1))
        assert stop_recorded(layout, run_id="dag/run")[0] == 1 and not records[0].running()
        records = launch_servers(cfg, cfg.model_path, run_id="dag/run")
        layout.servers_state.unlink()
        wait_until(lambda: not records[0].running(), timeout=60, what="the watchdog's idle shutdown")
    finally:
        stop_records(records, grace_s=5)


def test_a_record_of_another_node_counts_only_with_its_mac_under_the_runs_key(make_config, tmp_path):
    """Node gpu-b's record, edited on the share to point at a listener of the attacker's: the
    shards of gpu-a see no server there (and say so), and the listener never hears the key."""
    import http.server
    import json
    import threading

    from regen.errors import RegenError
    from regen.placement import node_answers, servers_for
    from regen.servers.records import ServerRecord, read_state, write_state

    heard: list[str] = []

    class Listener(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 (http.server's name)
            heard.append(self.headers.get("Authorization", ""))
            self.send_response(200)
            self.end_headers()

        do_POST = do_GET

        def log_message(self, *args):
            pass

    listener = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Listener)
    threading.Thread(target=listener.serve_forever, daemon=True).start()
    key = "run-key-" + "k" * 32
    cfg = make_config(num_servers=1, api_key=key, nodes=[{"name": "gpu-b", "num_servers": 1}])
    node_b = cfg.for_node("gpu-b")
    records = launch_servers(cfg, cfg.model_path, run_id="dag/run")
    try:
        theirs = ServerRecord(0, None, "127.0.0.1", records[0].port, 1, "/dev/null", key, node="gpu-b", owner="dag/run")
        write_state(node_b.layout, [theirs])
        assert [r.port for r in read_state(node_b.layout, key)] == [records[0].port]
        assert node_answers(node_b)
        doc = json.loads(node_b.layout.servers_state.read_text())
        doc["servers"][0]["port"] = listener.server_address[1]
        node_b.layout.servers_state.write_text(json.dumps(doc))
        assert read_state(node_b.layout, key) == []
        assert not node_answers(node_b)
        with pytest.raises(RegenError, match="no servers recorded"):
            servers_for(node_b, "dag/run")
        assert heard == []
    finally:
        listener.shutdown()
        stop_records(records, grace_s=5)


def test_a_retry_reattaches_only_to_the_job_regen_started_never_to_a_decoy(tmp_path):
    """The node's launch script, run by a shell as SSH runs it: while the job lives a second
    launch attaches to it; once it died without an exit file, a decoy at its recorded PID whose
    command line names the job is not it, and a new job starts."""
    import signal
    import subprocess

    from regen.remote import launch_script

    folder = tmp_path / "jobs" / "0123456789abcdef01234567"
    script = launch_script(str(folder), ["sleep", "60"], str(tmp_path / "config.json"), "result-marker")

    def launch() -> str:
        return subprocess.run(["sh", "-c", script], capture_output=True, text=True, timeout=30).stdout.strip()

    assert launch() == "launched"
    job = int((folder / "pid").read_text())
    decoy = None
    try:
        assert launch() == "attached" and int((folder / "pid").read_text()) == job
        os.killpg(job, signal.SIGKILL)  # stopped without its exit file, as a SIGTERM'd stop can leave it
        wait_until(lambda: not Path(f"/proc/{job}").exists() or "Z" in Path(f"/proc/{job}/stat").read_text().split(")")[1][:3],
                   timeout=10)
        decoy = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", str(folder)], start_new_session=True)
        (folder / "pid").write_text(f"{decoy.pid}\n")
        wait_until(lambda: folder.name in Path(f"/proc/{decoy.pid}/cmdline").read_text(), timeout=10)  # the old test
        assert launch() == "launched" and int((folder / "pid").read_text()) != decoy.pid
    finally:
        for pid in {job, int((folder / "pid").read_text())}:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pid, signal.SIGKILL)
        if decoy:
            decoy.kill()
            decoy.wait()
