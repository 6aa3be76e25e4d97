"""What the audit finds and decides: the findings per sample, the thresholds, the summary, the
verdict. The data model every other part of the audit (rules, run, report, viewer) reads."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pyarrow as pa

from regen.config import RunConfig
from regen.errors import RegenError
from regen.layout import AuditFiles


FINDINGS = (
    "error",               # the prompt failed for good; no sample to train on
    "duplicate_id",        # the id appears more than once
    "degenerate",          # loss mask under min_loss_tokens, or thinking asked and none came back
    "missing_reasoning",   # thinking was on and no reasoning came back
    "thinking_mode_mismatch",  # thinking was off and reasoning (or a think marker) came back anyway
    "truncated",           # finish_reason length
    "truncated_in_thinking",  # cut off before </think>: no answer at all
    "empty_answer",        # nothing after the reasoning
    "think_markers_in_content",  # <think> or </think> leaked into the answer
    "stale_prompt",        # not what this run's manifest says was sent for the id (edited, removed)
    "foreign_settings",    # made with another model or other settings than the dataset's
    "cut",                 # longer than the training's max length: training sees it cut
    "degenerate_after_cut",  # enough loss tokens whole, too few once cut
    "retokenized_differs",  # the answer, as training renders and re-encodes it, is not the generated tokens
    "off_policy",          # training's tokens are not what the engine was served and generated (on_policy says why)
    "left_out",            # the export leaves the conversation out (SpecForge's validator and expander would)
    "earlier_turn_cut",    # an earlier turn was truncated or empty: the conversation stopped there
    "repetition_loop",     # reasoning or answer ends in a repeated span (regen.quality.repetition_loop)
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
    ("on_policy", pa.string()),  # exact, why not (regen.chat.onpolicy.REASONS), or null: no token ids
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

    min_loss_tokens: int | None  # None (as the limits below): the training template's recipe, see resolved()
    max_degenerate_fraction: float
    train_template: str = "qwen3-thinking"
    train_max_length: int | None = None
    train_layout: str = "auto"  # events | conversation; auto: resolved with the tokenizer (regen.chat.render)
    max_divergence_fraction: float = 1.0
    min_on_policy_fraction: float | None = None
    max_loop_fraction: float = 1.0
    allow_mixed_makers: bool = False

    @classmethod
    def from_config(cls, cfg: RunConfig) -> "AuditThresholds":
        a = cfg.audit
        return cls(a.min_loss_tokens, a.max_degenerate_fraction, a.train_template, a.train_max_length, a.train_layout,
                   a.max_divergence_fraction, a.min_on_policy_fraction, a.max_loop_fraction, a.allow_mixed_makers)


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
    left_out: dict[str, int] = field(default_factory=dict)  # conversations the export leaves out, by reason
    # Agentic rows (tools, tool calls): how many, their steps, the recorded results spliced in, the
    # calls whose arguments differ from the recorded ones, the conversations ended by a divergence,
    # and where their requests sent earlier reasoning back (the context each step is trained on).
    agentic: dict[str, Any] = field(default_factory=lambda: {
        "rows": 0, "steps": 0, "spliced_results": 0, "argument_diffs": 0, "divergences": {},
        "history_reasoning": {}})
    # The samples whose last turn came with the engine's token ids, how many of them training sees
    # token for token as the engine was served and generated them, why the others differ.
    on_policy: dict[str, Any] = field(default_factory=lambda: {"checked": 0, "exact": 0, "reasons": {}})

    def fraction(self, finding: str) -> float:
        return self.counts[finding] / self.audited if self.audited else 0.0

    @property
    def degenerate_fraction(self) -> float:
        return self.fraction("degenerate")

    @property
    def on_policy_fraction(self) -> float | None:
        """Of the samples with token ids, those token-exact on-policy; None when none had ids."""
        return self.on_policy["exact"] / self.on_policy["checked"] if self.on_policy["checked"] else None

    @property
    def divergence_fraction(self) -> float:
        """Of the agentic rows, those a divergence ended early."""
        return sum(self.agentic["divergences"].values()) / self.agentic["rows"] if self.agentic["rows"] else 0.0


def mark_duplicates(results: list[dict], seen_ids: set[str]) -> None:
    """Duplicates across the whole dataset: the one finding that needs every id seen so far."""
    for result in results:
        if result["id"] in seen_ids:
            result["findings"].insert(0, "duplicate_id")
        seen_ids.add(result["id"])


# A divergence's kind, by the words regen.toolcalls.compare_calls says it with.
DIVERGENCE_KINDS = (("answered without a call", "no call"), ("answers without a call", "a call where none was recorded"),
                    ("where the recorded step calls", "another function"))


def divergence_kind(divergence: str) -> str:
    return next((kind for words, kind in DIVERGENCE_KINDS if words in divergence), "other")


def _fold_agentic(agentic: dict[str, Any], row: dict) -> None:
    """An agentic row, once (in the events layout, at its last step's sample)."""
    if not row.get("tools") or not row.get("last_step", True):
        return
    agentic["rows"] += 1
    agentic["steps"] += row.get("row_steps") or len(row.get("turns") or []) or 1
    agentic["spliced_results"] += row.get("spliced_results") or 0
    agentic["argument_diffs"] += row.get("argument_diffs") or 0
    sent = row.get("history_reasoning") or "never"
    agentic["history_reasoning"][sent] = agentic["history_reasoning"].get(sent, 0) + 1
    if row.get("divergence"):
        kind = divergence_kind(row["divergence"])
        agentic["divergences"][kind] = agentic["divergences"].get(kind, 0) + 1


def fold(summary: AuditSummary, rows: list[dict], results: list[dict]) -> None:
    for row, result in zip(rows, results):
        summary.samples += 1
        _fold_agentic(summary.agentic, row)
        verdict = result.get("on_policy")
        if verdict is not None:
            summary.on_policy["checked"] += 1
            if verdict == "exact":
                summary.on_policy["exact"] += 1
            else:
                summary.on_policy["reasons"][verdict] = summary.on_policy["reasons"].get(verdict, 0) + 1
        for finding in result["findings"]:
            summary.counts[finding] += 1
        if row.get("left_out"):
            summary.left_out[row["left_out"]] = summary.left_out.get(row["left_out"], 0) + 1
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


@dataclass
class AuditReport:
    summary: AuditSummary
    thresholds: AuditThresholds
    files: AuditFiles
    provenance: dict = field(default_factory=dict)

    @property
    def passed(self) -> bool:
        return self.summary.audited > 0 and not any(self.summary.counts[f] for f in PROVENANCE) and (
            not self.provenance.get("missing_ids")) and (
            self.summary.degenerate_fraction <= self.thresholds.max_degenerate_fraction) and (
            self.summary.divergence_fraction <= self.thresholds.max_divergence_fraction) and (
            self.summary.fraction("repetition_loop") <= self.thresholds.max_loop_fraction) and (
            self.summary.on_policy_fraction is None
            or self.summary.on_policy_fraction >= (self.thresholds.min_on_policy_fraction or 0.0))

    def verdict(self) -> str:
        return "PASS" if self.passed else "FAIL"

    def reasons(self) -> list[str]:
        """Why the verdict is FAIL, one line per broken bound (empty when it passes): what the run
        page and `regen summary` lead with."""
        s, t = self.summary, self.thresholds
        out = []
        if not s.audited:
            out.append("no sample was audited: the dataset is empty or unreadable")
        foreign = {f: s.counts[f] for f in PROVENANCE if s.counts[f]}
        if foreign:
            out.append("rows that are not this run's: " + ", ".join(f"{f} {n:,}" for f, n in foreign.items())
                       + " (another prompt file or other settings wrote them)")
        makers = self.provenance.get("makers") or []
        if self.provenance.get("mixed_rows") and not t.allow_mixed_makers:
            out.append("rows made by different servers' setups (engine, version, parsers, chat template): "
                       + "; ".join(f"{m['rows']:,} rows by {m['engine']} {m['version']} template {m['chat_template']} "
                                   f"parsers {m['reasoning_parser']}/{m['tool_call_parser']}" for m in makers[:4])
                       + " (allow_mixed_makers lets a dataset keep them)")
        if self.provenance.get("missing_ids"):
            out.append(f"{self.provenance['missing_ids']:,} prompts of the published shards have no row "
                       f"(e.g. {', '.join(self.provenance['missing_examples'])}): the shards hold fewer ids than "
                       "the run's manifest; run the output again to send them")
        if s.audited and s.degenerate_fraction > t.max_degenerate_fraction:
            out.append(f"{s.counts['degenerate']:,} of {s.audited:,} samples degenerate (fraction "
                       f"{s.degenerate_fraction:.4f} above max_degenerate_fraction {t.max_degenerate_fraction:.4f}): "
                       f"loss masks under min_loss_tokens {t.min_loss_tokens}, or thinking asked and none came back")
        if s.fraction("repetition_loop") > t.max_loop_fraction:
            out.append(f"{s.counts['repetition_loop']:,} of {s.audited:,} samples loop (fraction "
                       f"{s.fraction('repetition_loop'):.4f} above max_loop_fraction {t.max_loop_fraction:.4f}): "
                       f"greedy or low-temperature decoding; raise temperature or presence_penalty as the model's "
                       f"card recommends")
        if s.divergence_fraction > t.max_divergence_fraction:
            out.append(f"agentic rows ended at a divergence: fraction {s.divergence_fraction:.4f} above "
                       f"max_divergence_fraction {t.max_divergence_fraction:.4f}")
        if s.on_policy_fraction is not None and s.on_policy_fraction < (t.min_on_policy_fraction or 0.0):
            out.append(f"on-policy fraction {s.on_policy_fraction:.4f} under min_on_policy_fraction "
                       f"{t.min_on_policy_fraction:.4f}: samples are not what the engine served and generated")
        return out

    def to_json(self) -> dict:
        s = self.summary
        return {
            "verdict": self.verdict(),
            "reasons": self.reasons(),
            "samples": s.samples,
            "audited": s.audited,
            "degenerate_fraction": round(s.degenerate_fraction, 6),
            "thresholds": {"min_loss_tokens": self.thresholds.min_loss_tokens,
                           "max_degenerate_fraction": self.thresholds.max_degenerate_fraction,
                           "max_divergence_fraction": self.thresholds.max_divergence_fraction,
                           "max_loop_fraction": self.thresholds.max_loop_fraction,
                           "min_on_policy_fraction": self.thresholds.min_on_policy_fraction},
            "divergence_fraction": round(s.divergence_fraction, 6),
            "on_policy": {**s.on_policy, "fraction": None if s.on_policy_fraction is None
                          else round(s.on_policy_fraction, 6)},
            "train_view": {"template": self.thresholds.train_template,
                           "layout": self.thresholds.train_layout,
                           "max_length": self.thresholds.train_max_length,
                           "export_left_out": s.left_out,
                           "cut_fraction": round(s.fraction("cut"), 6),
                           "degenerate_after_cut_fraction": round(s.fraction("degenerate_after_cut"), 6)},
            "counts": s.counts,
            "fractions": {f: round(s.fraction(f), 6) for f in FINDINGS},
            "loss_tokens": _stats(s.loss_tokens),
            "completion_tokens": _stats(s.completion_tokens),
            "thinking_rows": s.thinking_rows,
            "reasoning_rows": s.reasoning_rows,
            "agentic": s.agentic,
            "example_degenerate": s.example,
            "provenance": self.provenance,
            "summary": self.lines(),
        }

    def lines(self) -> list[str]:
        """The five-line summary for a task log or a terminal, a line more for the on-policy
        certificate (when the engine returned token ids) and for agentic rows."""
        s = self.summary
        loss, comp = _stats(s.loss_tokens), _stats(s.completion_tokens)
        top = sorted(((n, f) for f, n in s.counts.items() if n and f != "degenerate"), reverse=True)
        return [
            f"audit {self.verdict()}{self.partial_note()}: {s.counts['degenerate']:,} of {s.audited:,} samples degenerate "
            f"(degenerate fraction {s.degenerate_fraction:.4f}, limit "
            f"{self.thresholds.max_degenerate_fraction:.4f})",
            f"loss tokens as {self.thresholds.train_template} trains on them ({self.thresholds.train_layout} layout)"
            + (f" cut at {self.thresholds.train_max_length:,}" if self.thresholds.train_max_length else "")
            + f": median {loss['median']}, p5 {loss['p5']}, p95 {loss['p95']} (min_loss_tokens "
            f"{self.thresholds.min_loss_tokens}); the cut shortens {s.fraction('cut'):.1%} of samples, "
            f"{s.fraction('degenerate_after_cut'):.1%} left too short; completion tokens median "
            f"{comp['median']}, max {comp['max']}",
            "findings: " + (", ".join(f"{f} {n:,}" for n, f in top) if top else "none"),
            f"reasoning present on {s.reasoning_rows:,} of {s.thinking_rows:,} samples that asked "
            f"for thinking; {s.counts['error']:,} error rows, {s.counts['duplicate_id']:,} duplicate ids, "
            f"{sum(s.left_out.values()):,} conversations the export leaves out"
            + (f"; NOT THIS RUN'S: {s.counts['stale_prompt']:,} stale prompts, "
               f"{s.counts['foreign_settings']:,} other settings"
               if any(s.counts[f] for f in PROVENANCE) else ""),
            *([self.on_policy_line()] if s.on_policy["checked"] else []),
            *([self.agentic_line()] if s.agentic["rows"] else []),
            f"report: {self.files.report_html}"
            + (f" (rows of run {self.provenance['made_by']})" if self.provenance.get("made_by") else ""),
        ]

    def partial_note(self) -> str:
        """`` (partial: 1 of 4 shards)`` when the run's data is not all there yet: the verdict is
        about the shards published so far."""
        published, shards = self.provenance.get("shards_published"), self.provenance.get("num_shards")
        if not shards or published is None or published >= shards:
            return ""
        return f" (partial: {published} of {shards} shards published; the verdict covers those rows only)"

    def on_policy_line(self) -> str:
        o, fraction = self.summary.on_policy, self.summary.on_policy_fraction or 0.0
        why = ", ".join(f"{reason} {n:,}" for reason, n in sorted(o["reasons"].items(), key=lambda kv: -kv[1]))
        return (f"on-policy: {o['exact']:,} of {o['checked']:,} samples are token for token what the engine was "
                f"served and generated (fraction {fraction:.4f}, limit {self.thresholds.min_on_policy_fraction or 0:.4f})"
                + (f"; the others: {why}" if why else ""))

    def agentic_line(self) -> str:
        a = self.summary.agentic
        ended = ", ".join(f"{kind} {n:,}" for kind, n in sorted(a["divergences"].items()))
        return (f"agentic: {a['rows']:,} rows, {a['steps']:,} steps, {a['spliced_results']:,} recorded results "
                f"spliced after the model's own calls, {a['argument_diffs']:,} calls with other arguments than "
                f"recorded; {sum(a['divergences'].values()):,} ended at a divergence" + (f" ({ended})" if ended else "")
                + f" (fraction {self.summary.divergence_fraction:.4f}, limit {self.thresholds.max_divergence_fraction:.4f})"
                + "; earlier reasoning sent back: " + ", ".join(f"{where.replace(',', ' and ')} {n:,}" for where, n
                                                                 in sorted(a.get("history_reasoning", {}).items())))


def _stats(values: list[int]) -> dict[str, Any]:
    if not values:
        return {"count": 0, "min": None, "p5": None, "median": None, "mean": None, "p95": None,
                "max": None}
    arr = np.asarray(values)
    return {"count": int(arr.size), "min": int(arr.min()), "p5": int(np.percentile(arr, 5)),
            "median": int(np.median(arr)), "mean": round(float(arr.mean()), 1),
            "p95": int(np.percentile(arr, 95)), "max": int(arr.max())}
