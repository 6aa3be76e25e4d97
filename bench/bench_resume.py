"""Settling a resume: 1,000,000 prompts over 64 shards, half of each shard already journaled; then
journals as an engine writes them (token ids, long reasoning, conversations cut mid-way).

"Settling" is what a shard does before its first request: learn its ids and their hashes, read
its journal and shard file, keep the rows of this run, and find the prompts still to send. regen
reads its slice of the prompt index that preflight wrote (sorted by shard) and then only the
pending records, by offset. The baseline is what regen did before the index (and what a careful
hand script does): each shard streams the whole prompt file, keeps its own ids (a hash of the id)
and hashes their messages. Both settle the same 64 shards, one after the other, in one process.

The second part is the journal's side, as a one-process resume of every shard (`regen generate`
without `--shard`) settles it: each journaled row carries the engine's token ids (``--ids``) and
~8 KB of text, and a fifth of the unfinished conversations have finished turns to resume from.
regen settles as ShardRun does (each journal's heads read by Arrow's JSON reader, the shards at
once in threads), and as the same code one shard after another; the baseline is the script a
skilled user writes: every line read with ``json.loads``, one process per shard over a pool of
one per core.

    .venv/bin/python bench/bench_resume.py [--prompts 1000000] [--shards 64]
        [--id-prompts 100000] [--id-shards 8] [--ids 2500] [--parts index,journal]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import random
import tempfile
import time
from pathlib import Path

from harness import alternating, write_section

from regen.config import RunConfig
from regen.generate import ShardRun
from regen.layout import RunLayout
from regen.manifest import Manifest, PromptIndexWriter, prompt_hash, settings_hash, template_kwargs
from regen.prompts import Prompt, read_at, read_prompts, shard_of
from regen.store import Journal, ShardStore


def make_prompts(path: Path, count: int) -> None:
    with path.open("w") as fh:
        for i in range(count):
            fh.write(json.dumps({"id": f"q{i}", "messages": [
                {"role": "system", "content": "You are a careful assistant."},
                {"role": "user", "content": f"Question {i}: what is {i % 97} times {i % 89}?"}]}) + "\n")


def settle_regen(cfg: RunConfig, run_hash: str) -> int:
    """Every shard as ShardRun settles it; returns how many prompts are pending in all."""
    manifest = Manifest(RunLayout(cfg.output))
    manifest.ensure(cfg, rebuild=False)
    pending_total = 0
    for shard in range(cfg.num_shards):
        prompts = manifest.shard_prompts(shard)
        settled, _ = ShardStore(manifest.layout, shard, cfg.num_shards).settled(prompts.hashes, run_hash)
        pending = set(prompts.ids) - settled
        places = sorted((prompts.places[i] for i in pending), key=lambda p: p[1])
        kwargs = template_kwargs(cfg)
        for item in read_at(cfg.prompts, places):
            assert prompt_hash(item.messages, kwargs) == prompts.hashes[item.id]
            pending_total += 1
    return pending_total


def settle_baseline(cfg: RunConfig, run_hash: str) -> int:
    """Every shard streams the prompt file, keeps its ids and their hashes, reads its journal."""
    kwargs = template_kwargs(cfg)
    pending_total = 0
    for shard in range(cfg.num_shards):
        hashes = {p.id: prompt_hash(p.messages, kwargs) for p in read_prompts(cfg.prompts)
                  if isinstance(p, Prompt) and shard_of(p.id, cfg.num_shards) == shard}
        settled, _ = ShardStore(RunLayout(cfg.output), shard, cfg.num_shards).settled(hashes, run_hash)
        pending_total += len(set(hashes) - settled)
    return pending_total


def index_prompts(cfg: RunConfig) -> float:
    """Preflight's prompt index; returns its seconds."""
    started = time.perf_counter()
    index = PromptIndexWriter(cfg)
    for item in read_prompts(cfg.prompts):
        index.feed(item)
    Manifest(RunLayout(cfg.output)).write_prompts(cfg, index, "bench")
    return time.perf_counter() - started


def journal_with_ids(cfg: RunConfig, run_hash: str, ids: int) -> tuple[int, int]:
    """Half of every shard journaled as rows with ``ids`` token ids; of the other half, one in five
    cut after its first turn. Returns (rows journaled, journal bytes)."""
    rng = random.Random(5)
    token_ids = [rng.randrange(150_000) for _ in range(ids)]
    text = "reasoning " * 800
    manifest = Manifest(RunLayout(cfg.output))
    rows = size = 0
    for shard in range(cfg.num_shards):
        prompts = manifest.shard_prompts(shard)
        store = ShardStore(manifest.layout, shard, cfg.num_shards)
        journal = Journal(store.journal_path)
        for k, prompt_id in enumerate(prompts.ids):
            stamp = {"prompt_hash": prompts.hashes[prompt_id], "settings_hash": run_hash}
            if k % 2 == 0:
                journal.append({"id": prompt_id, "error": None, "reasoning_content": text, "content": "answer",
                                "completion_token_ids": token_ids, **stamp})
                rows += 1
            elif k % 10 == 1:
                journal.append({"id": prompt_id, "partial": True, "turn": 0, "reasoning_content": text,
                                "content": "step", "completion_token_ids": token_ids, **stamp})
        journal.close()
        size += store.journal_path.stat().st_size
    return rows, size


def settle_shard_run(cfg: RunConfig, run_hash: str, at_once: bool) -> int:
    """Every shard as a one-process resume settles it (ShardRun._settle); ``at_once`` False: the
    same per-shard code, one shard after another."""
    shard_run = ShardRun(cfg, [], list(range(cfg.num_shards)), "bench")
    shard_run.settings_hash = run_hash
    doc = shard_run.manifest.ensure(cfg, rebuild=False)
    if at_once:
        work = shard_run._settle(doc)
    else:
        work = [shard_run._settle_shard(store, doc, True) for store in shard_run.stores]
    assert sum(len(s.resumed) for s in work) > 0
    return sum(len(s.pending) for s in work)


def _settle_by_json(job: tuple[str, str, int, int]) -> int:
    output, run_hash, shard, num_shards = job
    prompts = Manifest(RunLayout(output)).shard_prompts(shard)
    settled: set[str] = set()
    turns: dict[str, list[dict]] = {}
    with open(ShardStore(RunLayout(output), shard, num_shards).journal_path, "rb") as fh:
        for line in fh:
            row = json.loads(line)
            if prompts.hashes.get(row["id"]) != row["prompt_hash"] or row["settings_hash"] != run_hash:
                continue
            if row.get("partial"):
                turns.setdefault(row["id"], []).append(row)
            else:
                settled.add(row["id"])
                turns.pop(row["id"], None)
    assert turns
    return len(set(prompts.ids) - settled)


def settle_by_json(cfg: RunConfig, run_hash: str) -> int:
    """The baseline: each shard's journal read with json.loads, one process per shard, a pool of one per core."""
    with multiprocessing.Pool(os.cpu_count()) as pool:
        return sum(pool.map(_settle_by_json, [(cfg.output, run_hash, k, cfg.num_shards)
                                              for k in range(cfg.num_shards)]))


def bench_ids(args, tmp: Path) -> None:
    make_prompts(tmp / "id-prompts.jsonl", args.id_prompts)
    cfg = RunConfig(prompts=str(tmp / "id-prompts.jsonl"), output=str(tmp / "id-out"), num_shards=args.id_shards)
    index_prompts(cfg)
    run_hash = settings_hash("bench-model", cfg.sampling_settings())
    journaled, size = journal_with_ids(cfg, run_hash, args.ids)
    settlers = {"regen, the shards at once (ShardRun's settle)": lambda: settle_shard_run(cfg, run_hash, True),
                "regen, one shard after another (the same code)": lambda: settle_shard_run(cfg, run_hash, False),
                "baseline: json.loads per line, a process per shard (pool of one per core)":
                    lambda: settle_by_json(cfg, run_hash)}
    rounds: dict[str, list[float]] = {name: [] for name in settlers}
    for _, name in alternating(list(settlers), 2):
        started = time.perf_counter()
        pending = settlers[name]()
        rounds[name].append(time.perf_counter() - started)
        assert pending == args.id_prompts - journaled, (name, pending)
    best = {name: min(times) for name, times in rounds.items()}
    fastest = min(best.values())
    rows = ["| settling every shard's journal | seconds, each round | MB/s of journal (best) | vs the fastest |",
            "| --- | --- | --- | --- |"]
    for name, times in rounds.items():
        rows.append(f"| {name} | {' · '.join(f'{t:.1f}' for t in times)} | {size / 2**20 / best[name]:,.0f} | "
                    f"{best[name] / fastest:.2f}x |")
    names = list(settlers)
    body = "\n".join(rows) + (
        f"\n\n{args.id_prompts:,} prompts, {args.id_shards} shards, {journaled:,} rows journaled with "
        f"{args.ids:,} token ids and ~8 KB of text each, a fifth of the rest cut after a turn: "
        f"{size / 2**20:,.0f} MB of journal; every settler finds the same {args.id_prompts - journaled:,} "
        f"prompts to send. regen at once takes {best[names[0]]:.1f} s, "
        f"{best[names[2]] / best[names[0]]:.2f}x faster than the baseline and "
        f"{best[names[1]] / best[names[0]]:.2f}x faster than one shard after another.")
    write_section("Settling a resume: journals with token ids",
                  f".venv/bin/python bench/bench_resume.py --parts journal --id-prompts {args.id_prompts} "
                  f"--id-shards {args.id_shards} --ids {args.ids}", body)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--prompts", type=int, default=1_000_000)
    parser.add_argument("--shards", type=int, default=64)
    parser.add_argument("--id-prompts", type=int, default=100_000)
    parser.add_argument("--id-shards", type=int, default=8)
    parser.add_argument("--ids", type=int, default=2_500, help="token ids in each journaled row")
    parser.add_argument("--parts", default="index,journal", help="the parts to run (each writes its own section)")
    args = parser.parse_args()
    parts = set(args.parts.split(","))
    if "journal" in parts:
        with tempfile.TemporaryDirectory() as tmp:
            bench_ids(args, Path(tmp))
    if "index" not in parts:
        return
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        make_prompts(tmp / "prompts.jsonl", args.prompts)
        cfg = RunConfig(prompts=str(tmp / "prompts.jsonl"), output=str(tmp / "out"), num_shards=args.shards)
        index_s = index_prompts(cfg)
        run_hash = settings_hash("bench-model", cfg.sampling_settings())
        manifest = Manifest(RunLayout(cfg.output))
        journaled = 0
        for shard in range(args.shards):  # half of every shard finished before the "crash"
            prompts = manifest.shard_prompts(shard)
            journal = Journal(ShardStore(manifest.layout, shard, args.shards).journal_path)
            for prompt_id in prompts.ids[::2]:
                journal.append({"id": prompt_id, "prompt_hash": prompts.hashes[prompt_id],
                                "settings_hash": run_hash, "error": None, "content": "x" * 200})
                journaled += 1
            journal.close()
        rounds = {"regen (prompt index)": [], "baseline (each shard streams the file)": []}
        settlers = {"regen (prompt index)": settle_regen, "baseline (each shard streams the file)": settle_baseline}
        for _, name in alternating(list(settlers), 2):
            started = time.perf_counter()
            pending = settlers[name](cfg, run_hash)
            rounds[name].append(time.perf_counter() - started)
            assert pending == args.prompts - journaled, (name, pending)
    rows = ["| settling the resume of every shard | seconds, each round | per shard (best) |", "| --- | --- | --- |"]
    for name, times in rounds.items():
        rows.append(f"| {name} | {' · '.join(f'{t:.1f}' for t in times)} | {min(times) / args.shards:.2f} |")
    best = {k: min(v) for k, v in rounds.items()}
    regen_s, baseline_s = best["regen (prompt index)"], best["baseline (each shard streams the file)"]
    rows.append(f"| regen, the index build counted (preflight, once per run) | {regen_s + index_s:.1f} (best) | "
                f"{(regen_s + index_s) / args.shards:.2f} |")
    body = "\n".join(rows) + (
        f"\n\n{args.prompts:,} prompts, {args.shards} shards, {journaled:,} rows journaled (half of each "
        f"shard); both find the same {args.prompts - journaled:,} prompts to send and check their hashes. "
        f"Building the index (preflight's share, once per run): {index_s:.1f} s. regen settles "
        f"{baseline_s / regen_s:.1f}x faster, {baseline_s / (regen_s + index_s):.1f}x with the index build "
        f"counted (a run that resumes once pays it once); in a run the shards settle in parallel, so a "
        f"shard waits about the per-shard figure.")
    write_section("Settling a resume", ".venv/bin/python bench/bench_resume.py", body)


if __name__ == "__main__":
    main()
