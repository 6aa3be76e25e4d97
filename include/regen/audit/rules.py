"""The rules: each sample rendered, masked and cut as the training's template and max length
will, and what is found in it."""

from __future__ import annotations

from regen.audit.findings import AuditThresholds
from regen.chat.loss import loss_token_counts
from regen.chat.onpolicy import certify
from regen.chat.render import generation_prefill, render
from regen.chat.templates import TRAIN_TEMPLATES
from regen.quality import text_findings
from regen.rows import asked_thinking
from regen.training import served, training_conversation
from regen.turns import EARLIER_TURN_CUT


def audit_batch(rows: list[dict], tokenizer, thresholds: AuditThresholds,
                default_thinking: bool = True) -> list[dict]:
    """Findings and loss tokens of each row (duplicates aside: see mark_duplicates), each
    conversation rendered, masked and cut as the training's template and max length will."""
    template = TRAIN_TEMPLATES[thresholds.train_template]
    fmt = template.fmt
    results: list[dict] = [None] * len(rows)  # type: ignore[list-item]
    to_render: list[int] = []
    conversations, tools = [], []
    for i, row in enumerate(rows):
        findings: list[str] = []
        results[i] = {"id": row["id"], "loss_tokens": 0, "loss_tokens_uncut": 0, "tokens": 0, "on_policy": None,
                      "completion_tokens": row.get("completion_tokens"), "findings": findings}
        if row.get("error") is not None:
            findings.append("error")
            if str(row["error"]).startswith(EARLIER_TURN_CUT):
                findings.append("earlier_turn_cut")
            continue
        to_render.append(i)
        messages, row_tools = training_conversation(row, template)
        conversations.append(messages)
        tools.append(row_tools)
    texts = render(tokenizer, conversations, template.render_thinking, tools)
    counts = loss_token_counts(tokenizer, texts, fmt, thresholds.train_max_length, template.ignore,
                               last_turn_only=thresholds.train_layout == "events")
    certified = certificates(tokenizer, texts, [rows[i] for i in to_render], fmt, default_thinking)
    for j, i in enumerate(to_render):
        row, result, count = rows[i], results[i], counts[j]
        findings = result["findings"]
        certificate = certified[j]
        result.update(loss_tokens=count.loss, loss_tokens_uncut=count.uncut, tokens=count.total,
                      on_policy=certificate.verdict if certificate else None)
        findings.extend(text_findings(row, default_thinking, fmt))
        if thresholds.train_max_length and count.total > thresholds.train_max_length:
            findings.append("cut")
            if count.loss < thresholds.min_loss_tokens <= count.uncut:
                findings.append("degenerate_after_cut")
        if certificate and not certificate.completion_exact:
            findings.append("retokenized_differs")
        if result["on_policy"] not in (None, "exact"):
            findings.append("off_policy")
        if row.get("left_out"):
            findings.append("left_out")
        if count.loss < thresholds.min_loss_tokens or row.get("left_out") or (
                "missing_reasoning" in findings or "thinking_mode_mismatch" in findings):
            findings.append("degenerate")
    return results


def certificates(tokenizer, texts: list[str], rows: list[dict], fmt, default_thinking: bool = True) -> list:
    """Per rendered sample, its on-policy certificate (regen.chat.onpolicy) against the token ids
    the engine returned for its last turn. What the generation prompt pre-filled (an empty think
    block with thinking off) is the prompt's, not the generation's."""
    prefill = {thinking: generation_prefill(tokenizer, fmt, thinking) for thinking in (True, False)}
    return certify(tokenizer, texts, fmt, [served(row, prefill[asked_thinking(row, default_thinking)]) for row in rows])
