"""A dataset written to and resumed from an object store: regen's parts protocol against Delta Lake
(`deltalake`, exactly-once by transaction ids) and a plain `pyarrow.dataset.write_dataset` to the same
S3 server (moto's, on loopback).

regen seals the rows into parts of ``--part-rows`` (each a create-only PUT and a create-only
commit, the claim checked before and after), settles a resume (lists the valid commits, reads
each part's id and hash columns) and publishes the shard (reads the parts' ids, then streams them
into a file in the work folder; one PUT of it and its commit, the parts deleted). The baseline is what a user writes without
exactly-once: `write_dataset` with files of the same row count, then a resume that scans the id
and hash columns of every file it finds. Requests are counted from the server's own request log.

Then regen and Delta Lake under the same SIGKILL fuzz and rerun: a writer process (sealing parts,
or appending them under transaction ids, each resuming what is committed) killed ``--kills`` times
at random moments, then run to its end; then a rerun that edits a tenth of the rows (regen: the
edited prompts' rows resent and the shard republished; Delta: one overwrite of those ids). After
each, the rows every reader sees: the format's own (regen's `data/`, or the Delta table) and a
reader that globs the prefix's parquet files, as `datasets` and pandas users do.

    .venv/bin/python bench/bench_objectstore.py [--rows 50000] [--part-rows 10000] [--rounds 3] [--kills 10]
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import boto3
import pyarrow as pa
import pyarrow.dataset as ds
import pyarrow.parquet as pq
from harness import alternating, write_section
from pyarrow.fs import S3FileSystem

from regen.layout import RunLayout
from regen.objectstore import open_store
from regen.parts import BucketShardStore
from regen.store import SETTLE_COLUMNS
from regen.rows import ROW_SCHEMA
from regen.servers.probe import port_is_free

KEYS = {"AWS_ACCESS_KEY_ID": "bench", "AWS_SECRET_ACCESS_KEY": "bench-secret", "AWS_DEFAULT_REGION": "us-east-1"}


def make_rows(count: int) -> list[dict]:
    """Rows as the generator hands them over: dicts, which both sides turn into Arrow."""
    reasoning = "Let me work through this carefully, one step at a time. " * 25
    return [{
        "id": f"q{i:07d}", "messages": [{"role": "user", "content": f"Question {i}: what is {i % 97} x {i % 89}?"}],
        "reasoning_content": reasoning, "content": f"The answer is {(i % 97) * (i % 89)}.", "finish_reason": "stop",
        "prompt_tokens": 30, "completion_tokens": 400, "error": None, "prompt_hash": f"h{i}", "settings_hash": "s",
    } for i in range(count)]


class Server:
    """moto's S3 server; its request log is the request count."""

    def __init__(self, folder: Path):
        self.port = next(p for p in range(28400, 28500) if port_is_free("127.0.0.1", p))
        self.log = folder / "moto.log"
        with open(self.log, "wb") as out:
            self.proc = subprocess.Popen([str(Path(sys.executable).parent / "moto_server"), "-H", "127.0.0.1",
                                          "-p", str(self.port)], stdout=out, stderr=subprocess.STDOUT)
        self.endpoint = f"http://127.0.0.1:{self.port}"
        while port_is_free("127.0.0.1", self.port):
            if self.proc.poll() is not None:
                raise SystemExit(f"moto_server exited: {self.log.read_text()[-1000:]}")
            time.sleep(0.1)

    def filesystem(self) -> S3FileSystem:
        return S3FileSystem(access_key=KEYS["AWS_ACCESS_KEY_ID"], secret_key=KEYS["AWS_SECRET_ACCESS_KEY"],
                            endpoint_override=self.endpoint, scheme="http", region="us-east-1")

    def requests(self) -> int:
        return sum(1 for line in self.log.read_text(errors="replace").splitlines() if " HTTP/1.1" in line)


def run_regen(server: Server, bucket: str, rows: list[dict], part_rows: int, work: Path) -> dict:
    store = open_store(f"s3://{bucket}/regen-{uuid.uuid4().hex[:6]}")
    hashes = {r["id"]: r["prompt_hash"] for r in rows}
    shard = BucketShardStore(RunLayout(work / uuid.uuid4().hex[:6]), 0, 1, store, part_rows, 1e9)
    marks = [(time.perf_counter(), server.requests())]
    shard.parts.claim("bench")
    for start in range(0, len(rows), part_rows):
        shard.parts.seal(rows[start:start + part_rows])
    marks.append((time.perf_counter(), server.requests()))
    settled, _, _ = BucketShardStore(shard.layout, 0, 1, store, part_rows, 1e9).settled_and_failed(hashes, "s")
    assert len(settled) == len(rows)
    marks.append((time.perf_counter(), server.requests()))
    assert shard.publish(hashes, "s") == len(rows)
    marks.append((time.perf_counter(), server.requests()))
    return _phases(marks, ("write", "settle", "publish"))


def run_baseline(server: Server, bucket: str, rows: list[dict], part_rows: int, work: Path) -> dict:
    fs = server.filesystem()
    path = f"{bucket}/base-{uuid.uuid4().hex[:6]}"
    marks = [(time.perf_counter(), server.requests())]
    ds.write_dataset(pa.Table.from_pylist(rows, schema=ROW_SCHEMA), path, format="parquet", filesystem=fs, max_rows_per_file=part_rows,
                     max_rows_per_group=part_rows, existing_data_behavior="error",
                     file_options=ds.ParquetFileFormat().make_write_options(compression="zstd"))
    marks.append((time.perf_counter(), server.requests()))
    ids = ds.dataset(path, format="parquet", filesystem=fs).to_table(columns=SETTLE_COLUMNS).column("id")
    assert len(set(ids.to_pylist())) == len(rows)
    marks.append((time.perf_counter(), server.requests()))
    return _phases(marks, ("write", "settle"))


def run_delta(server: Server, bucket: str, rows: list[dict], part_rows: int, work: Path) -> dict:
    """Delta Lake (deltalake), the transactional table a skilled user reaches for: an append per
    part whose commit carries an application transaction (the shard and the part's number), so a
    retried append is skipped; S3's conditional PUT (``conditional_put: etag``) makes the commits
    safe between writers. The table is the dataset (deltalake, DuckDB and Polars read it): no publish."""
    from deltalake import CommitProperties, DeltaTable, Transaction, write_deltalake

    uri = f"s3://{bucket}/delta-{uuid.uuid4().hex[:6]}"
    options = _delta_options(server.endpoint)
    marks = [(time.perf_counter(), server.requests())]
    for part, start in enumerate(range(0, len(rows), part_rows)):
        write_deltalake(uri, pa.Table.from_pylist(rows[start:start + part_rows], schema=ROW_SCHEMA), mode="append",
                        storage_options=options,
                        commit_properties=CommitProperties(app_transactions=[Transaction("shard-00000", part)]))
    marks.append((time.perf_counter(), server.requests()))
    table = DeltaTable(uri, storage_options=options)
    assert table.transaction_version("shard-00000") == (len(rows) - 1) // part_rows
    ids = table.to_pyarrow_table(columns=SETTLE_COLUMNS).column("id")
    assert len(set(ids.to_pylist())) == len(rows)
    marks.append((time.perf_counter(), server.requests()))
    return _phases(marks, ("write", "settle"))


def _delta_options(endpoint: str) -> dict:
    return {"AWS_ENDPOINT_URL": endpoint, "AWS_ALLOW_HTTP": "true", "AWS_REGION": "us-east-1",
            "conditional_put": "etag", **{k: v for k, v in KEYS.items() if k != "AWS_DEFAULT_REGION"}}


def write_to_end(mode: str, uri: str, work: Path, rows_file: Path, part_rows: int, endpoint: str) -> None:
    """One writer process of the fuzz: everything its store does not hold yet, in parts; killed
    at any moment, the next one resumes. Rows whose prompt hash changed since are written again."""
    rows = pq.read_table(rows_file).to_pylist()
    if mode == "regen":
        shard = BucketShardStore(RunLayout(work), 0, 1, open_store(uri), part_rows, 1e9)
        shard.parts.claim("bench")
        hashes = {r["id"]: r["prompt_hash"] for r in rows}
        settled, _, _ = shard.settled_and_failed(hashes, "s")
        todo = [r for r in rows if r["id"] not in settled]
        for start in range(0, len(todo), part_rows):
            shard.parts.seal(todo[start:start + part_rows])
        shard.publish(hashes, "s")
        return
    from deltalake import CommitProperties, DeltaTable, Transaction, write_deltalake
    from deltalake.exceptions import TableNotFoundError

    options = _delta_options(endpoint)
    try:
        table = DeltaTable(uri, storage_options=options)
    except TableNotFoundError:  # the first writer
        table = None
    run = rows_file.stem  # the rerun is its own application transaction
    edited = [r for r in rows if r["prompt_hash"].endswith("-v2")]
    if edited:  # the rerun: those ids replaced in one commit (replaceWhere)
        if table.transaction_version(run) is None:
            ids = ", ".join(f"'{r['id']}'" for r in edited)
            write_deltalake(uri, pa.Table.from_pylist(edited, schema=ROW_SCHEMA), mode="overwrite",
                            predicate=f"id IN ({ids})", storage_options=options,
                            commit_properties=CommitProperties(app_transactions=[Transaction(run, 0)]))
        return
    done = table.transaction_version("shard-00000") if table is not None else None
    done = -1 if done is None else done
    for part, start in enumerate(range(0, len(rows), part_rows)):
        if part > done:
            write_deltalake(uri, pa.Table.from_pylist(rows[start:start + part_rows], schema=ROW_SCHEMA),
                            mode="append", storage_options=options,
                            commit_properties=CommitProperties(app_transactions=[Transaction("shard-00000", part)]))


def fuzz(server: Server, mode: str, rows: list[dict], part_rows: int, kills: int, folder: Path, seed: int) -> dict:
    """Kill the writer ``kills`` times, run it to its end; the rerun with a tenth of the rows
    edited, killed once, run to its end; the rows each reader sees after each."""
    bucket = f"fuzz-{mode}-{uuid.uuid4().hex[:8]}"
    boto3.client("s3", endpoint_url=server.endpoint).create_bucket(Bucket=bucket)
    uri, work = f"s3://{bucket}/out", folder / f"work-{mode}"
    rng = random.Random(seed)
    first, rerun = folder / f"rows-{mode}.parquet", folder / f"rerun-{mode}.parquet"
    pq.write_table(pa.Table.from_pylist(rows, schema=ROW_SCHEMA), first)
    edited = [{**r, "prompt_hash": r["prompt_hash"] + "-v2", "content": r["content"] + " (edited)"}
              if i % 10 == 0 else r for i, r in enumerate(rows)]
    pq.write_table(pa.Table.from_pylist(edited, schema=ROW_SCHEMA), rerun)
    command = [sys.executable, __file__, "--writer", mode, uri, str(work), "", str(part_rows), server.endpoint]
    killed, started = 0, time.perf_counter()
    seen = {}
    for rows_file, times in ((first, kills), (rerun, max(1, kills // 5))):
        command[6] = str(rows_file)
        for _ in range(times):
            child = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            try:  # a random moment of the writer's life, its start (imports) included
                child.wait(timeout=rng.uniform(0.3, 4.0))
            except subprocess.TimeoutExpired:
                child.kill()
                killed += 1
            child.wait()
        done = subprocess.run(command, capture_output=True, text=True)
        if done.returncode != 0:
            raise SystemExit(f"{mode} writer failed after the kills: {done.stderr[-2000:]}")
        seen[rows_file.stem.split("-")[0]] = _readers(server, mode, uri, bucket)
    return {"kills": killed, "seconds": time.perf_counter() - started, **seen}


def _readers(server: Server, mode: str, uri: str, bucket: str) -> dict:
    """(rows, distinct ids, edited rows) as the format's reader and as a prefix glob see them, and
    the bytes the prefix holds."""
    fs = server.filesystem()
    if mode == "regen":
        own = ds.dataset(f"{bucket}/out/data", format="parquet", filesystem=fs).to_table(columns=["id", "content"])
    else:
        from deltalake import DeltaTable

        own = DeltaTable(uri, storage_options=_delta_options(server.endpoint)).to_pyarrow_table(columns=["id", "content"])
    objects = boto3.client("s3", endpoint_url=server.endpoint).list_objects_v2(Bucket=bucket).get("Contents", [])
    files = [f"{bucket}/{o['Key']}" for o in objects if o["Key"].endswith(".parquet")]
    glob = ds.dataset(files, format="parquet", filesystem=fs).to_table(columns=["id", "content"])

    def view(table: pa.Table) -> tuple[int, int, int]:
        ids = table.column("id").to_pylist()
        return len(ids), len(set(ids)), sum(c.endswith("(edited)") for c in table.column("content").to_pylist())

    return {"own": view(own), "glob": view(glob), "bytes": sum(o["Size"] for o in objects), "objects": len(objects)}


def _fuzz_table(results: dict[str, dict], rows: int) -> str:
    lines = ["| format | SIGKILLs | time s | after the kills: own reader / prefix glob (rows, distinct) | "
             "after the rerun: own reader / prefix glob (rows, distinct, edited) | objects, MB stored |",
             "| --- | --- | --- | --- | --- | --- |"]
    for mode, r in results.items():
        first, rerun = r["rows"], r["rerun"]
        lines.append(f"| {mode} | {r['kills']} | {r['seconds']:.1f} | {first['own'][:2]} / {first['glob'][:2]} | "
                     f"{rerun['own']} / {rerun['glob']} | {rerun['objects']}, {rerun['bytes'] / 1e6:.1f} |")
    exact = {mode: r["rerun"]["own"] == (rows, rows, rows // 10) and r["rows"]["own"][:2] == (rows, rows)
             for mode, r in results.items()}
    globbed = {mode: r["rerun"]["glob"][:2] == (rows, rows) for mode, r in results.items()}
    lines += ["", f"{rows:,} rows: exactly once to its own reader after the kills and the rerun: "
              + ", ".join(f"{m} {'yes' if ok else 'NO'}" for m, ok in exact.items())
              + "; exactly once to a reader that globs the prefix: "
              + ", ".join(f"{m} {'yes' if ok else 'NO'}" for m, ok in globbed.items()) + "."]
    if exact["regen"] and globbed["regen"] and not globbed["deltalake"]:
        twice = results["deltalake"]["rerun"]["glob"][0] - rows
        lines[-1] += (" The design kept: regen's protocol. Delta Lake is exactly once only to Delta readers (deltalake, "
                      "DuckDB's and Polars' Delta scans): the files a rerun replaces stay under the prefix until a "
                      "VACUUM (7 days by default), as would a file a killed append wrote before its commit, and "
                      "`datasets`' `data_files` glob or `pandas.read_parquet` of the folder read them as rows (here "
                      f"{twice:,} rows twice: the overwrite of a tenth of the ids rewrote every file holding one); "
                      "regen's `data/` is exactly the dataset to every Parquet reader.")
    return "\n".join(lines)


def _phases(marks: list[tuple[float, int]], names: tuple[str, ...]) -> dict:
    return {name: (b[0] - a[0], b[1] - a[1]) for name, a, b in zip(names, marks, marks[1:])}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", type=int, default=50_000)
    parser.add_argument("--part-rows", type=int, default=10_000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--kills", type=int, default=10)
    parser.add_argument("--writer", nargs=6, help=argparse.SUPPRESS)  # a fuzz's writer process
    args = parser.parse_args()
    os.environ.update(KEYS)
    if args.writer:
        mode, uri, work, rows_file, part_rows, endpoint = args.writer
        os.environ["AWS_ENDPOINT_URL"] = endpoint
        write_to_end(mode, uri, Path(work), Path(rows_file), int(part_rows), endpoint)
        return
    rows = make_rows(args.rows)
    runs = {"regen": run_regen, "deltalake": run_delta, "write_dataset": run_baseline}
    results: dict[str, list[dict]] = {m: [] for m in runs}
    with tempfile.TemporaryDirectory() as tmp:
        server = Server(Path(tmp))
        os.environ["AWS_ENDPOINT_URL"] = server.endpoint
        try:
            for r, mode in alternating(list(runs), args.rounds):
                bucket = f"bench-{uuid.uuid4().hex[:10]}"
                boto3.client("s3", endpoint_url=server.endpoint).create_bucket(Bucket=bucket)
                results[mode].append(runs[mode](server, bucket, rows, args.part_rows, Path(tmp)))
                done = results[mode][-1]
                print(f"round {r}: {mode}: " + ", ".join(f"{k} {s:.2f} s / {n} requests" for k, (s, n) in done.items()))
            fuzzed = {}
            for seed, mode in enumerate(("regen", "deltalake")):
                fuzzed[mode] = fuzz(server, mode, rows, args.part_rows, args.kills, Path(tmp), seed)
                print(f"fuzz: {mode}: {fuzzed[mode]}")
        finally:
            server.proc.terminate()
            server.proc.wait()
    body = _table(results, args) + "\n\n" + _fuzz_table(fuzzed, args.rows)
    write_section("Object storage: write, resume, publish", ".venv/bin/python bench/bench_objectstore.py", body)


def _table(results: dict[str, list[dict]], args) -> str:
    rows = args.rows
    lines = ["| client | write s (rows/s) | settle a resume s | publish s | all s | requests | requests per 1,000 rows |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    medians = {}
    for mode, runs in results.items():
        med = {phase: statistics.median(r[phase][0] for r in runs) for phase in runs[0]}
        reqs = statistics.median(sum(n for _, n in r.values()) for r in runs)
        total = sum(med.values())
        medians[mode] = total
        lines.append(f"| {mode} | {med['write']:.2f} ({rows / med['write']:,.0f}) | {med['settle']:.2f} | "
                     f"{med['publish']:.2f} | {total:.2f} | {reqs:,.0f} | {1000 * reqs / rows:.2f} |"
                     if "publish" in med else
                     f"| {mode} | {med['write']:.2f} ({rows / med['write']:,.0f}) | {med['settle']:.2f} | none | "
                     f"{total:.2f} | {reqs:,.0f} | {1000 * reqs / rows:.2f} |")
    ratio = medians["write_dataset"] / medians["regen"]
    delta = medians["deltalake"] / medians["regen"]
    lines.append("")
    lines.append(
        f"{rows:,} rows (~1.6 kB of reasoning each, handed over as dicts, which both sides turn into Arrow), parts and files of {args.part_rows:,} rows, zstd; moto's S3 "
        f"server on loopback (objects in its memory); medians of {args.rounds} rounds, order alternated, a fresh "
        f"prefix each. Write + settle + publish: regen takes {1 / ratio:.2f}x the time of write_dataset + its "
        f"resume scan. What the difference buys: regen's rows are in `data/` exactly once whatever was killed "
        f"when (create-only writes, commits, fences); write_dataset's files appear as they are written, a killed "
        f"writer leaves a partial dataset that a resume cannot tell from a whole one, and two writers both land. "
        f"Delta Lake is exactly-once too (idempotent appends by transaction id, conditional PUT commits) and "
        f"takes {delta:.2f}x regen's time, with nothing to publish; its readers are deltalake, DuckDB and Polars "
        f"(pandas and `datasets` read regen's `data/` directly).")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
