"""A realistic fleet: seven servers, multi-turn rows, long-tailed reasoning lengths.

Each client regenerates the same ShareGPT file (half single-turn, ~40% with 2-5 user turns, ~10%
behind one of three long shared system prompts) against a fresh fleet of simulated servers that
batch as SGLang does (32 slots each, a prefill stall for uncached prompt tokens, a prefix cache
per server at message boundaries) and write traces whose lengths are log-normal (median ~300
words, 99th percentile ~6x). Every assistant turn is a request, in order; the clients:

- regen as README runs it: one `regen generate --endpoints U1..U7` process;
- regen as the DAG's mapped shards run on one node: one `regen generate --shard K` process per
  server, all at once, sharing the servers' budget;
- SpecForge's own `scripts/regenerate_train_data.py`, copied at run time from its git repository
  (a pinned commit), at its documented concurrency per server;
- the peer a skilled user writes: AsyncOpenAI, one shared queue of conversations, as many
  workers per server as it has slots, a conversation kept on its worker's server;
- SGLang's router (`sglang-router`, `--policy cache_aware`) in front of the same servers, with
  the same shared queue sending to it.

Makespan is wall-clock from the client's start to its last row (every client runs in a process of its
own, its start-up and imports included). Busy = the servers' decoding request-seconds over slots x makespan;
cache hit = prompt tokens the servers' prefix caches saved over all prompt tokens sent;
delivered tok/s = the servers' output tokens over the makespan. Rounds
alternate the order; each client gets fresh servers.

    .venv/bin/python bench/bench_fleet.py [--rows 2400] [--rounds 2] [--slow-server]
        [--specforge REPO] [--router-python PY]

``--specforge``: a clone of sgl-project/SpecForge (default: the tool library's mirror, when
present); ``--router-python``: an interpreter with `sglang-router` installed (default
$REGEN_ROUTER_PYTHON). A peer whose part is missing is left out of the table, and the table says so.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path

import httpx
from harness import alternating, simulated_servers, workspace, write_section

from regen.servers.probe import free_port_base

SPECFORGE_COMMIT = "a6b6b023"  # sgl-project/SpecForge HEAD when this bench was written (v0.3.0 line)
SPECFORGE_MIRROR = Path("/work/.mirror/sgl-project+SpecForge/repo")


SLOWDOWN = 0.01  # a request decodes this much slower per other running request


def sim_flags(slots: int, speed: float, median: int) -> list[str]:
    return ["--max-running-requests", str(slots), "--sim-tokens-per-second", str(speed),
            "--sim-batch-slowdown", str(SLOWDOWN), "--sim-prefill-tokens-per-second", "20000",
            "--enable-cache-report", "--sim-reasoning-median", str(median), "--sim-length-sigma", "0.77"]


def write_rows(path: Path, rows: int, seed: int = 7) -> int:
    """The ShareGPT file; returns how many requests it takes (one per assistant turn)."""
    rng = random.Random(seed)
    words = "explain why how compute the value of a system in detail prove compare list steps".split()
    systems = [" ".join(rng.choice(words) for _ in range(600)) for _ in range(3)]
    requests = 0
    with path.open("w") as fh:
        for i in range(rows):
            kind = rng.random()
            turns = 1 if kind < 0.5 else rng.randint(2, 5) if kind < 0.9 else rng.randint(1, 3)
            conversation = [{"role": "system", "content": systems[i % 3]}] if kind >= 0.9 else []
            for t in range(turns):
                question = f"row {i} turn {t}: " + " ".join(rng.choice(words) for _ in range(rng.randint(8, 60)))
                conversation += [{"role": "user", "content": question},
                                 {"role": "assistant", "content": "the dataset's old answer"}]
            requests += turns
            fh.write(json.dumps({"id": f"r{i}", "conversations": conversation}) + "\n")
    return requests


def fleet_counters(urls: list[str]) -> dict[str, float]:
    """Summed over the servers: decoding request-seconds, prompt, cached prompt and output tokens;
    over them all, the first request's and the last reply's wall-clock time and the longest answer."""
    busy = prompt = cached = generated = 0.0
    first, last, longest = [], [], 0
    for url in urls:
        state = httpx.get(f"{url}/server_info").json()["internal_states"][0]
        busy += state["sim_busy_slot_seconds"]
        first += [state["sim_first_request_at"]] if state["sim_first_request_at"] else []
        last += [state["sim_last_reply_at"]] if state["sim_last_reply_at"] else []
        longest = max(longest, state["sim_longest_completion_tokens"])
        for line in httpx.get(f"{url}/metrics").text.splitlines():
            if line.startswith("sglang:prompt_tokens_total"):
                prompt += float(line.rsplit(" ", 1)[1])
            elif line.startswith("sglang:cached_tokens_total"):
                cached += float(line.rsplit(" ", 1)[1])
            elif line.startswith("sglang:generation_tokens_total"):
                generated += float(line.rsplit(" ", 1)[1])
    return {"busy": busy, "prompt": prompt, "cached": cached, "generated": generated,
            "first": min(first, default=None), "last": max(last, default=None), "longest": longest}


def work_bound(generated: float, longest: int, speeds: list[float], slots: int) -> float:
    """The shortest makespan the servers allow for this work: every slot of every server decoding at
    once, and no less than the longest answer decoding alone (prefill and queueing left out)."""
    full = sum(slots * speed / (1 + SLOWDOWN * (slots - 1)) for speed in speeds)
    return max(generated / full, longest / max(speeds))


def _regen(*args: str) -> list[str]:
    """A regen client; no shard stops on its errors (max_error_fraction 1), as no peer does: the
    table counts complete rows (a trace past max_tokens in an earlier turn ends its conversation,
    and one such row is more than 5% of a 7-prompt shard of a 64-server fleet)."""
    return [str(Path(sys.executable).parent / "regen"), "--no-progress-bar", "generate", "--max-error-fraction", "1",
            *args]


def _regen_rows(out: Path) -> int:
    """Complete rows of a regen output (each id once)."""
    import pandas as pd

    df = pd.read_parquet(out / "data", columns=["id", "error"])
    assert df["id"].is_unique
    return int(df["error"].isna().sum())


def regen_one(prompts: Path, out: Path, urls: list[str], max_tokens: int, *flags: str) -> int:
    done = subprocess.run(_regen("--prompts", str(prompts), "--output", str(out), "--endpoints", ",".join(urls),
                                 "--max-tokens", str(max_tokens), *flags), capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    return _regen_rows(out)


def regen_shards(prompts: Path, out: Path, urls: list[str], max_tokens: int) -> int:
    procs = [subprocess.Popen(_regen("--prompts", str(prompts), "--output", str(out), "--endpoints", ",".join(urls),
                                     "--max-tokens", str(max_tokens), "--num-shards", str(len(urls)),
                                     "--shard", str(k)), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
             for k in range(len(urls))]
    for proc in procs:
        _, err = proc.communicate()
        assert proc.returncode == 0, err.decode()[-2000:]
    return _regen_rows(out)


def specforge_script(repo: Path, into: Path) -> Path:
    """SpecForge's regeneration script and the validation module it imports, at the pinned commit."""
    into.mkdir(parents=True, exist_ok=True)
    for name in ("regenerate_train_data.py", "conversation_validation.py"):
        text = subprocess.run(["git", "-C", str(repo), "show", f"{SPECFORGE_COMMIT}:scripts/{name}"],
                              check=True, capture_output=True, text=True).stdout
        (into / name).write_text(text)
    return into / "regenerate_train_data.py"


def specforge(script: Path, prompts: Path, out: Path, urls: list[str], max_tokens: int, slots: int) -> int:
    out.mkdir(parents=True, exist_ok=True)
    target = out / "regen.jsonl"
    subprocess.run([sys.executable, str(script), "--model", "m", "--reasoning", "save", "--temperature", "0.7",
                    "--max-tokens", str(max_tokens), "--concurrency", str(slots),
                    "--input-file-path", str(prompts), "--output-file-path", str(target),
                    "--server-address", *[u.removeprefix("http://") for u in urls]],
                   check=True, capture_output=True, cwd=script.parent)
    return len(target.read_text().splitlines())  # its successes; errors and skips go to files of their own


async def _shared_queue(prompts: Path, targets: list[tuple[str, int]], max_tokens: int) -> int:
    """One queue of conversations; ``workers`` per target URL, each running a whole conversation
    (its turns in order, the model's answers as history) against its own target."""
    from openai import AsyncOpenAI

    queue: asyncio.Queue = asyncio.Queue()
    for line in prompts.read_text().splitlines():
        queue.put_nowait(json.loads(line))
    complete = 0

    async def worker(client) -> None:
        nonlocal complete
        while not queue.empty():
            row = queue.get_nowait()
            history = [m for m in row["conversations"] if m["role"] == "system"]
            questions = [m for m in row["conversations"] if m["role"] == "user"]
            for k, question in enumerate(questions):
                history.append(question)
                reply = await client.chat.completions.create(
                    model="m", messages=history, max_tokens=max_tokens, temperature=0.7,
                    extra_body={"chat_template_kwargs": {"enable_thinking": True}})
                choice = reply.choices[0]
                history.append({"role": "assistant", "content": choice.message.content})
                if choice.finish_reason != "stop" and k < len(questions) - 1:
                    break  # regen's rule: no turn is built on a truncated one
            else:
                complete += 1

    clients = [(AsyncOpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=3600), n)
               for url, n in targets]
    await asyncio.gather(*(worker(c) for c, n in clients for _ in range(n)))
    for client, _ in clients:
        await client.close()
    return complete


def queue_process(prompts: Path, targets: list[tuple[str, int]], max_tokens: int) -> int:
    """The shared-queue peer in a process of its own, as regen and SpecForge run: its start and
    imports count in its makespan as theirs do."""
    done = subprocess.run([sys.executable, __file__, "--queue-peer", str(prompts), "--max-tokens", str(max_tokens),
                           "--targets", *[f"{url}={n}" for url, n in targets]], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    return int(done.stdout.split()[-1])


def shared_queue(prompts: Path, urls: list[str], max_tokens: int, slots: int) -> int:
    return queue_process(prompts, [(u, slots) for u in urls], max_tokens)


def router(python: str, prompts: Path, urls: list[str], max_tokens: int, slots: int, log: Path) -> int:
    port = free_port_base(1)
    url = f"http://127.0.0.1:{port}"
    with log.open("w") as out:
        proc = subprocess.Popen([python, "-m", "sglang_router.launch_router", "--worker-urls", *urls,
                                 "--policy", "cache_aware", "--host", "127.0.0.1", "--port", str(port)],
                                stdout=out, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"sglang-router did not come up: {log.read_text()[-2000:]}")
            time.sleep(0.2)
        return queue_process(prompts, [(url, slots * len(urls))], max_tokens)
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", type=int, default=2400)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--servers", type=int, default=7)
    parser.add_argument("--slots", type=int, default=32)
    parser.add_argument("--speed", type=float, default=150.0, help="tokens/s of one request alone")
    parser.add_argument("--median", type=int, default=300, help="median words of a reasoning trace")
    parser.add_argument("--max-tokens", type=int, default=2048)
    parser.add_argument("--slow-server", action="store_true", help="the last server at half speed")
    parser.add_argument("--specforge", type=Path, default=SPECFORGE_MIRROR if SPECFORGE_MIRROR.exists() else None)
    parser.add_argument("--router-python", default=os.environ.get("REGEN_ROUTER_PYTHON"))
    parser.add_argument("--only", help="comma-separated clients to run (default: all available)")
    parser.add_argument("--queue-peer", type=Path, help="run the shared-queue peer on this file (the bench starts it)")
    parser.add_argument("--targets", nargs="*", default=[], help="URL=WORKERS of the shared-queue peer")
    args = parser.parse_args()
    if args.queue_peer:
        targets = [(t.rsplit("=", 1)[0], int(t.rsplit("=", 1)[1])) for t in args.targets]
        print(asyncio.run(_shared_queue(args.queue_peer, targets, args.max_tokens)))
        return

    clients = {"regen": "`regen generate --endpoints U1..U%d` (one process)" % args.servers,
               "one-shard": "the same with `--num-shards 1` (one process, one shard)",
               "shards": f"regen as the DAG's mapped shards ({args.servers} `--shard K` processes at once)",
               "specforge": f"SpecForge's `scripts/regenerate_train_data.py` ({SPECFORGE_COMMIT}, --concurrency {args.slots})",
               "queue": "AsyncOpenAI + one shared queue, a conversation kept on one server",
               "router": "SGLang's router (`sglang-router`, cache_aware) + the same shared queue"}
    missing = []
    if args.specforge is None:
        missing.append("specforge (no SpecForge clone: --specforge REPO)")
    if not args.router_python:
        missing.append("router (no sglang-router interpreter: --router-python PY or $REGEN_ROUTER_PYTHON)")
    modes = [m for m in clients if not any(x.startswith(m + " ") for x in missing)]
    if args.only:
        modes = [m for m in modes if m in args.only.split(",")]
    speeds = [args.speed] * args.servers
    if args.slow_server:
        speeds[-1] = args.speed / 2
    results: dict[str, list[dict]] = {m: [] for m in modes}
    with workspace() as (tmp, model):
        prompts = tmp / "rows.jsonl"
        requests = write_rows(prompts, args.rows)
        script = specforge_script(args.specforge, tmp / "specforge") if "specforge" in modes else None
        for r, mode in alternating(modes, args.rounds):
            out = tmp / f"{mode}-{r}"
            with simulated_servers(model, [sim_flags(args.slots, speed, args.median) for speed in speeds]) as urls:
                before = fleet_counters(urls)
                started, started_at = time.perf_counter(), time.time()
                if mode == "regen":
                    rows = regen_one(prompts, out, urls, args.max_tokens)
                elif mode == "one-shard":
                    rows = regen_one(prompts, out, urls, args.max_tokens, "--num-shards", "1")
                elif mode == "shards":
                    rows = regen_shards(prompts, out, urls, args.max_tokens)
                elif mode == "specforge":
                    rows = specforge(script, prompts, out, urls, args.max_tokens, args.slots)
                elif mode == "queue":
                    rows = shared_queue(prompts, urls, args.max_tokens, args.slots)
                else:
                    rows = router(args.router_python, prompts, urls, args.max_tokens, args.slots,
                                          tmp / f"router-{r}.log")
                seconds, ended_at = time.perf_counter() - started, time.time()
                after = fleet_counters(urls)
            served = {k: after[k] - before[k] for k in ("busy", "prompt", "cached", "generated")}
            capacity = sum(args.slots for _ in urls) * seconds
            bound = work_bound(served["generated"], after["longest"], speeds, args.slots)
            result = {"seconds": seconds, "rows": rows, "tok_s": served["generated"] / seconds, "busy": served["busy"] / capacity,
                      "hit": served["cached"] / max(served["prompt"], 1), "uncached": served["prompt"] - served["cached"],
                      "first_request_s": after["first"] - started_at, "after_last_reply_s": ended_at - after["last"],
                      "over_bound": seconds / bound}
            results[mode].append(result)
            print(f"round {r}: {mode}: {json.dumps(result)}", flush=True)

    def each(mode: str, key: str, form: str) -> str:
        return " · ".join(form.format(x[key]) for x in results[mode])

    best_peer = min((min(x["seconds"] for x in results[m]) for m in modes if m not in ("regen", "one-shard", "shards")),
                    default=None)
    rows = ["| client | makespan s (each round) | vs best peer | over the work bound | to the first request s "
            "| after the last reply s | complete rows | delivered tok/s | servers busy | prefix-cache hit "
            "| uncached prompt tokens |", "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for mode in modes:
        best = min(x["seconds"] for x in results[mode])
        ratio = f"{best_peer / best:.2f}x" if best_peer else "-"
        rows.append(f"| {clients[mode]} | {each(mode, 'seconds', '{:.1f}')} | {ratio} "
                    f"| {each(mode, 'over_bound', '{:.2f}x')} | {each(mode, 'first_request_s', '{:.2f}')} "
                    f"| {each(mode, 'after_last_reply_s', '{:.2f}')} | {each(mode, 'rows', '{:,}')} "
                    f"| {each(mode, 'tok_s', '{:,.0f}')} | {each(mode, 'busy', '{:.0%}')} | {each(mode, 'hit', '{:.2f}')} "
                    f"| {each(mode, 'uncached', '{:,.0f}')} |")
    body = "\n".join(rows) + (
        f"\n\n{args.rows:,} ShareGPT rows, {requests:,} requests (one per assistant turn); {args.servers} simulated "
        f"servers ({args.slots} slots, {args.speed:.0f} tok/s per request alone"
        + (", the last at half speed" if args.slow_server else "") + f", 1% slower per other running request, "
        f"prefill 20,000 tok/s for uncached prompt tokens, a prefix cache per server), traces log-normal around "
        f"{args.median} words (sigma 0.77), max_tokens {args.max_tokens}. 'vs best peer' = the fastest peer's best "
        f"makespan over this client's best (above 1: faster than every peer). A row is complete when every turn "
        f"stopped by itself. Tokens and cache hits are the servers' own counters (`/metrics`), the same for every client. "
        f"The work bound: the servers' generated tokens with every slot of every server decoding, and never under the "
        f"longest answer decoding alone. The first request and the last reply are the servers' own clocks, against the "
        f"client's start (a process's start-up included) and end.")
    if missing:
        body += " Not run here: " + "; ".join(missing) + "."
    name = ("A realistic fleet" if args.servers == 7 else f"A fleet of {args.servers} servers") + (
        " with a half-speed server" if args.slow_server else "")
    command = ".venv/bin/python bench/bench_fleet.py" + (" --slow-server" if args.slow_server else "") + \
        (f" --rows {args.rows}" if args.rows != 2400 else "") + \
        (f" --servers {args.servers} --slots {args.slots}" if args.servers != 7 else "") + \
        (f" --only {args.only} --rounds {args.rounds}" if args.only else "")
    write_section(name, command, body)


if __name__ == "__main__":
    main()
