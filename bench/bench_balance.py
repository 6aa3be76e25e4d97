"""Balance: seven servers, one at half speed, a fixed amount of work.

regen sends each request to the server with the fewest outstanding requests; the baseline deals
prompts round-robin (prompt k to server k mod 7, 8 in flight per server), as hand scripts do. Both
are compared with the ideal makespan: total output tokens over total capacity (each server's
decode speed times its slots).

    .venv/bin/python bench/bench_balance.py [--prompts 5600]
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_client import make_prompts, start_sims  # noqa: E402
from results import write_section  # noqa: E402

from regen.config import RunConfig  # noqa: E402
from regen.generate import ShardRun  # noqa: E402

SLOTS = 8
FAST, SLOW = 400.0, 200.0
SPEEDS = [FAST] * 6 + [SLOW]


def round_robin(prompts, urls: list[str]) -> tuple[float, int]:
    async def main() -> int:
        clients = [httpx.AsyncClient(timeout=600) for _ in urls]
        semaphores = [asyncio.Semaphore(SLOTS) for _ in urls]
        tokens = 0

        async def one(i, prompt):
            nonlocal tokens
            k = i % len(urls)
            async with semaphores[k]:
                response = await clients[k].post(f"{urls[k]}/v1/chat/completions", json={
                    "model": "m", "messages": prompt.messages, "max_tokens": 1024,
                    "chat_template_kwargs": {"enable_thinking": True}})
                tokens += response.json()["usage"]["completion_tokens"]

        await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))
        for client in clients:
            await client.aclose()
        return tokens

    started = time.perf_counter()
    tokens = asyncio.run(main())
    return time.perf_counter() - started, tokens


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--prompts", type=int, default=5600)
    args = parser.parse_args()
    from regen.tinymodel import build_tiny_model

    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        model = build_tiny_model(tmp / "model")
        prompts_path = tmp / "prompts.jsonl"
        prompts = make_prompts(prompts_path, args.prompts)
        procs, urls = start_sims(model, {39201 + i: ["--max-running-requests", str(SLOTS),
                                                     "--sim-tokens-per-second", str(speed)]
                                         for i, speed in enumerate(SPEEDS)})
        try:
            started = time.perf_counter()
            cfg = RunConfig(prompts=str(prompts_path), output=str(tmp / "out"), num_shards=1,
                            max_tokens=1024)
            result = ShardRun(cfg, [(u, None) for u in urls], 0, None).run()
            regen_s = time.perf_counter() - started
            rr_s, tokens = round_robin(prompts, urls)
        finally:
            for proc in procs:
                proc.terminate()
                proc.wait()
    assert result.tokens == tokens, (result.tokens, tokens)  # the same work in both runs
    ideal = tokens / sum(SLOTS * s for s in SPEEDS)
    body = (
        "| dispatch | makespan s | over ideal |\n| --- | --- | --- |\n"
        f"| ideal (tokens / capacity) | {ideal:.2f} | 0.0% |\n"
        f"| regen (fewest outstanding, limit from /server_info) | {regen_s:.2f} | {regen_s / ideal - 1:+.1%} |\n"
        f"| round-robin, {SLOTS} per server | {rr_s:.2f} | {rr_s / ideal - 1:+.1%} |\n\n"
        f"{args.prompts:,} prompts, {tokens:,} output tokens; 7 simulated servers with {SLOTS} slots "
        f"each, six at {FAST:.0f} tok/s per request and one at {SLOW:.0f}. regen's makespan includes "
        f"reading the prompts, discovering the servers and writing the Parquet shard. Goal: within 5% "
        f"of ideal.")
    write_section("Balance over uneven servers", ".venv/bin/python bench/bench_balance.py", body)


if __name__ == "__main__":
    main()
