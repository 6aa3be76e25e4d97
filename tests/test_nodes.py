"""A run over several nodes without Airflow: the config, where shards go, what the page shows.
Real simulated servers on loopback, started by regen's server manager for each node."""

from __future__ import annotations

import pytest

from regen.config import ConfigError, RunConfig
from regen.placement import NoNodeAnswers, claim_node
from regen.servers.lifecycle import launch_servers, stop_recorded
from regen.status import node_balance
from regen.servers.probe import free_port_base


def nodes_config(make_config, tmp_path, **extra):
    nodes = [{"name": name, "queue": f"q-{name}", "base_port": free_port_base(1), "num_servers": 1,
              "staging_dir": str(tmp_path / f"shm-{name}"), "max_shards": 2} for name in ("a", "b")]
    return make_config(nodes=nodes, **extra)


def test_a_node_overrides_the_run_and_a_bad_node_is_named():
    cfg = RunConfig(num_servers=3, nodes=[{"name": "a", "num_servers": 1}, {"name": "b"}])
    assert cfg.for_node("a").servers.num_servers == 1 and cfg.for_node("b").servers.num_servers == 3
    assert cfg.for_node("a").layout.servers != cfg.for_node("b").layout.servers != cfg.layout.servers
    with pytest.raises(ConfigError, match=r"nodes: b: extra_server_args: .*'\$\(reboot\)'"):
        RunConfig.from_mapping({"nodes": [{"name": "a"}, {"name": "b", "extra_server_args": ["$(reboot)"]}]})
    with pytest.raises(ConfigError, match="each node needs its own name"):
        RunConfig.from_mapping({"nodes": [{"name": "a"}, {"name": "a"}]})
    with pytest.raises(ConfigError, match="nodes.0.gpu: unknown field|field 'nodes.0.gpu'"):
        RunConfig.from_mapping({"nodes": [{"name": "a", "gpu": [0]}]})


def test_shards_claim_the_node_with_room_and_never_a_silent_one(make_config, tmp_path):
    cfg = nodes_config(make_config, tmp_path)
    a = cfg.for_node("a")
    launch_servers(a, a.model_path)  # node b's servers never started: it does not answer
    try:
        with claim_node(cfg, [0]) as first, claim_node(cfg, [1]) as second:
            assert first.name == second.name == "a"
            # Node a's two slots are taken and node b is silent: a third shard waits, then gives up.
            with pytest.raises(NoNodeAnswers, match="no node of this run answers"):
                stop_recorded(a.layout, every=True)
                with claim_node(cfg, [2], give_up_after_s=0):
                    pass
        b = cfg.for_node("b")
        launch_servers(a, a.model_path)
        launch_servers(b, b.model_path)
        with claim_node(cfg, [0]) as first, claim_node(cfg, [1]) as second:
            assert {first.name, second.name} == {"a", "b"}  # each takes the node with the most room
    finally:
        for name in ("a", "b"):
            stop_recorded(cfg.for_node(name).layout, every=True)


def test_the_cli_without_node_claims_any_node_and_with_node_only_that_one(make_config, tmp_path):
    """`regen generate --shard N` without --node claims a node of the run like a DAG shard (it had
    pinned every command to the first node, so bench_nodes put every row there); with --node it
    generates there. Node a's slots are held here: the command goes to b."""
    import subprocess

    import pyarrow.parquet as pq

    from support.paths import BIN

    def cli(*args: str) -> list[str]:
        return [str(BIN / "regen"), "--no-progress-bar", *args]

    nodes = [{"name": name, "base_port": free_port_base(1), "num_servers": 1, "max_shards": 1} for name in ("a", "b")]
    cfg = make_config(nodes=nodes, num_shards=2, stage_weights=False)
    config = tmp_path / "run.yaml"
    config.write_text(cfg.to_yaml())
    for name in ("a", "b"):
        launch_servers(cfg.for_node(name), cfg.model_path)
    try:
        assert subprocess.run(cli("preflight", "--config", str(config)), capture_output=True).returncode == 0
        with claim_node(cfg, [9]) as held:
            assert held.name == "a"
            done = subprocess.run(cli("generate", "--config", str(config), "--shard", "0"), capture_output=True,
                                  text=True, timeout=120)
        assert done.returncode == 0, done.stderr[-2000:]
        assert "shard 0 generates on node b" in done.stderr
        done = subprocess.run(cli("generate", "--config", str(config), "--shard", "1", "--node", "a"),
                              capture_output=True, text=True, timeout=120)
        assert done.returncode == 0 and "shard 1 generates on node a" in done.stderr, done.stderr[-2000:]
        ports = {name: cfg.for_node(name).servers.base_port for name in ("a", "b")}
        servers = pq.read_table(f"{cfg.output}/data", columns=["id", "server"]).to_pylist()
        on = {name: sum(r["server"].endswith(f":{port}") for r in servers) for name, port in ports.items()}
        assert on["a"] and on["b"] and on["a"] + on["b"] == len(servers)
    finally:
        for name in ("a", "b"):
            stop_recorded(cfg.for_node(name).layout, every=True)


def test_balance_counts_each_nodes_busy_time_once():
    shards = {
        "shard-00000": {"node": "a", "started_at": 0.0, "updated": 10.0, "tokens": 1000},
        "shard-00001": {"node": "a", "started_at": 5.0, "updated": 20.0, "tokens": 1000},  # overlaps
        "shard-00002": {"node": "b", "started_at": 0.0, "updated": 20.0, "tokens": 1000},
    }
    balance = node_balance(shards)
    assert balance["nodes"]["a"] == {"tokens": 2000, "busy_s": 20.0, "tokens_per_s": 100.0}
    assert balance["nodes"]["b"]["tokens_per_s"] == 50.0
    assert balance["makespan_s"] == 20.0 and balance["ideal_s"] == 20.0  # 3000 tokens at 150 tok/s


def test_a_trigger_cannot_change_the_dags_nodes(make_config, tmp_path):
    """Each node's tasks go to its queue when the DAG is parsed: preflight refuses other nodes."""
    from regen.preflight import PreflightFailed, preflight

    cfg = nodes_config(make_config, tmp_path)
    with pytest.raises(PreflightFailed, match=r"nodes \['a', 'b'\] differ from the nodes this DAG was built for"):
        preflight(cfg, code=False, dag_nodes=["a"])
    assert preflight(cfg, code=False, dag_nodes=["a", "b"]).shards
    one = make_config(queue="gpu-b")  # a one-node DAG built for gpu-a's queue: its tasks go there
    with pytest.raises(PreflightFailed, match="queue 'gpu-b' differs from the queue this DAG was built for 'gpu-a'"):
        preflight(one, code=False, dag_nodes=[], dag_queue="gpu-a")
    with pytest.raises(ConfigError, match="queue: a run over several nodes takes each node's own queue"):
        RunConfig.from_mapping({"queue": "gpu-a", "nodes": [{"name": "a"}]})


def test_a_task_on_the_wrong_worker_touches_none_of_the_nodes_servers(make_config, monkeypatch):
    """Two worker hosts, simulated by two node names on one machine (the PIDs recorded on gpu-a
    are live here, so any signal from "gpu-b" would show). Everything that runs on gpu-b (a
    shard, a start, a relaunch, a teardown, the watchdog) fails at once naming both machines or
    leaves the servers alone: no signal, no record rewritten. gpu-a's own teardown stops them."""
    from regen.pipeline import run
    from regen.servers.lifecycle import ServerError, relaunch
    from regen.servers.probe import is_healthy
    from regen.servers.watchdog import watch

    cfg = make_config(num_servers=2)
    layout = cfg.layout
    monkeypatch.setenv("REGEN_NODE_NAME", "gpu-a")
    run("preflight", cfg, code=False)
    records = launch_servers(cfg, cfg.model_path, run_id="dag/run-1")
    state = layout.servers_state.read_bytes()

    monkeypatch.setenv("REGEN_NODE_NAME", "gpu-b")
    with pytest.raises(ServerError, match="servers run on node gpu-a; this task runs on gpu-b"):
        run("generate", cfg, shards=[0], run_id="dag/run-1")
    with pytest.raises(ServerError, match="gpu-a.*gpu-b"):
        launch_servers(cfg, cfg.model_path, run_id="dag/run-1")
    with pytest.raises(ServerError, match="gpu-a.*gpu-b"):
        relaunch(layout, 0)
    assert stop_recorded(layout, run_id="dag/run-1", every=True)[0] == 0
    assert "recorded on node gpu-a" in watch(layout, idle_shutdown_s=0.1, poll_s=0.05)
    assert layout.servers_state.read_bytes() == state
    assert not list(cfg.layout.data.glob("*.parquet"))
    for record in records:
        assert is_healthy(record.url)
        monkeypatch.setenv("REGEN_NODE_NAME", "gpu-a")
        assert record.running()
        monkeypatch.setenv("REGEN_NODE_NAME", "gpu-b")

    monkeypatch.setenv("REGEN_NODE_NAME", "gpu-a")
    assert stop_recorded(layout, run_id="dag/run-1")[0] == 2
    assert not any(is_healthy(r.url) for r in records)
