"""Shards sharing servers: four shards at once against the same work done one shard at a time.

Two simulated servers that batch as SGLang does (a fuller batch is slower per request and faster
in all) and report SGLang 0.5.23's `/server_info` shape: launch limit 64, effective limit 16. Each
shard is its own `regen generate --shard K` process against both servers, so the four concurrent
ones share each server's budget (effective limit plus the queue margin) through regen's slot
files. Delivered throughput is output tokens over the makespan (first process started to last
one finished, process start-up included for both). The servers' own peak of requests in flight is
read from `/server_info` at the end. Rounds alternate the order.

    .venv/bin/python bench/bench_share.py [--prompts 2400] [--rounds 2]
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

import httpx
from harness import alternating, make_prompts, simulated_servers, workspace, write_section

SHARDS = 4
LAUNCH_LIMIT, EFFECTIVE_LIMIT, MARGIN = 64, 16, 4
SIM = ["--max-running-requests", str(LAUNCH_LIMIT), "--sim-effective-max-running-requests",
       str(EFFECTIVE_LIMIT), "--sim-tokens-per-second", "300", "--sim-batch-slowdown", "0.02"]


def shard_cmd(prompts: Path, out: Path, urls: list[str], shard: int) -> list[str]:
    return [str(Path(sys.executable).parent / "regen"), "--no-progress-bar", "generate",
            "--prompts", str(prompts), "--output", str(out), "--endpoints", ",".join(urls),
            "--num-shards", str(SHARDS), "--shard", str(shard), "--max-tokens", "1024",
            "--queue-margin", str(MARGIN)]


def peak(urls: list[str]) -> int:
    """The most requests any server has had in flight since it started."""
    return max(httpx.get(f"{u}/server_info").json()["internal_states"][0]["sim_peak_requests_in_flight"]
               for u in urls)


def tokens_of(out: Path, prompts: int) -> int:
    """Output tokens in the published shards, checking every prompt has exactly one good row."""
    import pyarrow.compute as pc
    import pyarrow.parquet as pq

    table = pq.read_table(out / "data", columns=["id", "completion_tokens", "error"])
    assert table.num_rows == prompts == len(set(table["id"].to_pylist())), table.num_rows
    assert table["error"].null_count == table.num_rows
    return pc.sum(table["completion_tokens"]).as_py()


def one_at_a_time(prompts: Path, out: Path, urls: list[str]) -> float:
    started = time.perf_counter()
    for shard in range(SHARDS):
        subprocess.run(shard_cmd(prompts, out, urls, shard), check=True, capture_output=True)
    return time.perf_counter() - started


def all_at_once(prompts: Path, out: Path, urls: list[str]) -> float:
    started = time.perf_counter()
    procs = [subprocess.Popen(shard_cmd(prompts, out, urls, shard), stdout=subprocess.DEVNULL,
                              stderr=subprocess.PIPE) for shard in range(SHARDS)]
    for proc in procs:
        _, err = proc.communicate()
        assert proc.returncode == 0, err.decode()[-2000:]
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--prompts", type=int, default=2400)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    arrangements = {"one shard at a time": one_at_a_time, f"{SHARDS} shards at once": all_at_once}
    results: dict[str, list[tuple[float, int]]] = {name: [] for name in arrangements}
    with workspace() as (tmp, model):
        prompts = tmp / "prompts.jsonl"
        make_prompts(prompts, args.prompts)
        with simulated_servers(model, [SIM, SIM]) as urls:
            for r, name in alternating(list(arrangements), args.rounds):
                out = tmp / f"{r}-{name.replace(' ', '-')}"
                seconds = arrangements[name](prompts, out, urls)
                results[name].append((seconds, tokens_of(out, args.prompts)))
                print(f"round {r}: {name}: {seconds:.1f} s", flush=True)
            most = peak(urls)
    tokens = {t for runs in results.values() for _, t in runs}
    assert len(tokens) == 1, tokens  # the same work every time
    tokens = tokens.pop()
    best = {name: min(s for s, _ in runs) for name, runs in results.items()}
    rows = ["| arrangement | makespan s, each round | delivered tok/s (best) |", "| --- | --- | --- |"]
    for name, runs in results.items():
        rows.append(f"| {name} | {' · '.join(f'{s:.1f}' for s, _ in runs)} | {tokens / best[name]:,.0f} |")
    sequential, shared = best["one shard at a time"], best[f"{SHARDS} shards at once"]
    body = "\n".join(rows) + (
        f"\n\n{args.prompts:,} prompts in {SHARDS} shards, {tokens:,} output tokens; 2 simulated servers "
        f"reporting launch limit {LAUNCH_LIMIT} and effective limit {EFFECTIVE_LIMIT} (SGLang's "
        f"`effective_max_running_requests_per_dp`), batching (300 tok/s per request alone, 2% slower "
        f"per request added), queue margin {MARGIN}: each server's budget is "
        f"{EFFECTIVE_LIMIT + MARGIN} in flight whatever the number of shards; the most either server held "
        f"at once over the whole benchmark was {most}. Shards at once deliver "
        f"{sequential / shared:.2f}x the throughput of one at a time (goal: 0.95 or more, makespan no "
        f"worse); every arrangement produced the same tokens.")
    write_section("Shards sharing servers", ".venv/bin/python bench/bench_share.py", body)


if __name__ == "__main__":
    main()
