"""The seed's size on one node: each stage that reads every row, its time and its peak memory, at
N prompts and extrapolated to the seed's 914,000.

Each stage runs as a user runs it (`regen ...` against two simulators answering at once, token ids
returned), in a fresh process; its peak memory is the largest sum of the RSS of the process and all
its children (sampled every 50 ms). Generation is SIGKILLed once half the rows are journaled, and
the resume that finishes it is what is measured. The audit of an engine's token ids runs on rows of
4k- and 32k-token answers (built in Arrow: the simulator's answers are short) with 2 workers asked
and the default audit_memory_gb. The prompts are ~1.65 KB, a third each single-turn, system+user
and three-turn. Extrapolation: time in proportion to the rows (the audit's and the export's also to the cores: one
worker per core); memory as measured (it is bounded by bytes, not rows).

    .venv/bin/python bench/bench_scale.py [--prompts 100000] [--id-rows 1000] [--shards 8]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import psutil
import yaml
from harness import write_section

from regen.layout import RunLayout
from regen.servers.probe import free_port_base

SEED_ROWS = 914_000
FILLER = "Explain the reasoning behind each step, with the numbers written out in full. " * 20  # ~1.6 KB


def make_prompts(path: Path, count: int) -> None:
    with path.open("w") as fh:
        for i in range(count):
            ask = f"Question {i}: {FILLER}"
            kind = i % 3
            if kind == 0:
                messages = [{"role": "user", "content": ask}]
            elif kind == 1:
                messages = [{"role": "system", "content": "You are a careful tutor."}, {"role": "user", "content": ask}]
            else:
                messages = [{"role": "user", "content": ask}, {"role": "assistant", "content": "A first answer."},
                            {"role": "user", "content": "And why?"}, {"role": "assistant", "content": "Because."},
                            {"role": "user", "content": "Say it once more."}]
            fh.write(json.dumps({"id": f"q{i}", "messages": messages}) + "\n")


def measured(argv: list[str], stop_when=None) -> tuple[float, int, int]:
    """(seconds, peak bytes of the process tree, exit status) of ``argv``; ``stop_when()`` true
    SIGKILLs its process group."""
    started = time.perf_counter()
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True)
    peak = 0
    tail: list[bytes] = []
    reader = threading.Thread(target=lambda: tail.extend(proc.stderr), daemon=True)
    reader.start()
    me = psutil.Process(proc.pid)
    while proc.poll() is None:
        try:
            peak = max(peak, sum(p.memory_info().rss for p in [me, *me.children(recursive=True)]))
        except psutil.Error:
            pass
        if stop_when is not None and stop_when():
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            break
        try:
            proc.wait(timeout=0.05)
        except subprocess.TimeoutExpired:
            pass
    reader.join(timeout=10)
    if proc.returncode not in (0, -signal.SIGKILL):
        sys.stderr.write(b"".join(tail[-40:]).decode(errors="replace"))
        raise SystemExit(f"{' '.join(argv[:4])}: exit status {proc.returncode}")
    return time.perf_counter() - started, peak, proc.returncode


def journaled(layout: RunLayout) -> int:
    return sum(1 for path in (layout.work / "journal").glob("*.jsonl") for _ in path.open("rb"))


def id_dataset(path: Path, rows: int, answer_tokens: int) -> Path:
    """``rows`` rows with an engine's ids: 2k prompt tokens, ``answer_tokens`` answer tokens."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    from regen.rows import ROW_SCHEMA

    path.mkdir(parents=True)
    base = [{"id": f"s{i}", "messages": [{"role": "user", "content": f"Question {i}?"}],
             "reasoning_content": "Let me think. " * 40, "content": "The answer.", "finish_reason": "stop",
             "completion_tokens": answer_tokens, "enable_thinking": True, "settings_hash": "x"} for i in range(rows)]
    table = pa.Table.from_pylist(base, schema=ROW_SCHEMA)
    rng = np.random.default_rng(1)
    for name, length in (("prompt_token_ids", 2_000), ("completion_token_ids", answer_tokens)):
        values = pa.array(rng.integers(1_000, 150_000, rows * length, dtype=np.int32))
        offsets = pa.array(np.arange(0, rows * length + 1, length, dtype=np.int64))
        table = table.set_column(table.schema.get_field_index(name), name,
                                 pa.LargeListArray.from_arrays(offsets, values).cast(pa.list_(pa.int32())))
    pq.write_table(table, path / "shard-0.parquet", row_group_size=500)
    return path


ID_AUDIT = """
import sys
from regen.audit.dataset import audit_dataset
from regen.audit.findings import AuditThresholds
audit_dataset(sys.argv[1], sys.argv[2], sys.argv[3], AuditThresholds(16, 1.0), workers=int(sys.argv[4]))
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=100_000)
    ap.add_argument("--id-rows", type=int, default=1_000, help="rows of each token-id audit")
    ap.add_argument("--shards", type=int, default=8)
    ap.add_argument("--workers", type=int, default=2, help="the token-id audits' workers asked")
    args = ap.parse_args()
    regen = [sys.executable, "-m", "regen", "--no-progress-bar"]
    cores = os.cpu_count() or 1
    rows: list[tuple[str, int, float, int, str]] = []  # stage, rows, seconds, peak bytes, note
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        from regen.tinymodel import build_tiny_model

        model = build_tiny_model(tmp / "model")
        make_prompts(tmp / "prompts.jsonl", args.prompts)
        cfg = {"model_path": str(model), "prompts": str(tmp / "prompts.jsonl"), "output": str(tmp / "out"),
               "engine": "sim", "num_servers": 2, "base_port": free_port_base(2), "stage_weights": False,
               "reasoning_parser": "qwen3", "max_tokens": 256, "num_shards": args.shards,
               "concurrency_per_server": 64, "min_loss_tokens": 1, "max_degenerate_fraction": 1.0}
        config = tmp / "config.yaml"
        config.write_text(yaml.safe_dump(cfg))
        flags = ["--config", str(config)]
        layout = RunLayout(tmp / "out")

        seconds, peak, _ = measured([*regen, "preflight", *flags])
        rows.append(("preflight", args.prompts, seconds, peak, "index of every prompt, template checks"))
        measured([*regen, "serve", *flags])
        try:
            half = args.prompts // 2
            killed_s, _, status = measured([*regen, "generate", *flags], stop_when=lambda: journaled(layout) >= half)
            assert status == -signal.SIGKILL, "generation ended before half its rows: use more --prompts"
            seconds, peak, _ = measured([*regen, "generate", *flags])
            rows.append(("generate: resume after SIGKILL", args.prompts - half, seconds, peak,
                         f"settles {half:,} journaled rows, sends the rest, publishes {args.shards} shards"))
        finally:
            measured([*regen, "serve", "--stop", *flags])
        seconds, peak, _ = measured([*regen, "audit", *flags])
        rows.append(("audit (the simulator's short answers, its token ids)", args.prompts, seconds, peak, "every core"))
        for workers in ("1", str(cores)):  # one process, then the default's every core
            out = tmp / f"export-{workers}"
            seconds, peak, _ = measured([*regen, "export", *flags, "--data", str(tmp / "out"), "--format", "specforge",
                                         "--out", str(out), "--workers", workers])
            size = sum(p.stat().st_size for p in out.iterdir())
            rows.append((f"export --format specforge, {workers} worker{'s' * (workers != '1')}", args.prompts,
                         seconds, peak, f"{size / 2**20:,.0f} MB written"))
        for answer in (4_000, 32_000):
            data = id_dataset(tmp / f"ids-{answer}" / "data", args.id_rows, answer)
            script = tmp / "id_audit.py"
            script.write_text(ID_AUDIT)
            seconds, peak, _ = measured([sys.executable, str(script), str(data), str(model), str(tmp / f"report-{answer}"),
                                         str(args.workers)])
            rows.append((f"audit with token ids, {answer // 1000}k-token answers", args.id_rows, seconds, peak,
                         f"{args.workers} workers asked, audit_memory_gb 8"))

    lines = ["| stage | rows | time | peak memory | per 1k rows | 914k rows, 2 cores | 914k rows, 32 cores | note |",
             "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    def duration(s: float) -> str:
        return f"{s / 3600:.1f} h" if s >= 3600 else f"{s / 60:.0f} min" if s >= 60 else f"{s:.0f} s"

    for stage, count, seconds, peak, note in rows:
        per_row = seconds / count
        # one worker per core; the rest runs in one process per shard or one
        parallel = stage.startswith("audit") or (stage.startswith("export") and not stage.endswith(" 1 worker"))
        at_2 = per_row * SEED_ROWS * (cores / 2 if parallel else 1)
        at_32 = per_row * SEED_ROWS * (cores / 32 if parallel else 1)
        lines.append(f"| {stage} | {count:,} | {seconds:,.1f} s | {peak / 2**30:.2f} GB | {per_row * 1000:.2f} s "
                     f"| {duration(at_2)} | {duration(at_32)} | {note} |")
    body = "\n".join(lines) + (
        f"\n\nEach stage as `regen` runs it, on {cores} cores. Extrapolated times scale with rows (and the audits' and the parallel export's with cores); "
        "memory is what was measured: every stage here reads rows in batches sized by bytes, so it does "
        "not grow with the rows. A small N is mostly start-up: its per-row figures overstate. For scale: SpecForge's own dataset build mapped 1,416,784 examples at "
        "2,640 examples/s with 64 processes (its issue 354).")
    write_section("Scale", f".venv/bin/python bench/bench_scale.py --prompts {args.prompts} --id-rows {args.id_rows} --shards {args.shards}",
                  body)


if __name__ == "__main__":
    main()
