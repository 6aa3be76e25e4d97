"""The checks that run the model's tokenizer and chat template: the training template and layout,
the longest prompt against the context, and what the trainer's max length will cut. They run in
a child held to a time and memory budget (regen.childpool.call_bounded)."""

from __future__ import annotations

# The chat template and the tokenizer run in a child held to these (the template is a program
# a model folder brings): seconds for a real one, whatever the prompts; and what may be read of
# the longest prompt to count its tokens (beyond that it cannot fit the context anyway).
TEMPLATE_SECONDS = 60.0
TEMPLATE_MEMORY_BYTES = 3 * 2**30
LONGEST_PROMPT_CHARS_PER_TOKEN = 16
CUT_SAMPLE = 256  # conversations whose prompts are tokenized for the trainer-cut estimate


def tokenizer_checks(model: str, thresholds, enable_thinking: bool, longest: tuple[str, list[dict]] | None,
                     max_tokens: int, context: int | None, sample: list[tuple[list[dict], list[dict] | None]] = (),
                     ) -> tuple[list[str], dict]:
    """preflight's checks that run the model's tokenizer and chat template: (problems, info);
    run through regen.childpool.call_bounded."""
    from regen.audit.dataset import resolved
    from regen.chat.render import (history_reasoning_rendered, load_tokenizer, render_generation_prompt,
                                   template_digest, template_problems)
    from regen.chat.templates import DEFAULT_TRAIN_TEMPLATE, TRAIN_TEMPLATES
    from regen.errors import DataError

    problems: list[str] = []
    info: dict = {}
    try:
        tokenizer = load_tokenizer(model)
    except Exception as exc:  # any loader failure is a finding, named with its type
        return [f"model_path {model}: tokenizer does not load: {type(exc).__name__}: {exc}"], info
    template = DEFAULT_TRAIN_TEMPLATE
    try:
        thresholds = resolved(thresholds, tokenizer)
    except DataError as exc:
        problems.append(f"train_template: {exc}")
    else:
        template = TRAIN_TEMPLATES[thresholds.train_template]
        info["train_template"] = thresholds.train_template
        info["train_layout"] = thresholds.train_layout
        info["train_limits"] = {"max_length": thresholds.train_max_length, "min_loss_tokens": thresholds.min_loss_tokens,
                                "min_on_policy_fraction": thresholds.min_on_policy_fraction}
        if enable_thinking and not template.keeps_reasoning:
            problems.append(f"train_template {thresholds.train_template!r}: SpecForge's parser for it "
                            f"drops reasoning_content, so training would see empty think blocks")
        if not enable_thinking:
            problems.extend(thinking_off_problems(thresholds.train_template, thresholds.train_layout))
    for problem in template_problems(tokenizer, enable_thinking, template.fmt):
        problems.append(f"model_path {model}: {problem}")
    try:
        info["history_reasoning"] = {"model_path": model, "enable_thinking": enable_thinking,
                                     "template": template_digest(model),
                                     **history_reasoning_rendered(tokenizer, enable_thinking)}
    except Exception:  # template errors are reported above
        pass
    if sample and thresholds.train_max_length:  # resolved above: the template's recipe where the config left it empty
        info["trainer_cut"] = trainer_cut(tokenizer, sample, enable_thinking, max_tokens, thresholds.train_max_length)
    if longest is None or not context:
        return problems, info
    prompt_id, messages = longest
    cut, whole = bounded(messages, context)
    try:
        prompt_tokens = len(tokenizer.encode(render_generation_prompt(tokenizer, cut, enable_thinking),
                                             add_special_tokens=False))
    except Exception:  # template errors are reported above
        return problems, info
    info["longest_prompt_tokens"] = prompt_tokens
    if prompt_tokens + max_tokens > context:
        at_least = "" if whole else "at least "
        problems.append(f"max_tokens {max_tokens} + longest prompt ({prompt_id!r}, {at_least}{prompt_tokens} "
                        f"tokens) = {prompt_tokens + max_tokens} passes the context length {context}")
    return problems, info


def thinking_off_problems(train_template: str, train_layout: str) -> list[str]:
    """Data made with thinking off, trained as thinking data, is the seed's disaster: every mask an
    empty think block and a few answer tokens. Each problem names the whole way out, so that
    following it leads to a config the canary passes, not to the next refusal."""
    from regen.chat.templates import TRAIN_TEMPLATES, answer_only_counterpart

    if not TRAIN_TEMPLATES[train_template].keeps_reasoning:
        return ([] if train_layout != "events" else
                [f"train_layout events with enable_thinking off: SpecForge's expander takes only turns with "
                 f"reasoning, so every row would be left out of the export; set train_layout: conversation"])
    plain = answer_only_counterpart(train_template)
    fix = (f"set train_template: {plain} and train_layout: conversation" if plain else
           "no template of SpecForge's registry reads this format without a think block")
    return [f"train_template {train_template!r} trains on reasoning, and enable_thinking is off: every sample "
            f"would be an empty think block and a few answer tokens (the seed's 6-token masks); turn "
            f"enable_thinking on, or {fix}"]


def bounded(messages: list[dict], tokens: int) -> tuple[list[dict], bool]:
    """(the messages with at most the characters ``tokens`` tokens can hold, whether that is all
    of them): what is counted of a prompt that may be huge."""
    budget = LONGEST_PROMPT_CHARS_PER_TOKEN * (tokens + 1)
    cut = []
    for message in messages:
        content = message.get("content")
        if isinstance(content, str):
            message = {**message, "content": content[:max(budget, 0)]}
            budget -= len(content)
        cut.append(message)
    return cut, budget >= 0


def trainer_cut(tokenizer, sample: list[tuple[list[dict], list[dict] | None]], enable_thinking: bool, max_tokens: int,
                train_max_length: int) -> dict:
    """What SpecForge's --max-length will cut, estimated from sampled prompts before any answer
    exists: each prompt (the conversation up to its last user message or tool result, as the
    generation prompt renders it, with its tools) plus an answer of max_tokens, the most it can be. The canary
    then measures it on real answers."""
    from regen.chat.render import render_generation_prompt
    from regen.prompts import request_messages

    lengths = []
    for messages, tools in sample:
        try:
            asked, _ = bounded(request_messages(messages), train_max_length)  # past it, all is cut anyway
            text = render_generation_prompt(tokenizer, asked, enable_thinking, tools)
        except Exception:  # template errors are reported by the checks above
            continue
        lengths.append(len(tokenizer.encode(text, add_special_tokens=False)))
    if not lengths:
        return {}
    lengths.sort()
    total = sum(n + max_tokens for n in lengths)
    over = sum(max(0, n + max_tokens - train_max_length) for n in lengths)
    return {"sampled": len(lengths), "median_prompt_tokens": lengths[len(lengths) // 2],
            "max_prompt_tokens": lengths[-1], "train_max_length": train_max_length, "max_tokens": max_tokens,
            "prompts_over": sum(n >= train_max_length for n in lengths),
            "worst_share": round(over / total, 4),
            "answer_room_at_median": max(0, train_max_length - lengths[len(lengths) // 2])}


def trainer_cut_line(cut: dict) -> str:
    """The estimate in one line, or "" when nothing can be cut."""
    if not cut or not cut["worst_share"]:
        return ""
    line = (f"trainer cut (train_max_length {cut['train_max_length']:,}): up to {cut['worst_share']:.0%} of "
            f"tokens if answers run to max_tokens {cut['max_tokens']:,}; a median prompt ({cut['median_prompt_tokens']:,} "
            f"tokens) leaves {cut['answer_room_at_median']:,} for its answer")
    if cut["prompts_over"]:
        line += f"; {cut['prompts_over']} of {cut['sampled']} sampled prompts alone pass it"
    return line + " (the canary measures it)"
