"""The samples viewer: a few conversations, shown exactly as training will see them.

Before days of GPU time are trusted, a person reads a handful of samples: some at random, and
the worst of each finding (the fewest loss tokens among the degenerate, the longest among the
cut, ...). Each is the rendered conversation (the training template's view, turn by turn), its
loss spans marked, and the point where training's max length cuts it. The report embeds them;
``samples_view.json`` beside it holds the same.
"""

from __future__ import annotations

import html
import random
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq

from regen.audit.findings import AuditThresholds
from regen.chat.loss import assistant_spans
from regen.chat.onpolicy import REASONS
from regen.chat.render import render
from regen.chat.templates import TRAIN_TEMPLATES
from regen.training import training_conversation

RANDOM_SAMPLES = 5
PER_FINDING = 3
MAX_SHOWN_CHARS = 12_000  # per sample: the start and end of a longer one


def pick(samples_parquet: Path, seed: int = 0) -> dict[str, str]:
    """id -> why it is shown: random samples, then the worst few of each finding."""
    table = pq.read_table(samples_parquet, columns=["id", "loss_tokens", "tokens", "findings"]).to_pylist()
    chosen: dict[str, str] = {}
    rng = random.Random(seed)
    good = [s for s in table if "error" not in s["findings"]]
    for s in rng.sample(good, min(RANDOM_SAMPLES, len(good))):
        chosen[s["id"]] = "at random"
    by_finding: dict[str, list[dict]] = {}
    for s in table:
        for finding in s["findings"]:
            by_finding.setdefault(finding, []).append(s)
    for finding, items in sorted(by_finding.items()):
        if finding in ("degenerate", "degenerate_after_cut", "missing_reasoning", "thinking_mode_mismatch"):
            items = sorted(items, key=lambda s: s["loss_tokens"])
        elif finding in ("cut", "truncated"):
            items = sorted(items, key=lambda s: -(s["tokens"] or 0))
        for s in items[:PER_FINDING]:
            chosen.setdefault(s["id"], f"worst of {finding}")
    return chosen


def build(rows: list[dict], results: dict[str, dict], why: dict[str, str], tokenizer,
          thresholds: AuditThresholds) -> list[dict[str, Any]]:
    """Per chosen sample: the rendered text cut into (kind, text) segments, kind being "prompt",
    "loss" or "after_cut", and what the audit found."""
    template = TRAIN_TEMPLATES[thresholds.train_template]
    max_length = thresholds.train_max_length
    views = []
    for row in rows:
        result = results[row["id"]]
        view = {"id": row["id"], "why": why[row["id"]], "findings": result["findings"],
                "loss_tokens": result["loss_tokens"], "loss_tokens_uncut": result["loss_tokens_uncut"],
                "tokens": result["tokens"], "error": row.get("error"), "segments": [],
                "on_policy": result.get("on_policy")}
        if row.get("error") is None:
            conversation, tools = training_conversation(row, template)
            text = render(tokenizer, [conversation], template.render_thinking, [tools])[0]
            cut = len(text)
            if max_length:
                encoding = tokenizer._tokenizer.encode(text, add_special_tokens=False)
                if len(encoding.ids) > max_length:
                    cut = encoding.offsets[max_length][0]
            view["cut_at_char"] = cut if cut < len(text) else None
            spans = assistant_spans(text, template.fmt)
            view["segments"] = _segments(text, spans[-1:] if thresholds.train_layout == "events" else spans, cut)
        views.append(view)
    order = {i: n for n, i in enumerate(why)}
    return sorted(views, key=lambda v: order[v["id"]])


def _segments(text: str, spans: list[tuple[int, int]], cut: int) -> list[tuple[str, str]]:
    edges = sorted({0, len(text), cut, *(e for span in spans for e in span)})
    out = []
    for start, end in zip(edges, edges[1:]):
        in_loss = any(a <= start and end <= b for a, b in spans)
        kind = "after_cut" if start >= cut else "loss" if in_loss else "prompt"
        if out and out[-1][0] == kind:
            out[-1] = (kind, out[-1][1] + text[start:end])
        else:
            out.append((kind, text[start:end]))
    return out


def render_html(views: list[dict[str, Any]]) -> str:
    """The viewer as HTML: every piece of data escaped, no script."""
    parts = ['<h2 id="samples">Samples, as training sees them</h2><p class="muted">Highlighted: the loss '
             'mask (what training learns). Grey, after the scissors: what the max length cuts off. Each '
             'conversation is rendered with the training template, turn by turn.</p>']
    for view in views:
        uncut = (f" ({view['loss_tokens_uncut']:,} uncut)" if view["loss_tokens_uncut"] != view["loss_tokens"] else "")
        head = (f"{view['id']} · {view['why']} · {view['loss_tokens']:,} loss tokens{uncut} of "
                f"{view['tokens']:,} tokens · findings: {', '.join(view['findings']) or 'none'}"
                + (f" · NOT WHAT THE ENGINE SAW: {REASONS.get(view['on_policy'], view['on_policy'])}"
                   if view.get("on_policy") not in (None, "exact") else ""))
        if view.get("error"):
            body = f"<p>failed: {html.escape(view['error'])}</p>"
        else:
            shown, marked = [], False
            for kind, text in _shortened(view["segments"]):
                if kind == "after_cut" and not marked:
                    shown.append('<span class="cut-marker">&#9986; training stops here</span>')
                    marked = True
                shown.append(_segment_html(kind, text))
            body = '<pre class="sample">' + "".join(shown) + "</pre>"
        parts.append(f'<details class="sample-view"><summary>{html.escape(head)}</summary>{body}</details>')
    return "\n".join(parts)


def _segment_html(kind: str, text: str) -> str:
    if kind == "loss":
        return f"<mark>{html.escape(text)}</mark>"
    if kind == "after_cut":
        return f'<span class="after-cut">{html.escape(text)}</span>'
    if kind == "gap":
        return f'<span class="gap">{html.escape(text)}</span>'
    return html.escape(text)


def _shortened(segments: list[tuple[str, str]]) -> list[tuple[str, str]]:
    """A very long sample shows its first and last MAX_SHOWN_CHARS / 2 characters."""
    total = sum(len(t) for _, t in segments)
    if total <= MAX_SHOWN_CHARS:
        return segments
    keep = MAX_SHOWN_CHARS // 2
    head, tail, seen = [], [], 0
    for kind, text in segments:
        start, end = seen, seen + len(text)
        if start < keep:
            head.append((kind, text[:keep - start]))
        if end > total - keep:
            tail.append((kind, text[max(0, total - keep - start):]))
        seen = end
    return head + [("gap", f"\n[... {total - 2 * keep:,} characters not shown ...]\n")] + tail
