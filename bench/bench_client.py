"""Client overhead: regen's generator versus the usual hand script, against zero-latency servers.

All send the same prompts to the same two simulated servers (answers at once), 32 requests in
flight per server, and write every row to disk: regen through its journal and Parquet shard, the
baselines to a JSONL file: ``AsyncOpenAI`` + a semaphore, as hand scripts do, and the leanest
client a skilled user writes (one ``aiohttp`` session, a connection pool of the in-flight budget,
the JSON body posted as is). Every client runs in a process of its own, regen as README runs it
(``regen generate --endpoints``), the peers as this file's ``--client NAME``; what is measured is
that process from its start to its exit, imports included: wall time and CPU seconds. The servers
run in processes of their own.

    .venv/bin/python bench/bench_client.py [--requests 3000] [--rounds 2]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import resource
import subprocess
import sys
import time
from pathlib import Path

from harness import alternating, make_prompts, simulated_servers, workspace, write_section

from regen.config import RunConfig
from regen.prompts import Prompt, read_prompts

CONCURRENCY_PER_SERVER = 32
MAX_TOKENS = 1024
# What regen asks an SGLang server for besides the answer (the tokens): asked by the peer too,
# so that the servers do the same work for both.
TOKENS = {"separate_reasoning": True, "return_prompt_token_ids": True, "return_token_ids": True}


def client_process(name: str, prompts_path: Path, out: Path, urls: list[str]) -> list[str]:
    """The command that runs one client: regen's CLI as README gives it, a peer as this file."""
    if name == "regen":
        return [str(Path(sys.executable).parent / "regen"), "--no-progress-bar", "generate", "--prompts",
                str(prompts_path), "--output", str(out), "--endpoints", ",".join(urls), "--max-tokens",
                str(MAX_TOKENS), "--concurrency-per-server", str(CONCURRENCY_PER_SERVER)]
    return [sys.executable, __file__, "--client", name, "--prompts-file", str(prompts_path), "--out", str(out),
            "--urls", ",".join(urls)]


def measure_process(argv: list[str]) -> tuple[float, float]:
    """Wall and CPU seconds of the process ``argv`` (and what it waited for), start to exit."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    wall = time.perf_counter()
    done = subprocess.run(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    wall = time.perf_counter() - wall
    assert done.returncode == 0, done.stderr[-3000:]
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return wall, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def run_baseline(prompts: list[Prompt], out: Path, urls: list[str]) -> None:
    from openai import AsyncOpenAI

    async def main() -> None:
        clients = [AsyncOpenAI(base_url=f"{u}/v1", api_key="none") for u in urls]
        semaphore = asyncio.Semaphore(CONCURRENCY_PER_SERVER * len(urls))
        with out.open("w") as fh:
            async def one(i: int, prompt: Prompt) -> None:
                async with semaphore:
                    response = await clients[i % len(clients)].chat.completions.create(
                        model="tiny", messages=prompt.messages, max_tokens=MAX_TOKENS,
                        temperature=0.6, top_p=0.95,
                        extra_body={"top_k": 20, "chat_template_kwargs": {"enable_thinking": True},
                                    **TOKENS})
                    message = response.choices[0].message
                    fh.write(json.dumps({"id": prompt.id, "content": message.content,
                                         "reasoning_content": getattr(message, "reasoning_content", None),
                                         "finish_reason": response.choices[0].finish_reason}) + "\n")

            await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))
        for client in clients:
            await client.close()

    asyncio.run(main())


def run_aiohttp(prompts: list[Prompt], out: Path, urls: list[str]) -> None:
    import aiohttp

    async def main() -> None:
        budget = CONCURRENCY_PER_SERVER * len(urls)
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=budget)) as session:
            semaphore = asyncio.Semaphore(budget)
            with out.open("w") as fh:
                async def one(i: int, prompt: Prompt) -> None:
                    body = {"model": "tiny", "messages": prompt.messages, "max_tokens": MAX_TOKENS,
                            "temperature": 0.6, "top_p": 0.95, "top_k": 20,
                            "chat_template_kwargs": {"enable_thinking": True}, **TOKENS}
                    async with semaphore:
                        async with session.post(f"{urls[i % len(urls)]}/v1/chat/completions", json=body) as answer:
                            answer.raise_for_status()
                            response = await answer.json()
                    choice = response["choices"][0]
                    fh.write(json.dumps({"id": prompt.id, "content": choice["message"].get("content"),
                                         "reasoning_content": choice["message"].get("reasoning_content"),
                                         "finish_reason": choice["finish_reason"]}) + "\n")

                await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))

    asyncio.run(main())


def hashing_cpu(prompts: list[Prompt], cfg: RunConfig) -> float:
    """CPU seconds regen spends on the integrity hashes of these prompts (prompt hash per row,
    checked against the manifest's on every send and resume)."""
    from regen.manifest import prompt_hash, template_kwargs

    kwargs = template_kwargs(cfg)
    cpu = time.process_time()
    for prompt in prompts:
        prompt_hash(prompt.messages, kwargs)
    return time.process_time() - cpu


def guard_cpu(rows: list[dict], layout_root: Path) -> float:
    """CPU seconds the live quality guard (regen.quality) spends judging these rows, as it does
    each row a shard gets back."""
    from regen.layout import RunLayout
    from regen.quality import QualityGuard

    guard = QualityGuard(RunLayout(layout_root), 0.01, 0.02, True)
    cpu = time.process_time()
    for row in rows:
        guard.check(row, row.get("server") or "")
    return time.process_time() - cpu


def long_rows(count: int, words: int) -> list[dict]:
    """Rows as a reasoning model writes them at its longest: ``words`` words of reasoning."""
    import random

    vocabulary = "the sum of both terms is even so we check the next case and carry one".split()
    rng = random.Random(7)
    return [{"id": f"long-{i}", "reasoning_content": " ".join(rng.choice(vocabulary) for _ in range(words)),
             "content": "The answer is 42.", "finish_reason": "stop", "error": None, "enable_thinking": True,
             "server": "s"} for i in range(count)]


PEERS = {"aiohttp, minimal": run_aiohttp, "AsyncOpenAI + semaphore": run_baseline}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--requests", type=int, default=3000)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--client", choices=list(PEERS), help="run one peer (in the process the bench starts)")
    parser.add_argument("--prompts-file", type=Path)
    parser.add_argument("--out", type=Path)
    parser.add_argument("--urls")
    args = parser.parse_args()
    if args.client:
        PEERS[args.client]([p for p in read_prompts(args.prompts_file) if isinstance(p, Prompt)], args.out,
                           args.urls.split(","))
        return
    with workspace() as (tmp, model):
        prompts_path = tmp / "prompts.jsonl"
        prompts = make_prompts(prompts_path, args.requests)
        with simulated_servers(model, [["--max-running-requests", "256"]] * 2) as urls:
            names = ["regen", *PEERS]
            best = {name: (1e9, 1e9) for name in names}
            for r, name in alternating(names, args.rounds):
                out = tmp / f"{name.split(',')[0].split(' ')[0]}-{r}"
                best[name] = min(best[name], measure_process(client_process(name, prompts_path, out, urls)))
        hashing = min(hashing_cpu(prompts, RunConfig(prompts=str(prompts_path))) for _ in range(3))
        import pandas as pd

        produced = pd.read_parquet(tmp / "regen-0" / "data").to_dict("records")
        guard = min(guard_cpu(produced, tmp / "guard") for _ in range(3))
        longest = long_rows(200, 8000)
        guard_long = min(guard_cpu(longest, tmp / "guard-long") for _ in range(3)) / len(longest)
    rows = ["| client | requests/s | CPU s per 1,000 requests | wall s |", "| --- | --- | --- | --- |"]
    for name, (wall, cpu) in best.items():
        rows.append(f"| {name} | {args.requests / wall:,.0f} | {cpu / args.requests * 1000:.2f} | {wall:.2f} |")
    lean = best["aiohttp, minimal"]
    body = "\n".join(rows) + (
        f"\n\n{args.requests:,} requests, 2 simulated servers answering at once, "
        f"{CONCURRENCY_PER_SERVER} in flight per server, best of {args.rounds} rounds, order alternated; each client a "
        f"process of its own, timed from its start to its exit (imports included). regen "
        f"(journal, retries, least-outstanding dispatch, Parquet shard) is {lean[0] / best['regen'][0]:.2f}x the "
        f"throughput of the leanest client (aiohttp) at {best['regen'][1] / lean[1]:.2f}x its CPU per request, and "
        f"{best['AsyncOpenAI + semaphore'][0] / best['regen'][0]:.2f}x AsyncOpenAI's at "
        f"{best['regen'][1] / best['AsyncOpenAI + semaphore'][1]:.2f}x its CPU per request. The servers share the "
        f"same 2 cores, so wall time includes their work. The integrity hashes (a prompt hash per "
        f"row, against the run manifest) cost {hashing / args.requests * 1e6:.0f} µs of CPU per request, "
        f"{hashing / best['regen'][1]:.1%} of regen's CPU per request (goal: within 5%). The live quality "
        f"guard (each row's text findings and windows) costs {guard / len(produced) * 1e6:.0f} µs of CPU per row "
        f"here, {guard / len(produced) / (best['regen'][1] / args.requests):.1%} of regen's CPU per request, and "
        f"{guard_long * 1e6:.0f} µs on a row of 8,000 words of reasoning (a long trace: its loop check reads the "
        f"last 2,000 words).")
    write_section("Client overhead", ".venv/bin/python bench/bench_client.py", body)


if __name__ == "__main__":
    main()
