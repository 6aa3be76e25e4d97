"""Settling a resume: 1,000,000 prompts over 64 shards, half of each shard already journaled.

"Settling" is what a shard does before its first request: learn its ids and their hashes, read
its journal and shard file, keep the rows of this run, and find the prompts still to send. regen
reads its slice of the prompt index that preflight wrote (sorted by shard) and then only the
pending records, by offset. The baseline is what regen did before the index (and what a careful
hand script does): each shard streams the whole prompt file, keeps its own ids (a hash of the id)
and hashes their messages. Both settle the same 64 shards, one after the other, in one process.

    .venv/bin/python bench/bench_resume.py [--prompts 1000000] [--shards 64]
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

from harness import alternating, write_section

from regen.config import RunConfig
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


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--prompts", type=int, default=1_000_000)
    parser.add_argument("--shards", type=int, default=64)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        make_prompts(tmp / "prompts.jsonl", args.prompts)
        cfg = RunConfig(prompts=str(tmp / "prompts.jsonl"), output=str(tmp / "out"), num_shards=args.shards)
        started = time.perf_counter()
        index = PromptIndexWriter(cfg)
        for item in read_prompts(cfg.prompts):
            index.feed(item)
        Manifest(RunLayout(cfg.output)).write_prompts(cfg, index, "bench")
        index_s = time.perf_counter() - started
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
