"""Generation against real simulated servers with injected faults: complete, exactly once, resumable."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys

import httpx
import pandas as pd
import pytest

from regen.config import RunConfig
from regen.dispatch import ClientTuning
from regen.errors import ShardFailed
from regen.generate import ShardRun
from regen.layout import shard_name
from regen.status import SHARD_SILENT_S, attention, with_stopped_shards
from regen.store import Journal, ShardStore
from support.data import read_ids, turn_requests
from support.engines import sim_requests_total, sim_running
from support.paths import BIN, ROOT
from support.processes import wait_until

PROMPTS = ROOT / "demo" / "prompts.jsonl"
FAST = ClientTuning(retry_backoff_s=0.02, retry_backoff_max_s=0.2, probe_interval_s=0.1,
                    progress_interval_s=0.5, all_down_timeout_s=10)


def generate_shard(prompts, out, pairs, shard=0, num_shards=1, identity=None, on_row=None,
                   tuning=FAST, **overrides):
    """One shard through ShardRun, with the test's fast client and the given config fields."""
    values = dict(prompts=str(prompts), output=str(out), num_shards=num_shards, max_tokens=1024,
                  concurrency_per_server=8)
    values.update(overrides)
    cfg = RunConfig.from_mapping(values)
    return ShardRun(cfg, pairs, shard, identity, tuning, on_row).run()


def endpoints(records):
    return [(r.url, r.api_key) for r in records]


def subset(tmp_path, count, extra=()):
    lines = PROMPTS.read_text().splitlines()[:count]
    path = tmp_path / f"prompts-{count}.jsonl"
    path.write_text("\n".join([*lines, *extra]) + "\n")
    return path


def test_shards_write_every_id_once_with_the_design_columns(sim_servers, tmp_path):
    cfg, records = sim_servers(num_servers=2)
    out = tmp_path / "ds"
    results = [generate_shard(PROMPTS, out, endpoints(records), s, 3) for s in range(3)]
    df = pd.read_parquet(out / "data")
    assert sorted(df["id"]) == sorted(read_ids(PROMPTS))
    assert sum(r.total for r in results) == len(df)
    assert sorted(p.name for p in (out / "data").iterdir()) == [
        f"{shard_name(s, 3)}.parquet" for s in range(3)]
    assert df["error"].isna().all()
    assert set(df["server"]) == {r.url for r in records}  # both servers took work
    assert list(df["messages"].iloc[0][0].keys()) == ["role", "content", "reasoning_content",
                                                      "tool_calls", "tool_call_id", "name"]  # null but in agentic rows
    progress = json.loads((out / "progress.json").read_text())
    assert progress["done"] == progress["total"] == len(df)
    assert not list((out / "work" / "journal").glob("*.jsonl"))  # journals folded into data/


def test_http_500s_and_hung_requests_are_retried_until_the_dataset_is_complete(sim_servers, tmp_path):
    cfg, records = sim_servers(num_servers=2, sim_failure_rate=0.2, sim_hang_rate=0.1)
    prompts = subset(tmp_path, 60)
    result = generate_shard(prompts, tmp_path / "ds", endpoints(records), max_attempts=12,
                            request_timeout_s=1.0,
                            tuning=ClientTuning(**{**FAST.__dict__, "failures_before_down": 1000}))
    df = pd.read_parquet(tmp_path / "ds" / "data")
    assert sorted(df["id"]) == sorted(read_ids(prompts))
    assert df["error"].isna().all(), df["error"].dropna().tolist()
    assert (df["attempts"] > 1).sum() >= 5  # faults did happen, and were absorbed
    assert result.failed == 0


def test_a_server_killed_mid_shard_is_dropped_and_the_others_finish(sim_servers, tmp_path):
    cfg, records = sim_servers(num_servers=2, sim_tokens_per_second=400)
    victim = records[1]
    seen = []

    def kill_after_20(row):
        seen.append(row)
        if len(seen) == 20:
            os.killpg(victim.pid, signal.SIGKILL)

    prompts = subset(tmp_path, 120)
    result = generate_shard(prompts, tmp_path / "ds", endpoints(records), max_attempts=4,
                            on_row=kill_after_20)
    df = pd.read_parquet(tmp_path / "ds" / "data")
    assert sorted(df["id"]) == sorted(read_ids(prompts))
    assert df["error"].isna().all()
    assert result.failed == 0
    # Rows are in journal order: well after the kill, every row came from the survivor.
    assert (df["server"].iloc[20:] == records[0].url).sum() >= 100 - 16
    assert (df["server"].iloc[40:] == records[0].url).all()


def test_concurrency_comes_from_the_server_and_never_passes_what_it_can_run(sim_servers, tmp_path):
    cfg, records = sim_servers(num_servers=2, max_running_requests=8, sim_tokens_per_second=2000,
                               extra_server_args=["--sim-effective-max-running-requests", "3"])
    result = generate_shard(subset(tmp_path, 80), tmp_path / "ds", endpoints(records),
                            concurrency_per_server=None, queue_margin=1)
    assert result.done == 80
    progress = json.loads((tmp_path / "ds" / "progress.json").read_text())
    slots = [s["slots"] for s in progress["shards"]["shard-00000"]["servers"].values()]
    assert slots == [4, 4]  # the effective value plus the margin, not the CLI's 8
    for r in records:
        info = httpx.get(f"{r.url}/server_info").json()["internal_states"][0]
        assert info["sim_peak_requests_in_flight"] <= 3 + 1  # never more than it runs, plus the margin


def test_a_prompt_too_long_for_the_context_becomes_an_error_row_without_retries(sim_servers, tmp_path):
    cfg, records = sim_servers(num_servers=1)
    huge = json.dumps({"id": "too-long", "prompt": "word " * 9000})
    prompts = subset(tmp_path, 40, extra=[huge])
    result = generate_shard(prompts, tmp_path / "ds", endpoints(records))
    df = pd.read_parquet(tmp_path / "ds" / "data").set_index("id")
    assert len(df) == 41
    row = df.loc["too-long"]
    assert row["error"].startswith("HTTP 400: Requested token count exceeds")
    assert row["attempts"] == 1
    assert result.failed == 1
    assert sim_requests_total(records[0].url) == sum(turn_requests(prompts).values())  # one for it, never retried


def test_a_shard_with_too_many_errors_fails_and_keeps_what_it_finished(sim_servers, tmp_path):
    cfg, records = sim_servers(num_servers=1, sim_failure_rate=1.0)
    with pytest.raises(ShardFailed, match="max_error_fraction"):
        generate_shard(subset(tmp_path, 40), tmp_path / "ds", endpoints(records), max_attempts=2,
                       tuning=ClientTuning(**{**FAST.__dict__, "failures_before_down": 1000}))
    assert not (tmp_path / "ds" / "data").exists()


def test_the_error_bound_is_the_shards_across_attempts_not_each_attempts(sim_servers, tmp_path):
    """Errors no retry fixes (a prompt past the context) stay in the shard: its retry counts them,
    and fails before sending anything, rather than pass with more errors than the bound."""
    cfg, records = sim_servers(num_servers=1)
    huge = [json.dumps({"id": f"too-long-{i}", "prompt": "word " * 9000}) for i in range(3)]
    prompts = subset(tmp_path, 20, extra=huge)
    for attempt in (1, 2):
        before = sim_requests_total(records[0].url)
        with pytest.raises(ShardFailed, match=r"3 of 23 prompts failed \(more than max_error_fraction 10%\)"):
            generate_shard(prompts, tmp_path / "ds", endpoints(records), max_error_fraction=0.1)
        if attempt == 2:
            assert sim_requests_total(records[0].url) == before  # nothing sent: the bound was already passed


def test_no_server_answering_fails_with_what_to_do(tmp_path):
    with pytest.raises(ShardFailed, match="no server answers .* start them first"):
        generate_shard(PROMPTS, tmp_path / "ds", [("http://127.0.0.1:9", None)])


@pytest.mark.slow
def test_sigkill_at_half_then_rerun_gives_every_id_once_and_resends_nothing(sim_servers, tmp_path):
    cfg, records = sim_servers(num_servers=2, sim_tokens_per_second=300)
    out = tmp_path / "ds"
    argv = [str(BIN / "regen"), "generate", "--prompts", str(PROMPTS), "--output", str(out),
            "--endpoints", ",".join(r.url for r in records), "--api-key", records[0].api_key,
            "--shard", "0", "--num-shards", "1", "--max-tokens", "1024",
            "--concurrency-per-server", "6"]
    total = len(read_ids(PROMPTS))
    journal = out / "work" / "journal" / f"{shard_name(0, 1)}.jsonl"
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_until(lambda: len({row["id"] for row in Journal.rows(journal)}) >= total // 2,
                   timeout=120, what="half the shard journaled", max_pause=0.02)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    for r in records:  # requests that were in flight at the kill finish on the servers first
        wait_until(lambda: sim_running(r.url) == 0, timeout=30)
    kept = {row["id"] for row in Journal.rows(journal)}
    assert total // 2 <= len(kept) < total
    # The killed attempt's shard still says "running": shown stopped once it has been silent.
    progress = json.loads((out / "progress.json").read_text())
    assert progress["shards"]["shard-00000"]["state"] == "running"
    assert with_stopped_shards(progress)["shards"]["shard-00000"]["state"] == "running"
    later = with_stopped_shards(progress, now=progress["shards"]["shard-00000"]["updated"] + SHARD_SILENT_S + 1)
    assert later["shards"]["shard-00000"]["state"] == "stopped"
    [stopped] = attention(later, None)
    assert stopped["kind"] == "stopped"
    assert stopped["what"] == "1 shard stopped unfinished (0/1): no word from its attempt for 2 min"
    assert stopped["next"].startswith("its task's retry resumes it")
    [rows_kept] = stopped["details"]
    assert rows_kept.startswith("shard 0/1 on ") and rows_kept.endswith(
        f": {progress['shards']['shard-00000']['done']:,} of {total:,} rows kept")
    turns = turn_requests(PROMPTS)
    answered = {row["id"]: row["turn"] + 1 for row in Journal.rows(journal, partial=True) if row["id"] not in kept}
    sent_before = sum(sim_requests_total(r.url) for r in records)
    rerun = subprocess.run(argv, capture_output=True, text=True, timeout=300)
    assert rerun.returncode == 0, rerun.stderr[-2000:]
    sent_during_rerun = sum(sim_requests_total(r.url) for r in records) - sent_before
    # no request for an id that had a row, nor for a turn that had an answer
    assert sent_during_rerun == sum(n - answered.get(i, 0) for i, n in turns.items() if i not in kept)
    df = pd.read_parquet(out / "data")
    assert len(df) == total and df["id"].is_unique
    assert sorted(df["id"]) == sorted(read_ids(PROMPTS))


def test_a_trial_on_the_first_n_prompts_writes_its_own_folder_and_resumes(sim_servers, tmp_path):
    """`--limit N`: the first N prompts the file can send, in OUTPUT/trials/first-N; the full dataset's
    folder gets nothing, and a rerun of the trial sends nothing. The command never loads pandas
    (pyarrow would, for 0.25 s of CPU per shard process: regen.cli.hide_pandas)."""
    from support.data import write_prompts

    cfg, records = sim_servers(num_servers=1)
    prompts = tmp_path / "prompts.jsonl"
    write_prompts(prompts, 30)
    with prompts.open("r+") as fh:  # a repeated id early on: it does not count as one of the N
        lines = fh.readlines()
        lines.insert(2, lines[0])
        fh.seek(0)
        fh.writelines(lines)
    out = tmp_path / "ds"
    argv = [str(BIN / "regen"), "generate", "--prompts", str(prompts), "--output", str(out), "--limit", "7",
            "--endpoints", records[0].url, "--api-key", records[0].api_key, "--num-shards", "2"]
    first = subprocess.run([sys.executable, "-X", "importtime", *argv], capture_output=True, text=True, timeout=300)
    assert first.returncode == 0, first.stderr[-2000:]
    loaded = re.findall(r"^import time: .*\| +([\w.]+)$", first.stderr, re.M)
    assert "pyarrow.lib" in loaded and not [m for m in loaded if m.startswith("pandas.")]
    df = pd.read_parquet(out / "trials" / "first-7" / "data")
    assert sorted(df["id"]) == sorted(f"p{i}" for i in range(7)) and df["id"].is_unique
    assert not (out / "data").exists()
    sent = sim_requests_total(records[0].url)
    again = subprocess.run(argv, capture_output=True, text=True, timeout=300)
    assert again.returncode == 0, again.stderr[-2000:]
    assert sim_requests_total(records[0].url) == sent


def test_a_full_disk_fails_the_shard_clearly_and_leaves_data_clean(sim_servers, tmp_path):
    mount = tmp_path / "full"
    mount.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(mount)], check=True)
    try:
        cfg, records = sim_servers(num_servers=1)
        with pytest.raises(ShardFailed, match="No space left on device"):
            generate_shard(PROMPTS, mount / "ds", endpoints(records))
        data = mount / "ds" / "data"
        assert not data.exists() or list(data.iterdir()) == []
        # What was journaled before the disk filled is kept for the rerun.
        assert (mount / "ds" / "work" / "journal" / f"{shard_name(0, 1)}.jsonl").stat().st_size > 0
    finally:
        subprocess.run(["umount", str(mount)], check=True)


def test_a_second_generator_waits_for_an_attempt_still_stopping_and_is_refused_after(
        sim_servers, tmp_path, monkeypatch, caplog):
    """A shard cleared while its marked-failed attempt still writes its journal: the new attempt
    waits for the lock and generates once it is free; a holder that outlasts the grace (a second
    generator) is refused, naming it."""
    import threading

    import regen.store
    from regen.layout import RunLayout

    monkeypatch.setattr(regen.store, "STOPPING_ATTEMPT_GRACE_S", 1.0)
    with ShardStore(RunLayout(tmp_path / "ds"), 0, 1).lock():
        with pytest.raises(ShardFailed, match=r"being generated right now by pid \d+ .*, still after 1 s"):
            generate_shard(PROMPTS, tmp_path / "ds", [("http://127.0.0.1:9", None)])

    monkeypatch.setattr(regen.store, "STOPPING_ATTEMPT_GRACE_S", 120.0)
    cfg, records = sim_servers(num_servers=1)
    prompts, done = subset(tmp_path, 20), {}
    stopping = ShardStore(RunLayout(tmp_path / "ds2"), 0, 1).lock()
    stopping.__enter__()
    successor = threading.Thread(target=lambda: done.update(
        result=generate_shard(prompts, tmp_path / "ds2", endpoints(records))))
    successor.start()
    wait_until(lambda: "an attempt still stopping?); waiting up to 120 s" in caplog.text, 60, "the successor waiting")
    assert "result" not in done
    stopping.__exit__(None, None, None)
    successor.join(120)
    assert done["result"].done == 20


def test_a_rerun_reuses_good_rows_and_a_settings_change_regenerates(sim_servers, tmp_path):
    cfg, records = sim_servers(num_servers=1)
    prompts = subset(tmp_path, 50)
    out = tmp_path / "ds"
    first = generate_shard(prompts, out, endpoints(records), identity="m1")
    assert first.done == 50
    before = sim_requests_total(records[0].url)
    again = generate_shard(prompts, out, endpoints(records), identity="m1")
    assert (again.done, again.skipped) == (0, 50)
    assert sim_requests_total(records[0].url) == before  # nothing sent
    changed = generate_shard(prompts, out, endpoints(records), identity="m1", max_tokens=900)
    assert changed.done == 50  # other settings: every row regenerated
    df = pd.read_parquet(out / "data")
    assert len(df) == 50 and df["id"].is_unique and df["settings_hash"].nunique() == 1


def test_without_a_model_directory_the_servers_say_what_model_the_rows_come_from(sim_servers, tmp_path):
    cfg, records = sim_servers(num_servers=1)
    prompts = subset(tmp_path, 20)
    first = generate_shard(prompts, tmp_path / "ds", endpoints(records))  # identity: what they report
    assert first.done == 20
    again = generate_shard(prompts, tmp_path / "ds", endpoints(records))
    assert (again.done, again.skipped) == (0, 20)  # the same servers: nothing resent
    known = generate_shard(prompts, tmp_path / "ds", endpoints(records), identity="m1")
    assert known.done == 20  # a model named otherwise is another model: regenerated


def test_unreadable_records_are_listed_with_file_and_line_and_the_shard_goes_on(sim_servers, tmp_path):
    cfg, records = sim_servers(num_servers=1)
    prompts = subset(tmp_path, 30, extra=["{not json", json.dumps({"prompt": "no id"})])
    result = generate_shard(prompts, tmp_path / "ds", endpoints(records))
    assert (result.done, result.bad_records) == (30, 2)
    errors = (tmp_path / "ds" / "work" / "errors" / f"{shard_name(0, 1)}.txt").read_text().splitlines()
    assert errors[0].startswith(f"{prompts}:31: not valid JSON")
    assert errors[1] == f"{prompts}:32: missing 'id'"
    assert len(pd.read_parquet(tmp_path / "ds" / "data")) == 30


def test_a_shard_past_its_error_bound_always_ends_while_responses_complete(sim_servers, tmp_path):
    """The bound trips on the file's first prompts while the rest are answered every few
    milliseconds: a cancellation that lands as a response completes must still stop its worker
    (Python 3.11's wait_for lost it; the worker went on through the queue and waited for ever at
    its end, the shard renewing its lease). Twenty shards; each must fail within seconds and
    leave no lease behind."""
    import threading

    from regen.coordination import live_leases
    from regen.engines.simulator.settings import FAULT_MARKER

    fault = tmp_path / "fault"
    fault.touch()
    cfg, records = sim_servers(num_servers=2, sim_tokens_per_second=0, concurrency_per_server=64,
                               extra_server_args=["--sim-fail-while", str(fault)])
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"id": f"p{i:04d}", "prompt": f"question {i}"
                                           + (f" {FAULT_MARKER}" if i < 100 else "")}) + "\n"
                               for i in range(1500)))
    tuning = ClientTuning(**{**FAST.__dict__, "failures_before_down": 10**6})
    for attempt in range(20):
        out = tmp_path / f"ds{attempt}"
        outcome: list = []

        def shard() -> None:
            try:
                generate_shard(prompts, out, endpoints(records), max_attempts=1, tuning=tuning,
                               concurrency_per_server=64, max_error_fraction=0.05)
            except ShardFailed as exc:
                outcome.append(exc)

        worker = threading.Thread(target=shard, daemon=True)
        worker.start()
        worker.join(timeout=30)
        assert not worker.is_alive(), f"attempt {attempt}: the shard hung after its error bound"
        assert outcome and "max_error_fraction" in str(outcome[0]), outcome
        assert live_leases(RunConfig.from_mapping({"prompts": str(prompts), "output": str(out)}).layout) == []


def test_a_conversations_turns_stay_on_one_server_while_the_servers_are_balanced(sim_servers, tmp_path):
    """A fleet that is not full (60 three-turn conversations, 3 servers of 32 slots): least
    outstanding spreads the first turns, then each conversation's later turns go to the server
    that holds its prefix. Counted from each simulator's own request log and cache counter. In
    the tail a turn may leave a home measured at under half the fastest free server's speed
    (dispatch.AFFINITY_MIN_SPEED); on a loaded CI machine that moved 2 of 60: at most 3 may."""
    from collections import defaultdict

    from support.data import write_conversations

    logs = tmp_path / "requests-{port}.jsonl"
    cfg, records = sim_servers(num_servers=3, concurrency_per_server=32, sim_tokens_per_second=400,
                               extra_server_args=["--sim-request-log", str(logs)])
    prompts = write_conversations(tmp_path / "conversations.jsonl", 60, turns=3)
    result = generate_shard(prompts, tmp_path / "ds", endpoints(records), concurrency_per_server=32)
    assert result.failed == 0 and result.done == 60
    servers_of: dict[str, set[int]] = defaultdict(set)
    per_server = {}
    for r in records:
        lines = [json.loads(line) for line in (tmp_path / f"requests-{r.port}.jsonl").read_text().splitlines()]
        per_server[r.port] = len(lines)
        for line in lines:
            first_user = next(m["content"] for m in line["messages"] if m["role"] == "user")
            servers_of[first_user].add(r.port)
    assert sum(per_server.values()) == 180
    moved = {k: v for k, v in servers_of.items() if len(v) > 1}
    assert len(servers_of) == 60 and len(moved) <= 3, moved
    assert max(per_server.values()) <= 1.25 * min(per_server.values()), per_server
    for r in records:  # every later turn found its history in that server's prefix cache
        cached = [line for line in httpx.get(f"{r.url}/metrics").text.splitlines()
                  if line.startswith("sglang:cached_tokens_total")]
        assert float(cached[0].rsplit(" ", 1)[1]) > 0


def test_mapped_shards_place_a_shared_prefix_on_the_same_server_without_talking():
    """Each of the DAG's mapped shards has its own memory of where prefixes are: a shared system
    prompt none of its requests has placed yet goes to the server every process ranks first for
    it (rendezvous), spread over the servers by prefix; a server leaving moves only its own
    prefixes; where this process has placed the prefix, that server comes first."""
    import asyncio

    from regen.dispatch import Endpoint, ServerPool

    urls = [f"http://127.0.0.1:{30000 + i}" for i in range(3)]
    keys = [f"prefix:{i:04x}" for i in range(60)]

    async def first_homes(down: set[str] = frozenset(), placed: dict[str, str] | None = None) -> dict[str, str]:
        pool = ServerPool([Endpoint(url=u, healthy=u not in down) for u in urls], ClientTuning())
        for key, url in (placed or {}).items():
            pool.remember([key], next(e for e in pool.endpoints if e.url == url), {key})
        out = {key: pool.homes([f"conversation:{key}", key], {key})[0].url for key in keys}
        assert pool.homes(["conversation:alone", "prefix:unshared"], set()) == []
        return out

    one, other = asyncio.run(first_homes()), asyncio.run(first_homes())
    assert one == other  # two processes, the same first home for every shared prefix
    assert all(list(one.values()).count(u) >= 10 for u in urls)  # spread over the servers
    without = asyncio.run(first_homes(down={urls[0]}))
    assert all(without[k] == one[k] for k in keys if one[k] != urls[0])  # only the gone server's move
    assert all(without[k] != urls[0] for k in keys)
    assert asyncio.run(first_homes(placed={keys[0]: urls[2] if one[keys[0]] != urls[2] else urls[1]}))[keys[0]] != one[keys[0]]


def test_half_written_shard_files_of_a_killed_publish_are_removed_by_the_next_attempt(sim_servers, tmp_path):
    from regen.layout import RunLayout

    cfg, records = sim_servers(num_servers=1)
    out = tmp_path / "ds"
    generate_shard(PROMPTS, out, endpoints(records))
    store = ShardStore(RunLayout(out), 0, 1)
    orphan = store.journal_path.parent / f".{store.final.name}.k1ll3d.tmp"
    orphan.write_bytes(b"PAR1 half a file")
    other = store.journal_path.parent / ".something-else.tmp"  # not this shard's: left alone
    other.write_bytes(b"x")
    assert generate_shard(PROMPTS, out, endpoints(records)).done == 0  # up to date
    assert not orphan.exists() and other.exists()


def test_preflights_disk_estimate_covers_a_running_shards_journal_and_its_file(sim_servers, tmp_path):
    """At the peak a shard holds its journal (text and every token id, as JSON) and the Parquet
    file it publishes: the estimate preflight checks the free space against covers both."""
    import pyarrow.parquet as pq

    from regen.pipeline import run
    from support.data import write_prompts

    prompts = write_prompts(tmp_path / "p.jsonl", 60)
    cfg, records = sim_servers(num_servers=1, num_shards=1, max_tokens=200, prompts=str(prompts))
    estimate = run("preflight", cfg, code=False).info["output_estimate_bytes"]
    run("generate", cfg, shards=[0])
    published = sum(p.stat().st_size for p in cfg.layout.data.glob("*.parquet"))
    journal = Journal(tmp_path / "journal.jsonl")
    for row in pq.read_table(cfg.layout.data).to_pylist():
        journal.append(row)
    journal.close()
    assert (tmp_path / "journal.jsonl").stat().st_size + published <= estimate


def test_sampling_left_empty_is_not_sent_and_every_option_set_arrives(sim_servers, tmp_path):
    """Null sampling fields reach the server as absent (its generation_config decides); the
    penalties, min_p and extra chat template arguments arrive as set, beside enable_thinking."""
    from regen.generate import generate_rows
    from regen.prompts import read_prompts
    from regen.protocol import SAMPLING_FIELDS

    log = tmp_path / "requests.jsonl"
    cfg, records = sim_servers(num_servers=1, temperature=None, top_p=None, top_k=None,
                               extra_server_args=["--sim-request-log", str(log)])
    prompts = list(read_prompts(cfg.prompts))[:2]
    endpoints = [(r.url, r.api_key) for r in records]
    generate_rows(cfg, prompts, endpoints)
    sent = [json.loads(line) for line in log.read_text().splitlines()]
    assert sent and all(not set(SAMPLING_FIELDS) & set(body) for body in sent)
    assert all(body["chat_template_kwargs"] == {"enable_thinking": True} for body in sent)

    log.unlink()
    options = {"temperature": 0.0, "min_p": 0.05, "presence_penalty": 1.5, "repetition_penalty": 1.05}
    generate_rows(cfg.model_copy(update={**options, "chat_template_kwargs": {"preserve_thinking": True}}),
                  prompts, endpoints)
    sent = [json.loads(line) for line in log.read_text().splitlines()]
    assert sent and all({k: body.get(k) for k in options} == options for body in sent)
    assert all(body["chat_template_kwargs"] == {"preserve_thinking": True, "enable_thinking": True} for body in sent)


def test_endpoints_of_servers_regen_serve_started_take_their_key_and_a_401_says_so(sim_servers, tmp_path):
    """`regen generate --endpoints` against the servers `regen serve` started for the output uses
    their recorded key; for another output it has none, and the servers' 401 is said as such."""
    from regen.dispatch import AllServersDown
    from regen.generate import generate

    cfg, records = sim_servers(num_servers=1, prompts=str(subset(tmp_path, 4)), num_shards=1)
    assert records[0].api_key and cfg.servers.api_key is None  # the key is the servers', not the config's
    result = generate(cfg, [0], endpoints=[records[0].url])
    assert result.shards[0].done == 4
    other = cfg.model_copy(update={"output": str(tmp_path / "other")})
    with pytest.raises(AllServersDown, match=r"answered HTTP 401 Unauthorized: the servers want an API key"):
        generate(other, [0], endpoints=[records[0].url])


def test_a_running_shard_logs_its_progress_at_every_interval(sim_servers, tmp_path, caplog):
    """Long work shows progress: every progress_interval_s a shard logs done/total, tok/s and an ETA."""
    import logging

    cfg, records = sim_servers(num_servers=1, sim_tokens_per_second=200)
    with caplog.at_level(logging.INFO, logger="regen.generate"):
        generate_shard(subset(tmp_path, 30), tmp_path / "ds", endpoints(records),
                       tuning=ClientTuning(**{**FAST.__dict__, "progress_interval_s": 0.2}))
    lines = [r.getMessage() for r in caplog.records if "tok/s, ETA" in r.getMessage()]
    assert lines and all("/30 done, 0 failed" in line for line in lines), lines


def test_the_audit_of_a_run_with_shards_still_to_come_says_it_is_partial(sim_servers, tmp_path):
    cfg, records = sim_servers(num_servers=1)
    prompts, out = subset(tmp_path, 40), tmp_path / "ds"
    audit = [str(BIN / "regen"), "audit", "--data", str(out), "--tokenizer", cfg.model_path]
    generate_shard(prompts, out, endpoints(records), 0, 2)
    first = subprocess.run(audit, capture_output=True, text=True, timeout=300)
    assert "audit PASS (partial: 1 of 2 shards published; the verdict covers those rows only)" in first.stdout, \
        first.stdout + first.stderr
    generate_shard(prompts, out, endpoints(records), 1, 2)
    whole = subprocess.run(audit, capture_output=True, text=True, timeout=300)
    assert "audit PASS: " in whole.stdout and "partial" not in whole.stdout


def test_one_process_of_32_shards_reports_its_servers_once_and_ends_in_one_fold(sim_servers, tmp_path, monkeypatch):
    """`regen generate` without --shard: 32 shards share one pool of servers. The run page counts
    each request once (not once per shard part), and the attempt's end writes every part and
    rebuilds progress.json once: a rebuild per shard reads every part (the square of the shards,
    15-19 s after the last reply of a 64-server fleet)."""
    from regen import progress

    cfg, records = sim_servers(num_servers=1, sim_tokens_per_second=2000)
    reads = []
    real = progress.read_json
    monkeypatch.setattr(progress, "read_json", lambda path, *a, **k: reads.append(path) or real(path, *a, **k))
    out = tmp_path / "ds"
    values = dict(prompts=str(subset(tmp_path, 64)), output=str(out), num_shards=32, max_tokens=1024)
    run = ShardRun(RunConfig.from_mapping(values), endpoints(records), list(range(32)), None, FAST)
    ended = []
    run.progress.write_shards = lambda parts, write=run.progress.write_shards: (
        ended.append(len(reads)) if all(p["state"] == "done" for p in parts.values()) else None, write(parts))
    result = run.run()
    assert sum(s.done for s in result.shards) == 64
    folded = json.loads((out / "progress.json").read_text())
    assert folded["done"] == 64 and {s["state"] for s in folded["shards"].values()} == {"done"}
    sent = sim_requests_total(records[0].url)  # the server's own count (multi-turn rows: a request a turn)
    assert sent >= 64 and sum(s["done"] for s in folded["servers"].values()) == sent  # once, not 32 times
    assert len(reads) - ended[-1] <= 32 + 1, f"{len(reads) - ended[-1]} part reads at the end"


def test_a_shard_whose_rows_are_all_in_is_published_while_the_others_still_generate(sim_servers, tmp_path):
    """One process with two shards: the first to have all its rows is published while the other
    still generates (each later row waits here, its event loop held, until that file is in data/:
    a publish left to the end would never come), not one after another once everything is in."""
    cfg, records = sim_servers(num_servers=1)
    out = tmp_path / "ds"
    seen: list[int] = []

    def on_row(row: dict) -> None:
        mine = run.shard_of[row["id"]]
        for other in run.shards.values():
            if other is not mine and other.publishing is not None and other.store.shard not in seen:
                wait_until(other.store.final.exists, 60, f"{other.store.name} published")
                seen.append(other.store.shard)

    values = dict(prompts=str(subset(tmp_path, 80)), output=str(out), num_shards=2, max_tokens=256,
                  concurrency_per_server=2)
    run = ShardRun(RunConfig.from_mapping(values), endpoints(records), [0, 1], None, FAST, on_row)
    result = run.run()
    assert len(seen) == 1 and sum(s.total for s in result.shards) == 80
    assert sorted(pd.read_parquet(out / "data")["id"]) == sorted(read_ids(subset(tmp_path, 80)))


def test_a_shards_file_is_written_as_its_rows_come_in_and_a_resume_adds_the_earlier_rows(
        sim_servers, tmp_path, monkeypatch):
    """Rows that settle their id go into the shard's file as they come in (STAGE_ROWS at a time,
    here 4): publishing a shard whose rows all came in this attempt reads nothing back (it closes
    and renames the file). A resume's publish adds the rows earlier attempts journaled, unchanged."""
    import pyarrow.parquet as pq

    import regen.store

    monkeypatch.setattr(regen.store, "STAGE_ROWS", 4, raising=False)
    read_back: list = []
    rows_of = ShardStore._rows
    monkeypatch.setattr(ShardStore, "_rows", lambda self, columns=None: read_back.append(columns) or rows_of(self, columns))
    cfg, records = sim_servers(num_servers=1)
    prompts = subset(tmp_path, 30)
    out = tmp_path / "ds"
    shard_file = out / "data" / f"{shard_name(0, 1)}.parquet"
    assert generate_shard(prompts, out, endpoints(records)).shards[0].done == 30
    assert read_back == []
    assert pq.ParquetFile(shard_file).metadata.num_row_groups == 8  # written 4 rows at a time, 2 at the end
    first = {row["id"]: row for row in pq.read_table(shard_file).to_pylist()}
    assert sorted(first) == sorted(read_ids(prompts))

    # An earlier attempt's rows for ten ids in the journal, nothing published: the resume sends the other 20.
    carried = sorted(first)[:10]
    journal = out / "work" / "journal" / f"{shard_name(0, 1)}.jsonl"
    journal.write_text("".join(json.dumps(first[i]) + "\n" for i in carried))
    shard_file.unlink()
    sent = sim_requests_total(records[0].url)
    assert generate_shard(prompts, out, endpoints(records)).shards[0].done == 20
    assert sim_requests_total(records[0].url) - sent == sum(
        n for i, n in turn_requests(prompts).items() if i not in carried)
    assert read_back  # the journal's ten, read back once the twenty were in
    resumed = {row["id"]: row for row in pq.read_table(shard_file).to_pylist()}
    assert sorted(resumed) == sorted(first) and all(resumed[i] == first[i] for i in carried)
    assert not journal.exists() and not list(journal.parent.glob(".*.tmp"))  # the staged file became the shard's
