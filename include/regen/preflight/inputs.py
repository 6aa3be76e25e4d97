"""The run's inputs: the prompts file (every record, every id once, what SpecForge's validator
refuses) and the model folder (its config, its tokenizer and chat template, in a bounded child)."""

from __future__ import annotations

import json
import logging
import random
from pathlib import Path

from regen.config import RunConfig
from regen.files import MAX_JSON_BYTES, read_bounded
from regen.modelconfig import context_length
from regen.preflight.report import PreflightReport
from regen.preflight.template import CUT_SAMPLE, TEMPLATE_MEMORY_BYTES, TEMPLATE_SECONDS

log = logging.getLogger("regen.preflight")


def check_prompts(cfg: RunConfig, report: PreflightReport, max_listed: int = 20) -> None:
    """Every record readable, every id once, every conversation one SpecForge's validator takes
    (or, with skip_invalid, those it refuses listed in the skipped file, never sent); the prompt
    index of the run manifest on the way."""
    from regen.files import MAX_JSON_BYTES, atomic_write_text, read_bounded
    from regen.manifest import PromptIndexWriter
    from regen.prompts import PromptError, read_prompts

    path = Path(cfg.prompts)
    if not path.is_file():
        report.problems.append(f"prompts {path}: file not found")
        return
    index = PromptIndexWriter(cfg)
    bad: list[str] = []
    duplicates: list[str] = []
    refused: dict[str, list[PromptError]] = {}
    count, longest_chars, longest, with_history, agentic = 0, 0, None, 0, 0
    sample: list[tuple[list[dict], list[dict] | None]] = []  # a reservoir, for the trainer-cut estimate
    pick = random.Random(0)
    try:
        for item in read_prompts(path):
            problem = index.feed(item)
            if isinstance(item, PromptError) and item.rule is not None:
                refused.setdefault(item.rule, []).append(item)
                continue
            if problem is not None:
                (bad if isinstance(item, PromptError) else duplicates).append(problem)
            if isinstance(item, PromptError):
                continue
            count += 1
            with_history += any(m["role"] == "assistant" for m in item.messages)
            agentic += item.agentic
            chars = sum(len(m["content"]) for m in item.messages)
            if len(sample) < CUT_SAMPLE:
                sample.append((item.messages, item.tools))
            elif (slot := pick.randrange(count)) < CUT_SAMPLE:
                sample[slot] = (item.messages, item.tools)
            if chars > longest_chars:
                longest_chars, longest = chars, item
    except (OSError, ValueError) as exc:
        report.problems.append(f"prompts {path}: cannot be read: {exc}")
        return
    report.info["prompts"] = count
    report.info["agentic_prompts"] = agentic
    report.info["longest_prompt_chars"] = longest_chars
    report.info["_longest_prompt"] = longest
    report.info["_sample_prompts"] = sample
    report.info["_index"] = index
    for lines, what in ((bad, "unreadable record"), (duplicates, "duplicate id")):
        report.problems.extend(lines[:max_listed])
        if len(lines) > max_listed:
            report.problems.append(f"prompts {path}: ... and {len(lines) - max_listed} more {what}s")
    if refused:
        counts = ", ".join(f"{rule} {len(items):,}" for rule, items in sorted(refused.items()))
        if cfg.generation.skip_invalid:
            skipped = cfg.layout.skipped_prompts
            skipped.parent.mkdir(parents=True, exist_ok=True)
            atomic_write_text(skipped, "".join(
                json.dumps({"file": e.file, "line": e.line, "rule": e.rule, "reason": e.reason}) + "\n"
                for items in refused.values() for e in items))
            report.info["skipped_conversations"] = {rule: len(items) for rule, items in refused.items()}
            log.warning("prompts %s: %s", path, f"{sum(map(len, refused.values())):,} conversations "
                        f"SpecForge's validator refuses are skipped ({counts}), listed in {skipped}")
        else:
            report.problems.append(f"prompts {path}: {sum(map(len, refused.values())):,} conversations "
                                   f"SpecForge's validator refuses ({counts}); fix them, or set "
                                   f"skip_invalid to leave them out")
            for rule, items in sorted(refused.items()):
                report.problems.extend(f"  {e}" for e in items[:3])
    if cfg.generation.regenerate_turns == "last" and cfg.enable_thinking and with_history:
        report.problems.append(
            f"regenerate_turns last with thinking on: {with_history:,} conversations keep "
            f"the dataset's own earlier assistant turns, which have no reasoning; SpecForge's expander "
            f"and validator would drop every one after the GPU time is spent. Use regenerate_turns all")
    if agentic and not cfg.engine_options.tool_call_parser:
        report.problems.append(
            f"prompts {path}: {agentic:,} agentic conversations (tools, tool calls) and no tool_call_parser: "
            f"the engine would answer every call as text, so no recorded result could be spliced in; set "
            f"tool_call_parser to the one that reads the model's calls ({suggested_tool_parser(cfg)})")
    if count == 0 and not bad:
        report.problems.append(f"prompts {path}: no prompts in the file")


def suggested_tool_parser(cfg: RunConfig) -> str:
    """From the call format the model's chat template renders and the engine's parser names."""
    from regen.engines import engine
    from regen.toolcalls import parser_for_template

    model, text = Path(cfg.model_path), ""
    for name in ("chat_template.jinja", "tokenizer_config.json"):
        try:
            with open(model / name, "rb") as fh:  # a template is kilobytes: a bounded read
                text += fh.read(4 << 20).decode("utf-8", "replace")
        except OSError:
            continue
    parser = parser_for_template(text, engine(cfg.engine).tool_call_parsers)
    return (f"{parser}: its chat template writes calls in that format" if parser else
            "its chat template renders no call format regen knows: name the engine's parser for it")


def check_model(cfg: RunConfig, report: PreflightReport) -> None:
    model = Path(cfg.model_path)
    if not model.is_dir():
        report.problems.append(f"model_path {model}: directory not found")
        return
    if not (model / "config.json").is_file():
        report.problems.append(f"model_path {model}: no config.json (not a model directory)")
        return
    try:
        model_cfg = json.loads(read_bounded(model / "config.json", MAX_JSON_BYTES))
    except (OSError, ValueError) as exc:
        report.problems.append(f"model_path {model}/config.json: unreadable: {exc}")
        return
    report.info["model_bytes"] = sum(f.stat().st_size for f in model.rglob("*") if f.is_file())
    context = cfg.engine_options.context_length or context_length(model_cfg)
    if not (model / "tokenizer.json").is_file():
        report.problems.append(f"model_path {model}: no tokenizer.json (the audit needs a fast tokenizer)")
        return
    from regen.audit.findings import AuditThresholds
    from regen.childpool import ChildFailed, OverBudget, call_bounded

    longest = report.info.get("_longest_prompt")
    try:
        problems, info = call_bounded("regen.preflight.template:tokenizer_checks", (
            str(model), AuditThresholds.from_config(cfg), cfg.enable_thinking,
            (longest.id, longest.messages) if longest is not None else None, cfg.sampling.max_tokens, context,
            report.info.get("_sample_prompts") or []),
            TEMPLATE_SECONDS, TEMPLATE_MEMORY_BYTES)
    except OverBudget as exc:
        where = next((model / n for n in ("chat_template.jinja", "tokenizer_config.json") if (model / n).is_file()), model)
        report.problems.append(f"{where}: the chat template (with the tokenizer, on a probe and the longest prompt) "
                               f"{exc}: a template is a program, and this one is refused")
        return
    except ChildFailed as exc:  # regen's own modules did not import (check_code names why)
        report.problems.append(f"model_path {model}: the tokenizer checks could not run: {exc}")
        return
    report.problems.extend(problems)
    report.info.update(info)
