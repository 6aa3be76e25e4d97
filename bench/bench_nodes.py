"""Two unequal GPU nodes in one run: regen's claims against the splits a skilled user would make.

Node `fast` and node `slow` (half its speed) each run one simulated server with `SLOTS` requests
at once; each node takes `MAX_SHARDS` shards at once. The run has many more shards than nodes and
four shard processes at a time (the slots of both nodes, as an Airflow pool would allow), each
`regen generate --shard K`:

- regen: every shard claims the node with free room when it starts (`nodes` in the config);
- one shared queue: two workers per node take the next shard from one queue (`--node` their own),
  what a Celery deployment with one queue and a worker per node gives;
- static, weighted: two thirds of the shards on `fast`, a third on `slow`, the split a user makes
  after measuring each node's speed;
- static half/half: the first half of the shards on `fast`, the second on `slow`.

The ideal makespan is the work split by capacity: the output tokens of the dataset over both
nodes' combined rate (slots x tokens/s per request), with no overhead at all. Makespan is from the
first shard process started to the last one finished (process start-up included). Each mode gets a
fresh output directory and fresh servers; rounds alternate the order.

    .venv/bin/python bench/bench_nodes.py [--rounds 2] [--shards 24]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import yaml
from harness import alternating, make_prompts, write_section

REGEN = str(Path(sys.executable).parent / "regen")
SLOTS, MAX_SHARDS, SPEED = 8, 2, 160.0  # per node: requests at once, shards at once; fast node's tok/s
NAMES = {"regen": "regen: each shard claims a node with room",
         "shared": "one shared queue, each node's workers take the next shard",
         "weighted": "static, split by measured speed (2:1)",
         "static": "static half/half"}


def write_config(tmp: Path, name: str, prompts: Path, shards: int, max_tokens: int) -> Path:
    out = tmp / name
    cfg = {"output": str(out), "prompts": str(prompts), "engine": "sim", "num_shards": shards,
           "max_tokens": max_tokens, "concurrency_per_server": SLOTS, "max_running_requests": SLOTS,
           "stage_weights": False, "idle_shutdown_s": 600, "canary_size": 1,
           "nodes": [{"name": "fast", "base_port": 31400, "num_servers": 1, "sim_tokens_per_second": SPEED,
                      "max_shards": MAX_SHARDS},
                     {"name": "slow", "base_port": 31500, "num_servers": 1, "sim_tokens_per_second": SPEED / 2,
                      "max_shards": MAX_SHARDS}]}
    path = tmp / f"{name}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


class RegenFailed(RuntimeError):
    pass


def regen(*args: str) -> None:
    out = subprocess.run([REGEN, "--no-progress-bar", *args], capture_output=True, text=True)
    if out.returncode != 0:
        raise RegenFailed(f"regen {' '.join(args)} failed:\n{out.stderr[-3000:]}")


def plan(mode: str, shards: int) -> tuple[dict[str, list[int]], list[tuple[str, str | None]]]:
    """The mode's queues of shards, and its shard runners as (queue, node or None to claim one);
    every mode runs 2 x MAX_SHARDS shard processes at a time."""
    everything = list(range(shards))
    if mode == "regen":  # no node named: each shard claims one with room
        return {"all": everything}, [("all", None)] * (2 * MAX_SHARDS)
    if mode == "shared":  # a Celery-style shared queue: each node's workers take the next shard
        return {"all": everything}, [("all", node) for node in ("fast", "slow") for _ in range(MAX_SHARDS)]
    # static: each node gets a fixed list up front, half/half or by measured speed (fast:slow = 2:1)
    cut = shards // 2 if mode == "static" else round(shards * SPEED / (SPEED + SPEED / 2))
    return ({"fast": everything[:cut], "slow": everything[cut:]},
            [(node, node) for node in ("fast", "slow") for _ in range(MAX_SHARDS)])


def run_shards(config: Path, shards: int, mode: str) -> float:
    """Makespan of every shard, as the mode's runners take them."""
    queues, runners = plan(mode, shards)
    lock = threading.Lock()
    failures: list[RegenFailed] = []

    def runner(queue: str, node: str | None) -> None:
        while True:
            with lock:
                if not queues[queue] or failures:
                    return
                shard = queues[queue].pop(0)
            try:
                regen("generate", "--config", str(config), "--shard", str(shard), *(["--node", node] if node else []))
            except RegenFailed as exc:  # a thread cannot end the bench: the main thread raises it
                failures.append(exc)
                return

    threads = [threading.Thread(target=runner, args=runner_args) for runner_args in runners]
    started = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if failures:
        raise failures[0]
    return time.perf_counter() - started


def one_mode(tmp: Path, name: str, prompts: Path, count: int, args) -> dict:
    config = write_config(tmp, name, prompts, args.shards, args.max_tokens)
    regen("preflight", "--config", str(config))
    for node in ("fast", "slow"):
        regen("serve", "--config", str(config), "--node", node)
    try:
        makespan = run_shards(config, args.shards, name)
    finally:
        for node in ("fast", "slow"):
            regen("serve", "--stop", "--config", str(config), "--node", node)
    import pyarrow.compute as pc
    import pyarrow.parquet as pq

    table = pq.read_table(tmp / name / "data", columns=["id", "completion_tokens", "server", "error"])
    assert table.num_rows == count == len(set(table["id"].to_pylist())), table.num_rows
    assert table["error"].null_count == table.num_rows
    from regen.status import node_balance

    balance = node_balance(json.loads((tmp / name / "progress.json").read_text())["shards"])
    nominal = pc.sum(table["completion_tokens"]).as_py() / (SLOTS * SPEED + SLOTS * SPEED / 2)
    on_fast = sum(url.endswith(":31400") for url in table["server"].to_pylist())
    return {"makespan": makespan, "ideal": balance["ideal_s"], "ratio": makespan / balance["ideal_s"],
            "nominal_ratio": makespan / nominal, "fast_share": on_fast / count,
            "capacity": {n: v["tokens_per_s"] for n, v in balance["nodes"].items()}}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--shards", type=int, default=24)
    parser.add_argument("--prompts", type=int, default=1120)
    parser.add_argument("--max-tokens", type=int, default=256)  # the simulator's longest answer: no turn cut
    args = parser.parse_args()
    modes = list(NAMES)
    results: dict[str, list[dict]] = {m: [] for m in modes}
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        prompts, count = tmp / "prompts.jsonl", args.prompts
        make_prompts(prompts, count)
        for r, mode in alternating(modes, args.rounds):
            (tmp / f"r{r}").mkdir(exist_ok=True)
            result = one_mode(tmp / f"r{r}", mode, prompts, count, args)
            results[mode].append(result)
            print(f"round {r}: {mode}: {json.dumps(result)}", flush=True)
    rows = ["| split | makespan (s), each round | ideal (s) | makespan / ideal | over the nominal ideal | "
            "rows on the fast node | capacity fast · slow (tok/s) |", "| --- | --- | --- | --- | --- | --- | --- |"]
    for mode in modes:
        rs = results[mode]

        def each(key: str, form: str) -> str:
            return " · ".join(form.format(r[key]) for r in rs)

        rows.append(f"| {NAMES[mode]} | {each('makespan', '{:.1f}')} | {each('ideal', '{:.1f}')} | "
                    f"{each('ratio', '{:.2f}')} | {each('nominal_ratio', '{:.2f}')} | {each('fast_share', '{:.0%}')} | "
                    + " ; ".join(f"{r['capacity'].get('fast', 0):,.0f} · {r['capacity'].get('slow', 0):,.0f}" for r in rs) + " |")
    body = "\n".join(rows) + (
        f"\n\nTwo simulated nodes, one server each ({SLOTS} requests at once; {SPEED:.0f} and "
        f"{SPEED / 2:.0f} tokens/s per request), {count:,} prompts (max_tokens {args.max_tokens}) in "
        f"{args.shards} shards, four shard processes at a time, {MAX_SHARDS} per node in every mode. Ideal = output "
        f"tokens / both nodes' capacity, each node's capacity measured in the same run (its tokens over "
        f"the time it was busy: `regen.status.node_balance`); the makespan is wall-clock, process "
        f"start-ups included. 'Over the nominal ideal' divides by the simulator's configured speed "
        f"instead (slots x tokens/s), which no client reaches: the simulator's own per-request "
        f"overhead (~0.2 s) counts there too. The fast node's ideal share of the rows: 67%. "
        f"Rounds alternate the order; each mode starts from a fresh output and fresh servers.")
    write_section("Two unequal nodes", f".venv/bin/python bench/bench_nodes.py --rounds {args.rounds} "
                  f"--shards {args.shards}", body)


if __name__ == "__main__":
    main()
