"""The loss-mask audit of a whole dataset: every sample checked as training will see it.

It streams the dataset's Parquet shards in batches (in a process per core once the data is large
enough), renders and counts each sample (regen.audit.rules), checks that each row is this run's
(its manifest), and writes the report directory (regen.layout.AuditFiles): ``summary.json``,
``samples.parquet`` (one row per sample, to filter the data by), the samples viewer's
conversations and a self-contained ``report.html`` with histograms.
"""

from __future__ import annotations

import json
import logging
import os
from collections import Counter
from dataclasses import replace
from pathlib import Path
from typing import Iterable, Iterator

import pyarrow as pa
import pyarrow.parquet as pq

from regen.audit import report, viewer
from regen.audit.findings import (SAMPLE_SCHEMA, AuditFailed, AuditReport, AuditSummary, AuditThresholds, fold,
                                  mark_duplicates)
from regen.audit.rules import audit_batch
from regen.chat.render import load_tokenizer, resolve_training
from regen.childpool import memory_plan, ordered_map
from regen.chat.templates import TRAIN_TEMPLATES, recipe
from regen.config import RunConfig
from regen.config.options import AuditOptions
from regen.errors import DataError
from regen.files import atomic_path, atomic_write_json, atomic_write_text
from regen.layout import AuditFiles, RunLayout, parse_shard_file
from regen.manifest import Manifest
from regen.progress import RunProgress
from regen.prompts import shard_of
from regen.card import write_card
from regen.results import AuditResult
from regen.rows import count_rows, iter_batches, record_batches
from regen.training import training_samples

log = logging.getLogger("regen.audit")


# What two rows must share to be of one dataset (regen.dispatch.made_by); the launch's own hash
# may differ (one node's memory settings).
MAKER_FIELDS = ("engine", "version", "reasoning_parser", "tool_call_parser", "chat_template")


class Provenance:
    """Which rows this run produced: the prompt hash its manifest recorded for the id, and the
    dataset's one settings hash (the manifest's, else the most common)."""

    def __init__(self, layout: RunLayout):
        self.manifest = Manifest(layout)
        doc = self.manifest.read()
        self.num_shards = doc.get("num_shards") if layout.prompt_index.exists() else None
        self.settings_counts: Counter = Counter()
        for path in layout.data_files():
            parquet = layout.parquet(path)
            if "settings_hash" in parquet.schema_arrow.names:
                self.settings_counts.update(parquet.read(columns=["settings_hash"])["settings_hash"].to_pylist())
        common = self.settings_counts.most_common(1)
        self.settings_hash = doc.get("settings_hash") or (common[0][0] if common else None)
        # How much of the run the data is: the run's shard count (its manifest) and its shard files.
        self.shard_files = layout.shard_files()
        self.shards_published = len(self.shard_files)
        self.run_shards = doc.get("num_shards")
        self.made_by = doc.get("run_id")  # the run whose preflight wrote the manifest the rows answer
        self.makers: Counter = Counter()  # what made the rows (regen.dispatch.made_by), as compared
        self._slices: dict[int, dict[str, str]] = {}
        self.seen: set[str] = set()

    def _expected(self, prompt_id: str) -> str | None:
        shard = shard_of(prompt_id, self.num_shards)
        if shard not in self._slices:
            if len(self._slices) > 4:
                self._slices.clear()
            self._slices[shard] = self.manifest.shard_prompts(shard).hashes
        return self._slices[shard].get(prompt_id)

    def check(self, rows: list[dict], results: list[dict]) -> None:
        for row in rows:
            if row.get("made_by"):
                made = json.loads(row["made_by"])
                self.makers[json.dumps({k: made.get(k) for k in (*MAKER_FIELDS, "launch")}, sort_keys=True)] += 1
        for row, result in zip(rows, results):
            prompt_id = row.get("source_id", row["id"])  # an event's row is its conversation's
            if self.num_shards and "prompt_hash" in row and row["prompt_hash"] != self._expected(prompt_id):
                result["findings"].append("stale_prompt")
            if self.settings_hash and row.get("settings_hash", self.settings_hash) != self.settings_hash:
                result["findings"].append("foreign_settings")

    def reading(self, batches: Iterable[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        """The data's batches, each id noted on the way (failed rows too, which make no sample)."""
        for batch in batches:
            self.seen.update(batch.column("id").to_pylist())
            yield batch

    def missing(self) -> list[str]:
        """The manifest's prompts of each published shard that have no row in the data."""
        if not self.num_shards:
            return []
        out = []
        for path in self.shard_files:
            shard, of = parse_shard_file(Path(path).name) or (None, None)
            if of == self.num_shards:
                out += set(self.manifest.shard_prompts(shard).ids) - self.seen
        return sorted(out)

    def mixed_rows(self) -> int:
        """Rows made otherwise than most of the dataset (another engine, version, parser or chat
        template; not another launch hash): a dataset regenerated across an image upgrade, a node
        with another template."""
        groups: Counter = Counter()
        for key, rows in self.makers.items():
            made = json.loads(key)
            groups[tuple(made.get(k) for k in MAKER_FIELDS)] += rows
        return sum(groups.values()) - max(groups.values(), default=0)

    def to_json(self) -> dict:
        missing = self.missing()
        return {"made_by": self.made_by,
                "makers": [{**json.loads(k), "rows": n} for k, n in self.makers.most_common()],
                "mixed_rows": self.mixed_rows(),
                "settings_hash": self.settings_hash, "rows_per_settings_hash": dict(self.settings_counts),
                "checked_against_manifest": bool(self.num_shards),
                "shards_published": self.shards_published, "num_shards": self.run_shards,
                "missing_ids": len(missing), "missing_examples": missing[:3]}


def resolved(thresholds: AuditThresholds, tokenizer) -> AuditThresholds:
    """The thresholds with the training template and layout decided (``auto``: by the model's
    chat template), and what the config left empty taken from that template's recipe."""
    try:
        name, layout = resolve_training(tokenizer, thresholds.train_template, thresholds.train_layout)
    except ValueError as exc:
        raise DataError(str(exc)) from None
    shipped = recipe(name)
    pick = lambda value, default: default if value is None else value  # noqa: E731
    return replace(thresholds, train_template=name, train_layout=layout,
                   min_loss_tokens=pick(thresholds.min_loss_tokens, shipped.min_loss_tokens),
                   train_max_length=pick(thresholds.train_max_length, shipped.max_length),
                   min_on_policy_fraction=pick(thresholds.min_on_policy_fraction, shipped.min_on_policy_fraction))


def audit_rows(rows: list[dict], tokenizer_dir: str, thresholds: AuditThresholds,
               default_thinking: bool = True) -> tuple[AuditSummary, list[dict], list[dict], AuditThresholds]:
    """Audit rows held in memory (the canary) with the same code as the dataset audit:
    (summary, the samples training will see, their results, the thresholds as resolved)."""
    tokenizer = load_tokenizer(str(tokenizer_dir))
    thresholds = resolved(thresholds, tokenizer)
    samples = _samples(rows, thresholds, default_thinking)
    results = audit_batch(samples, tokenizer, thresholds, default_thinking)
    mark_duplicates(results, set())
    summary = AuditSummary()
    fold(summary, samples, results)
    return summary, samples, results, thresholds


_worker_state: tuple | None = None


def _worker_init(tokenizer_dir: str, thresholds: AuditThresholds, default_thinking: bool) -> None:
    global _worker_state
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one process per core already
    _worker_state = (load_tokenizer(tokenizer_dir), thresholds, default_thinking)


def _worker_audit(batch: pa.RecordBatch) -> tuple[list[dict], list[dict]]:
    tokenizer, thresholds, default_thinking = _worker_state
    return _audit_record_batch(batch, tokenizer, thresholds, default_thinking)


def _audit_samples(rows: list[dict], tokenizer, thresholds: AuditThresholds,
                   default_thinking: bool) -> tuple[list[dict], list[dict]]:
    samples = _samples(rows, thresholds, default_thinking)
    return samples, audit_batch(samples, tokenizer, thresholds, default_thinking)


def _audit_record_batch(batch: pa.RecordBatch, tokenizer, thresholds: AuditThresholds,
                        default_thinking: bool) -> tuple[list[dict], list[dict]]:
    """A batch's (samples, results), the samples without their token ids: what the report needs,
    without sending the batch's largest part back (Arrow crosses to a worker at 4 bytes an id,
    Python lists at 36)."""
    samples, results = _audit_samples(batch.to_pylist(), tokenizer, thresholds, default_thinking)
    return [_without_ids(sample) for sample in samples], results


_ID_FIELDS = ("prompt_token_ids", "completion_token_ids")


def _without_ids(sample: dict) -> dict:
    """The sample without the engine's token ids, its turns' included (their count stays)."""
    out = {k: v for k, v in sample.items() if k not in _ID_FIELDS}
    if out.get("turns"):
        out["turns"] = [{k: v for k, v in turn.items() if k not in _ID_FIELDS} for turn in out["turns"]]
    return out


def _samples(rows: list[dict], thresholds: AuditThresholds, default_thinking: bool) -> list[dict]:
    return training_samples(rows, thresholds.train_layout, default_thinking,
                            TRAIN_TEMPLATES[thresholds.train_template].keeps_reasoning)


def audited_batches(batches: Iterable[pa.RecordBatch], tokenizer_dir: str, thresholds: AuditThresholds,
                    default_thinking: bool, workers: int) -> Iterator[tuple[list[dict], list[dict]]]:
    """(samples, results) of each batch of rows, in order (a sample per row, or per assistant
    turn in the events layout); with ``workers`` > 1, batches are audited in that many processes
    (regen.childpool: they run inside an Airflow task too), at most two batches per worker in
    flight, as Arrow, so memory stays bounded."""
    if workers <= 1:
        tokenizer = load_tokenizer(tokenizer_dir)
        for batch in batches:
            yield _audit_record_batch(batch, tokenizer, thresholds, default_thinking)
        return
    yield from ordered_map(_worker_audit, batches, workers, initializer=_worker_init,
                           init_args=(tokenizer_dir, thresholds, default_thinking))


def audit_dataset(data: str | Path | RunLayout, tokenizer_dir: str | Path, report_dir: str | Path,
                  thresholds: AuditThresholds, default_thinking: bool = True,
                  batch_size: int = 512, workers: int | None = None, memory_gb: float | None = None) -> AuditReport:
    """``data``: an output directory or its data/. ``workers``: processes to audit with; default
    every core once the data is large enough to pay for their start-up (a few seconds each), as
    many as ``memory_gb`` holds with their batches (sized by bytes, not rows)."""
    layout = data if isinstance(data, RunLayout) else RunLayout.from_data_arg(data)
    files = AuditFiles(Path(report_dir))
    files.root.mkdir(parents=True, exist_ok=True)
    rows = count_rows(layout)
    if workers is None:
        workers = (os.cpu_count() or 1) if rows >= 8 * batch_size else 1
    asked = workers
    memory_gb = AuditOptions.model_fields["audit_memory_gb"].default if memory_gb is None else memory_gb
    workers, batch_bytes = memory_plan(memory_gb * (1 << 30), asked)
    thresholds = resolved(thresholds, load_tokenizer(str(tokenizer_dir)))
    log.info("auditing %s rows in %d worker process(es)%s, batches of at most %d MB as Python objects "
             "(audit_memory_gb %s)", f"{rows:,}", workers,
             f" (of {asked} asked: memory)" if workers < asked else "", batch_bytes >> 20, memory_gb)
    summary = AuditSummary()
    seen: set[str] = set()
    provenance = Provenance(layout)
    batches = provenance.reading(record_batches(layout, batch_size, max_batch_bytes=batch_bytes))
    with atomic_path(files.samples_parquet) as samples_tmp, \
            pq.ParquetWriter(samples_tmp, SAMPLE_SCHEMA, compression="zstd") as writer:
        for samples, results in audited_batches(batches, str(tokenizer_dir), thresholds,
                                                default_thinking, workers):
            mark_duplicates(results, seen)
            provenance.check(samples, results)
            fold(summary, samples, results)
            writer.write_table(pa.Table.from_pylist(results, schema=SAMPLE_SCHEMA))
            if summary.samples % (batch_size * 20) < len(samples):
                log.info("audited %s samples", f"{summary.samples:,}")
    if not thresholds.allow_mixed_makers:
        summary.counts["foreign_settings"] += provenance.mixed_rows()
    audit_report = AuditReport(summary, thresholds, files, provenance.to_json())
    atomic_write_json(files.summary_json, audit_report.to_json())
    views = sample_views(layout, files.samples_parquet, str(tokenizer_dir), thresholds, default_thinking)
    atomic_write_json(files.samples_view_json, views)
    atomic_write_text(files.report_html, report.render_html(audit_report, views))
    return audit_report


# What the viewer's pass over the data holds at once.
VIEW_BATCH_BYTES = 256 << 20


def sample_views(layout: RunLayout, samples: Path, tokenizer_dir: str, thresholds: AuditThresholds,
                 default_thinking: bool = True) -> list[dict]:
    """The samples viewer's conversations (regen.audit.viewer): one more pass over the data for them."""
    why = viewer.pick(samples)
    results: dict[str, dict] = {}
    for s in pq.read_table(samples).to_pylist():
        if s["id"] in why:
            results.setdefault(s["id"], s)
    rows: dict[str, dict] = {}
    for batch in iter_batches(layout, max_batch_bytes=VIEW_BATCH_BYTES):
        for row in _samples(batch, thresholds, default_thinking):
            if row["id"] in why:
                rows.setdefault(row["id"], row)
    return viewer.build(list(rows.values()), results, why, load_tokenizer(tokenizer_dir), thresholds)


def audit(cfg: RunConfig, data: str | None = None, tokenizer: str | None = None,
              report_dir: str | None = None) -> AuditResult:
    """The audit stage: AuditFailed (with the five-line summary) when the data fails. ``data``
    takes an output directory or its data/ (default: the run's output)."""
    layout = RunLayout.from_data_arg(data, cfg.work_dir) if data else cfg.layout
    reports = Path(report_dir) if report_dir else layout.audit.root
    result = audit_dataset(layout, tokenizer or cfg.model_path, reports,
                           AuditThresholds.from_config(cfg), default_thinking=cfg.enable_thinking,
                           memory_gb=cfg.audit.audit_memory_gb)
    doc = result.to_json()
    RunProgress(layout).write_section("audit", doc)
    rows = count_rows(layout)
    judged_by = (tokenizer or cfg.model_path) if data else None  # other data: the card says what it recorded
    write_card(cfg, layout, doc, result.summary.loss_tokens, rows, reports, tokenizer=judged_by)
    if not data and result.passed and not result.partial_note():  # a pass of the whole output (preflight: audit_due)
        Manifest(layout).update(audit_due=False)
    if not result.passed:
        raise AuditFailed("\n".join(result.lines()), doc)
    return AuditResult.model_validate({**doc, "rows": rows, "output": str(layout.root),
                                       "dataset_uri": layout.asset_uri(cfg.ssh_conn_id)})
