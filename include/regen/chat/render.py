"""Conversations rendered as training renders them, with the model's own tokenizer and chat
template (a local directory only), and the template problems that would make a loss mask wrong."""

from __future__ import annotations

import contextlib
import resource
import signal
import threading
import time
from functools import lru_cache
from pathlib import Path
from typing import Any, Sequence

from regen.chat.loss import assistant_spans
from regen.chat.templates import DEFAULT_TRAIN_TEMPLATE, QWEN, TRAIN_TEMPLATES, ChatFormat, TrainTemplate
from regen.errors import RegenError

# One render of one conversation takes milliseconds; a template that takes this long loops on
# its input. Under a lease's staleness (regen.coordination.leases.STALE_AFTER_S): a stage stuck in
# a render fails before its servers are taken for idle.
RENDER_SECONDS = 20.0
# What one render may add to the process's address space. A real template's render of the longest
# agentic conversation is megabytes; a template that builds a string by doubling it reaches this
# within a second, long before the node's memory (the audit's workers, the canary and a shard
# render in processes that also hold a run's work).
RENDER_MEMORY_BYTES = 1 << 30


class TemplateTooSlow(RegenError):
    """The chat template did not finish rendering within its bound: it loops on some input."""


class TemplateTooLarge(RegenError, MemoryError):
    """The chat template needed more memory than its bound to render one conversation. A
    MemoryError too, so that code which treats a bounded child's MemoryError as the budget's
    (regen.childpool.call_bounded, preflight) treats this one alike."""


@contextlib.contextmanager
def render_bound(seconds: float | None = None):
    """TemplateTooSlow when the block runs past ``seconds``: preflight checks the template in a
    bounded child, but a template can loop only on inputs preflight never gave it (the canary's,
    the audit's, a shard's). A timer signal, so only on the main thread (where stages, the audit's
    workers and the generation loop run); an outer timer that ends sooner is left alone."""
    seconds = RENDER_SECONDS if seconds is None else seconds
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    outer_left, outer_interval = signal.getitimer(signal.ITIMER_REAL)
    if outer_left and outer_left <= seconds:
        yield
        return

    def on_alarm(signum, frame):
        raise TemplateTooSlow(f"the chat template took more than {seconds:.0f} s to render one conversation: it "
                              f"loops on some input (preflight's samples passed); fix the template")

    previous = signal.signal(signal.SIGALRM, on_alarm)
    started = time.monotonic()
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
        if outer_left:
            signal.setitimer(signal.ITIMER_REAL, max(0.001, outer_left - (time.monotonic() - started)), outer_interval)


_address_space_lock = threading.Lock()
_address_space_holders = 0
_address_space_restore: tuple[int, int] | None = None


def _address_space() -> int:
    with open("/proc/self/statm", "rb") as fh:
        return int(fh.read().split()[0]) * resource.getpagesize()


@contextlib.contextmanager
def memory_bound(extra_bytes: int | None = None):
    """TemplateTooLarge when the block needs more than ``extra_bytes`` of address space beyond what
    the process holds as it starts. RLIMIT_AS is the process's, so this holds on any thread: the
    soft limit is lowered while any thread renders and given back when the last one ends; a lower
    limit already set (preflight's bounded child) is kept. Where /proc is missing, no bound."""
    global _address_space_holders, _address_space_restore
    extra_bytes = RENDER_MEMORY_BYTES if extra_bytes is None else extra_bytes
    with _address_space_lock:
        if _address_space_holders == 0:
            soft, hard = resource.getrlimit(resource.RLIMIT_AS)
            try:
                limit = _address_space() + extra_bytes
            except OSError:
                limit = None
            if limit is not None and (soft == resource.RLIM_INFINITY or limit < soft) and \
                    (hard == resource.RLIM_INFINITY or limit <= hard):
                resource.setrlimit(resource.RLIMIT_AS, (limit, hard))
                _address_space_restore = (soft, hard)
        _address_space_holders += 1
    try:
        yield
    except MemoryError as exc:
        if isinstance(exc, TemplateTooLarge):
            raise
        raise TemplateTooLarge(f"the chat template needed more than {extra_bytes >> 20:,} MB of memory to render "
                               f"one conversation: it builds an unbounded string on some input (preflight's "
                               f"samples passed); fix the template") from None
    finally:
        with _address_space_lock:
            _address_space_holders -= 1
            if _address_space_holders == 0 and _address_space_restore is not None:
                resource.setrlimit(resource.RLIMIT_AS, _address_space_restore)
                _address_space_restore = None


def _apply(tokenizer, conversation, **kwargs) -> Any:
    with render_bound(), memory_bound():
        return tokenizer.apply_chat_template(conversation, tokenize=False, **kwargs)


@lru_cache(maxsize=8)
def load_tokenizer(model_dir: str):
    """A Hugging Face fast tokenizer with its chat template, from a local directory only."""
    from transformers import AutoTokenizer

    path = Path(model_dir)
    if not path.is_dir():
        raise FileNotFoundError(f"{model_dir}: tokenizer directory not found")
    tokenizer = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    if not tokenizer.is_fast:
        raise ValueError(f"{model_dir}: needs a fast tokenizer (tokenizer.json) for offsets")
    if not tokenizer.chat_template:
        raise ValueError(f"{model_dir}: the tokenizer has no chat template")
    return tokenizer


def template_digest(model_dir: str | Path) -> str | None:
    """A short hash of the chat template a model folder serves (chat_template.jinja, else
    tokenizer_config.json's); None when the folder is not here or has none."""
    import hashlib
    import json

    folder = Path(model_dir)
    try:
        text = (folder / "chat_template.jinja").read_text() if (folder / "chat_template.jinja").is_file() else \
            json.loads((folder / "tokenizer_config.json").read_text()).get("chat_template")
    except (OSError, ValueError):
        return None
    return hashlib.sha256(json.dumps(text).encode()).hexdigest()[:12] if text else None


def parser_calls(calls: list[dict]) -> list[dict]:
    """Tool calls as SpecForge's parser hands them to the template: id, type and function only,
    the arguments parsed into an object (an unparsable string becomes ``{}``, as there)."""
    import json

    out = []
    for call in calls:
        function = call.get("function") or {}
        arguments = function.get("arguments", {})
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments)
            except ValueError:
                arguments = {}
        out.append({"id": call.get("id", ""), "type": call.get("type", "function"),
                    "function": {"name": function.get("name", ""), "arguments": arguments}})
    return out


def training_messages(messages: Sequence[dict[str, Any]], reasoning: str | None, content: str | None,
                      template: TrainTemplate = DEFAULT_TRAIN_TEMPLATE,
                      tool_calls: list[dict] | None = None) -> list[dict[str, Any]]:
    """The conversation as training prepares it: the messages (earlier assistant turns with their
    own reasoning and tool calls) and the final assistant turn; the template's system prompt when
    there is none; cut where the roles stop alternating; each message with only the keys its
    parser keeps, its tool calls as the parser sanitizes them."""
    final: dict[str, Any] = {"role": "assistant", "content": content or ""}
    if reasoning is not None:
        final["reasoning_content"] = reasoning
    if tool_calls:
        final["tool_calls"] = tool_calls
    turns = [*messages, final]
    out: list[dict[str, Any]] = []
    if turns[0]["role"] == "system":
        out.append({"role": "system", "content": turns[0].get("content") or ""})
        turns = turns[1:]
    elif template.system_prompt:
        out.append({"role": "system", "content": template.system_prompt})
    while turns and turns[0]["role"] != "user":
        turns = turns[1:]
    follows = {"tool": ("assistant", "tool"), "assistant": ("user", "tool")}
    for j, message in enumerate(turns):
        role = message["role"]
        if (j == 0 and role != "user") or (j and role in follows and turns[j - 1]["role"] not in follows[role]):
            break
        kept = {k: v for k, v in message.items()
                if k in template.message_keys and not (k in ("reasoning_content", "tool_calls") and v is None)}
        if kept.get("tool_calls"):
            kept["tool_calls"] = parser_calls(kept["tool_calls"])
        out.append(kept | {"content": message.get("content") or ""})
    return out


# The generation prompt's end -> SpecForge's template for the family (thinking variant, plain one).
_FAMILIES = (
    ("<|im_start|>assistant\n<think>\n", ("qwen3.5", "qwen3.5")),
    ("<|im_start|>assistant\n", ("qwen3-thinking", "qwen")),
    ("<|im_assistant|>assistant<|im_middle|>", ("kimi-k2-thinking", "kimi-k2-instruct")),
    ("<｜Assistant｜>", ("deepseek-v32", "deepseek-v3")),
    ("<|start_header_id|>assistant<|end_header_id|>\n\n", ("llama3", "llama3")),
    ("<|header_start|>assistant<|header_end|>\n\n", ("llama4", "llama4")),
    ("<start_of_turn>model\n", ("gemma", "gemma")),
    ("<|im_start|>assistant<|im_sep|>", ("phi4", "phi4")),
)


def model_type(model_dir: str | Path) -> str | None:
    """The ``model_type`` of a model directory's config.json, when it has one."""
    import json

    try:
        return json.loads((Path(model_dir) / "config.json").read_text()).get("model_type")
    except (OSError, ValueError):
        return None


def template_for_model(tokenizer, model_type: str | None = None) -> str | None:
    """SpecForge's template for the model, from its own chat template: the family by the
    assistant header its generation prompt ends with, the thinking variant whenever the template
    knows think blocks (a drafter of a thinking model learns its thinking). None: not known."""
    try:
        prompt = render_generation_prompt(tokenizer, [{"role": "user", "content": "Hi"}], True)
    except MemoryError:  # past its budget (regen.childpool.call_bounded): the caller's to report
        raise
    except Exception:  # a template that cannot render is preflight's finding, not this one's
        return None
    thinks = "<think>" in (tokenizer.chat_template or "") or "</think>" in (tokenizer.chat_template or "")
    found = [names for header, names in _FAMILIES if prompt.endswith(header)]
    if not found:  # something pre-filled after the header: the last header, the shortest there
        placed = [(prompt.rfind(header), -len(header), names) for header, names in _FAMILIES if header in prompt]
        found = [max(placed)[2]] if placed else []
    if not found:
        return None
    name = found[0][0] if thinks else found[0][1]
    return "qwen3-next-thinking" if name == "qwen3.5" and model_type == "qwen3_next" else name


def resolve_training(tokenizer, template_name: str, train_layout: str) -> tuple[str, str]:
    """(template, layout) with ``auto`` decided by the model's chat template; ValueError when
    the template cannot be told."""
    if template_name == "auto":
        template_name = template_for_model(tokenizer, model_type(tokenizer.name_or_path))
        if template_name is None:
            raise ValueError(f"{tokenizer.name_or_path}: cannot tell SpecForge's training template from the "
                             f"chat template; set train_template")
    if train_layout == "auto":
        train_layout = default_train_layout(tokenizer, TRAIN_TEMPLATES[template_name])
    return template_name, train_layout


def default_train_layout(tokenizer, template: TrainTemplate) -> str:
    """``events`` when the chat template drops earlier turns' reasoning from the history it
    renders (Qwen3's do): SpecForge's recipe then trains one event per assistant turn, last turn
    only; else ``conversation`` (also for a parser that keeps no reasoning at all)."""
    if not template.keeps_reasoning:
        return "conversation"
    marker = "Earlier reasoning to look for."
    history = [{"role": "user", "content": "One?"},
               {"role": "assistant", "content": "1", "reasoning_content": marker},
               {"role": "user", "content": "Two?"}]
    text = render(tokenizer, [training_messages(history, "Then two.", "2", template)], template.render_thinking)[0]
    return "conversation" if marker in text else "events"


HISTORY_PROBE_TOOL = {"type": "function", "function": {
    "name": "lookup", "description": "Look a word up.",
    "parameters": {"type": "object", "properties": {"word": {"type": "string"}}, "required": ["word"]}}}


def history_reasoning_rendered(tokenizer, enable_thinking: bool) -> dict[str, bool]:
    """Where the model's own chat template renders an earlier step's reasoning in a generation
    prompt: a chat turn before the last user message (``chat_turns``), an agent-loop step after
    it (``tool_steps``). What regen sends back with ``history_reasoning: template``."""
    def shows(history: list[dict], tools: list[dict] | None) -> bool:
        marker = "Earlier reasoning to look for."
        history = [{**m, "reasoning_content": marker} if m["role"] == "assistant" else m for m in history]
        return marker in render_generation_prompt(tokenizer, history, enable_thinking, tools)

    call = {"id": "call_0", "type": "function", "function": {"name": "lookup", "arguments": '{"word": "two"}'}}
    return {"chat_turns": shows([{"role": "user", "content": "One?"}, {"role": "assistant", "content": "1"},
                                 {"role": "user", "content": "Two?"}], None),
            "tool_steps": shows([{"role": "user", "content": "What is two?"},
                                 {"role": "assistant", "content": "", "tool_calls": [call]},
                                 {"role": "tool", "tool_call_id": "call_0", "content": "2"}], [HISTORY_PROBE_TOOL])}


def history_reasoning_of(model_dir: str, enable_thinking: bool) -> dict[str, bool]:
    """history_reasoning_rendered of a model folder's own tokenizer and template (a bounded
    child's call: regen.generate.reasoning_probed)."""
    return history_reasoning_rendered(load_tokenizer(model_dir), enable_thinking)


def render(tokenizer, conversations: Sequence[list[dict[str, Any]]], enable_thinking: bool | None,
           tools: Sequence[list[dict] | None] | None = None) -> list[str]:
    """``enable_thinking`` None: the template's own default (SpecForge's general parser).
    ``tools``: each conversation's (an agentic row's are rendered with them, one at a time; the
    others in one batch)."""
    if not conversations:
        return []
    kwargs = {} if enable_thinking is None else {"enable_thinking": enable_thinking}
    tools = list(tools or [None] * len(conversations))
    plain = [i for i, t in enumerate(tools) if not t]
    out: list[str] = [""] * len(conversations)
    if plain:
        for i in plain:  # one at a time: each under its bound
            out[i] = _apply(tokenizer, conversations[i], add_generation_prompt=False, **kwargs)
    for i, tool_list in enumerate(tools):
        if tool_list:
            out[i] = _apply(tokenizer, conversations[i], tools=tool_list, add_generation_prompt=False, **kwargs)
    return out


def render_generation_prompt(tokenizer, messages: list[dict[str, Any]], enable_thinking: bool,
                             tools: list[dict] | None = None) -> str:
    """``tools``: an agentic row's, rendered with its calls' arguments as objects (as the engine
    hands them to the template)."""
    if tools is None:
        return _apply(tokenizer, messages, add_generation_prompt=True, enable_thinking=enable_thinking)
    messages = [{**m, "tool_calls": parser_calls(m["tool_calls"])} if m.get("tool_calls") else m for m in messages]
    return _apply(tokenizer, messages, tools=tools, add_generation_prompt=True, enable_thinking=enable_thinking)


def generation_prefill(tokenizer, fmt: ChatFormat, thinking: bool) -> str:
    """What the generation prompt puts after the assistant header, which the model does not
    generate but training renders inside the span (Qwen3 with thinking off: an empty think block)."""
    try:
        prompt = render_generation_prompt(tokenizer, [{"role": "user", "content": "Hi"}], thinking)
    except MemoryError:  # past its budget (regen.childpool.call_bounded): the caller's to report
        raise
    except Exception:  # a template that cannot render is preflight's finding
        return ""
    at = prompt.rfind(fmt.assistant_header)
    return prompt[at + len(fmt.assistant_header):] if at != -1 else ""


def template_problems(tokenizer, enable_thinking: bool, fmt: ChatFormat = QWEN) -> list[str]:
    """What in the chat template would make the loss mask wrong; empty when it is fine."""
    probe = [{"role": "user", "content": "What is 2 + 2?"}]
    problems = []
    try:
        prompt = render_generation_prompt(tokenizer, probe, enable_thinking)
        full = render(tokenizer, [training_messages(probe, "Two plus two is four.", "4")],
                      enable_thinking)[0]
    except MemoryError:  # past its budget (regen.childpool.call_bounded): the caller's to report
        raise
    except Exception as exc:  # a template error is a finding, whatever its type
        return [f"chat template fails to render: {type(exc).__name__}: {exc}"]
    if not prompt.endswith(fmt.assistant_header) and fmt.assistant_header not in prompt:
        problems.append(f"generation prompt has no assistant header {fmt.assistant_header!r}")
    empty_think = f"{fmt.think_start}\n\n{fmt.think_end}"
    if enable_thinking and prompt.rstrip().endswith(empty_think):
        problems.append(
            "chat template pre-fills an empty think block with enable_thinking=true: "
            "the model would answer without reasoning"
        )
    spans = [full[start:end] for start, end in assistant_spans(full, fmt)]
    if not spans:
        problems.append(f"rendered conversation has no assistant span {fmt.assistant_header!r}")
    elif enable_thinking and "Two plus two is four." not in spans[-1]:
        problems.append("chat template drops reasoning_content from the final assistant turn")
    elif not spans[-1].endswith(fmt.end_of_turn):
        problems.append(f"assistant turn does not end with {fmt.end_of_turn!r}")
    return problems
