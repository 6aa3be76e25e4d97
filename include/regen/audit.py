"""The loss-mask audit: every sample checked as training will see it, and a verdict.

It streams the dataset's Parquet shards in batches, renders each sample with the model's chat
template and the run's ``enable_thinking``, counts the loss tokens as SpecForge does
(:mod:`regen.chat`), and records findings per sample. The report directory gets
``summary.json``, ``samples.parquet`` (one row per sample, to filter the data by) and a
self-contained ``report.html`` with histograms.
"""

from __future__ import annotations

import json
import logging
import multiprocessing
import os
from collections import deque
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Iterator

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from regen.chat import TRAIN_TEMPLATES, load_tokenizer, loss_token_counts, render, training_messages
from regen.config import RunConfig
from regen.errors import DataError, RegenError
from regen.layout import RunLayout

log = logging.getLogger("regen.audit")

FINDINGS = (
    "error",               # the prompt failed for good; no sample to train on
    "duplicate_id",        # the id appears more than once
    "degenerate",          # loss mask under min_loss_tokens, or thinking asked and none came back
    "missing_reasoning",   # thinking was on and no reasoning came back
    "truncated",           # finish_reason length
    "truncated_in_thinking",  # cut off before </think>: no answer at all
    "empty_answer",        # nothing after the reasoning
    "think_markers_in_content",  # <think> or </think> leaked into the answer
    "stale_prompt",        # not what this run's manifest says was sent for the id (edited, removed)
    "foreign_settings",    # made with another model or other settings than the dataset's
    "cut",                 # longer than the training's max length: training sees it cut
    "degenerate_after_cut",  # enough loss tokens whole, too few once cut
    "retokenized_differs",  # the answer's text, re-encoded as training renders it, is not the generated tokens
)
# Findings that fail the audit whatever their number: rows this run did not produce.
PROVENANCE = ("stale_prompt", "foreign_settings")

SAMPLE_SCHEMA = pa.schema([
    ("id", pa.string()),
    ("loss_tokens", pa.int64()),  # as training sees them: after the cut at train_max_length
    ("loss_tokens_uncut", pa.int64()),
    ("tokens", pa.int64()),  # the whole rendered conversation, before the cut
    ("completion_tokens", pa.int64()),
    ("findings", pa.list_(pa.string())),
])


class AuditFailed(RegenError):
    """The data fails its thresholds; the message is the audit's five-line summary."""

    def __init__(self, message: str, summary: dict | None = None):
        super().__init__(message)
        self.summary = summary or {}

    def detail(self) -> dict:
        return {"summary": self.summary}

    @classmethod
    def from_detail(cls, message: str, detail: dict) -> "AuditFailed":
        return cls(message, detail.get("summary"))


@dataclass(frozen=True)
class AuditThresholds:
    """What a sample is checked against: the limits, and the training's view of it."""

    min_loss_tokens: int
    max_degenerate_fraction: float
    train_template: str = "qwen3-thinking"
    train_max_length: int | None = None

    @classmethod
    def from_config(cls, cfg: RunConfig) -> "AuditThresholds":
        return cls(cfg.min_loss_tokens, cfg.max_degenerate_fraction, cfg.train_template, cfg.train_max_length)


@dataclass
class AuditSummary:
    samples: int = 0
    audited: int = 0  # samples that are not error rows
    counts: dict[str, int] = field(default_factory=lambda: {f: 0 for f in FINDINGS})
    loss_tokens: list[int] = field(default_factory=list)
    completion_tokens: list[int] = field(default_factory=list)
    thinking_rows: int = 0
    reasoning_rows: int = 0
    example: dict[str, Any] | None = None

    def fraction(self, finding: str) -> float:
        return self.counts[finding] / self.audited if self.audited else 0.0

    @property
    def degenerate_fraction(self) -> float:
        return self.fraction("degenerate")


def mark_duplicates(results: list[dict], seen_ids: set[str]) -> None:
    """Duplicates across the whole dataset: the one finding that needs every id seen so far."""
    for result in results:
        if result["id"] in seen_ids:
            result["findings"].insert(0, "duplicate_id")
        seen_ids.add(result["id"])


def audit_batch(rows: list[dict], tokenizer, thresholds: AuditThresholds,
                default_thinking: bool = True) -> list[dict]:
    """Findings and loss tokens of each row (duplicates aside: see mark_duplicates), each
    conversation rendered, masked and cut as the training's template and max length will."""
    template = TRAIN_TEMPLATES[thresholds.train_template]
    fmt = template.fmt
    results: list[dict] = [None] * len(rows)  # type: ignore[list-item]
    to_render: list[int] = []
    conversations = []
    for i, row in enumerate(rows):
        findings: list[str] = []
        results[i] = {"id": row["id"], "loss_tokens": 0, "loss_tokens_uncut": 0, "tokens": 0,
                      "completion_tokens": row.get("completion_tokens"), "findings": findings}
        if row.get("error") is not None:
            findings.append("error")
            continue
        to_render.append(i)
        conversations.append(training_messages(row_messages(row), row.get("reasoning_content"),
                                               row.get("content"), template))
    texts = render(tokenizer, conversations, True if template.enable_thinking else None)
    counts = loss_token_counts(tokenizer, texts, fmt, thresholds.train_max_length, template.ignore)
    differs = retokenized_differs(tokenizer, texts, [rows[i] for i in to_render], fmt)
    for j, i in enumerate(to_render):
        row, result, count = rows[i], results[i], counts[j]
        findings = result["findings"]
        result.update(loss_tokens=count.loss, loss_tokens_uncut=count.uncut, tokens=count.total)
        content = row.get("content") or ""
        thinking = row.get("enable_thinking")
        thinking = default_thinking if thinking is None else bool(thinking)
        reasonings = [row.get("reasoning_content")] + [m.get("reasoning_content") for m in _regenerated(row)]
        if thinking and not all((r or "").strip() for r in reasonings):
            findings.append("missing_reasoning")
        if row.get("finish_reason") == "length":
            findings.append("truncated")
            if (fmt.think_start in content and fmt.think_end not in content) or (
                    (reasonings[0] or "").strip() and not content.strip()):
                findings.append("truncated_in_thinking")
        if not content.strip():
            findings.append("empty_answer")
        if fmt.think_start in content or fmt.think_end in content:
            findings.append("think_markers_in_content")
        if thresholds.train_max_length and count.total > thresholds.train_max_length:
            findings.append("cut")
            if count.loss < thresholds.min_loss_tokens <= count.uncut:
                findings.append("degenerate_after_cut")
        if differs[j]:
            findings.append("retokenized_differs")
        if count.loss < thresholds.min_loss_tokens or "missing_reasoning" in findings:
            findings.append("degenerate")
    return results


def retokenized_differs(tokenizer, texts: list[str], rows: list[dict], fmt) -> list[bool]:
    """Per rendered conversation whose row holds the generated tokens: whether its last
    assistant turn, as training renders and re-encodes it, is other tokens than the engine
    generated (a drafter would learn what the target never produced)."""
    from regen.chat import assistant_spans

    out = [False] * len(texts)
    todo = []
    for i, row in enumerate(rows):
        spans = assistant_spans(texts[i], fmt) if row.get("completion_token_ids") is not None else []
        if spans:
            start, end = spans[-1]
            todo.append((i, texts[i][start:end].removesuffix(fmt.after_eos)))
    encodings = tokenizer._tokenizer.encode_batch([span for _, span in todo], add_special_tokens=False)
    for (i, _), encoding in zip(todo, encodings):
        generated = list(rows[i]["completion_token_ids"])
        ids = encoding.ids if rows[i].get("finish_reason") == "stop" else encoding.ids[:len(generated)]
        out[i] = ids != generated
    return out


def row_messages(row: dict) -> list[dict]:
    messages = row["messages"]
    if hasattr(messages, "tolist"):
        messages = messages.tolist()
    return [{k: v for k, v in m.items() if v is not None or k == "content"} for m in messages]


def _regenerated(row: dict) -> list[dict]:
    """The earlier assistant turns this run regenerated (all of them with regenerate_turns all;
    none with last, whose history is the dataset's own)."""
    turns = row.get("turns")
    earlier = len(turns) - 1 if turns else 0
    if earlier <= 0:
        return []
    return [m for m in row_messages(row) if m["role"] == "assistant"][-earlier:]


def iter_batches(layout: RunLayout, batch_size: int = 512) -> Iterator[list[dict]]:
    """Rows in batches, one file at a time: memory holds one batch, however large the data."""
    files = layout.data_files()
    if not files:
        raise DataError(f"{layout.data}: no Parquet files to read")
    for path in files:
        parquet = pq.ParquetFile(path)
        names = parquet.schema_arrow.names
        missing = {"id", "messages", "content"} - set(names)
        if missing:
            raise DataError(f"{path}: the data has no column(s) {sorted(missing)}")
        wanted = [c for c in ("id", "messages", "reasoning_content", "content", "finish_reason",
                              "completion_tokens", "error", "enable_thinking", "prompt_hash",
                              "settings_hash", "turns", "prompt_token_ids", "completion_token_ids")
                  if c in names]
        for batch in parquet.iter_batches(batch_size=batch_size, columns=wanted):
            yield batch.to_pylist()


class Provenance:
    """Which rows this run produced: the prompt hash its manifest recorded for the id, and the
    dataset's one settings hash (the manifest's, else the most common)."""

    def __init__(self, layout: RunLayout):
        from collections import Counter

        from regen.manifest import Manifest

        self.manifest = Manifest(layout)
        doc = self.manifest.read()
        self.num_shards = doc.get("num_shards") if layout.prompt_index.exists() else None
        self.settings_counts: Counter = Counter()
        for path in layout.data_files():
            if "settings_hash" in pq.ParquetFile(path).schema_arrow.names:
                self.settings_counts.update(pq.read_table(path, columns=["settings_hash"])["settings_hash"].to_pylist())
        common = self.settings_counts.most_common(1)
        self.settings_hash = doc.get("settings_hash") or (common[0][0] if common else None)
        self._slices: dict[int, dict[str, str]] = {}

    def _expected(self, prompt_id: str) -> str | None:
        from regen.prompts import shard_of

        shard = shard_of(prompt_id, self.num_shards)
        if shard not in self._slices:
            if len(self._slices) > 4:
                self._slices.clear()
            self._slices[shard] = self.manifest.shard_prompts(shard).hashes
        return self._slices[shard].get(prompt_id)

    def check(self, rows: list[dict], results: list[dict]) -> None:
        for row, result in zip(rows, results):
            if self.num_shards and "prompt_hash" in row and row["prompt_hash"] != self._expected(row["id"]):
                result["findings"].append("stale_prompt")
            if self.settings_hash and row.get("settings_hash", self.settings_hash) != self.settings_hash:
                result["findings"].append("foreign_settings")

    def to_json(self) -> dict:
        return {"settings_hash": self.settings_hash, "rows_per_settings_hash": dict(self.settings_counts),
                "checked_against_manifest": bool(self.num_shards)}


def fold(summary: AuditSummary, rows: list[dict], results: list[dict]) -> None:
    for row, result in zip(rows, results):
        summary.samples += 1
        for finding in result["findings"]:
            summary.counts[finding] += 1
        if "error" in result["findings"]:
            continue
        summary.audited += 1
        summary.loss_tokens.append(result["loss_tokens"])
        if result["completion_tokens"] is not None:
            summary.completion_tokens.append(int(result["completion_tokens"]))
        if row.get("enable_thinking", True) is not False:
            summary.thinking_rows += 1
        if (row.get("reasoning_content") or "").strip():
            summary.reasoning_rows += 1
        if summary.example is None and "degenerate" in result["findings"]:
            summary.example = {"id": row["id"], "loss_tokens": result["loss_tokens"],
                               "reasoning_content": row.get("reasoning_content"),
                               "content": (row.get("content") or "")[:300],
                               "findings": result["findings"]}


def audit_rows(rows: list[dict], tokenizer_dir: str, thresholds: AuditThresholds,
               default_thinking: bool = True) -> tuple[AuditSummary, list[dict]]:
    """Audit rows held in memory (the canary) with the same code as the dataset audit."""
    tokenizer = load_tokenizer(str(tokenizer_dir))
    results = audit_batch(rows, tokenizer, thresholds, default_thinking)
    mark_duplicates(results, set())
    summary = AuditSummary()
    fold(summary, rows, results)
    return summary, results


@dataclass
class AuditReport:
    summary: AuditSummary
    thresholds: AuditThresholds
    report_dir: Path
    provenance: dict = field(default_factory=dict)

    @property
    def passed(self) -> bool:
        return self.summary.audited > 0 and not any(self.summary.counts[f] for f in PROVENANCE) and (
            self.summary.degenerate_fraction <= self.thresholds.max_degenerate_fraction)

    def verdict(self) -> str:
        return "PASS" if self.passed else "FAIL"

    def to_json(self) -> dict:
        s = self.summary
        return {
            "verdict": self.verdict(),
            "samples": s.samples,
            "audited": s.audited,
            "degenerate_fraction": round(s.degenerate_fraction, 6),
            "thresholds": {"min_loss_tokens": self.thresholds.min_loss_tokens,
                           "max_degenerate_fraction": self.thresholds.max_degenerate_fraction},
            "train_view": {"template": self.thresholds.train_template,
                           "max_length": self.thresholds.train_max_length,
                           "cut_fraction": round(s.fraction("cut"), 6),
                           "degenerate_after_cut_fraction": round(s.fraction("degenerate_after_cut"), 6)},
            "counts": s.counts,
            "fractions": {f: round(s.fraction(f), 6) for f in FINDINGS},
            "loss_tokens": _stats(s.loss_tokens),
            "completion_tokens": _stats(s.completion_tokens),
            "thinking_rows": s.thinking_rows,
            "reasoning_rows": s.reasoning_rows,
            "example_degenerate": s.example,
            "provenance": self.provenance,
            "summary": self.lines(),
        }

    def lines(self) -> list[str]:
        """The five-line summary for a task log or a terminal."""
        s = self.summary
        loss, comp = _stats(s.loss_tokens), _stats(s.completion_tokens)
        top = sorted(((n, f) for f, n in s.counts.items() if n and f != "degenerate"), reverse=True)
        return [
            f"audit {self.verdict()}: {s.counts['degenerate']:,} of {s.audited:,} samples degenerate "
            f"(degenerate fraction {s.degenerate_fraction:.4f}, limit "
            f"{self.thresholds.max_degenerate_fraction:.4f})",
            f"loss tokens as {self.thresholds.train_template} trains on them"
            + (f" cut at {self.thresholds.train_max_length:,}" if self.thresholds.train_max_length else "")
            + f": median {loss['median']}, p5 {loss['p5']}, p95 {loss['p95']} (min_loss_tokens "
            f"{self.thresholds.min_loss_tokens}); the cut shortens {s.fraction('cut'):.1%} of samples, "
            f"{s.fraction('degenerate_after_cut'):.1%} left too short; completion tokens median "
            f"{comp['median']}, max {comp['max']}",
            "findings: " + (", ".join(f"{f} {n:,}" for n, f in top) if top else "none"),
            f"reasoning present on {s.reasoning_rows:,} of {s.thinking_rows:,} samples that asked "
            f"for thinking; {s.counts['error']:,} error rows, {s.counts['duplicate_id']:,} duplicate ids"
            + (f"; NOT THIS RUN'S: {s.counts['stale_prompt']:,} stale prompts, "
               f"{s.counts['foreign_settings']:,} other settings"
               if any(s.counts[f] for f in PROVENANCE) else ""),
            f"report: {self.report_dir / 'report.html'}",
        ]


def _stats(values: list[int]) -> dict[str, Any]:
    if not values:
        return {"count": 0, "min": None, "p5": None, "median": None, "mean": None, "p95": None,
                "max": None}
    arr = np.asarray(values)
    return {"count": int(arr.size), "min": int(arr.min()), "p5": int(np.percentile(arr, 5)),
            "median": int(np.median(arr)), "mean": round(float(arr.mean()), 1),
            "p95": int(np.percentile(arr, 95)), "max": int(arr.max())}


_worker_state: tuple | None = None


def _worker_init(tokenizer_dir: str, thresholds: AuditThresholds, default_thinking: bool) -> None:
    global _worker_state
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one process per core already
    _worker_state = (load_tokenizer(tokenizer_dir), thresholds, default_thinking)


def _worker_audit(rows: list[dict]) -> list[dict]:
    tokenizer, thresholds, default_thinking = _worker_state
    return audit_batch(rows, tokenizer, thresholds, default_thinking)


def audited_batches(batches: Iterable[list[dict]], tokenizer_dir: str, thresholds: AuditThresholds,
                    default_thinking: bool, workers: int) -> Iterator[tuple[list[dict], list[dict]]]:
    """(rows, results) in order; with ``workers`` > 1, batches are audited in that many processes,
    at most two batches per worker in flight so memory stays bounded."""
    if workers <= 1:
        tokenizer = load_tokenizer(tokenizer_dir)
        for rows in batches:
            yield rows, audit_batch(rows, tokenizer, thresholds, default_thinking)
        return
    context = multiprocessing.get_context("spawn")  # a fork would inherit the tokenizer's threads
    with ProcessPoolExecutor(workers, mp_context=context, initializer=_worker_init,
                             initargs=(tokenizer_dir, thresholds, default_thinking)) as pool:
        pending: deque = deque()
        for rows in batches:
            pending.append((rows, pool.submit(_worker_audit, rows)))
            if len(pending) >= 2 * workers:
                done_rows, future = pending.popleft()
                yield done_rows, future.result()
        while pending:
            done_rows, future = pending.popleft()
            yield done_rows, future.result()


def count_rows(layout: RunLayout) -> int:
    return sum(pq.ParquetFile(p).metadata.num_rows for p in layout.data_files())


def audit_dataset(data: str | Path, tokenizer_dir: str | Path, report_dir: str | Path,
                  thresholds: AuditThresholds, default_thinking: bool = True,
                  batch_size: int = 512, workers: int | None = None) -> AuditReport:
    """``data``: an output directory or its data/. ``workers``: processes to audit with; default
    every core once the data is large enough to pay for their start-up (a few seconds each)."""
    layout = RunLayout.from_data_arg(data)
    report_dir = Path(report_dir)
    report_dir.mkdir(parents=True, exist_ok=True)
    if workers is None:
        workers = (os.cpu_count() or 1) if count_rows(layout) >= 8 * batch_size else 1
    summary = AuditSummary()
    seen: set[str] = set()
    provenance = Provenance(layout)
    samples_tmp = report_dir / ".samples.parquet.tmp"
    batches = iter_batches(layout, batch_size)
    with pq.ParquetWriter(samples_tmp, SAMPLE_SCHEMA, compression="zstd") as writer:
        for rows, results in audited_batches(batches, str(tokenizer_dir), thresholds,
                                             default_thinking, workers):
            mark_duplicates(results, seen)
            provenance.check(rows, results)
            fold(summary, rows, results)
            writer.write_table(pa.Table.from_pylist(results, schema=SAMPLE_SCHEMA))
            if summary.samples % (batch_size * 20) < len(rows):
                log.info("audited %s samples", f"{summary.samples:,}")
    samples_tmp.replace(report_dir / "samples.parquet")
    report = AuditReport(summary, thresholds, report_dir, provenance.to_json())
    (report_dir / "summary.json").write_text(json.dumps(report.to_json(), indent=1))
    views = sample_views(layout, report_dir / "samples.parquet", str(tokenizer_dir), thresholds)
    (report_dir / "samples_view.json").write_text(json.dumps(views, indent=1))
    from regen.report import render_html

    (report_dir / "report.html").write_text(render_html(report, views))
    return report


def sample_views(layout: RunLayout, samples: Path, tokenizer_dir: str, thresholds: AuditThresholds) -> list[dict]:
    """The samples viewer's conversations (regen.viewer): one more pass over the data for them."""
    from regen import viewer

    why = viewer.pick(samples)
    results: dict[str, dict] = {}
    for s in pq.read_table(samples).to_pylist():
        if s["id"] in why:
            results.setdefault(s["id"], s)
    rows: dict[str, dict] = {}
    for batch in iter_batches(layout):
        for row in batch:
            if row["id"] in why:
                rows.setdefault(row["id"], row)
    return viewer.build(list(rows.values()), results, why, load_tokenizer(tokenizer_dir),
                        thresholds.train_template, thresholds.train_max_length)


def audit(cfg: RunConfig, data: str | None = None, tokenizer: str | None = None,
          report: str | None = None) -> dict:
    """The audit stage: AuditFailed (with the five-line summary) when the data fails. ``data``
    takes an output directory or its data/ (default: the run's output)."""
    from regen.progress import RunProgress

    layout = RunLayout.from_data_arg(data) if data else RunLayout(cfg.output)
    result = audit_dataset(layout.root, tokenizer or cfg.model_path,
                           Path(report) if report else layout.audit,
                           AuditThresholds.from_config(cfg), default_thinking=cfg.enable_thinking)
    doc = result.to_json()
    RunProgress(layout).write_section("audit", doc)
    if not result.passed:
        raise AuditFailed("\n".join(result.lines()), doc)
    return doc
