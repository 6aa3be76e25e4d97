"""Two unequal GPU nodes in one run: regen's claims against a static half/half split.

Node `fast` and node `slow` (half its speed) each run one simulated server with `SLOTS` requests
at once; each node takes `MAX_SHARDS` shards at once. The run has many more shards than nodes and
four shard processes at a time (the slots of both nodes, as an Airflow pool would allow), each
`regen generate --shard K`:

- regen: every shard claims the node with free room when it starts (`nodes` in the config);
- static half/half: the first half of the shards on `fast`, the second on `slow` (`--node`), two
  at a time on each, what a user splitting the prompts by hand between two nodes gets.

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

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_client import make_prompts  # noqa: E402
from results import write_section  # noqa: E402

REGEN = str(Path(sys.executable).parent / "regen")
SLOTS, MAX_SHARDS, SPEED = 8, 2, 160.0  # per node: requests at once, shards at once; fast node's tok/s


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


def regen(*args: str) -> None:
    out = subprocess.run([REGEN, "--no-progress-bar", *args], capture_output=True, text=True)
    if out.returncode != 0:
        sys.exit(f"regen {' '.join(args)} failed:\n{out.stderr[-3000:]}")


def run_shards(config: Path, shards: int, static: bool) -> float:
    """Makespan of every shard, four processes at a time (static: two per node)."""
    queues = ({"fast": list(range(shards // 2)), "slow": list(range(shards // 2, shards))} if static
              else {None: list(range(shards))})
    lock = threading.Lock()

    def runner(node: str | None) -> None:
        while True:
            with lock:
                if not queues[node]:
                    return
                shard = queues[node].pop(0)
            regen("generate", "--config", str(config), "--shard", str(shard), *(["--node", node] if node else []))

    per_queue = 2 * MAX_SHARDS // len(queues)
    threads = [threading.Thread(target=runner, args=(node,)) for node in queues for _ in range(per_queue)]
    started = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return time.perf_counter() - started


def one_mode(tmp: Path, name: str, prompts: Path, count: int, args) -> dict:
    config = write_config(tmp, name, prompts, args.shards, args.max_tokens)
    regen("preflight", "--config", str(config))
    for node in ("fast", "slow"):
        regen("serve", "--config", str(config), "--node", node)
    try:
        makespan = run_shards(config, args.shards, static=name.startswith("static"))
    finally:
        for node in ("fast", "slow"):
            regen("serve", "--stop", "--config", str(config), "--node", node)
    import pyarrow.compute as pc
    import pyarrow.parquet as pq

    table = pq.read_table(tmp / name / "data", columns=["id", "completion_tokens", "server", "error"])
    assert table.num_rows == count == len(set(table["id"].to_pylist())), table.num_rows
    assert table["error"].null_count == table.num_rows
    from regen.nodes import node_balance

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
    parser.add_argument("--max-tokens", type=int, default=64)
    args = parser.parse_args()
    modes = ["regen", "static"]
    results: dict[str, list[dict]] = {m: [] for m in modes}
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        prompts, count = tmp / "prompts.jsonl", args.prompts
        make_prompts(prompts, count)
        for r in range(args.rounds):
            for mode in (modes if r % 2 == 0 else modes[::-1]):
                (tmp / f"r{r}").mkdir(exist_ok=True)
                result = one_mode(tmp / f"r{r}", mode, prompts, count, args)
                results[mode].append(result)
                print(f"round {r}: {mode}: {json.dumps(result)}", flush=True)
    rows = ["| split | makespan (s), each round | ideal (s) | makespan / ideal | over the nominal ideal | "
            "rows on the fast node | capacity fast · slow (tok/s) |", "| --- | --- | --- | --- | --- | --- | --- |"]
    names = {"regen": "regen: each shard claims a node with room", "static": "static half/half"}
    for mode in modes:
        rs = results[mode]

        def each(key: str, form: str) -> str:
            return " · ".join(form.format(r[key]) for r in rs)

        rows.append(f"| {names[mode]} | {each('makespan', '{:.1f}')} | {each('ideal', '{:.1f}')} | "
                    f"{each('ratio', '{:.2f}')} | {each('nominal_ratio', '{:.2f}')} | {each('fast_share', '{:.0%}')} | "
                    + " ; ".join(f"{r['capacity']['fast']:,.0f} · {r['capacity']['slow']:,.0f}" for r in rs) + " |")
    body = "\n".join(rows) + (
        f"\n\nTwo simulated nodes, one server each ({SLOTS} requests at once; {SPEED:.0f} and "
        f"{SPEED / 2:.0f} tokens/s per request), {count:,} prompts (max_tokens {args.max_tokens}) in "
        f"{args.shards} shards, four shard processes at a time, {MAX_SHARDS} per node. Ideal = output "
        f"tokens / both nodes' capacity, each node's capacity measured in the same run (its tokens over "
        f"the time it was busy: `regen.nodes.node_balance`); the makespan is wall-clock, process "
        f"start-ups included. 'Over the nominal ideal' divides by the simulator's configured speed "
        f"instead (slots x tokens/s), which no client reaches: the simulator's own per-request "
        f"overhead (~0.2 s) counts there too. The fast node's ideal share of the rows: 67%. "
        f"Rounds alternate the order; each mode starts from a fresh output and fresh servers.")
    write_section("Two unequal nodes", f".venv/bin/python bench/bench_nodes.py --rounds {args.rounds} "
                  f"--shards {args.shards}", body)


if __name__ == "__main__":
    main()
