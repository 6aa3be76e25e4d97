"""What regen acts on comes only from regen: the code its children run (never a ``regen.py``
planted where they work), the servers' records (sealed on every node that reads them, the
watchdog's own copy when the output's is lost)."""

from __future__ import annotations

import pytest

from regen.layout import RunLayout
from regen.servers.lifecycle import launch_servers, stop_records


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
    assert check_code() == []
    assert call_bounded("regen.childpool:_nothing", (), 60, 2 << 30) is None
    records = launch_servers(cfg, cfg.model_path, run_id="dag/run")  # a key: through its log relay
    try:
        assert records[0].api_key and records[0].running()
    finally:
        stop_records(records, grace_s=5)
    assert not marker.exists()


def test_a_lost_or_edited_servers_json_orphans_no_server(make_config):
    """servers.json changed by one byte, then deleted: the teardown still stops every server, and
    a watchdog whose servers go idle still stops them (its records are its own private copy)."""
    from regen.servers.lifecycle import stop_recorded
    from support.processes import wait_until

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
