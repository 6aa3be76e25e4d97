"""Export the dataset as the JSONL that SpecForge and DFlash training read.

``sharegpt`` writes what SpecForge's ``scripts/regenerate_train_data.py`` writes:
``{"id", "conversations": [{"role", "content", "reasoning_content"?}, ...], "status": "success"}``,
one line per prompt, every regenerated assistant turn with its reasoning; with ``train_layout=events``,
what its ``expand_reasoning_conversations.py`` writes from that file (regen.training). Rows that
would fail ``scripts/validate_regenerated_data.py --expect-reasoning --strict-think-markers``
(failed prompts, empty messages, roles out of order, an assistant turn without reasoning,
leftover think markers, and agentic rows: tool messages, call steps without text) are left out
and counted, so the file passes that validator. ``specforge`` (:func:`export_specforge`) writes
every file of SpecForge's recipe, the agentic rows in one of their own in its trainer's tool-use
shape, and accounts for every prompt.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from regen.chat.loss import training_tokens
from regen.chat.onpolicy import certify
from regen.chat.render import generation_prefill, load_tokenizer, render, resolve_training
from regen.chat.templates import TRAIN_TEMPLATES, recipe
from regen.config.options import AuditOptions
from regen.errors import DataError
from regen.files import atomic_file, atomic_write_text
from regen.layout import RunLayout
from regen.manifest import Manifest
from regen.childpool import memory_plan, ordered_map
from regen.rows import (AUDIT_COLUMNS, TEXT_COLUMNS, arrow_bytes_per_row, asked_thinking, count_rows, iter_batches,
                        record_batches, row_messages, row_tools)
from regen.training import (TrainLayout, conversation_record, event_records, history_kept, served, training_conversation,
                            training_samples, why_left_out)

log = logging.getLogger("regen.export")


class RecipeConflict(ValueError):
    """A flag that contradicts what the output's audit judged the data with."""


# Why sharegpt leaves an agentic row out: SpecForge's validator refuses its tool messages; the recipe export
# (--format specforge) writes such rows in a file of their own, in its trainer's tool-use shape.
AGENTIC_LEFT_OUT = "agentic, in --format specforge's own file"

# The training recipe as the audit's summary.json names it (its train_view) and as the config does.
RECIPE_FIELDS = {"train_template": "template", "train_layout": "layout", "train_max_length": "max_length"}
RECIPE_UNSET = {"train_template": "auto", "train_layout": "auto", "train_max_length": None}


def export_recipe(data: str | Path | RunLayout, given: dict, force: bool = False) -> dict:
    """The recipe an export writes: the one the output's audit judged (so training sees what passed),
    each field ``given`` (a flag or the config, when set) in its place; a template or max length that
    differs from the audited one is refused unless ``force``. Without an audit, what is given; the
    tokenizer is the run's model (its manifest) when that folder is here."""
    from regen.files import read_json

    layout = RunLayout.from_data_arg(data)
    view = (read_json(layout.audit.summary_json) or {}).get("train_view") or {}
    recipe_ = {}
    for name, key in RECIPE_FIELDS.items():
        audited, wanted = view.get(key, RECIPE_UNSET[name]), given.get(name, RECIPE_UNSET[name])
        # The layout is a file's shape (the conversation file is the events recipe's input), not
        # another mask: a flag may choose either; template and max length would change every mask.
        if (wanted != RECIPE_UNSET[name] and key in view and wanted != audited and name != "train_layout"
                and not force):
            raise RecipeConflict(f"{name} {wanted!r}: the audit of {layout.root} judged this data with {name} "
                                 f"{audited!r} ({layout.audit.summary_json}); training another way would see other "
                                 f"masks than the ones that passed. Leave it out to export the audited recipe, audit "
                                 f"again with it, or pass --force")
        recipe_[name] = wanted if wanted != RECIPE_UNSET[name] else audited
    model = (Manifest(layout).read().get("model") or {}).get("source")
    return {**recipe_, "model_path": model if model and Path(model, "tokenizer_config.json").is_file() else None}


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


def export_sharegpt(data_dir: str | Path | RunLayout, out: str | Path, expect_reasoning: bool = True,
                    train_layout: TrainLayout = "conversation", agentic: bool = False) -> ExportResult:
    """Stream the shards into ``out``, written beside it and renamed into place when complete:
    one conversation per prompt, or (``events``) what SpecForge's expander writes from that file.
    ``agentic``: agentic rows too, in its trainer's tool-use shape (which its validator refuses);
    else they are left out and counted."""
    written = 0

    def record(row: dict) -> tuple[list[dict], str | None]:
        nonlocal written
        reason = why_left_out(row, expect_reasoning or train_layout == "events")
        if reason:
            return [], reason
        doc = conversation_record(row)
        if not agentic and (row_tools(row) or any(m["role"] == "tool" or m.get("tool_calls") for m in doc["conversations"])):
            return [], AGENTIC_LEFT_OUT  # its validator refuses tool messages and call steps without text
        written += 1
        return (event_records(doc, written - 1, history_kept(row)) if train_layout == "events" else [doc]), None

    return _export(data_dir, out, record, "events" if train_layout == "events" else "conversations", columns=TEXT_COLUMNS)


def export_tokens(data_dir: str | Path | RunLayout, out: str | Path, tokenizer_dir: str | Path,
                  template_name: str = "auto", train_layout: str = "auto", default_thinking: bool = True) -> ExportResult:
    """``{"id", "input_ids", "loss_mask"}`` per training sample (a conversation, or an event in
    the events layout), what SpecForge's parser makes of the same sample (its system prompt,
    ignore tokens and the template's rendering, empty think block included), the engine's own
    token ids used only where the on-policy certificate (regen.chat.onpolicy) allows: a sample
    whose rendered prompt part is the served prompt and whose generated part is the engine's
    completion in another tokenization takes the engine's ids (the record is then token for
    token what the engine saw and produced); every other sample keeps the rendering's, and
    ``checks`` counts each case with its reason. For SpecForge's online training from token ids;
    its offline ``prepare_hidden_states.py`` reads conversations only."""
    tokenizer = load_tokenizer(str(tokenizer_dir))
    template_name, train_layout = resolve_training(tokenizer, template_name, train_layout)
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
        ids, mask, _ = training_tokens(tokenizer, text, template.fmt, template.ignore, train_layout == "events")
        certificate = certify(tokenizer, [text], template.fmt,
                              [served(sample, prefill[asked_thinking(sample, default_thinking)])])[0]
        if certificate is None:
            checks["no token ids from the engine (rendered)"] += 1
            return [{"id": str(sample["id"]), "input_ids": ids, "loss_mask": mask}], None
        if certificate.prompt_exact is not None:
            checks["served prompt = the training prefix" if certificate.prompt_exact else
                   f"served prompt differs from the training prefix: {certificate.prompt_reason}"] += 1
        if certificate.completion_exact:
            checks["completion agrees with the rendering"] += 1
        elif (certificate.prompt_exact and certificate.completion_reason == "retokenization"
              and sample.get("finish_reason") in ("stop", "tool_calls")):
            g, last = certificate.generation
            generated = list(sample["completion_token_ids"]) + after_eos
            gen_mask = [1] * len(generated)
            for pattern in ignored:
                for at in range(len(generated) - len(pattern) + 1):
                    if pattern and generated[at:at + len(pattern)] == pattern:
                        gen_mask[at:at + len(pattern)] = [0] * len(pattern)
            ids, mask = ids[:g] + generated + ids[last:], mask[:g] + gen_mask + mask[last:]
            checks["completion re-encodes differently (the engine's tokens kept: now token-exact)"] += 1
        else:
            checks[f"completion differs from the rendering: {certificate.completion_reason} "
                   f"(rendered tokens kept)"] += 1
        return [{"id": str(sample["id"]), "input_ids": ids, "loss_mask": mask}], None

    def samples(rows: list[dict]) -> list[dict]:
        return training_samples(rows, train_layout, default_thinking, template.keeps_reasoning)

    result = _export(data_dir, out, record, "events" if train_layout == "events" else "conversations", samples)
    result.checks = checks
    return result


# What an export holds in memory at once: a batch of rows as Python objects (rows.record_batches).
EXPORT_BATCH_BYTES = 256 << 20
# JSONL of a row's text is about its Arrow bytes (escapes and keys add a little); the events layout
# repeats each turn's history, and specforge writes both layouts: a margin over the first.
JSONL_BYTES_PER_TEXT_BYTE = 1.3
EVENTS_FACTOR = 3.0


def _room_for(layout: RunLayout, out: Path, events: bool) -> None:
    """Refused before anything is written when ``out``'s disk has not room for the export's
    estimated size (a seed-sized export is tens of GB: it must not fill the disk half-way)."""
    files = [layout.parquet(path) for path in layout.data_files()]
    estimate = (sum(arrow_bytes_per_row(f, list(TEXT_COLUMNS)) * f.metadata.num_rows for f in files)
                * JSONL_BYTES_PER_TEXT_BYTE * (EVENTS_FACTOR if events else 1))
    folder = out if out.is_dir() else out.parent
    free = shutil.disk_usage(folder).free
    if estimate > free:
        raise DataError(f"{out}: the export needs about {estimate / 2**30:,.1f} GB and {folder} has "
                        f"{free / 2**30:,.1f} GB free; nothing written (free space, or --out elsewhere)")
    log.info("exporting about %.1f GB to %s", estimate / 2**30, out)


def _export(data_dir: str | Path | RunLayout, out: str | Path, record, unit: str = "records", samples=None,
            columns: tuple[str, ...] = AUDIT_COLUMNS) -> ExportResult:
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    result = ExportResult(out, unit=unit)
    layout = RunLayout.from_data_arg(data_dir)
    _room_for(layout, out, unit == "events")
    with atomic_file(out) as fh:
        for rows in iter_batches(layout, columns=columns, max_batch_bytes=EXPORT_BATCH_BYTES):
            for row in (samples(rows) if samples else rows):
                docs, reason = record(row)
                if reason:
                    result.left_out[reason] += 1
                    continue
                for doc in docs:
                    fh.write(_jsonl(doc))
                result.written += len(docs)
    return result


# SpecForge's recipe, file by file (export_specforge): its regenerate script's names for the
# conversations and their failures, and regen's for what its own steps do not produce.
RECIPE_CHAT, RECIPE_EVENTS, RECIPE_AGENTIC = "regenerated.jsonl", "regenerated_events.jsonl", "regenerated_agentic.jsonl"
RECIPE_ERROR, RECIPE_SKIPPED, RECIPE_CONFIG = "regenerated_error.jsonl", "regenerated_skipped.jsonl", "specforge_data.yaml"


class RecipeIncomplete(ValueError):
    """success + error + skipped is not the run's prompt count (SpecForge's script refuses such a run)."""


@dataclass
class RecipeResult:
    folder: Path
    counts: Counter
    train_layout: str
    data_blocks: dict[str, dict]
    prompts: int | None  # the run's prompts, as its manifest counts them (None: no manifest)

    def summary(self) -> str:
        c = self.counts
        train = [name for name, block in self.data_blocks.items() if block.get("recommended")]
        return (f"wrote {self.folder}: {c['chat']:,} chat conversations ({c['events']:,} events), "
                f"{c['agentic']:,} agentic conversations ({c['agentic_records']:,} records, {self.train_layout} layout), "
                f"{c['error']:,} errors, {c['skipped']:,} skipped"
                + (f" = {self.prompts:,} prompts" if self.prompts is not None else " (no manifest: not counted against the prompts)")
                + f"\ntrain on {' and '.join(train)}; the `data:` block of each file is in {self.folder / RECIPE_CONFIG}")


def export_specforge(data_dir: str | Path | RunLayout, out_dir: str | Path, tokenizer_dir: str | Path,
                     template_name: str = "auto", train_layout: str = "auto",
                     max_length: int | None = None, workers: int | None = None, batch_size: int = 512,
                     memory_gb: float | None = None) -> RecipeResult:
    """Every file SpecForge's documented steps take, from one run, in ``out_dir``:

    - ``regenerated.jsonl``: the chat conversations as its regenerate_train_data.py writes them,
      which its validate_regenerated_data.py (--expect-reasoning --strict-think-markers) and
      expand_reasoning_conversations.py take;
    - ``regenerated_events.jsonl``: what that expander writes from it (trained with
      train_only_last_turn);
    - ``regenerated_agentic.jsonl``: the agentic conversations in its trainer's tool-use shape
      (``tools`` a JSON string, as its data loader decodes it: a list would have Arrow merge the
      schemas of every row), in the run's training layout; its validator and expander take no
      tool messages, so they get a file of their own, which the trainer reads as it is;
    - ``regenerated_error.jsonl`` and ``regenerated_skipped.jsonl``: what failed and what was left
      out (by preflight, or by the validator's rules), shaped as its script writes them; success +
      error + skipped must be the run's prompts (RecipeIncomplete otherwise, and nothing written);
    - ``specforge_data.yaml``: the ``data:`` block of a SpecForge run config for each training file
      (``max_length``: None takes the template's recipe, 0 none).

    ``workers``: processes that turn batches of rows into lines (the export is CPU-bound: about
    4 ms a row at seed lengths); default every core once the data pays for their start, as many
    as ``memory_gb`` holds (the audit's bound, ``audit_memory_gb``: about 0.4 GB a worker, so 32
    cores would otherwise take 13 GB).
    """
    tokenizer = load_tokenizer(str(tokenizer_dir))
    template_name, train_layout = resolve_training(tokenizer, template_name, train_layout)
    max_length = recipe(template_name).max_length if max_length is None else max_length
    run = RunLayout.from_data_arg(data_dir)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    _room_for(run, out, events=True)
    counts: Counter = Counter()
    rows = count_rows(run)
    asked = workers if workers is not None else (os.cpu_count() or 1) if rows >= PARALLEL_EXPORT_ROWS else 1
    memory_gb = AuditOptions.model_fields["audit_memory_gb"].default if memory_gb is None else memory_gb
    workers, batch_bytes = memory_plan(memory_gb * (1 << 30), asked)
    log.info("exporting %s rows in %d worker process(es)%s (audit_memory_gb %s)", f"{rows:,}", workers,
             f" (of {asked} asked: memory)" if workers < asked else "", memory_gb)

    with (atomic_file(out / RECIPE_CHAT) as chat, atomic_file(out / RECIPE_EVENTS) as events,
          atomic_file(out / RECIPE_AGENTIC) as agentic, atomic_file(out / RECIPE_ERROR) as errors,
          atomic_file(out / RECIPE_SKIPPED) as skipped):
        files = {"chat": chat, "agentic": agentic, "error": errors, "skipped": skipped}
        batches = record_batches(run, batch_size, TEXT_COLUMNS,
                                 max_batch_bytes=EXPORT_BATCH_BYTES if workers <= 1 else
                                 min(PARALLEL_BATCH_BYTES, batch_bytes))
        for kinds in ordered_map(_recipe_lines, batches, workers, (train_layout,)):
            for kind, lines in kinds:
                if kind == "chat":  # its events are numbered by the conversation's line in the chat file
                    text, events_of = lines
                    chat.write(text)
                    for event in events_of:
                        events.write(event.replace(_ROW_INDEX_SLOT, f'"source_row_index": {counts["chat"]},', 1))
                    counts["events"] += len(events_of)
                elif kind == "agentic":  # numbered among the agentic conversations, in the events layout
                    for doc in lines:
                        agentic.write(doc.replace(_ROW_INDEX_SLOT, f'"source_row_index": {counts["agentic"]},', 1)
                                      if train_layout == "events" else doc)
                    counts["agentic_records"] += len(lines)
                else:
                    files[kind].write(lines)
                counts[kind] += 1
        manifest = Manifest(run).read().get("prompts") or {}
        refused = ([json.loads(text) for text in run.skipped_prompts.read_text().splitlines() if text.strip()]
                   if run.skipped_prompts.is_file() else [])
        for left in refused:  # by preflight, before anything was sent (skip_invalid)
            skipped.write(_jsonl({"status": "skipped", "error": f"{left['rule']}: {left['reason']}",
                           "data": {"file": left["file"], "line": left["line"]}}))
        kept = [problem for _, problem in manifest.get("unreadable") or []]
        unreadable = manifest.get("unreadable_count") or 0
        for i in range(unreadable):
            skipped.write(_jsonl({"status": "skipped", "data": None, "error": kept[i] if i < len(kept) else
                           "an unreadable record of the prompts file (preflight listed the first ones)"}))
        counts["skipped"] += len(refused) + unreadable
        prompts = manifest["count"] + len(refused) + unreadable if "count" in manifest else None
        done = counts["chat"] + counts["agentic"] + counts["error"] + counts["skipped"]
        if prompts is not None and done != prompts:
            raise RecipeIncomplete(
                f"{data_dir}: success {counts['chat'] + counts['agentic']:,} + error {counts['error']:,} + skipped "
                f"{counts['skipped']:,} = {done:,}, but the run has {prompts:,} prompts: "
                f"{prompts - done:,} have no row (is every shard finished?); nothing written")
    blocks = _data_blocks(out, template_name, train_layout, max_length, counts)
    atomic_write_text(out / RECIPE_CONFIG, _recipe_yaml(blocks, train_layout))
    return RecipeResult(out, counts, train_layout, blocks, prompts)


# A recipe export of at least this many rows runs in worker processes (their start costs seconds),
# each taking batches of at most PARALLEL_BATCH_BYTES as Python objects, two per worker in flight.
PARALLEL_EXPORT_ROWS = 4096
PARALLEL_BATCH_BYTES = 64 << 20
# An event's conversation index is its line in the chat file, known only once the batches before
# are written: a worker writes this slot, the writer puts the index in. The first unescaped
# `"source_row_index": ` of a line is the key's (inside a JSON string every quote is escaped).
_ROW_INDEX_SLOT = '"source_row_index": -1,'


def _jsonl(doc: dict) -> str:
    """One line of every JSONL file the export writes."""
    return json.dumps(doc, ensure_ascii=False) + "\n"


def _recipe_lines(batch, train_layout: str) -> list[tuple[str, object]]:
    """A batch's rows, in order, each as (the recipe file it goes to, its text): a chat row with its
    events' lines (their conversation index a slot), an agentic row as its records' lines."""
    out: list[tuple[str, object]] = []
    for row in batch.to_pylist():
        if row.get("error") is not None:
            out.append(("error", _jsonl({"id": str(row["id"]), "conversations": [
                {"role": m["role"], "content": m.get("content")} for m in row_messages(row)],
                "status": "error", "error": row["error"]})))
            continue
        record = conversation_record(row)
        reason = why_left_out(row, expect_reasoning=True)
        if reason:
            out.append(("skipped", _jsonl({**record, "status": "skipped", "error": reason})))
        elif record.get("tools") or any(m["role"] == "tool" or m.get("tool_calls") for m in record["conversations"]):
            if record.get("tools"):
                record["tools"] = json.dumps(record["tools"], ensure_ascii=False)
            docs = event_records(record, -1, history_kept(row)) if train_layout == "events" else [record]
            out.append(("agentic", [_jsonl(doc) for doc in docs]))
        else:
            out.append(("chat", (_jsonl(record), [_jsonl(doc) for doc in event_records(record, -1)])))
    return out


def _data_blocks(out: Path, template_name: str, train_layout: str, max_length: int | None, counts: Counter) -> dict[str, dict]:
    """Each training file's ``data:`` block, and whether the run's training layout trains on it
    (never on an empty file)."""
    def block(name: str, records: int, last_turn_only: bool, recommended: bool) -> dict:
        data = {"train_data_path": str((out / name).resolve()), "chat_template": template_name}
        data |= {"max_length": max_length} if max_length else {}
        return {"records": records, "recommended": recommended,
                "data": data | {"train_only_last_turn": last_turn_only}}

    events = train_layout == "events"
    return {RECIPE_CHAT: block(RECIPE_CHAT, counts["chat"], False, not events and counts["chat"] > 0),
            RECIPE_EVENTS: block(RECIPE_EVENTS, counts["events"], True, events and counts["chat"] > 0),
            RECIPE_AGENTIC: block(RECIPE_AGENTIC, counts["agentic_records"], events, counts["agentic"] > 0)}


def _recipe_yaml(blocks: dict[str, dict], train_layout: str) -> str:
    import yaml

    train = " and ".join(name for name, b in blocks.items() if b["recommended"])
    return (f"# The `data:` block of a SpecForge run config (specforge train -c) for each file regen wrote.\n"
            f"# This run trains in the {train_layout} layout: {train}.\n"
            + yaml.safe_dump(blocks, sort_keys=False))
