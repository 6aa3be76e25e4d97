"""Export the dataset as the JSONL that SpecForge and DFlash training read.

``sharegpt`` writes what SpecForge's ``scripts/regenerate_train_data.py`` writes:
``{"id", "conversations": [{"role", "content", "reasoning_content"?}, ...], "status": "success"}``,
one line per prompt, every regenerated assistant turn with its reasoning; with ``layout=events``,
what its ``expand_reasoning_conversations.py`` writes from that file (regen.training). Rows that
would fail ``scripts/validate_regenerated_data.py --expect-reasoning --strict-think-markers``
(failed prompts, empty messages, roles out of order, an assistant turn without reasoning,
leftover think markers) are left out and counted, so the file passes that validator as written.
"""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from regen.chat.loss import assistant_spans, training_tokens
from regen.chat.render import generation_prefill, load_tokenizer, render, resolve_training
from regen.chat.templates import TRAIN_TEMPLATES
from regen.files import atomic_file
from regen.layout import RunLayout
from regen.rows import asked_thinking, iter_batches
from regen.training import TrainLayout, conversation_record, event_records, training_conversation, training_samples, why_left_out

@dataclass
class ExportResult:
    path: Path
    written: int = 0
    left_out: Counter = field(default_factory=Counter)
    unit: str = "records"
    checks: Counter = field(default_factory=Counter)

    def summary(self) -> str:
        reasons = ", ".join(f"{reason} {n:,}" for reason, n in self.left_out.most_common())
        checks = "; ".join(f"{what}: {n:,}" for what, n in self.checks.most_common())
        return (f"wrote {self.written:,} {self.unit} to {self.path}; left out "
                f"{sum(self.left_out.values()):,}" + (f" ({reasons})" if reasons else "")
                + (f"; {checks}" if checks else ""))


def export_sharegpt(data_dir: str | Path, out: str | Path, expect_reasoning: bool = True,
                    layout: TrainLayout = "conversation") -> ExportResult:
    """Stream the shards into ``out``, written beside it and renamed into place when complete:
    one conversation per prompt, or (``events``) what SpecForge's expander writes from that file."""
    written = 0

    def record(row: dict) -> tuple[list[dict], str | None]:
        nonlocal written
        reason = why_left_out(row, expect_reasoning or layout == "events")
        if reason:
            return [], reason
        doc = conversation_record(row)
        written += 1
        return (event_records(doc, written - 1) if layout == "events" else [doc]), None

    return _export(data_dir, out, record, "events" if layout == "events" else "conversations")


def export_tokens(data_dir: str | Path, out: str | Path, tokenizer_dir: str | Path,
                  template_name: str = "auto", layout: str = "auto", default_thinking: bool = True) -> ExportResult:
    """``{"id", "input_ids", "loss_mask"}`` per training sample (a conversation, or an event in
    the events layout), what SpecForge's parser makes of the same sample (its system prompt,
    ignore tokens and the template's rendering, empty think block included), with the generated
    part taken from the engine's own token ids where the row has them: where re-encoding the
    text agrees with them, the record is SpecForge's exactly. For SpecForge's online training
    from token ids; its offline ``prepare_hidden_states.py`` reads conversations only."""
    tokenizer = load_tokenizer(str(tokenizer_dir))
    template_name, layout = resolve_training(tokenizer, template_name, layout)
    template = TRAIN_TEMPLATES[template_name]
    encode = lambda text: tokenizer.encode(text, add_special_tokens=False)  # noqa: E731
    after_eos, ignored = encode(template.fmt.after_eos), [encode(t) for t in template.ignore]
    prefill = {thinking: generation_prefill(tokenizer, template.fmt, thinking) for thinking in (True, False)}
    checks: Counter = Counter()

    def record(sample: dict) -> tuple[list[dict], str | None]:
        if sample.get("error") is not None:
            return [], "failed"
        if sample.get("left_out"):
            return [], sample["left_out"]
        conversation, tools = training_conversation(sample, template)
        text = render(tokenizer, [conversation], template.render_thinking, [tools])[0]
        ids, mask, ranges = training_tokens(tokenizer, text, template.fmt, template.ignore, layout == "events")
        completion = sample.get("completion_token_ids")
        if completion is not None and ranges:
            first, last = ranges[-1]
            filled = prefill[asked_thinking(sample, default_thinking)]
            start = assistant_spans(text, template.fmt)[-1][0]
            g = first + (len(encode(filled)) if filled and text.startswith(filled, start) else 0)
            generated = list(completion) + (after_eos if sample.get("finish_reason") == "stop" else [])
            if ids[g:last] == generated:
                checks["completion agrees with the rendering"] += 1
            else:
                checks["completion re-encodes differently (engine's tokens kept)"] += 1
                gen_mask = [1] * len(generated)
                for pattern in ignored:
                    for at in range(len(generated) - len(pattern) + 1):
                        if pattern and generated[at:at + len(pattern)] == pattern:
                            gen_mask[at:at + len(pattern)] = [0] * len(pattern)
                ids, mask = ids[:g] + generated + ids[last:], mask[:g] + gen_mask + mask[last:]
            served = sample.get("prompt_token_ids")
            if served is not None:
                checks["served prompt = the training prefix" if list(served) == ids[:g]
                       else "served prompt differs from the training prefix (system prompt, history)"] += 1
        return [{"id": str(sample["id"]), "input_ids": ids, "loss_mask": mask}], None

    def samples(rows: list[dict]) -> list[dict]:
        return training_samples(rows, layout, default_thinking, template.keeps_reasoning)

    result = _export(data_dir, out, record, "events" if layout == "events" else "conversations", samples)
    result.checks = checks
    return result


def _export(data_dir: str | Path, out: str | Path, record, unit: str = "records", samples=None) -> ExportResult:
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    result = ExportResult(out, unit=unit)
    with atomic_file(out) as fh:
        for rows in iter_batches(RunLayout.from_data_arg(data_dir)):
            for row in (samples(rows) if samples else rows):
                docs, reason = record(row)
                if reason:
                    result.left_out[reason] += 1
                    continue
                for doc in docs:
                    fh.write(json.dumps(doc, ensure_ascii=False) + "\n")
                result.written += len(docs)
    return result
