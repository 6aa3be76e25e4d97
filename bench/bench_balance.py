"""Balance: seven servers that batch, one at half speed, a fixed amount of work.

regen sends each request to the server with the fewest outstanding requests, within the limit
each reports; the baseline is the peer a skilled user writes: one shared queue, and per server
as many AsyncOpenAI workers as it runs at once, each taking the next prompt when it is free.
Both are compared with the ideal makespan: total output tokens over total capacity (each
server's slots times its per-request speed with every slot running).

    .venv/bin/python bench/bench_balance.py [--prompts 5600]
"""

from __future__ import annotations

import argparse
import asyncio
import time

from bench_client import TOKENS
from harness import make_prompts, simulated_servers, workspace, write_section

from regen.config import RunConfig
from regen.generate import ShardRun

SLOTS = 8
SLOWDOWN = 0.03  # each running request slows the others: the simulator's --sim-batch-slowdown
FAST, SLOW = 400.0, 200.0
SPEEDS = [FAST] * 6 + [SLOW]


def shared_queue(prompts, urls: list[str]) -> tuple[float, int]:
    from openai import AsyncOpenAI

    async def main() -> int:
        queue: asyncio.Queue = asyncio.Queue()
        for prompt in prompts:
            queue.put_nowait(prompt)
        tokens = 0

        async def worker(client) -> None:
            nonlocal tokens
            while not queue.empty():
                prompt = queue.get_nowait()
                response = await client.chat.completions.create(
                    model="m", messages=prompt.messages, max_tokens=1024,
                    extra_body={"chat_template_kwargs": {"enable_thinking": True}, **TOKENS})
                tokens += response.usage.completion_tokens

        clients = [AsyncOpenAI(base_url=f"{u}/v1", api_key="none", max_retries=0, timeout=600) for u in urls]
        await asyncio.gather(*(worker(c) for c in clients for _ in range(SLOTS)))
        for client in clients:
            await client.close()
        return tokens

    started = time.perf_counter()
    tokens = asyncio.run(main())
    return time.perf_counter() - started, tokens


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--prompts", type=int, default=5600)
    args = parser.parse_args()
    with workspace() as (tmp, model):
        prompts_path = tmp / "prompts.jsonl"
        prompts = make_prompts(prompts_path, args.prompts)
        with simulated_servers(model, [["--max-running-requests", str(SLOTS),
                                        "--sim-tokens-per-second", str(speed),
                                        "--sim-batch-slowdown", str(SLOWDOWN)]
                                       for speed in SPEEDS]) as urls:
            started = time.perf_counter()
            cfg = RunConfig(prompts=str(prompts_path), output=str(tmp / "out"), num_shards=1,
                            max_tokens=1024, queue_margin=0, regenerate_turns="last")  # one request a prompt, as the peer
            result = ShardRun(cfg, [(u, None) for u in urls], 0, None).run()
            regen_s = time.perf_counter() - started
            peer_s, tokens = shared_queue(prompts, urls)
    assert result.tokens == tokens, (result.tokens, tokens)  # the same work in both runs
    ideal = tokens / sum(SLOTS * s / (1 + SLOWDOWN * (SLOTS - 1)) for s in SPEEDS)
    body = (
        "| dispatch | makespan s | over ideal |\n| --- | --- | --- |\n"
        f"| ideal (tokens / capacity) | {ideal:.2f} | 0.0% |\n"
        f"| regen (fewest outstanding, limit from /server_info) | {regen_s:.2f} | {regen_s / ideal - 1:+.1%} |\n"
        f"| AsyncOpenAI, one shared queue, {SLOTS} workers per server | {peer_s:.2f} | {peer_s / ideal - 1:+.1%} |\n\n"
        f"{args.prompts:,} prompts, {tokens:,} output tokens; 7 simulated servers that batch ({SLOTS} "
        f"slots each, each running request {SLOWDOWN:.0%} slower per other one), six at {FAST:.0f} tok/s "
        f"per request alone and one at {SLOW:.0f}. regen's makespan includes reading the prompts, "
        f"discovering the servers and writing the Parquet shard; the peer's only its requests. Goal: "
        f"within 5% of ideal.")
    write_section("Balance over uneven servers", ".venv/bin/python bench/bench_balance.py", body)


if __name__ == "__main__":
    main()
