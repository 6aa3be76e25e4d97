"""Every row provably from this run's prompts, model and settings (issue: integrity).

Real simulated servers and real processes throughout; where the issue says killed, SIGKILL.
"""

from __future__ import annotations

import json
import signal
import subprocess
import threading
from pathlib import Path

import pandas as pd
import pytest
import yaml

from regen.audit.dataset import audit_dataset
from regen.audit.findings import AuditThresholds
from regen.errors import ShardFailed
from regen.generate import ShardRun
from regen.layout import RunLayout
from regen.manifest import Manifest, ManifestError, model_fingerprint, settings_hash
from regen.pipeline import run
from regen.preflight import PreflightFailed
from regen.servers.lifecycle import ServerError, launch_servers, stop_records
from regen.servers.records import read_state
from regen.store import Journal
from support.data import FAST, cli, settle, turn_requests, write_prompts
from support.engines import sim_requests_total
from support.paths import BIN
from support.processes import wait_until


def requests_total(records) -> int:
    return sum(sim_requests_total(r.url) for r in records)


def rows_written(output: Path) -> set[str]:
    """Ids with a row anywhere: published shard files and journals."""
    layout = RunLayout(output)
    ids = set()
    for path in layout.shard_files():
        ids |= set(pd.read_parquet(path, columns=["id"])["id"])
    for journal in (layout.work / "journal").glob("*.jsonl"):
        ids |= {row["id"] for row in Journal.rows(journal)}
    return ids


def turns_journaled(output: Path) -> dict[str, int]:
    """Per conversation cut mid-way: how many of its turns the journals hold answers for."""
    from regen.turns import resumed_answers

    rows: dict[str, list[dict]] = {}
    for journal in (RunLayout(output).work / "journal").glob("*.jsonl"):
        for row in Journal.rows(journal, partial=True):
            rows.setdefault(row["id"], []).append(row)
    return {i: len(resumed_answers(r)) for i, r in rows.items()}


def kill_when(proc: subprocess.Popen, output: Path, rows: int) -> set[str]:
    """SIGKILL ``proc`` once ``rows`` ids have a row; the ids written by then."""
    try:
        wait_until(lambda: len(rows_written(output)) >= rows or proc.poll() is not None, 120, f"{rows} rows", max_pause=0.02)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    return rows_written(output)


def test_rows_of_other_settings_in_the_journal_are_regenerated_not_kept(sim_servers, tmp_path):
    """(1) thinking off, SIGKILL after ~400 of 1,200 rows, the same command with thinking on."""
    cfg, records = sim_servers(num_servers=2, sim_ttft_s=0.05, concurrency_per_server=6)
    prompts = write_prompts(tmp_path / "p.jsonl", 1200)
    out = tmp_path / "ds"
    base = ["--prompts", str(prompts), "--output", str(out), "--endpoints", ",".join(r.url for r in records),
            "--api-key", records[0].api_key, "--num-shards", "1", "--concurrency-per-server", "6"]
    proc = subprocess.Popen(cli(*base, "--no-thinking"), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    off = kill_when(proc, out, 400)
    settle(records)
    assert 400 <= len(off) < 1200
    before = requests_total(records)
    rerun = subprocess.run(cli(*base), capture_output=True, text=True, timeout=300)
    assert rerun.returncode == 0, rerun.stderr[-2000:]
    assert requests_total(records) - before == sum(turn_requests(prompts).values())  # no thinking-off row kept
    df = pd.read_parquet(out / "data")
    assert len(df) == 1200 and df["id"].is_unique
    assert df["settings_hash"].nunique() == 1 and df["enable_thinking"].all()
    assert df["reasoning_content"].notna().all()


def test_deleted_prompts_leave_the_dataset_and_edited_ones_are_regenerated(sim_servers, tmp_path):
    """(2) 100 prompts deleted, (3) 100 edited: only the edited are sent, the deleted are gone."""
    cfg, records = sim_servers(num_servers=1, num_shards=2)
    prompts = write_prompts(tmp_path / "p.jsonl", 400)
    cfg = cfg.model_copy(update={"prompts": str(prompts)})
    for shard in range(2):
        run("generate", cfg, shards=[shard])
    before = requests_total(records)
    write_prompts(prompts, 400, drop=range(0, 100), edit=range(100, 200))
    for shard in range(2):
        run("generate", cfg, shards=[shard])
    assert requests_total(records) - before == 100  # exactly the edited prompts
    df = pd.read_parquet(Path(cfg.output) / "data").set_index("id")
    assert sorted(df.index) == sorted(f"p{i}" for i in range(100, 400))
    assert df.loc["p150", "messages"][0]["content"] == "An edited question, number 150?"
    again = requests_total(records)
    for shard in range(2):
        assert run("generate", cfg, shards=[shard]).done == 0  # up to date: nothing sent
    assert requests_total(records) == again


@pytest.mark.parametrize("form", ["endpoints", "config"])
def test_the_same_command_after_a_kill_resends_at_most_what_was_in_flight(sim_servers, tmp_path, form):
    """(4) killed mid-run, the identical command again: finished shards are not regenerated."""
    cfg, records = sim_servers(num_servers=2, sim_ttft_s=0.03, concurrency_per_server=4, num_shards=3)
    prompts = write_prompts(tmp_path / "p.jsonl", 900)
    if form == "endpoints":
        argv = cli("--prompts", str(prompts), "--output", str(tmp_path / "ds"), "--endpoints",
                   ",".join(r.url for r in records), "--api-key", records[0].api_key, "--num-shards", "3",
                   "--concurrency-per-server", "4")
        output = tmp_path / "ds"
    else:
        config = tmp_path / "run.yaml"
        config.write_text(yaml.safe_dump({**json.loads(cfg.model_dump_json()), "prompts": str(prompts)}))
        argv = cli("--config", str(config))
        output = Path(cfg.output)
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    written = kill_when(proc, output, 450)
    settle(records)
    assert 450 <= len(written) < 900  # killed in the middle
    sent_before = requests_total(records)
    turns = turn_requests(prompts)
    partial = turns_journaled(output)
    rerun = subprocess.run(argv, capture_output=True, text=True, timeout=300)
    assert rerun.returncode == 0, rerun.stderr[-2000:]
    left = sum(n - partial.get(i, 0) for i, n in turns.items() if i not in written)
    assert requests_total(records) - sent_before == left
    in_flight_at_kill = (sent_before - sum(turns[i] for i in written)
                         - sum(n for i, n in partial.items() if i not in written))
    assert 0 <= in_flight_at_kill <= 2 * 4  # what was in flight: the only requests made twice
    df = pd.read_parquet(output / "data")
    assert len(df) == 900 and df["id"].is_unique


def test_a_recorded_server_that_does_not_match_is_never_used(make_config, tiny_model, tmp_path):
    """(5) a healthy server on a recorded port: reused only if it serves this run's model with
    this run's arguments; another run's mismatching server is refused, naming why; a teardown
    stops only its own run's servers."""
    import shutil

    other_model = tmp_path / "other-model"
    shutil.copytree(tiny_model, other_model)
    (other_model / "extra.bin").write_bytes(b"another checkpoint")
    cfg = make_config(num_servers=1)
    first = launch_servers(cfg, cfg.model_path, run_id="dag/run-1")
    try:
        with pytest.raises(ServerError, match=r"belongs to run 'dag/run-1'.*serves model"):
            launch_servers(cfg, str(other_model), run_id="dag/run-2")
        with pytest.raises(ServerError, match=r"launched with other arguments.*--max-running-requests"):
            launch_servers(cfg.model_copy(update={"max_running_requests": 4}), cfg.model_path,
                          run_id="dag/run-2")
        shared = launch_servers(cfg, cfg.model_path, run_id="dag/test-run")  # same model, same args
        assert [r.pid for r in shared] == [r.pid for r in first]
        assert run("stop_servers", cfg, run_id="dag/test-run").stopped == 0
        assert first[0].running()  # the test run's teardown left the owner's server alone
        relaunched = launch_servers(cfg.model_copy(update={"max_running_requests": 4}), cfg.model_path,
                                   run_id="dag/run-1")  # the owner itself: relaunched, not refused
        assert relaunched[0].pid != first[0].pid and not first[0].running()
    finally:
        stop_records(read_state(RunLayout(cfg.output)), grace_s=5)


def test_a_reused_pid_is_never_signalled(tmp_path):
    """(5) a recorded server whose PID now belongs to another process is not that process."""
    from regen.servers.records import ServerRecord

    other = subprocess.Popen(["sleep", "600"], start_new_session=True)
    try:
        stale = ServerRecord(0, None, "127.0.0.1", 1, other.pid, "/dev/null", None, start_ticks=1)
        assert not stale.running()
        assert stop_records([stale], grace_s=1) == []
        assert other.poll() is None  # still alive: never signalled
    finally:
        other.kill()
        other.wait()


def test_rows_carry_the_fingerprint_of_the_copy_the_servers_loaded(make_config, tmp_path, tiny_model):
    """(6) the checkpoint rewritten in place mid-run: rows still name what the servers serve."""
    import shutil

    source = tmp_path / "ckpt"
    shutil.copytree(tiny_model, source)
    cfg = make_config(model_path=str(source), num_servers=1, num_shards=1)
    staged = run("stage_weights", cfg)
    run("start_servers", cfg, served_model_path=staged.path)
    try:
        weights = next(source.glob("*.safetensors"))
        with open(weights, "r+b") as fh:  # retrained in place while the run goes on
            fh.write(b"\x01" * 64)
        assert model_fingerprint(source) != staged.fingerprint
        run("generate", cfg, shards=[0])
    finally:
        run("stop_servers", cfg)
    df = pd.read_parquet(Path(cfg.output) / "data")
    assert set(df["settings_hash"]) == {settings_hash(staged.fingerprint, cfg.sampling_settings())}
    assert Manifest(RunLayout(cfg.output)).read()["model"]["fingerprint"] == staged.fingerprint


def test_more_shards_than_airflow_can_map_fail_preflight(make_config):
    """(7) num_shards above max_map_length: refused before any GPU time, naming both numbers."""
    with pytest.raises(PreflightFailed) as err:
        run("preflight", make_config(num_shards=1100), code=False, max_map_length=1024)
    assert any("num_shards 1100 is above this Airflow's max_map_length 1024" in p for p in err.value.problems)


def test_a_prompt_file_changed_while_shards_run_fails_them_and_loses_nothing(sim_servers, tmp_path):
    """(8) the file changes under running shards: the shard that reads a changed record fails
    clearly (finished rows kept), and one that starts afterwards refuses the stale manifest."""
    prompts = write_prompts(tmp_path / "p.jsonl", 300)
    cfg, records = sim_servers(num_servers=1, sim_tokens_per_second=300, concurrency_per_server=2,
                               prompts=str(prompts), num_shards=2)
    run("preflight", cfg, code=False)
    endpoints = [(r.url, r.api_key) for r in records]
    fingerprint = model_fingerprint(cfg.model_path)
    errors: list[BaseException] = []

    def shard0():
        try:
            ShardRun(cfg, endpoints, 0, fingerprint, FAST, rebuild_index=False).run()
        except BaseException as exc:  # noqa: BLE001 - the test inspects it
            errors.append(exc)

    worker = threading.Thread(target=shard0)
    worker.start()
    journal = RunLayout(cfg.output).journal(0, 2)
    wait_until(lambda: len(list(Journal.rows(journal))) >= 10, 60, "10 rows")
    write_prompts(prompts, 300, edit=range(0, 300))  # every record rewritten in place
    worker.join(timeout=120)
    assert len(errors) == 1 and isinstance(errors[0], ShardFailed)
    assert "changed while the run went on" in str(errors[0])
    assert sum(1 for _ in Journal.rows(journal)) >= 10  # what was finished is kept
    assert not RunLayout(cfg.output).shard_file(0, 2).exists()  # nothing half-true published
    with pytest.raises(ManifestError, match="changed since preflight"):
        ShardRun(cfg, endpoints, 1, fingerprint, FAST, rebuild_index=False).run()


def test_a_shard_publishes_only_when_it_holds_exactly_its_ids(tmp_path):
    from regen.store import ShardStore

    store = ShardStore(RunLayout(tmp_path / "ds"), 0, 1)
    journal = Journal(store.journal_path)
    journal.append({"id": "a", "prompt_hash": "ha", "settings_hash": "s", "error": None})
    journal.close()
    with pytest.raises(ShardFailed, match="rows for 1 of its 2 prompts"):
        store.publish({"a": "ha", "b": "hb"}, "s")
    assert not store.final.exists() and store.journal_path.exists()


def test_the_audit_fails_rows_this_run_did_not_produce(sim_servers, tmp_path):
    """Mixed settings, stale prompts and prompts the data lacks fail the audit; rows are counted
    per settings hash."""
    cfg, records = sim_servers(num_servers=1, num_shards=2)
    prompts = write_prompts(tmp_path / "p.jsonl", 200)
    cfg = cfg.model_copy(update={"prompts": str(prompts)})
    run("preflight", cfg, code=False)
    run("generate", cfg, shards=[0])
    run("generate", cfg.model_copy(update={"max_tokens": 900}), shards=[1])  # another setting
    write_prompts(prompts, 205, edit=[3])
    run("preflight", cfg, code=False)  # the next run's manifest: p3 is not what it was, p200-p204 are new
    report = audit_dataset(cfg.output, cfg.model_path, tmp_path / "audit",
                           AuditThresholds(1, 1.0, train_layout="conversation"))  # a sample per row
    doc = report.to_json()
    assert doc["verdict"] == "FAIL"
    per_hash = doc["provenance"]["rows_per_settings_hash"]
    files = {pd.read_parquet(p)["settings_hash"].iloc[0]: len(pd.read_parquet(p))
             for p in RunLayout(cfg.output).shard_files()}
    assert per_hash == files  # two settings, counted
    run_hash = Manifest(RunLayout(cfg.output)).read()["settings_hash"]
    assert doc["provenance"]["settings_hash"] == run_hash
    assert doc["counts"]["foreign_settings"] == sum(n for h, n in files.items() if h != run_hash)
    assert doc["counts"]["stale_prompt"] == 1
    assert "NOT THIS RUN'S" in doc["summary"][3]
    assert doc["provenance"]["missing_ids"] == 5 and doc["provenance"]["missing_examples"] == ["p200", "p201", "p202"]
    assert any(r.startswith("5 prompts of the published shards have no row") for r in doc["reasons"])


def test_a_cut_history_line_does_not_hide_the_run(tmp_path):
    """A writer killed mid-line (cut inside a UTF-8 character, too) leaves a bad line in
    history.jsonl: the run page's data and `regen progress` still answer, with the good lines."""
    from regen.status import run_data

    layout = RunLayout(tmp_path / "out")
    layout.history.parent.mkdir(parents=True)
    layout.history.write_bytes(b'{"t": 1, "rows": 10}\n{"t": 2, "note": "caf\xc3' + b'\n{"t": 3, "rows": 30}\n')
    assert [p["t"] for p in run_data(layout)["history"]] == [1, 3]
    out = subprocess.run([str(BIN / "regen"), "progress", "--output", str(layout.root)], capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0, out.stderr


@pytest.mark.parametrize("cut_line", [b'{"id": "c", "tex', b'{"id": "c", "text": "' + b"x" * 200_000])
def test_a_cut_journal_line_is_dropped_without_reading_the_journal_whole(tmp_path, monkeypatch, cut_line):
    """A kill mid-append leaves a cut last line (here also one longer than a read block): it is
    dropped, every whole line kept, the next append starts a fresh line; the repair reads only
    blocks from the end."""
    from regen import store

    path = tmp_path / "journal.jsonl"
    whole = b"".join(json.dumps({"id": f"r{i}", "text": "y" * 500}).encode() + b"\n" for i in range(2000))
    path.write_bytes(whole + cut_line)
    reads: list[int] = []
    real_open = open

    class Counting:
        def __init__(self, fh):
            self.fh = fh

        def read(self, size=-1):
            reads.append(size)
            return self.fh.read(size)

        def __getattr__(self, name):
            return getattr(self.fh, name)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.fh.close()

    monkeypatch.setattr(store, "open", lambda p, mode="r", *a, **k: Counting(real_open(p, mode, *a, **k))
                        if mode == "rb+" else real_open(p, mode, *a, **k), raising=False)
    journal = Journal(path)
    journal.append({"id": "d", "text": "z"})
    journal.close()
    assert path.read_bytes() == whole + json.dumps({"id": "d", "text": "z"}).encode() + b"\n"
    assert reads and all(0 <= size <= store.REPAIR_BLOCK for size in reads)


def test_prompts_appended_while_preflight_reads_them_are_never_silently_left_out(make_config, tmp_path):
    """A prompt file still being written: lines appended while the index is built may be missing
    from it, so that index is not recorded as describing the file; the next preflight takes all."""
    from regen.manifest import PromptIndexWriter
    from regen.prompts import read_prompts

    cfg = make_config(prompts=str(write_prompts(tmp_path / "p.jsonl", 10)))
    index = PromptIndexWriter(cfg)
    for item in read_prompts(cfg.prompts):
        index.feed(item)
    with open(cfg.prompts, "a") as fh:
        fh.write(json.dumps({"id": "late", "prompt": "Appended while preflight read the file?"}) + "\n")
    with pytest.raises(ManifestError, match="changed while it was read"):
        Manifest(cfg.layout).write_prompts(cfg, index, "run")
    assert Manifest(cfg.layout).current_for(cfg) is None
    run("preflight", cfg, code=False)
    assert Manifest(cfg.layout).current_for(cfg)["prompts"]["count"] == 11


def test_a_journals_heads_and_rows_are_the_same_lines_whatever_the_file_holds(tmp_path, monkeypatch):
    """Settling reads a journal's heads with Arrow's reader, publishing its rows as JSON: both must
    take the same lines as a plain line-by-line reading does (blank and non-JSON lines passed over,
    a line longer than the reader's block, a field of an odd type, a last line a kill cut), and the
    reader goes on after a line it could not take."""
    from regen import store as store_module

    monkeypatch.setattr(store_module, "HEAD_BLOCK", 4096)
    opened = []
    open_json = store_module.pj.open_json
    monkeypatch.setattr(store_module.pj, "open_json", lambda *a, **k: opened.append(1) or open_json(*a, **k))
    stamp = {"prompt_hash": "h", "settings_hash": "s"}
    lines = [json.dumps({"id": f"r{i}", "error": None, "content": "x\n", "completion_token_ids": [i] * 20, **stamp})
             for i in range(200)]
    lines[10] = json.dumps({"id": "r10", "partial": True, "turn": 0, "content": "step", **stamp})
    lines[20] = ""
    lines[30] = "not json"
    lines[40] = json.dumps({"id": "r40", "error": {"code": 500}, "retryable": True, **stamp})
    lines[50] = json.dumps({"id": "r50", "error": None, "completion_token_ids": list(range(3000)), **stamp})
    lines[150] = ""
    path = tmp_path / "journal.jsonl"
    path.write_text("".join(line + "\n" for line in lines) + '{"id": "cut", "error": nu')

    def plain(partial):
        for line in lines:
            try:
                row = json.loads(line)
            except ValueError:
                continue
            if partial is None or bool(row.get("partial")) is partial:
                yield row

    for partial in (False, True, None):
        expected = list(plain(partial))
        assert list(Journal.rows(path, partial)) == expected
        heads = list(Journal.heads(path, partial))
        assert [h["id"] for h in heads] == [r["id"] for r in expected]
        assert [h["error"] for h in heads] == [r.get("error") for r in expected]
        assert list(Journal.rows_at(path, [h["at"] for h in heads])) == expected
    assert len(opened) > 3  # per reading: the reader again after each line it passed to JSON
    assert [h["retryable"] for h in Journal.heads(path) if h["id"] == "r40"] == [True]


def test_a_resumed_shards_memory_follows_its_unfinished_conversations_not_its_journal(tmp_path):
    """A resume keeps the finished turns (with their 4k token ids) of the conversations still going
    only: a journal four times longer in finished conversations costs the same peak (within 20%)."""
    import random
    import tracemalloc

    from regen.store import ShardStore

    def peak_of_resume(finished: int) -> tuple[int, dict]:
        store = ShardStore(RunLayout(tmp_path / f"out-{finished}"), 0, 1)
        journal = Journal(store.journal_path)
        ids = [random.randrange(1_000, 150_000) for _ in range(4_000)]
        stamp = {"prompt_hash": "h", "settings_hash": "s"}
        for c in range(finished + 5):
            for turn in range(3):
                journal.append({"id": f"c{c}", "partial": True, "turn": turn, "content": "step",
                                "completion_token_ids": ids, **stamp})
            if c < finished:  # its last turn came back: the conversation is a row of the dataset
                journal.append({"id": f"c{c}", "error": None, "content": "done", **stamp})
        journal.close()
        hashes = {f"c{c}": "h" for c in range(finished + 5)}
        tracemalloc.start()
        turns: dict = {}
        store.settled_and_failed(hashes, "s", turns)
        resumed = store.turns_at(turns)
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
        return peak, resumed

    short_peak, short = peak_of_resume(100)
    long_peak, long = peak_of_resume(400)
    assert sorted(long) == [f"c{c}" for c in range(400, 405)] and all(len(a) == 3 for a in long.values())
    assert sorted(short) == [f"c{c}" for c in range(100, 105)]
    assert long_peak <= 1.2 * short_peak, f"{long_peak / 2**20:.1f} MB against {short_peak / 2**20:.1f} MB"


def test_a_publish_batches_rows_by_their_bytes_not_only_their_count(tmp_path, monkeypatch):
    """Rows of long answers with their token ids: a publish writes them a few at a time (a 1,000-row
    batch of 32k-token rows would be ~1.2 GB of Python objects), and the file holds every one."""
    import pyarrow.parquet as pq

    from regen import store as store_module
    from regen.store import ShardStore

    monkeypatch.setattr(store_module, "PUBLISH_BATCH_BYTES", 4 << 20)
    store = ShardStore(RunLayout(tmp_path / "out"), 0, 1)
    journal = Journal(store.journal_path)
    ids = list(range(1_000, 33_000))  # 32,000 ids: ~1.2 MB as Python objects
    for i in range(20):
        journal.append({"id": f"r{i}", "error": None, "content": "done", "completion_token_ids": ids,
                        "prompt_hash": "h", "settings_hash": "s"})
    journal.close()
    assert store.publish({f"r{i}": "h" for i in range(20)}, "s") == 20
    written = pq.ParquetFile(store.final)
    assert written.metadata.num_rows == 20 and written.metadata.num_row_groups >= 5  # 3-4 rows a batch
