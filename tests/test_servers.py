"""Server manager with real processes and ports: launch, health, failures, teardown, re-entry."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time

import pytest

from regen.layout import RunLayout
from regen.procs import session_pids
from regen.servers.lifecycle import ServerError, build_command, port_is_free, start_servers, stop_records, stop_servers
from regen.servers.records import ServerRecord
from support.processes import processes_with_args


def test_start_health_and_stop_leave_no_process_or_port(make_config):
    cfg = make_config(num_servers=2)
    records = start_servers(cfg, cfg.model_path)
    assert [r.port for r in records] == [cfg.servers.base_port, cfg.servers.base_port + 1]
    assert all(session_pids(r.pid) for r in records)
    layout = RunLayout(cfg.output)
    assert all(layout.server_log(r.index).exists() for r in records)
    assert oct(layout.servers_state.stat().st_mode & 0o777) == "0o600"  # API key
    assert stop_servers(layout)[0] == 2
    for r in records:
        assert session_pids(r.pid) == []
        assert port_is_free(cfg.servers.host, r.port)
    assert stop_servers(layout)[0] == 0  # a second teardown is harmless


def test_start_is_idempotent_and_reuses_healthy_servers(sim_servers):
    cfg, first = sim_servers(num_servers=2)
    stop_records([first[1]], grace_s=5)  # one server died
    second = start_servers(cfg, cfg.model_path)
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
            start_servers(cfg, cfg.model_path)
        assert time.monotonic() - started < 2
    assert processes_with_args("--port", str(cfg.servers.base_port)) == []  # nothing was launched


def test_a_server_that_crashes_while_starting_fails_with_its_log_tail(make_config, tmp_path):
    cfg = make_config(num_servers=2, startup_timeout_s=600)
    started = time.monotonic()
    with pytest.raises(ServerError) as err:
        start_servers(cfg, str(tmp_path / "no-model-here"))
    assert time.monotonic() - started < 10
    assert "exited with code 1 while starting" in str(err.value)
    assert "no config.json" in str(err.value)  # the log's last lines
    for i in range(2):  # the sibling that might have come up is stopped too
        assert processes_with_args("--port", str(cfg.servers.base_port + i)) == []


def test_teardown_kills_children_that_ignore_sigterm(make_config):
    cfg = make_config(num_servers=1, extra_server_args=["--sim-orphan-child"])
    records = start_servers(cfg, cfg.model_path)
    assert len(session_pids(records[0].pid)) == 3  # the log relay, the server and its stubborn child
    left = stop_records(records, grace_s=1)
    assert left == []
    assert session_pids(records[0].pid) == []


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
    records = start_servers(cfg, cfg.model_path)
    try:
        assert records[0].launch[records[0].launch.index("--model-path") + 1] == str(evil)
    finally:
        stop_servers(RunLayout(cfg.output))
    assert not list(tmp_path.rglob("PWNED*"))
    assert not list(RunLayout(cfg.output).servers.rglob("PWNED*"))


def test_sglang_and_vllm_commands_carry_the_launch_options(make_config):
    cfg = make_config(engine="sglang", speculative_algorithm="NEXTN", speculative_num_steps=3,
                      speculative_eagle_topk=1, speculative_num_draft_tokens=4,
                      max_mamba_cache_size=80, mem_fraction_static=0.85, max_running_requests=48,
                      extra_server_args=["--tp-size", "1"])
    argv = build_command(cfg, "/dev/shm/m", 30001, "k" * 16)
    assert argv[1:3] == ["-m", "sglang.launch_server"]
    pairs = dict(zip(argv[3::1], argv[4::1]))
    for flag, value in {"--model-path": "/dev/shm/m", "--port": "30001", "--api-key": "k" * 16,
                        "--reasoning-parser": "qwen3", "--speculative-algorithm": "NEXTN",
                        "--speculative-num-steps": "3", "--speculative-eagle-topk": "1",
                        "--speculative-num-draft-tokens": "4", "--max-mamba-cache-size": "80",
                        "--mem-fraction-static": "0.85", "--max-running-requests": "48",
                        "--host": "127.0.0.1", "--tp-size": "1"}.items():
        assert pairs[flag] == value, flag
    assert "--enable-metrics" in argv
    vllm = build_command(cfg.model_copy(update={"engine": "vllm", "max_mamba_cache_size": None}),
                         "/m", 30001, None)
    assert vllm[1:3] == ["-m", "vllm.entrypoints.openai.api_server"]
    assert vllm[vllm.index("--max-num-seqs") + 1] == "48"
    assert '"method": "mtp"' in vllm[vllm.index("--speculative-config") + 1]


def test_a_vllm_server_on_the_cpu_runs_its_model_in_the_engine_core_and_the_node_can_override(monkeypatch):
    """vLLM's worker process spins against its engine core on a small CPU machine and starves the
    front end (bench/RESULTS.md): a CPU server runs without it, a GPU server as vLLM chooses, and a
    value the node sets itself wins."""
    from regen.engines import engine
    from regen.servers.lifecycle import server_env

    vllm = engine("vllm")
    assert vllm.launch_env(None) == {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    assert vllm.launch_env(0) == {} and engine("sglang").launch_env(None) == {} == engine("sim").launch_env(None)
    monkeypatch.delenv("VLLM_ENABLE_V1_MULTIPROCESSING", raising=False)
    assert server_env(None, vllm.launch_env(None))["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0"
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "1")
    assert server_env(None, vllm.launch_env(None))["VLLM_ENABLE_V1_MULTIPROCESSING"] == "1"
    assert server_env(3, vllm.launch_env(3))["CUDA_VISIBLE_DEVICES"] == "3"


FAKE_SMI = "#!/bin/sh\nprintf '0\\n1\\n2\\n3\\n4\\n5\\n6\\n7\\n'\n"


@pytest.mark.parametrize("mask, gpus, expected", [
    (None, None, [str(i) for i in range(8)]),  # no mask: every GPU nvidia-smi lists
    ("4,5,6,7", None, ["4", "5", "6", "7"]),  # a scheduler's mask: those and only those
    ("4,5,6,7", [1, 3], ["5", "7"]),  # gpus picks among them by position
    ("GPU-aa11,GPU-bb22", None, ["GPU-aa11", "GPU-bb22"]),  # UUIDs kept as the mask spells them
    ("MIG-1c2d", None, ["MIG-1c2d"]),
    ("", None, [None, None]),  # masked to nothing: CPU servers (num_servers)
])
def test_servers_run_on_the_gpus_the_worker_was_given(make_config, tmp_path, monkeypatch, mask, gpus, expected):
    """A fake nvidia-smi lists 8 GPUs, as it does whatever the mask; each server's GPU comes from
    the worker's CUDA_VISIBLE_DEVICES, and is what that server's own CUDA_VISIBLE_DEVICES becomes."""
    from regen.servers.gpus import server_slots
    from regen.servers.lifecycle import server_env

    smi = tmp_path / "bin" / "nvidia-smi"
    smi.parent.mkdir()
    smi.write_text(FAKE_SMI)
    smi.chmod(0o755)
    monkeypatch.setenv("PATH", f"{smi.parent}:{os.environ['PATH']}")
    if mask is None:
        monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    else:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", mask)
    cfg = make_config(engine="sglang", gpus=gpus, num_servers=2)
    slots = server_slots(cfg)
    assert slots == expected
    assert [server_env(s).get("CUDA_VISIBLE_DEVICES") for s in slots if s is not None] == [s for s in expected if s]


def test_a_gpu_the_worker_was_not_given_is_refused_by_preflight(make_config, monkeypatch):
    from regen.preflight import run_preflight

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5")
    problems = run_preflight(make_config(gpus=[0, 2]), code=False).problems
    assert "gpus [0, 2]: this worker was given 2 GPU(s) (4,5); no GPU at position(s) [2]" in problems
