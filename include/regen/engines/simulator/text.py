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


def seeded_rng(messages: list[dict], seed: int | None, base_seed: int) -> random.Random:
    key = json.dumps(messages, sort_keys=True) + f"|{seed if seed is not None else base_seed}"
    return random.Random(hashlib.sha256(key.encode()).digest())


def compose(messages: list[dict], thinking: bool, seed: int | None, base_seed: int = 0,
            reasoning_median: int = 0, length_sigma: float = 0.0) -> tuple[list[str], list[str]]:
    """(reasoning words, answer words) for a request; no reasoning when thinking is off. The
    trace's length is 40 to 120 words, or log-normal around ``reasoning_median``."""
    rng = seeded_rng(messages, seed, base_seed)
    if not thinking:
        return [], [NO_THINKING_ANSWER]
    length = (max(4, round(reasoning_median * math.exp(length_sigma * rng.gauss(0.0, 1.0))))
              if reasoning_median else rng.randint(40, 120))
    reasoning = [rng.choice(REASONING_WORDS) for _ in range(length)]
    answer = [rng.choice(ANSWER_WORDS) for _ in range(rng.randint(12, 48))]
    answer[-1] = answer[-1] + "."
    return reasoning, answer


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
            template = self.template_source()

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

    def template_source(self) -> str | None:
        """The chat template: tokenizer_config.json's, else chat_template.jinja; None without."""
        config_file, jinja_file = self.model_path / "tokenizer_config.json", self.model_path / "chat_template.jinja"
        template = json.loads(config_file.read_text()).get("chat_template") if config_file.is_file() else None
        if template is None and jinja_file.is_file():
            template = jinja_file.read_text()
        return template

    def ids(self, messages: list[dict], kwargs: dict, reasoning: str | None, text: str, finished: bool,
            tools: list[dict] | None = None) -> tuple[list[int], list[int]]:
        """(prompt ids, output ids) of a reply: its reasoning (continued inside a think block the
        generation prompt opened, else in one of its own) and its text, calls as written."""
        tokenizer, template, eos = self._load()
        prompt = template.render(messages=messages, tools=tools, add_generation_prompt=True, **kwargs)
        output = ""
        if reasoning is not None:
            opened = "" if prompt.endswith("<think>\n") else "\n" if prompt.endswith("<think>") else "<think>\n"
            output = f"{opened}{reasoning}\n</think>\n\n"
        output += text + (eos if finished else "")
        encode = lambda text: tokenizer.encode(text, add_special_tokens=False).ids  # noqa: E731
        return encode(prompt), encode(output)
