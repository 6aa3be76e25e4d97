"""The simulated model's tool calls: which it makes, how it writes them, and what the server's
tool-call parser makes of the text.

A model writes calls in its own format, which its chat template renders back: Qwen3's JSON in
``<tool_call>`` or, for a template that renders ``<function=...>`` (Qwen3-Coder, Qwen3.5/3.6),
``<tool_call>\\n<function=NAME>\\n<parameter=K>\\nV\\n</parameter>\\n</function>\\n</tool_call>``.
The parser named at launch reads the text as SGLang 0.5.23's detector of that name does
(test_contracts runs them on the same text): each reads its own format and drops or leaves the
other's. With the calls recorded in a prompts file (``--sim-follow-recorded``), the model calls
what the conversation's recorded step calls, a model that behaves like the data.
"""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path

from regen.engines.simulator.text import seeded_rng

TOOL_CALL_PARSERS = ("hermes", "qwen25", "qwen3_coder")
_BLOCK = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)
_FUNCTION = re.compile(r"<function=([^>]*)>(.*?)</function>", re.DOTALL)
_PARAMETER = re.compile(r"<parameter=([^>]*)>(.*?)(?:</parameter>|(?=<parameter=)|$)", re.DOTALL)
_AS_TEXT = ("string", "str", "text", "varchar", "char", "enum")


def call_format(chat_template: str | None) -> str:
    """``xml`` for a model whose template renders ``<function=...>`` calls, else ``json``."""
    return "xml" if chat_template and "<function=" in chat_template else "json"


def write_call(call: dict, fmt: str) -> str:
    """One call as the model writes it (and its chat template renders it)."""
    function = call["function"]
    arguments = json.loads(function["arguments"])
    if fmt == "json":
        return f'<tool_call>\n{{"name": "{function["name"]}", "arguments": {json.dumps(arguments, ensure_ascii=False)}}}\n</tool_call>'
    parameters = "".join(f"<parameter={k}>\n{v if isinstance(v, str) else json.dumps(v, ensure_ascii=False)}\n</parameter>\n"
                         for k, v in arguments.items())
    return f"<tool_call>\n<function={function['name']}>\n{parameters}</function>\n</tool_call>"


def parse_calls(text: str, parser: str, tools: list[dict] | None) -> tuple[str, list[tuple[str, dict]]]:
    """(content, [(name, arguments)]) as SGLang's chat route makes of a reply's text with this
    tool-call parser: ``qwen3_coder`` reads ``<function=...>`` blocks and keeps the text before
    the first call as it is; ``qwen25`` and ``hermes`` read JSON blocks and strip that text; a
    block in the other format is dropped (``hermes`` leaves the whole text when one cannot be
    read as JSON)."""
    start = text.find("<tool_call>")
    if start < 0:
        return text, []
    blocks = _BLOCK.findall(text)
    if parser == "qwen3_coder":
        calls = [(name, {k: _value(v.removeprefix("\n").removesuffix("\n"), k, _schema(tools, name))
                         for k, v in _PARAMETER.findall(body)})
                 for block in blocks for name, body in _FUNCTION.findall(block)]
        return text[:start], calls
    calls = []
    for block in blocks:
        try:
            call = json.loads(block.strip())
        except ValueError:
            if parser == "hermes":
                return text, []
            continue
        calls.append((call["name"], call.get("arguments") or {}))
    return text[:start].strip(), calls


def _schema(tools: list[dict] | None, name: str) -> dict:
    for tool in tools or []:
        if tool["function"]["name"] == name:
            return (tool["function"].get("parameters") or {}).get("properties") or {}
    return {}


def _value(raw: str, name: str, properties: dict) -> object:
    """A parameter's value by its schema type, as qwen3_coder converts it (strings as written)."""
    if raw.lower() == "null":
        return None
    kind = str((properties.get(name) or {}).get("type", "string")).lower() if name in properties else "string"
    if kind in _AS_TEXT:
        return raw
    try:
        if kind.startswith(("int", "uint", "long", "short")):
            return int(raw)
        if kind.startswith(("num", "float")):
            number = float(raw)
            return int(number) if number.is_integer() and "." not in raw and "e" not in raw.lower() else number
        if kind in ("boolean", "bool"):
            return raw.lower() == "true"
        return json.loads(raw)
    except ValueError:
        return raw


def call_id(messages: list[dict], position: int) -> str:
    key = json.dumps(messages, sort_keys=True)
    return "call_" + hashlib.sha256(f"{key}|{position}".encode()).hexdigest()[:24]


def _step_key(messages: list[dict]) -> str:
    """What identifies a step of a recorded conversation in any request for it: the system, user
    and tool messages before it (the assistant messages are the model's own, regenerated)."""
    return json.dumps([[m["role"], m.get("content")] for m in messages if m["role"] != "assistant"],
                      sort_keys=True, ensure_ascii=False)


class RecordedSteps:
    """The calls each step of a prompts file's conversations records, found by the request."""

    def __init__(self, path: str | Path):
        from regen.prompts import Prompt, read_prompts

        self.calls: dict[str, list[dict]] = {}
        for prompt in read_prompts(path):
            if not isinstance(prompt, Prompt):
                continue
            before: list[dict] = []
            for message in prompt.messages:
                if message["role"] == "assistant":
                    self.calls.setdefault(_step_key(before), message.get("tool_calls") or [])
                else:
                    before.append(message)

    def step(self, messages: list[dict]) -> list[dict] | None:
        """The recorded step's calls ([] when it answers), None when no conversation records it."""
        return self.calls.get(_step_key(messages))


def plan_calls(messages: list[dict], tools: list[dict] | None, divergence: float, seed: int | None,
               base_seed: int = 0, recorded: RecordedSteps | None = None) -> list[dict] | None:
    """The calls the simulated model makes for a request, or None (it answers). With
    ``recorded``, what the conversation's recorded step calls, with its arguments. Otherwise the
    last user message asks for them: ``[tools: a+b; c]`` calls a and b at once, then c once their
    results are back, then answers; a tool of the request named in the text is called once. With
    ``divergence``, that share of steps (by prompt, deterministic) calls another tool, or none."""
    if not tools:
        return None
    by_name = {t["function"]["name"]: t for t in tools}
    last_user = max(i for i, m in enumerate(messages) if m["role"] == "user")
    step = sum(1 for m in messages[last_user:] if m["role"] == "assistant" and m.get("tool_calls"))
    if recorded is not None:
        group = [(c["function"]["name"], c["function"]["arguments"]) for c in recorded.step(messages) or []]
    else:
        text = str(messages[last_user].get("content") or "")
        if "[tools:" in text:
            plan = [[n.strip() for n in group.split("+") if n.strip()]
                    for group in text.split("[tools:", 1)[1].split("]", 1)[0].split(";")]
        else:
            plan = [[n for n in sorted(by_name, key=text.find) if n in text]]
        group = [(n, None) for n in plan[step] if n in by_name] if step < len(plan) else []
    if group and seeded_rng(messages, seed, base_seed).random() < divergence:
        others = [n for n in by_name if n not in {name for name, _ in group}]
        group = [(others[0], None)] if others else []
    return [{"id": call_id(messages, j), "type": "function",
             "function": {"name": name, "arguments": arguments if arguments is not None
                          else _arguments(by_name.get(name), step)}}
            for j, (name, arguments) in enumerate(group)] or None


def _arguments(tool: dict | None, step: int) -> str:
    """Made-up arguments: each parameter of the tool's schema, named with the step."""
    properties = (((tool or {}).get("function") or {}).get("parameters") or {}).get("properties") or {}
    return json.dumps({name: f"{name} {step}" for name in sorted(properties)})
