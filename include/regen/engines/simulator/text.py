"""What the simulator answers: deterministic words per (prompt, seed), thinking or not, and the
token ids an engine would return for them (with the model directory's own tokenizer and chat
template). A "token" of ``usage`` is a word."""

from __future__ import annotations

import hashlib
import json
import math
import random
from pathlib import Path

REASONING_WORDS = (
    "okay let me think about this carefully first the question asks for the answer so I "
    "should check each step then consider whether the result makes sense because a small "
    "mistake here would change everything hmm wait actually that is right now compute the "
    "value and verify it again before writing the final answer clearly"
).split()


ANSWER_WORDS = (
    "the answer is that this works because each part follows from the previous one and the "
    "result is consistent with what we expected in summary here is a clear explanation"
).split()


NO_THINKING_ANSWER = "OK."


def _rng(messages: list[dict], seed: int | None, base_seed: int) -> random.Random:
    key = json.dumps(messages, sort_keys=True) + f"|{seed if seed is not None else base_seed}"
    return random.Random(hashlib.sha256(key.encode()).digest())


def compose(messages: list[dict], thinking: bool, seed: int | None, base_seed: int = 0,
            reasoning_median: int = 0, length_sigma: float = 0.0) -> tuple[list[str], list[str]]:
    """(reasoning words, answer words) for a request; no reasoning when thinking is off. The
    trace's length is 40 to 120 words, or log-normal around ``reasoning_median``."""
    rng = _rng(messages, seed, base_seed)
    if not thinking:
        return [], [NO_THINKING_ANSWER]
    length = (max(4, round(reasoning_median * math.exp(length_sigma * rng.gauss(0.0, 1.0))))
              if reasoning_median else rng.randint(40, 120))
    reasoning = [rng.choice(REASONING_WORDS) for _ in range(length)]
    answer = [rng.choice(ANSWER_WORDS) for _ in range(rng.randint(12, 48))]
    answer[-1] = answer[-1] + "."
    return reasoning, answer


def _call(tool: dict, step: int, call_id: str) -> dict:
    properties = ((tool["function"].get("parameters") or {}).get("properties") or {})
    arguments = {name: f"{name} {step}" for name in sorted(properties)}
    return {"id": call_id, "type": "function",
            "function": {"name": tool["function"]["name"], "arguments": json.dumps(arguments)}}


def plan_calls(messages: list[dict], tools: list[dict] | None, divergence: float, seed: int | None,
               base_seed: int = 0) -> list[dict] | None:
    """The calls the simulator makes for a request, or None (it answers). The last user message
    asks for them: ``[tools: a+b; c]`` calls a and b at once, then c once their results are back,
    then answers; a tool of the request named in the text is called once. With ``divergence``,
    that share of steps (by prompt, deterministic) calls another tool, or none."""
    if not tools:
        return None
    last_user = max(i for i, m in enumerate(messages) if m["role"] == "user")
    text = str(messages[last_user].get("content") or "")
    by_name = {t["function"]["name"]: t for t in tools}
    if "[tools:" in text:
        plan = [[n.strip() for n in group.split("+") if n.strip()]
                for group in text.split("[tools:", 1)[1].split("]", 1)[0].split(";")]
    else:
        plan = [[n for n in sorted(by_name, key=text.find) if n in text]]
    step = sum(1 for m in messages[last_user:] if m["role"] == "assistant" and m.get("tool_calls"))
    group = [n for n in plan[step] if n in by_name] if step < len(plan) else []
    rng = _rng(messages, seed, base_seed)
    if group and rng.random() < divergence:
        others = [n for n in by_name if n not in group]
        group = [others[0]] if others else []
    key = json.dumps(messages, sort_keys=True)
    return [_call(by_name[n], step, "call_" + hashlib.sha256(f"{key}|{j}".encode()).hexdigest()[:24])
            for j, n in enumerate(group)] or None


def call_text(call: dict) -> str:
    """One call as a Qwen3 model writes it (and its chat template renders it)."""
    function = call["function"]
    return f'<tool_call>\n{{"name": "{function["name"]}", "arguments": {function["arguments"]}}}\n</tool_call>'


def message_tokens(message: dict) -> int:
    """A message's tokens as the simulator counts them: its words and four for its frame."""
    return len(str(message.get("content", "")).split()) + 4


def count_prompt_tokens(messages: list[dict]) -> int:
    return sum(message_tokens(m) for m in messages) + 2


class SimTokens:
    """Token ids as an engine returns them, with the model directory's own tokenizer and chat
    template (the `tokenizers` library and Jinja, loaded on the first request that asks): the
    prompt as the generation prompt renders it, the output as the model would have written it
    (think block, answer, end-of-turn token)."""

    def __init__(self, model_path: str):
        self.model_path = Path(model_path)
        self._loaded: tuple | None = None

    def _load(self) -> tuple:
        if self._loaded is None:
            import jinja2
            from jinja2.sandbox import ImmutableSandboxedEnvironment
            from tokenizers import Tokenizer

            config = json.loads((self.model_path / "tokenizer_config.json").read_text())
            template = config.get("chat_template")
            if template is None and (self.model_path / "chat_template.jinja").exists():
                template = (self.model_path / "chat_template.jinja").read_text()

            def raise_exception(message):
                raise jinja2.TemplateError(message)

            env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
            env.globals["raise_exception"] = raise_exception
            env.filters["tojson"] = lambda value, **kw: json.dumps(value, ensure_ascii=False, **kw)
            eos = config.get("eos_token")
            eos = eos.get("content") if isinstance(eos, dict) else eos
            self._loaded = (Tokenizer.from_file(str(self.model_path / "tokenizer.json")),
                            env.from_string(template), eos or "<|im_end|>")
        return self._loaded

    def ids(self, messages: list[dict], kwargs: dict, reply, finished: bool,
            tools: list[dict] | None = None) -> tuple[list[int], list[int]]:
        """(prompt ids, output ids) of a reply (regen.protocol.ChatReply); its calls written as
        a Qwen3 model writes them, which its tool-call parser reads back."""
        tokenizer, template, eos = self._load()
        prompt = template.render(messages=messages, tools=tools, add_generation_prompt=True, **kwargs)
        reasoning, content = reply.reasoning_content, reply.content or ""
        output = (f"<think>\n{reasoning}\n</think>\n\n" if reasoning is not None else "") + content
        for j, call in enumerate(reply.tool_calls or []):
            output += ("\n" if j or content else "") + call_text(call)
        output += eos if finished else ""
        encode = lambda text: tokenizer.encode(text, add_special_tokens=False).ids  # noqa: E731
        return encode(prompt), encode(output)
