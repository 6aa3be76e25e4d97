"""Server manager with real processes and ports: launch, health, failures, teardown, re-entry."""

from __future__ import annotations

import os
import shlex
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from regen.layout import RunLayout
from regen.procs import session_pids
from regen.servers.lifecycle import ServerError, launch_servers, stop_records, stop_recorded
from regen.servers.plan import build_command
from regen.servers.probe import port_is_free
from regen.servers.records import ServerRecord
from support.processes import processes_with_args


def test_start_health_and_stop_leave_no_process_or_port(make_config):
    cfg = make_config(num_servers=2)
    records = launch_servers(cfg, cfg.model_path)
    assert [r.port for r in records] == [cfg.servers.base_port, cfg.servers.base_port + 1]
    assert all(session_pids(r.pid) for r in records)
    layout = RunLayout(cfg.output)
    assert all(layout.server_log(r.index).exists() for r in records)
    assert oct(layout.servers_state.stat().st_mode & 0o777) == "0o600"  # API key
    assert stop_recorded(layout)[0] == 2
    for r in records:
        assert session_pids(r.pid) == []
        assert port_is_free(cfg.servers.host, r.port)
    assert stop_recorded(layout)[0] == 0  # a second teardown is harmless
    from regen.servers.lifecycle import server_logs

    after = server_logs(cfg, lines=5)  # a post-mortem after teardown still reads what they wrote
    assert after.servers == 2 and "server-0 (stopped)" in after.logs and "server-1 (stopped)" in after.logs
    assert layout.server_log(0).read_text().splitlines()[-1] in after.logs


def test_start_is_idempotent_and_reuses_healthy_servers(sim_servers):
    cfg, first = sim_servers(num_servers=2)
    stop_records([first[1]], grace_s=5)  # one server died
    second = launch_servers(cfg, cfg.model_path)
    assert second[0].pid == first[0].pid  # healthy: reused
    assert second[1].pid != first[1].pid  # gone: restarted
    assert second[1].api_key == first[0].api_key  # one key for the run


def test_a_taken_port_fails_fast_naming_it(make_config):
    cfg = make_config(num_servers=2)
    with socket.socket() as sock:
        sock.bind((cfg.servers.host, cfg.servers.base_port + 1))
        sock.listen()
        started = time.monotonic()
        with pytest.raises(ServerError, match=f"port {cfg.servers.base_port + 1} on 127.0.0.1 already in use"):
            launch_servers(cfg, cfg.model_path)
        assert time.monotonic() - started < 2
    assert processes_with_args("--port", str(cfg.servers.base_port)) == []  # nothing was launched


def test_a_server_that_crashes_while_starting_fails_with_its_log_tail(make_config, tmp_path):
    cfg = make_config(num_servers=2, startup_timeout_s=600)
    started = time.monotonic()
    with pytest.raises(ServerError) as err:
        launch_servers(cfg, str(tmp_path / "no-model-here"))
    assert time.monotonic() - started < 10
    assert "exited with code 1 while starting" in str(err.value)
    assert "no config.json" in str(err.value)  # the log's last lines
    for i in range(2):  # the sibling that might have come up is stopped too
        assert processes_with_args("--port", str(cfg.servers.base_port + i)) == []


def test_teardown_kills_children_that_ignore_sigterm(make_config):
    cfg = make_config(num_servers=1, extra_server_args=["--sim-orphan-child"])
    records = launch_servers(cfg, cfg.model_path)
    assert len(session_pids(records[0].pid)) == 2  # the server and its stubborn child (the log relay is apart)
    left = stop_records(records, grace_s=1)
    assert left == []
    assert session_pids(records[0].pid) == []


def test_the_recorded_pid_is_the_server_and_its_log_relay_can_die(make_config):
    """A full disk or a stray kill ends the log relay, never the server: the recorded process is
    the server itself, still running and reused afterwards (a relaunch would cost minutes of
    loading on a GPU node)."""
    cfg = make_config(num_servers=1)
    records = launch_servers(cfg, cfg.model_path)
    try:
        cmdline = open(f"/proc/{records[0].pid}/cmdline", "rb").read().split(b"\0")
        assert b"sim" in cmdline and b"regen.logrelay" not in cmdline
        relays = processes_with_args("regen.logrelay", records[0].log_path)
        assert len(relays) == 1
        os.kill(relays[0], 9)
        assert records[0].running()
        again = launch_servers(cfg, cfg.model_path)
        assert again[0].pid == records[0].pid
    finally:
        stop_recorded(RunLayout(cfg.output))


def test_the_log_relay_survives_a_full_disk_and_says_what_it_lost(tmp_path):
    """/dev/full fails every write with ENOSPC: the relay still drains the server's pipe to the
    end (a server writing to a pipe nobody reads would block), and once writing works again
    the log says how much was lost."""
    from regen.logrelay import LogWriter

    proc = subprocess.run([sys.executable, "-m", "regen.logrelay", "/dev/full"], input=b"x" * (1 << 20),
                          capture_output=True, timeout=60)
    assert proc.returncode == 0
    writer = LogWriter(os.open("/dev/full", os.O_WRONLY))
    writer.write(b"lost line\n")
    writer.log_fd = os.open(tmp_path / "log", os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    writer.write(b"next line\n")
    text = (tmp_path / "log").read_text()
    assert "10 bytes of server output lost: No space left on device" in text
    assert text.endswith("next line\n")


def test_teardown_escalates_to_sigkill_for_a_server_that_ignores_sigterm(tmp_path):
    proc = subprocess.Popen([sys.executable, "-c", "import signal, time; "
                             "signal.signal(signal.SIGTERM, signal.SIG_IGN); print('up', flush=True); "
                             "time.sleep(600)"], start_new_session=True, stdout=subprocess.PIPE)
    assert proc.stdout.readline() == b"up\n"
    record = ServerRecord(0, None, "127.0.0.1", 1, proc.pid, "/dev/null", None)
    started = time.monotonic()
    assert stop_records([record], grace_s=1) == []
    assert 1 <= time.monotonic() - started < 10
    assert proc.wait(timeout=5) == -9


def test_a_model_path_with_shell_metacharacters_runs_no_command(make_config, tiny_model, tmp_path):
    evil = tmp_path / "model; touch PWNED; $(touch PWNED2)"
    shutil.copytree(tiny_model, evil)
    cfg = make_config(num_servers=1, model_path=str(evil))
    records = launch_servers(cfg, cfg.model_path)
    try:
        assert records[0].launch[records[0].launch.index("--model-path") + 1] == str(evil)
    finally:
        stop_recorded(RunLayout(cfg.output))
    assert not list(tmp_path.rglob("PWNED*"))
    assert not list(RunLayout(cfg.output).servers.rglob("PWNED*"))


def test_sglang_and_vllm_commands_carry_the_launch_options(make_config):
    cfg = make_config(engine="sglang", speculative_algorithm="NEXTN", speculative_num_steps=3,
                      speculative_eagle_topk=1, speculative_num_draft_tokens=4,
                      max_mamba_cache_size=80, mem_fraction_static=0.85, max_running_requests=48,
                      extra_server_args=["--tp-size", "1"])
    argv = build_command(cfg, "/dev/shm/m", 30001)
    assert argv[1:3] == ["-m", "sglang.launch_server"] and "--api-key" not in argv
    pairs = dict(zip(argv[3::1], argv[4::1]))
    for flag, value in {"--model-path": "/dev/shm/m", "--port": "30001",
                        "--reasoning-parser": "qwen3", "--speculative-algorithm": "NEXTN",
                        "--speculative-num-steps": "3", "--speculative-eagle-topk": "1",
                        "--speculative-num-draft-tokens": "4", "--max-mamba-cache-size": "80",
                        "--mem-fraction-static": "0.85", "--max-running-requests": "48",
                        "--host": "127.0.0.1", "--tp-size": "1"}.items():
        assert pairs[flag] == value, flag
    assert "--enable-metrics" in argv
    vllm = build_command(cfg.model_copy(update={"engine": "vllm", "max_mamba_cache_size": None}), "/m", 30001)
    assert vllm[1:3] == ["-m", "vllm.entrypoints.openai.api_server"]
    assert vllm[vllm.index("--max-num-seqs") + 1] == "48"
    assert '"method": "mtp"' in vllm[vllm.index("--speculative-config") + 1]


def test_a_vllm_server_on_the_cpu_runs_its_model_in_the_engine_core_and_the_node_can_override(monkeypatch):
    """vLLM's worker process spins against its engine core on a small CPU machine and starves the
    front end (bench/RESULTS.md): a CPU server runs without it, a GPU server as vLLM chooses, and a
    value the node sets itself wins."""
    from regen.engines import engine
    from regen.servers.plan import server_env

    vllm = engine("vllm")
    assert vllm.launch_env(None) == {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    assert vllm.launch_env(0) == {} and engine("sglang").launch_env(None) == {} == engine("sim").launch_env(None)
    monkeypatch.delenv("VLLM_ENABLE_V1_MULTIPROCESSING", raising=False)
    assert server_env(None, vllm.launch_env(None))["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0"
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "1")
    assert server_env(None, vllm.launch_env(None))["VLLM_ENABLE_V1_MULTIPROCESSING"] == "1"
    assert server_env(3, vllm.launch_env(3))["CUDA_VISIBLE_DEVICES"] == "3"


FAKE_SMI = ("#!/bin/sh\ncase \"$*\" in *memory.total*) printf '81559\\n%.0s' 1 2 3 4 5 6 7 8 ;;\n"
            "*) printf '0\\n1\\n2\\n3\\n4\\n5\\n6\\n7\\n' ;; esac\n")


@pytest.fixture
def fake_smi(tmp_path, monkeypatch):
    """An nvidia-smi on PATH that lists 8 GPUs, as the real one does whatever the mask."""
    smi = tmp_path / "bin" / "nvidia-smi"
    smi.parent.mkdir()
    smi.write_text(FAKE_SMI)
    smi.chmod(0o755)
    monkeypatch.setenv("PATH", f"{smi.parent}:{os.environ['PATH']}")

    def mask(value: str | None) -> None:
        if value is None:
            monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
        else:
            monkeypatch.setenv("CUDA_VISIBLE_DEVICES", value)
    return mask


@pytest.mark.parametrize("mask, gpus, tp, dp, expected", [
    (None, None, 1, 1, [str(i) for i in range(8)]),  # no mask: every GPU nvidia-smi lists
    ("4,5,6,7", None, 1, 1, ["4", "5", "6", "7"]),  # a scheduler's mask: those and only those
    ("4,5,6,7", [1, 3], 1, 1, ["5", "7"]),  # gpus picks among them by position
    ("GPU-aa11,GPU-bb22", None, 1, 1, ["GPU-aa11", "GPU-bb22"]),  # UUIDs kept as the mask spells them
    ("MIG-1c2d", None, 1, 1, ["MIG-1c2d"]),
    ("", None, 1, 1, [None, None]),  # masked to nothing: CPU servers (num_servers)
    (None, None, 2, 1, ["0,1", "2,3", "4,5", "6,7"]),  # tensor parallel: a server per pair
    ("4,5,6,7", None, 2, 1, ["4,5", "6,7"]),
    ("4,5,6,7", None, 1, 2, ["4,5", "6,7"]),  # data parallel: ranks of one server
    ("4,5,6,7", None, 2, 2, ["4,5,6,7"]),
    ("GPU-a,GPU-b,GPU-c,GPU-d", [3, 2, 1, 0], 2, 1, ["GPU-d,GPU-c", "GPU-b,GPU-a"]),
    (None, [6, 7], 1, 2, ["6,7"]),
])
def test_servers_run_on_the_gpus_the_worker_was_given(make_config, fake_smi, mask, gpus, tp, dp, expected):
    """Each server's GPUs come from the worker's CUDA_VISIBLE_DEVICES (tp_size x dp_size of them,
    server i the i-th group), and are what that server's own CUDA_VISIBLE_DEVICES becomes."""
    from regen.servers.plan import server_env, server_plan

    fake_smi(mask)
    cfg = make_config(engine="sglang", gpus=gpus, num_servers=2, tp_size=tp, dp_size=dp)
    servers = server_plan(cfg).servers
    assert [s.cuda_visible_devices for s in servers] == expected
    assert [s.port for s in servers] == [cfg.servers.base_port + i for i in range(len(expected))]
    assert [server_env(s.cuda_visible_devices).get("CUDA_VISIBLE_DEVICES") for s in servers if s.cuda_visible_devices] \
        == [e for e in expected if e]
    for s in servers:  # the engine is told how to use them
        assert ("--tp-size" in s.argv) == (tp > 1) and ("--dp-size" in s.argv) == (dp > 1)
        if tp > 1:
            assert s.argv[s.argv.index("--tp-size") + 1] == str(tp)
        if dp > 1:
            assert s.argv[s.argv.index("--dp-size") + 1] == str(dp)


@pytest.mark.parametrize("mask, gpus, tp, dp, message", [
    ("4,5,6", None, 2, 1, "tp_size 2 x dp_size 1 = 2 GPUs per server: the 3 GPU(s) 4,5,6 leave 1 unused"),
    ("4,5", None, 2, 2, "tp_size 2 x dp_size 2 = 4 GPUs per server: the 2 GPU(s) 4,5 cannot hold one server"),
    ("4,5", [0, 2], 1, 1, "gpus [0, 2]: this worker was given 2 GPU(s) (4,5); no GPU at position(s) [2]"),
])
def test_a_layout_the_gpus_cannot_hold_is_refused_by_preflight(make_config, fake_smi, mask, gpus, tp, dp, message):
    from regen.preflight import run_preflight

    fake_smi(mask)
    problems = run_preflight(make_config(engine="sglang", gpus=gpus, tp_size=tp, dp_size=dp), code=False).problems
    assert any(p.startswith(message) for p in problems), problems


def test_serve_dry_run_prints_the_plan_and_starts_nothing(make_config, fake_smi, tmp_path):
    """`regen serve --dry-run`: one JSON document, the same plan preflight reports; no process,
    no record."""
    import json

    from regen.preflight import run_preflight

    fake_smi("2,3,4,5")
    cfg = make_config(engine="sglang", tp_size=2, api_key="a-secret-key-1234")
    path = tmp_path / "config.json"
    path.write_text(cfg.model_dump_json())
    out = subprocess.run([str(Path(sys.executable).parent / "regen"), "serve", "--config", str(path), "--dry-run", "--json"],
                         capture_output=True, text=True, timeout=120, env=os.environ)
    assert out.returncode == 0, out.stderr
    doc = json.loads(out.stdout)
    assert [(s["index"], s["port"], s["cuda_visible_devices"]) for s in doc["servers"]] == [
        (0, cfg.servers.base_port, "2,3"), (1, cfg.servers.base_port + 1, "4,5")]
    argv = doc["servers"][0]["argv"]
    assert argv[1].endswith("with_key.py") and argv[2] == "sglang.launch_server"  # as the process will show it
    served = argv[argv.index("--model-path") + 1]  # the copy staging will make, not the source
    assert cfg.stage_weights and Path(served).parent == Path(cfg.staging_dir) and served != cfg.model_path
    assert "a-secret-key-1234" not in out.stdout and "--api-key" not in argv
    assert not RunLayout(cfg.output).servers_state.exists()
    assert processes_with_args("--port", str(cfg.servers.base_port)) == []
    assert run_preflight(cfg, code=False).info["servers"] == doc["servers"]
    plan = subprocess.run([str(Path(sys.executable).parent / "regen"), "serve", "--config", str(path), "--dry-run"],
                          capture_output=True, text=True, timeout=120, env=os.environ)
    lines = plan.stdout.splitlines()  # for people: the plan first, a launch line per server to paste
    assert lines[0].startswith("2 sglang server(s)") and not plan.stdout.lstrip().startswith("{")
    assert lines[2].strip() == f"CUDA_VISIBLE_DEVICES=2,3 {shlex.join(argv)}"



def test_the_key_is_on_no_command_line_and_the_server_still_requires_it(make_config):
    """Every local user of a node reads /proc/PID/cmdline: no process of a server (its wrapper,
    the server, its children, the log relay) shows the key there, and the server refuses a
    request without it."""
    import httpx

    key = "regen-argv-test-key-" + "q7" * 10
    cfg = make_config(num_servers=1, api_key=key, extra_server_args=["--sim-orphan-child"])
    records = launch_servers(cfg, cfg.model_path)
    try:
        cmdlines = [p.read_bytes() for p in Path("/proc").glob("[0-9]*/cmdline") if _readable(p)]
        assert not [c for c in cmdlines if key.encode() in c]
        assert any(b"with_key.py" in c and b"--port" in c for c in cmdlines)  # the server is up, wrapped
        url = records[0].url
        assert httpx.get(f"{url}/v1/models", timeout=10).status_code == 401
        assert httpx.get(f"{url}/v1/models", headers={"Authorization": f"Bearer {key}"}, timeout=10).status_code == 200
        children = [pid for pid in session_pids(records[0].pid) if pid != records[0].pid]
        assert children  # the simulator's child, started after the key was taken out of the environment
        assert all(key.encode() not in Path(f"/proc/{pid}/environ").read_bytes() for pid in children)
    finally:
        stop_recorded(RunLayout(cfg.output))


def _readable(path: Path) -> bool:
    try:
        path.read_bytes()
        return True
    except OSError:
        return False


def test_keys_are_never_put_where_others_can_read_them(tmp_path, monkeypatch):
    """An existing key folder that others may read (or a symlink planted in its place) is refused,
    naming the folder and the fix; nothing is written there."""
    from regen.procs import KeyDirError
    from regen.servers.records import key_file

    shared = tmp_path / "keys"
    shared.mkdir(mode=0o755)
    shared.chmod(0o755)
    monkeypatch.setenv("REGEN_KEY_DIR", str(shared))
    with pytest.raises(KeyDirError, match=f"key folder {shared}: .*0o755.*chmod 700"):
        key_file(RunLayout(tmp_path / "out"))
    link = tmp_path / "link"
    link.symlink_to(shared)
    monkeypatch.setenv("REGEN_KEY_DIR", str(link))
    with pytest.raises(KeyDirError, match="a symlink"):
        key_file(RunLayout(tmp_path / "out"))
    assert list(shared.iterdir()) == []
    shared.chmod(0o700)
    monkeypatch.setenv("REGEN_KEY_DIR", str(shared))
    assert key_file(RunLayout(tmp_path / "out")).parent == shared


def test_the_output_folder_is_data_never_commands(make_config, tmp_path):
    """Anyone who can write the dataset's share can edit what regen records there. A record
    added or changed after regen wrote it, and a watchdog file planted in the output, change
    nothing: this node's records are regen's private copy; nothing is executed, no process of
    theirs is signalled, no file they name is opened."""
    import json

    from regen import procs
    from regen.servers.lifecycle import ensure_watchdog, relaunch, stop_watchdog
    from regen.servers.records import read_state

    cfg = make_config(num_servers=1)
    layout = RunLayout(cfg.output)
    records = launch_servers(cfg, cfg.model_path)
    bystander = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"], start_new_session=True)
    marker, victim = tmp_path / "payload-ran", tmp_path / "not-a-log"
    victim.write_text("precious\n")
    victim.chmod(0o600)
    try:
        doc = json.loads(layout.servers_state.read_text())
        planted = {**doc["servers"][0], "index": 7, "port": 39999, "pid": bystander.pid,
                   "start_ticks": procs.start_ticks(bystander.pid), "log_path": str(victim),
                   "launch": ["/bin/sh", "-c", f"touch {marker}"]}
        gone = subprocess.Popen(["true"])
        gone.wait()
        dead = {**planted, "index": 8, "pid": gone.pid, "start_ticks": None}  # a dead server: relaunched, if trusted
        edited = {**doc["servers"][0], "launch": ["/bin/sh", "-c", f"touch {marker}"]}
        layout.servers_state.write_text(json.dumps({"servers": [edited, planted, dead]}))
        assert [(r.pid, r.launch) for r in read_state(layout)] == [(records[0].pid, records[0].launch)]
        assert relaunch(layout, 7) is None and relaunch(layout, 8) is None
        assert relaunch(layout, 0).pid == records[0].pid  # the one regen started, running: nothing launched
        (layout.servers / "watchdog.json").write_text(json.dumps(
            {"pid": bystander.pid, "start_ticks": procs.start_ticks(bystander.pid), "idle_shutdown_s": 1}))
        ensure_watchdog(layout, 30)
        stop_watchdog(layout)
        stop_recorded(layout, every=True)
        assert bystander.poll() is None  # never signalled
        assert not marker.exists()
        assert victim.read_text() == "precious\n" and oct(victim.stat().st_mode & 0o777) == "0o600"
    finally:
        bystander.kill()
        bystander.wait()
        stop_records(records, grace_s=5)
