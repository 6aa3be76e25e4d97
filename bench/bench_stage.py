"""Staging: regen's verified, parallel copy to /dev/shm versus ``cp -r``, and a no-op re-stage.

A model directory of safetensors shards (plus config and tokenizer files) is copied to a RAM disk
by ``cp -r`` and by regen (4 threads, largest files first, sizes and small-file checksums
verified, manifest written). Both read from the page cache (the files were just written), so this
measures copying, not the source disk.

    .venv/bin/python bench/bench_stage.py [--shards 8] [--shard-mb 256]
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from results import write_section  # noqa: E402

from regen.stage import stage_model  # noqa: E402


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


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--shards", type=int, default=8)
    parser.add_argument("--shard-mb", type=int, default=256)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(dir="/var/tmp") as src_root, \
            tempfile.TemporaryDirectory(dir="/dev/shm") as shm:
        src = Path(src_root) / "model"
        size = make_model(src, args.shards, args.shard_mb)
        os.sync()  # no dirty pages left for either copy to flush
        cp_s, regen_s = [], []
        for round_ in range(2):
            target = Path(shm) / f"cp-{round_}"
            started = time.perf_counter()
            subprocess.run(["cp", "-r", str(src), str(target)], check=True)
            cp_s.append(time.perf_counter() - started)
            shutil.rmtree(target)
            staging = Path(shm) / f"regen-{round_}"
            started = time.perf_counter()
            result = stage_model(src, staging)
            regen_s.append(time.perf_counter() - started)
            assert result.copied
        noop = stage_model(src, Path(shm) / "regen-1")
        assert not noop.copied
    gb = size / 1e9
    body = (
        "| copy | seconds | GB/s |\n| --- | --- | --- |\n"
        f"| `cp -r` (baseline) | {min(cp_s):.2f} | {gb / min(cp_s):.2f} |\n"
        f"| regen stage (4 threads, verified, manifest) | {min(regen_s):.2f} | {gb / min(regen_s):.2f} |\n"
        f"| regen re-stage of an unchanged model (no-op) | {noop.seconds:.3f} | |\n\n"
        f"{args.shards} shards of {args.shard_mb} MB plus config and an 11 MB tokenizer ({gb:.2f} GB), "
        f"best of 2, from the page cache to /dev/shm. regen's time includes verifying sizes and "
        f"hashing the small files.")
    write_section("Staging", ".venv/bin/python bench/bench_stage.py", body)


if __name__ == "__main__":
    main()
