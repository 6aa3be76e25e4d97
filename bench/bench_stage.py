"""Staging: regen's verified, parallel copy to /dev/shm versus ``cp -r`` and a 4-way parallel
``cp``, and a no-op re-stage.

A model directory of safetensors shards (plus config and tokenizer files) is copied to a RAM disk
by each, in rotating order, every target removed before the next copy. All read from the page
cache (the files were just written), so this measures copying, not the source disk.

    .venv/bin/python bench/bench_stage.py [--shards 8] [--shard-mb 256]
"""

from __future__ import annotations

import argparse
import os
import shlex
import shutil
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

from harness import write_section

from regen.weights import stage_model


def make_model(path: Path, shards: int, shard_mb: int) -> int:
    path.mkdir(parents=True)
    (path / "config.json").write_text('{"model_type": "qwen3"}')
    (path / "tokenizer.json").write_bytes(os.urandom(11 * 1024 * 1024))
    block = os.urandom(16 * 1024 * 1024)
    for i in range(shards):
        with open(path / f"model-{i + 1:05d}-of-{shards:05d}.safetensors", "wb") as fh:
            for _ in range(shard_mb // 16):
                fh.write(block)
    return sum(f.stat().st_size for f in path.iterdir())


def copy_cp(src: Path, target: Path) -> None:
    subprocess.run(["cp", "-r", str(src), str(target)], check=True)


def copy_parallel_cp(src: Path, target: Path) -> None:
    """What a skilled user writes to beat `cp -r`: one `cp` per file, four at a time."""
    target.mkdir()
    subprocess.run(f"ls {shlex.quote(str(src))} | xargs -P4 -I{{}} cp {shlex.quote(str(src))}/{{}} "
                   f"{shlex.quote(str(target))}/", shell=True, check=True)


def copy_regen(src: Path, target: Path) -> None:
    assert stage_model(src, target).copied


METHODS = {"`cp -r`": copy_cp, "4 x `cp` in parallel (`xargs -P4`)": copy_parallel_cp,
           "regen stage (4 threads, sizes and small files verified, manifest)": copy_regen}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--shards", type=int, default=8)
    parser.add_argument("--shard-mb", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    times: dict[str, list[float]] = {name: [] for name in METHODS}
    with tempfile.TemporaryDirectory(dir="/var/tmp") as src_root, \
            tempfile.TemporaryDirectory(dir="/dev/shm") as shm:
        src = Path(src_root) / "model"
        size = make_model(src, args.shards, args.shard_mb)
        os.sync()  # no dirty pages left for any copy to flush
        names = list(METHODS)
        for r in range(args.rounds):
            for name in names[r % len(names):] + names[:r % len(names)]:  # each goes first once
                target = Path(shm) / "target"
                started = time.perf_counter()
                METHODS[name](src, target)
                times[name].append(time.perf_counter() - started)
                shutil.rmtree(target)  # every copy pays for fresh /dev/shm pages
        staged = Path(shm) / "staged"
        copy_regen(src, staged)
        noop = stage_model(src, staged)
        assert not noop.copied
    gb = size / 1e9
    median = {name: statistics.median(t) for name, t in times.items()}
    rows = ["| copy | seconds, each round | median s | GB/s (median) |", "| --- | --- | --- | --- |"]
    for name, t in times.items():
        rows.append(f"| {name} | {' · '.join(f'{x:.2f}' for x in t)} | {median[name]:.2f} | {gb / median[name]:.2f} |")
    rows.append(f"| regen re-stage of an unchanged model (no-op) | {noop.seconds:.3f} | | |")
    regen_name = list(METHODS)[-1]
    best = min((n for n in METHODS if n != regen_name), key=median.get)
    body = "\n".join(rows) + (
        f"\n\n{args.shards} shards of {args.shard_mb} MB plus config and an 11 MB tokenizer ({gb:.2f} GB), from "
        f"the page cache to /dev/shm; the order rotates every round and every target is removed "
        f"before the next copy, so each pays for fresh /dev/shm pages. regen's time includes its "
        f"verification. regen is {median[best] / median[regen_name]:.2f}x the best baseline ({best}) "
        f"by the medians (goal: 1.0x or more).")
    write_section("Staging", ".venv/bin/python bench/bench_stage.py", body)


if __name__ == "__main__":
    main()
