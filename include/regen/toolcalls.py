"""Agentic rows in one spelling: tools, the assistant's tool calls, the recorded tool results.

Prompt files spell them the OpenAI way (``tools``; assistant ``tool_calls`` with ``id`` and
``function{name, arguments}``, or the older single ``function_call``; ``tool`` messages with
``tool_call_id``) or the ShareGPT way (``function_call`` and ``observation`` turns, ``tools`` as a
JSON string). Both become the OpenAI shape, ``arguments`` a JSON string, which is what SGLang and
vLLM take in a request and give back in a reply. :func:`compare_calls` decides whether a step the
model regenerated can take the recorded results (same functions, in the same positions).
"""

from __future__ import annotations

import json
import re
from typing import Any

# How models write calls as text, for an engine's tool-call parser to take apart: Hermes and
# Qwen's <tool_call>, Qwen3-Coder's (and Qwen3.5's) <function=...>, Mistral's [TOOL_CALLS],
# Llama 3's python tag, DeepSeek's and Kimi's call sections.
CALL_MARKUP = re.compile(r"<tool_call>|<function=|\[TOOL_CALLS\]|<\|python_tag\|>|<｜tool▁calls▁begin｜>"
                         r"|<\|tool_calls_section_begin\|>")


# The call markup a chat template renders, and the engines' parser that reads it back (SGLang's and
# vLLM's names where they agree; first match wins, so Qwen3.5/3.6's <function=...> inside
# <tool_call> is read as qwen3_coder, not as Qwen3's JSON calls).
PARSER_FOR_MARKUP = (("<function=", "qwen3_coder"), ("<tool_call>", "qwen25"), ("[TOOL_CALLS]", "mistral"),
                     ("<|python_tag|>", "llama3"), ("<｜tool▁calls▁begin｜>", "deepseekv3"),
                     ("<|tool_calls_section_begin|>", "kimi_k2"))


def parser_for_template(template: str, known: frozenset[str]) -> str | None:
    """The tool-call parser for the call format a chat template renders, when the engine has it."""
    return next((parser for markup, parser in PARSER_FOR_MARKUP if markup in template and parser in known), None)


def _loaded(raw: Any, what: str) -> Any:
    if isinstance(raw, str):
        try:
            return json.loads(raw)
        except ValueError as exc:
            raise ValueError(f"{what} is a string that is not JSON ({exc})") from None
    return raw.tolist() if hasattr(raw, "tolist") else raw


def normalize_tools(raw: Any) -> list[dict] | None:
    """A row's ``tools`` as a list of ``{"type": "function", "function": {...}}``; None when it
    has none. A bare function description (``{"name", "parameters"}``) is wrapped."""
    if raw is None or (isinstance(raw, str) and not raw.strip()):
        return None
    tools = _loaded(raw, "'tools'")
    if not isinstance(tools, list):
        raise ValueError(f"'tools' must be a list of tools (or a JSON string of one), got {type(tools).__name__}")
    return [{"type": "function", "function": dict(_named(tool, f"'tools[{i}]' is not a function tool with a name"))}
            for i, tool in enumerate(tools)] or None


def _named(item: Any, problem: str) -> dict:
    """The function of a tool or a call (``{"function": {...}}`` or the function itself), which
    must have a name; ValueError(``problem``) otherwise."""
    function = item.get("function", item) if isinstance(item, dict) else None
    if not isinstance(function, dict) or not isinstance(function.get("name"), str) or not function["name"]:
        raise ValueError(problem)
    return function


def _arguments(raw: Any) -> str:
    if raw is None:
        return "{}"
    return raw if isinstance(raw, str) else json.dumps(raw, ensure_ascii=False)


def normalize_calls(raw: Any, where: str, message_index: int) -> list[dict]:
    """One assistant message's calls (a list, one call, or their JSON), each with an id (the
    given one, else ``call_{message}_{position}``) and its arguments as a JSON string."""
    calls = _loaded(raw, where)
    if isinstance(calls, dict):
        calls = [calls]
    if not isinstance(calls, list) or not calls:
        raise ValueError(f"{where}: the tool calls must be a non-empty list")
    out = []
    for j, call in enumerate(calls):
        function = _named(call, f"{where}: call {j} has no function name")
        call_id = call.get("id") if isinstance(call.get("id"), str) and call.get("id") else f"call_{message_index}_{j}"
        out.append({"id": call_id, "type": "function",
                    "function": {"name": function["name"], "arguments": _arguments(function.get("arguments"))}})
    return out


def answer_calls_in_order(messages: list[dict]) -> None:
    """Give each tool result without a ``tool_call_id`` the next unanswered call of the
    assistant message before it (ShareGPT results answer in the order the calls were made)."""
    pending: list[str] = []
    for message in messages:
        if message["role"] == "assistant":
            pending = [c["id"] for c in message.get("tool_calls") or []]
        elif message["role"] == "tool":
            if not message.get("tool_call_id") and pending:
                message["tool_call_id"] = pending[0]
            if message.get("tool_call_id") in pending:
                pending.remove(message["tool_call_id"])
        else:
            pending = []


def written_call(content: str | None, tools: Any) -> bool:
    """Whether an answer's text holds a call no parser took apart: call markup, or a JSON object
    naming one of the request's tools (what a reply holds when the server's tool-call parser is
    missing or is not the one for the model's call format)."""
    if not content:
        return False
    if CALL_MARKUP.search(content):
        return True
    return any(re.search(r'"name"\s*:\s*"' + re.escape(n) + '"', content)
               for n in names(normalize_tools(tools)))


def names(calls: list[dict] | None) -> list[str]:
    return [c["function"]["name"] for c in calls or []]


def same_arguments(a: str, b: str) -> bool:
    """Whether two JSON argument strings say the same (key order and spacing aside)."""
    try:
        return json.loads(a) == json.loads(b)
    except (TypeError, ValueError):
        return a == b


def compare_calls(produced: list[dict] | None, recorded: list[dict] | None) -> tuple[str | None, int]:
    """(why the model's step cannot take the recorded results, or None; how many of its calls
    have other arguments than the recorded ones). The i-th call must name the i-th recorded
    function: parallel calls are matched one by one, never truncated."""
    made, want = names(produced), names(recorded)
    if made == want:
        return None, sum(not same_arguments(p["function"]["arguments"], r["function"]["arguments"])
                         for p, r in zip(produced or [], recorded or []))
    if not made:
        return f"the model answered without a call where the recorded step calls {want}", 0
    if not want:
        return f"the model called {made} where the recorded step answers without a call", 0
    return f"the model called {made} where the recorded step calls {want}", 0
