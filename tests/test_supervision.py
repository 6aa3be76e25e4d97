"""Servers as a shared, supervised resource of the node: one in-flight budget for all shards,
restarts, leases and idle shutdown, the node check, and every Airflow retry path."""

from __future__ import annotations

import fcntl
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pandas as pd
import pytest
import yaml

from regen.layout import RunLayout
from regen.pipeline import run
from regen.servers.lifecycle import launch_servers, stop_records
from regen.servers.records import read_state
from support.airflow import assert_clean_success, fault_config, shard_states, trigger_run, wait_run
from support.data import as_after_preflight, read_ids, write_prompts
from support.engines import sim_requests_total
from support.paths import BIN
from support.processes import processes_with_args, wait_until

SGLANG_MAMBA = ["--max-running-requests", "64", "--sim-effective-max-running-requests", "8"]


def peak_in_flight(url: str) -> int:
    return httpx.get(f"{url}/server_info").json()["internal_states"][0]["sim_peak_requests_in_flight"]


def test_a_data_parallel_servers_budget_is_its_ranks_times_the_per_rank_limit(sim_servers):
    """`--dp-size 2`: SGLang's /server_info has one internal state per rank, each with its own
    effective limit (8 here); the server runs 2 x 8 at once, not 8."""
    import asyncio

    from regen.dispatch import ClientTuning, discover

    cfg, records = sim_servers(num_servers=1, dp_size=2, concurrency_per_server=None, extra_server_args=SGLANG_MAMBA)
    info = httpx.get(f"{records[0].url}/server_info").json()
    per_rank = [s["effective_max_running_requests_per_dp"] for s in info["internal_states"]]
    assert info["dp_size"] == 2 and per_rank == [8, 8]
    endpoint = asyncio.run(discover(records[0].url, records[0].api_key, cfg, ClientTuning()))
    assert endpoint.size == 2 * 8 + cfg.generation.queue_margin


def test_the_limit_is_sglangs_effective_one_and_shared_by_every_shard(sim_servers, tmp_path):
    """SGLang 0.5.23 reports 64 (launch value) and 8 (effective): one generator, then four shard
    generators at once, never keep more than 8 + the queue margin in flight."""
    cfg, records = sim_servers(num_servers=1, sim_tokens_per_second=400, concurrency_per_server=None,
                               extra_server_args=SGLANG_MAMBA)
    info = httpx.get(f"{records[0].url}/server_info").json()["internal_states"][0]
    assert (info["max_running_requests"], info["effective_max_running_requests_per_dp"]) == (64, 8)
    budget = 8 + cfg.generation.queue_margin
    prompts = write_prompts(tmp_path / "p.jsonl", 120)
    base = [str(BIN / "regen"), "--no-progress-bar", "generate", "--prompts", str(prompts),
            "--endpoints", records[0].url, "--api-key", records[0].api_key]
    one = subprocess.run([*base, "--output", str(tmp_path / "one"), "--num-shards", "1"],
                         capture_output=True, text=True, timeout=300)
    assert one.returncode == 0, one.stderr[-2000:]
    assert budget - 2 <= peak_in_flight(records[0].url) <= budget  # used, and never passed

    cfg2, records2 = sim_servers(num_servers=1, sim_tokens_per_second=400, concurrency_per_server=None,
                                 extra_server_args=SGLANG_MAMBA)
    url = records2[0].url
    four = [subprocess.Popen([*base[:-4], "--endpoints", url, "--api-key", records2[0].api_key,
                              "--output", str(tmp_path / "four"), "--num-shards", "4", "--shard", str(i)],
                             stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True) for i in range(4)]
    for proc in four:
        assert proc.wait(timeout=300) == 0, proc.stderr.read()[-2000:]
    assert peak_in_flight(url) <= budget  # four shards, one budget
    df = pd.read_parquet(tmp_path / "four" / "data")
    assert len(df) == 120 and df["id"].is_unique


def test_a_shards_deadline_moves_with_its_pace_and_a_hung_one_fails_there_and_its_retry_resumes(
        sim_servers, tmp_path, caplog, monkeypatch):
    """A canary's estimate far too low (a 5 s deadline for a shard of about 10 s) fails no
    shard: the deadline moves with the shard's own pace while rows come in (it failed at the
    first deadline before). The first rows must come before it: 5 s, not 2, for a loaded CI
    machine, where they once took longer than 2 s. A server that stops answering (SIGSTOP) with rows left: no row comes in, the attempt
    fails at its last deadline with what it finished kept; the retry sends only the rest."""
    import logging

    from regen import generate
    from regen.dispatch import ClientTuning
    from regen.errors import ShardFailed
    from regen.generate import SHARD_DEADLINE_FLOOR_S, ShardRun, shard_deadline_s

    assert shard_deadline_s({"eta_s": 3600}) == 4 * 3600 and shard_deadline_s({"eta_s": 60}) == SHARD_DEADLINE_FLOOR_S
    assert shard_deadline_s(None) is None and shard_deadline_s({"eta_s": None}) is None
    tuning = ClientTuning(progress_interval_s=0.5)
    slow, slow_records = sim_servers(num_servers=1, sim_tokens_per_second=200, concurrency_per_server=4,
                                     output=str(tmp_path / "paced"))
    slow = slow.model_copy(update={"prompts": str(write_prompts(tmp_path / "paced.jsonl", 60)), "num_shards": 1})
    as_after_preflight(slow)  # the first rows in 5 s: no template probe before them, as in a DAG run
    with caplog.at_level(logging.INFO, "regen.generate"):
        paced = ShardRun(slow, [(r.url, r.api_key) for r in slow_records], 0, slow_records[0].model_fingerprint,
                         tuning, deadline_s=5).run()
    assert paced.shards[0].done == 60 and paced.seconds > 5 and "deadline moved to" in caplog.text

    # The hang, on a server twice as fast: the deadline it ends at is what the first rows' pace
    # set (about 7 s here).
    cfg, records = sim_servers(num_servers=1, sim_tokens_per_second=400, concurrency_per_server=4)
    prompts = write_prompts(tmp_path / "p.jsonl", 40)
    cfg = cfg.model_copy(update={"prompts": str(prompts), "num_shards": 1})
    endpoints = [(r.url, r.api_key) for r in records]

    monkeypatch.setattr(generate, "SHARD_DEADLINE_FACTOR", 1.0)  # the hang met sooner: seconds, not 4x them
    hung = cfg.model_copy(update={"output": str(tmp_path / "hung")})
    as_after_preflight(hung)
    server = records[0].pid
    came: list[str] = []

    def stop_at_30(row: dict) -> None:
        came.append(row["id"])
        if len(came) == 30:
            os.kill(server, signal.SIGSTOP)

    try:
        with pytest.raises(ShardFailed, match="passed its deadline of [0-9]+ s"):
            ShardRun(hung, endpoints, 0, records[0].model_fingerprint, tuning, on_row=stop_at_30, deadline_s=5).run()
    finally:
        os.kill(server, signal.SIGCONT)
    sent_first = sim_requests_total(records[0].url)
    done = ShardRun(hung, endpoints, 0, records[0].model_fingerprint, tuning).run()
    assert done.failed == 0 and done.skipped >= 30  # finished rows kept
    assert sim_requests_total(records[0].url) - sent_first <= 40 - done.skipped  # the rest only
    df = pd.read_parquet(Path(hung.output) / "data")
    assert sorted(df["id"]) == sorted(read_ids(prompts)) and df["id"].is_unique


BLOCKED_LOOP = """
import json, sys, time
from regen import generate
from regen.config import RunConfig
from regen.dispatch import ClientTuning

cfg = RunConfig.model_validate_json(sys.argv[1])
url, key, fingerprint = json.loads(sys.argv[2])
generate.LOOP_GRACE_S, generate.LOOP_CHECK_S = 1.0, 0.2

def block_the_loop(row):
    attempt.deadline_s = time.monotonic() - attempt.started  # it passes now, whatever the load
    time.sleep(600)  # a callback that never returns, on the loop: no asyncio timeout can fire

attempt = generate.ShardRun(cfg, [(url, key)], 0, fingerprint, ClientTuning(progress_interval_s=0.5),
                            on_row=block_the_loop, deadline_s=3600)
attempt.run()
"""


def test_a_shard_whose_event_loop_blocks_ends_past_its_deadline_and_its_retry_resumes(sim_servers, tmp_path):
    """The attempt's deadline is an asyncio timeout, which a blocked loop never fires: a thread
    ends the process past the deadline (its grace shortened here, the deadline set to pass as the
    loop blocks), naming the shard and the loop's stack, with the shard shown failed; the retry
    keeps the rows the journal holds. About 10 s: one sim server, a child process."""
    from regen.dispatch import ClientTuning
    from regen.generate import EXIT_LOOP_BLOCKED, ShardRun

    cfg, records = sim_servers(num_servers=1, sim_tokens_per_second=400, concurrency_per_server=4)
    prompts = write_prompts(tmp_path / "p.jsonl", 20)
    cfg = cfg.model_copy(update={"prompts": str(prompts), "num_shards": 1})
    server = json.dumps([records[0].url, records[0].api_key, records[0].model_fingerprint])
    blocked = subprocess.run([sys.executable, "-c", BLOCKED_LOOP, cfg.model_dump_json(), server],
                             capture_output=True, text=True, timeout=120)
    assert blocked.returncode == EXIT_LOOP_BLOCKED, blocked.stderr[-3000:]
    assert "shard-00000-of-00001: its event loop has been blocked past its deadline" in blocked.stderr
    assert "in block_the_loop" in blocked.stderr  # the loop's stack, where it is stuck
    shard = json.loads(cfg.layout.progress_file.read_text())["shards"]["shard-00000"]
    assert shard["state"] == "failed" and "event loop has been blocked" in shard["reason"]
    done = ShardRun(cfg, [(records[0].url, records[0].api_key)], 0, records[0].model_fingerprint,
                    ClientTuning(progress_interval_s=0.5)).run()
    assert done.failed == 0 and done.skipped >= 1  # the row the blocked attempt journaled, kept
    df = pd.read_parquet(Path(cfg.output) / "data")
    assert sorted(df["id"]) == sorted(read_ids(prompts)) and df["id"].is_unique


def test_a_server_killed_mid_shard_is_restarted_and_the_shard_completes(sim_servers, tmp_path):
    cfg, records = sim_servers(num_servers=2, sim_tokens_per_second=300, concurrency_per_server=4)
    victim = records[1]
    prompts = write_prompts(tmp_path / "p.jsonl", 240)
    cfg = cfg.model_copy(update={"prompts": str(prompts), "num_shards": 1})
    seen: list[dict] = []
    killed_at: list[int] = []

    def on_row(row):
        seen.append(row)
        if len(seen) == 20:
            os.killpg(victim.pid, signal.SIGKILL)
            killed_at.append(len(seen))

    from regen.dispatch import ClientTuning
    from regen.generate import ShardRun

    result = ShardRun(cfg, [(r.url, r.api_key) for r in records], 0, records[0].model_fingerprint,
                      ClientTuning(probe_interval_s=0.2, retry_backoff_s=0.05, all_down_timeout_s=30),
                      on_row=on_row).run()
    assert result.failed == 0 and killed_at == [20]
    restarted = next(r for r in read_state(RunLayout(cfg.output)) if r.index == victim.index)
    assert restarted.pid != victim.pid and restarted.running()
    after = [row["server"] for row in seen[40:]]
    assert victim.url in after  # serving again before the shard ended
    df = pd.read_parquet(Path(cfg.output) / "data")
    assert sorted(df["id"]) == sorted(read_ids(prompts)) and df["id"].is_unique
    log = RunLayout(cfg.output).watchdog_log.read_text()
    assert f"server {victim.index} (port {victim.port}) died; restart 1 of 3" in log


def test_abandoned_servers_stop_by_themselves(make_config, tmp_path):
    """No shard, no teardown: the watchdog stops them within idle_shutdown_s, also when they were
    started by `regen serve --config FILE`."""
    cfg = make_config(num_servers=2, idle_shutdown_s=3)
    started = time.monotonic()
    records = launch_servers(cfg, cfg.model_path)
    wait_until(lambda: read_state(RunLayout(cfg.output)) == [], 15, "idle shutdown")
    assert time.monotonic() - started < 3 + 5  # the idle time, a poll, the stop
    assert not any(r.running() for r in records)

    config = tmp_path / "serve.yaml"
    other = make_config(num_servers=1, idle_shutdown_s=3, output=str(tmp_path / "cli"))
    config.write_text(yaml.safe_dump(json.loads(other.model_dump_json())))
    served = subprocess.run([str(BIN / "regen"), "serve", "--config", str(config)], capture_output=True,
                            text=True, timeout=120)
    assert served.returncode == 0, served.stderr[-2000:]
    wait_until(lambda: read_state(RunLayout(other.output)) == [], 15, "idle shutdown")
    assert processes_with_args("--port", str(other.servers.base_port)) == []


def test_the_watchdog_watches_from_the_first_record_and_never_idles_a_loading_server(make_config, tmp_path):
    """Servers that take longer to load than idle_shutdown_s come up (the start holds a lease);
    a `regen serve` killed while they load leaves nothing: the watchdog, started with the first
    record, stops them once the start's lease is gone."""
    slow = ["--sim-startup-delay", "5"]
    cfg = make_config(num_servers=1, idle_shutdown_s=1, extra_server_args=slow)
    records = launch_servers(cfg, cfg.model_path)
    assert records[0].running()  # loaded for 5 s under a 1 s idle shutdown, and not stopped
    wait_until(lambda: read_state(RunLayout(cfg.output)) == [], 15, "idle shutdown after the start")

    # Killed while they load, under an idle shutdown of ten minutes: stopped at once, not after it.
    other = make_config(num_servers=1, idle_shutdown_s=600, output=str(tmp_path / "killed"),
                        extra_server_args=["--sim-startup-delay", "600"])
    config = tmp_path / "serve.yaml"
    config.write_text(yaml.safe_dump(json.loads(other.model_dump_json())))
    serve = subprocess.Popen([str(BIN / "regen"), "serve", "--config", str(config)], stdout=subprocess.DEVNULL,
                             stderr=subprocess.DEVNULL)
    layout = RunLayout(other.output)
    wait_until(lambda: read_state(layout) != [], 60, "the server recorded")
    server = read_state(layout)[0]
    serve.kill()
    serve.wait(timeout=10)
    wait_until(lambda: read_state(layout) == [], 20, "the watchdog stopping the orphaned server")
    assert not server.running()
    assert processes_with_args("--port", str(other.servers.base_port)) == []


NFS_SHIM = r"""
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <fcntl.h>
#include <sys/file.h>
/* NFSv4 turns flock() into a POSIX lock, and an exclusive one needs a descriptor open for
   writing: on a read-only one the server answers EBADF. Local filesystems do not care. */
int flock(int fd, int op) {
    static int (*real)(int, int);
    if (!real) real = (int (*)(int, int))dlsym(RTLD_NEXT, "flock");
    if ((op & LOCK_EX) && (fcntl(fd, F_GETFL) & O_ACCMODE) == O_RDONLY) { errno = EBADF; return -1; }
    return real(fd, op);
}
"""


def test_leases_and_slots_work_where_exclusive_locks_need_a_writable_descriptor(make_config, tmp_path,
                                                                                 monkeypatch):
    """NFSv4's rule, brought to a local disk by an LD_PRELOAD shim around flock(): every process of
    the run (servers, watchdog, a shard with its leases, request slots and shard lock) under it.
    The shard completes, and the watchdog, which tests every lease each second, is still alive
    and never logged a failure."""
    shim = tmp_path / "nfs_flock.so"
    (tmp_path / "nfs_flock.c").write_text(NFS_SHIM)
    subprocess.run(["gcc", "-shared", "-fPIC", "-o", str(shim), str(tmp_path / "nfs_flock.c"), "-ldl"],
                   check=True, capture_output=True)
    monkeypatch.setenv("LD_PRELOAD", str(shim))
    probe = subprocess.run([sys.executable, "-c", "import fcntl, os, sys; fd = os.open(sys.argv[1], os.O_RDONLY)\n"
                            "try:\n fcntl.flock(fd, fcntl.LOCK_EX)\nexcept OSError as e: print(e.errno)",
                            str(shim)], capture_output=True, text=True)
    assert probe.stdout.strip() == "9"  # EBADF: the shim behaves as NFSv4

    cfg = make_config(num_servers=2, num_shards=1, idle_shutdown_s=300, sim_tokens_per_second=2000)
    records = launch_servers(cfg, cfg.model_path)
    layout = RunLayout(cfg.output)
    config = tmp_path / "run.yaml"
    config.write_text(yaml.safe_dump(json.loads(cfg.model_dump_json())))
    for argv in (["preflight", "--skip-code"], ["generate", "--shard", "0"]):
        out = subprocess.run([str(BIN / "regen"), "--no-progress-bar", *argv, "--config", str(config)],
                             capture_output=True, text=True, timeout=300)
        assert out.returncode == 0, out.stderr[-3000:]
    df = pd.read_parquet(Path(cfg.output) / "data")
    assert len(df) == len(read_ids(cfg.prompts)) and df["error"].isna().all()
    from regen.servers.records import watchdog_file

    watchdog = json.loads(watchdog_file(layout).read_text())
    assert os.path.exists(f"/proc/{watchdog['pid']}")
    log = layout.watchdog_log.read_text()
    assert "Traceback" not in log and "cannot be tested" not in log and "cannot be opened" not in log
    stop_records(records, grace_s=5)


def test_a_shard_that_finds_no_servers_brings_them_up_itself(make_config):
    """After the teardown ran (a run cleared with only failed), a DAG shard starts the servers
    through the same code as start_servers; the audit's stop then leaves none running."""
    cfg = make_config(num_servers=2, num_shards=2)
    result = run("generate", cfg, shards=[1], run_id="dag/cleared-run")
    assert result.failed == 0 and result.done == result.total
    records = read_state(RunLayout(cfg.output))
    assert len(records) == 2 and {r.owner for r in records} == {"dag/cleared-run"}
    stop_records(records, grace_s=5)


# --- under a real scheduler: every Airflow retry path -----------------------------------------

@pytest.mark.slow
def test_failed_shards_resume_from_either_clear_the_ui_offers(airflow, make_config, tmp_path):
    base, headers = airflow["base"], {"Authorization": f"Bearer {airflow['token']}"}
    api = httpx.Client(base_url=f"{base}/api/v2", headers=headers, timeout=30)

    # (a) the run's Clear, "only failed" ticked: start_servers and stop_servers stay succeeded.
    cfg, fault = fault_config(make_config, tmp_path, "run-clear")
    run_id = trigger_run(api, cfg, airflow["config_dir"])
    assert wait_run(api, run_id, 300) == "failed"
    failed = [k for k, v in shard_states(api, run_id).items() if k[0] == "generate" and v == "failed"]
    assert failed and shard_states(api, run_id)[("stop_servers", -1)] == "success"
    fault.unlink()  # the cause goes away
    cleared = api.post(f"/dags/regenerate_dataset/dagRuns/{run_id}/clear",
                       json={"dry_run": False, "only_failed": True})
    assert cleared.status_code == 200, cleared.text
    assert_clean_success(api, run_id, cfg)
    assert shard_states(api, run_id)[("start_servers", -1)] == "success"

    # (b) the task's Clear with its defaults (downstream included, not only failed).
    cfg, fault = fault_config(make_config, tmp_path, "task-clear")
    run_id = trigger_run(api, cfg, airflow["config_dir"])
    assert wait_run(api, run_id, 300) == "failed"
    failed = [k for k, v in shard_states(api, run_id).items() if k[0] == "generate" and v == "failed"]
    fault.unlink()
    # One request for every failed shard: each clear with downstream included takes in the
    # teardown and so its setup, start_servers, which a later request could clear again while it
    # runs (a reading of the b8f1605 failure; an API-server stall fits its log better).
    body = {"dry_run": False, "dag_run_id": run_id, "task_ids": [["generate", shard[1]] for shard in failed],
            "include_downstream": True, "include_upstream": False, "only_failed": False, "reset_dag_runs": True}
    cleared = api.post("/dags/regenerate_dataset/clearTaskInstances", json=body)
    assert cleared.status_code == 200, cleared.text
    assert_clean_success(api, run_id, cfg)


@pytest.mark.slow
def test_a_person_approves_or_rejects_the_run_after_the_canary(airflow, make_config, tmp_path):
    """approve_after_canary under a real scheduler, answered through the REST API as the UI's
    human-in-the-loop form does: approve (after longer than idle_shutdown_s: the servers wait
    for the answer), the shards run on them; reject, the run stops before generation with no
    server left. About a minute."""
    base, headers = airflow["base"], {"Authorization": f"Bearer {airflow['token']}"}
    api = httpx.Client(base_url=f"{base}/api/v2", headers=headers, timeout=30)

    def answer(run_id: str, option: str, pending_for_s: float = 0.0) -> None:
        path = f"/dags/regenerate_dataset/dagRuns/{run_id}/taskInstances/approve/-1/hitlDetails"
        asked = ("awaiting_input", "failed", "upstream_failed", "skipped")  # Airflow 3.3's HITL state
        wait_until(lambda: shard_states(api, run_id).get(("approve", -1)) in asked, 300, "the approval asked")
        assert shard_states(api, run_id)[("approve", -1)] == "awaiting_input", shard_states(api, run_id)
        # Airflow 3.3.2 fails an approval answered before the scheduler has the executor's report
        # of the paused attempt (LocalExecutor race); a person is never that fast, a test is.
        log = airflow["home"] / "standalone.log"
        wait_until(lambda: any("Received executor event" in line and "task_id='approve'" in line and run_id in line
                               for line in log.read_text(errors="replace").splitlines()), 60, "the pause reported")
        detail = api.get(path).json()
        # the estimate with its cost (the simulator has no GPU: server-hours), and examples
        assert "canary" in detail["body"] and "tok/s" in detail["body"] and "server-hours" in detail["body"]
        assert set(detail["options"]) == {"Approve", "Reject"}
        assert not any(k[0] == "generate" and v for k, v in shard_states(api, run_id).items())  # nothing started
        if pending_for_s:  # a person slower than idle_shutdown_s: the scenario is time passing
            layout = RunLayout(cfg.output)
            before = [(r.pid, r.start_ticks) for r in read_state(layout)]
            time.sleep(pending_for_s)
            assert [(r.pid, r.start_ticks) for r in read_state(layout) if r.running()] == before
            assert "no shard used the servers" not in layout.watchdog_log.read_text()  # not even for a moment
        answered = api.patch(path, json={"chosen_options": [option]})
        assert answered.status_code == 200, answered.text

    # Longer than the scheduler's gaps between tasks (start_servers to canary took over 8 s on a
    # loaded CI machine: the servers idled out before the canary held them), shorter than the
    # person takes to answer.
    cfg = make_config(approve_after_canary=True, output=str(tmp_path / "approved"), sim_tokens_per_second=2000,
                      idle_shutdown_s=20)
    run_id = trigger_run(api, cfg, airflow["config_dir"])
    answer(run_id, "Approve", pending_for_s=20 + 4)  # the idle time, and the watchdog's polls after it
    assert_clean_success(api, run_id, cfg)

    cfg = make_config(approve_after_canary=True, output=str(tmp_path / "rejected"), sim_tokens_per_second=2000)
    run_id = trigger_run(api, cfg, airflow["config_dir"])
    answer(run_id, "Reject")
    wait_run(api, run_id, 300)
    states = shard_states(api, run_id)
    assert states[("approve", -1)] == "success" and states[("stop_servers", -1)] == "success"
    assert {v for k, v in states.items() if k[0] in ("generate", "audit")} == {"skipped"}
    assert not (Path(cfg.output) / "data").exists()
    wait_until(lambda: processes_with_args("--port", str(cfg.servers.base_port)) == [], 30, "no server left")


@pytest.mark.slow
def test_a_run_marked_failed_while_its_shards_wait_for_a_pool_slot_ends_failed(airflow, make_config, tmp_path):
    """A team's runs share REGEN_POOL: one run's shards can all be waiting for a slot when a person
    marks it failed. Airflow skips them (nothing ran, nothing failed) and would let the run end
    green, unaudited; the teardown stops the servers and fails it. The whole run's Clear, once a
    slot is free, generates and audits. About a minute."""
    from support.airflow import SHARD_POOL

    base, headers = airflow["base"], {"Authorization": f"Bearer {airflow['token']}"}
    api = httpx.Client(base_url=f"{base}/api/v2", headers=headers, timeout=30)

    def pool_slots(slots: int) -> None:
        patched = api.patch(f"/pools/{SHARD_POOL}",
                            json={"name": SHARD_POOL, "slots": slots, "include_deferred": False})
        assert patched.status_code == 200, patched.text

    cfg = make_config(output=str(tmp_path / "waiting"), sim_tokens_per_second=2000)
    pool_slots(0)  # every slot taken by another run
    try:
        run_id = trigger_run(api, cfg, airflow["config_dir"])
        wait_until(lambda: {v for k, v in shard_states(api, run_id).items() if k[0] == "generate" and k[1] >= 0}
                   == {"scheduled"}, 300, "the shards waiting for a slot")
        assert shard_states(api, run_id)[("canary", -1)] == "success"
        marked = api.patch(f"/dags/regenerate_dataset/dagRuns/{run_id}", json={"state": "failed"})
        assert marked.status_code == 200, marked.text
        assert wait_run(api, run_id, 300) == "failed"
        states = shard_states(api, run_id)
        assert states[("audit", -1)] == "skipped" and states[("stop_servers", -1)] == "failed", states
        assert {v for k, v in states.items() if k[0] == "generate"} == {"skipped"}, states
        wait_until(lambda: processes_with_args("--port", str(cfg.servers.base_port)) == [], 30, "no server left")
    finally:
        pool_slots(16)
    assert api.post(f"/dags/regenerate_dataset/dagRuns/{run_id}/clear",
                    json={"dry_run": False, "only_failed": False}).status_code == 200
    assert_clean_success(api, run_id, cfg)
    assert shard_states(api, run_id)[("audit", -1)] == "success"


def test_reading_leases_never_removes_one_a_retried_holder_just_put_in_place(tmp_path, monkeypatch):
    """The watchdog finds a dead shard's lease free; in the same instant the shard's retry puts its
    own lease under that name. The reader must not remove it: the retry's lease stays, and counts."""
    import multiprocessing

    from regen.coordination import Lease, live_leases

    layout = RunLayout(tmp_path / "out")
    ctx = multiprocessing.get_context("fork")
    dead = ctx.Process(target=lambda: Lease(layout, "shard-00001", "run", demand=5).hold())
    dead.start()
    dead.join(30)  # its holder is gone: the file stays, free
    assert layout.lease("shard-00001").exists() and live_leases(layout) == []

    real_flock, retry = fcntl.flock, []

    def flock_then_retry_replaces(fd, op):  # the reader's lock test succeeds; the retry lands
        real_flock(fd, op)
        if not retry:
            retry.append(None)  # once (the retry's own hold takes a lock too)
            retry[0] = Lease(layout, "shard-00001", "run", demand=7).hold()

    monkeypatch.setattr(fcntl, "flock", flock_then_retry_replaces)
    live_leases(layout)
    monkeypatch.setattr(fcntl, "flock", real_flock)
    assert [(entry["name"], entry["demand"]) for entry in live_leases(layout)] == [("shard-00001", 7)]
    retry[0].release()


def test_a_lease_read_while_it_is_renewed_still_counts(tmp_path):
    """A reader can catch a lease mid-write: it still has its holder's name (the rebalancer of a
    shard once died on a nameless lease, and the shard waited for slots forever)."""
    from regen.coordination import Lease, live_leases

    layout = RunLayout(tmp_path / "out")
    with Lease(layout, "shard-00003", "run", demand=10) as lease:
        lease.path.write_text("")  # the instant between two writes of another implementation
        assert [(entry["name"], entry["demand"]) for entry in live_leases(layout)] == [("shard-00003", 0)]
        lease.path.write_text('{"name": "shard-0000')  # caught mid-write: held, so live all the same
        assert [(entry["name"], entry["demand"]) for entry in live_leases(layout)] == [("shard-00003", 0)]
        lease.renew(674)
        assert [(entry["name"], entry["demand"]) for entry in live_leases(layout)] == [("shard-00003", 674)]


def test_a_lease_whose_holder_hangs_goes_stale_and_counts_again_once_it_renews(tmp_path):
    """A holder that stops renewing keeps its lock (it is alive) but not the servers: past
    STALE_AFTER_S its lease no longer counts as use, so the watchdog can stop idle servers."""
    from regen.coordination import Lease, is_locked, live_leases
    from regen.coordination.leases import STALE_AFTER_S
    from regen.layout import RunLayout

    layout = RunLayout(tmp_path / "ds")
    with Lease(layout, "shard-00002", "run", demand=5) as lease:
        assert [e["name"] for e in live_leases(layout)] == ["shard-00002"]
        hung_since = time.time() - STALE_AFTER_S - 1
        os.utime(lease.path, (hung_since, hung_since))  # its last renewal, a minute ago
        assert is_locked(lease.path)  # the holder is alive ...
        assert live_leases(layout) == []  # ... and its lease no longer counts
        lease.renew()
        assert [e["name"] for e in live_leases(layout)] == ["shard-00002"]


def test_an_approval_hold_past_its_deadline_no_longer_keeps_the_servers(tmp_path):
    from regen.coordination import approval_pending, end_approval_hold, hold_for_approval
    from regen.layout import RunLayout

    layout = RunLayout(tmp_path / "ds")
    assert not approval_pending(layout)
    hold_for_approval(layout, "dag/run-1", hold_s=3600)
    assert approval_pending(layout)
    hold_for_approval(layout, "dag/run-1", hold_s=-1)  # nobody answered within the hold
    assert not approval_pending(layout)
    hold_for_approval(layout, "dag/run-1", hold_s=3600)
    end_approval_hold(layout)
    assert not approval_pending(layout) and not layout.approval_hold.exists()


def test_a_second_run_on_an_output_is_refused_at_preflight_naming_the_first(make_config):
    """Two DAGs given one output: the second's preflight fails naming the run that holds it, and
    nothing of the first is touched (its servers, its manifest); the first's teardown frees it.
    A holder is taken over only once Airflow says its run ended, however old its claim; with no
    one to ask, once nothing of it lives and it has not renewed for CLAIM_STALE_S."""
    from regen.coordination.owner import CLAIM_STALE_S
    from regen.files import atomic_write_json
    from regen.preflight import PreflightFailed

    cfg = make_config(num_servers=1)
    layout = RunLayout(cfg.output)
    run("preflight", cfg, code=False, run_id="regenerate_a/run-1")
    records = launch_servers(cfg, cfg.model_path, run_id="regenerate_a/run-1")
    manifest = layout.manifest.read_bytes()
    try:
        with pytest.raises(PreflightFailed, match="held by run regenerate_a/run-1") as refused:
            run("preflight", cfg.model_copy(update={"max_tokens": 77}), code=False, run_id="regenerate_b/run-1")
        assert refused.value.held_by == "regenerate_a/run-1"  # what the DAG asks Airflow about
        assert [r.running() for r in read_state(layout)] == [True]
        assert layout.manifest.read_bytes() == manifest
        run("preflight", cfg, code=False, run_id="regenerate_a/run-1")  # its own retry: still its own
        run("stop_servers", cfg, run_id="regenerate_a/run-1")  # the teardown releases the output
        run("preflight", cfg, code=False, run_id="regenerate_b/run-1")
        stale = time.time() - CLAIM_STALE_S - 1
        atomic_write_json(layout.owner, {"run_id": "regenerate_b/run-1", "since": stale, "renewed": stale})
        with pytest.raises(PreflightFailed, match="held by run regenerate_b/run-1"):  # Airflow: b still runs
            run("preflight", cfg, code=False, run_id="regenerate_c/run-1", ended_runs=[])
        run("preflight", cfg, code=False, run_id="regenerate_c/run-1", ended_runs=["regenerate_b/run-1"])
        assert json.loads(layout.owner.read_text())["run_id"] == "regenerate_c/run-1"
        atomic_write_json(layout.owner, {"run_id": "regenerate_c/run-1", "since": stale, "renewed": stale})
        run("preflight", cfg, code=False, run_id="regenerate_d/run-1")  # no one to ask, nothing of c lives
        assert json.loads(layout.owner.read_text())["run_id"] == "regenerate_d/run-1"
    finally:
        stop_records(records, grace_s=5)
