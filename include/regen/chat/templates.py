"""SpecForge's chat templates as regen needs them: the markers of what training learns from, and
what its data parser does with a conversation for each ``--chat-template`` name. Pure data: the
config validates ``train_template`` against this registry, and preflight names the templates of
SpecForge 0.2.0's registry that regen cannot reproduce exactly (``UNSUPPORTED``)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ChatFormat:
    """The markers that delimit what training learns from: an assistant span starts after
    ``assistant_header`` (and after ``skip_after_header`` when the text has it there) and runs
    through the first of ``end_of_turn`` and ``also_ends``, or to the end of the text."""

    assistant_header: str = "<|im_start|>assistant\n"
    end_of_turn: str = "<|im_end|>\n"
    also_ends: tuple[str, ...] = ()
    skip_after_header: str = ""
    think_start: str = "<think>"
    think_end: str = "</think>"

    @property
    def after_eos(self) -> str:
        """What training renders after the end-of-turn token, which the engine does not generate
        (the newline of ``<|im_end|>\n``)."""
        return self.end_of_turn[len(self.end_of_turn.rstrip("\n")):]

    @property
    def opens_thinking(self) -> bool:
        """The header itself opens the think block (Qwen3.5/3.6, Qwen3-Next): a sample's span
        starts inside it."""
        return self.assistant_header.rstrip("\n").endswith(self.think_start)


QWEN = ChatFormat()


@dataclass(frozen=True)
class TrainTemplate:
    """What SpecForge's data parser does with a conversation for one ``--chat-template`` name:
    the markers of what it trains on, the system prompt it adds when there is none (``""`` and
    None: none), whether its parser keeps ``reasoning_content`` (ThinkingParser) or drops it
    (the general parser), the ``enable_thinking`` it renders with (None: the template's own
    default), and strings whose tokens it takes out of the mask."""

    fmt: ChatFormat
    system_prompt: str | None
    keeps_reasoning: bool
    render_thinking: bool | None
    ignore: tuple[str, ...] = ()

    @property
    def message_keys(self) -> frozenset[str]:
        base = {"role", "content", "tool_calls"}
        return frozenset(base | {"reasoning_content", "name", "tool_call_id"} if self.keeps_reasoning else base)


def _general(header: str, eot: str, system: str | None = "You are a helpful assistant.", **kw) -> TrainTemplate:
    return TrainTemplate(ChatFormat(header, eot), system, keeps_reasoning=False, render_thinking=None, **kw)


def _thinking(header: str, eot: str, system: str | None = "You are a helpful assistant.",
              render_thinking: bool | None = True, **kw) -> TrainTemplate:
    return TrainTemplate(ChatFormat(header, eot), system, keeps_reasoning=True, render_thinking=render_thinking, **kw)


_LLAMA2_SYSTEM = (
    "You are a helpful, respectful and honest assistant. Always answer as helpfully as possible, while being "
    "safe.  Your answers should not include any harmful, unethical, racist, sexist, toxic, dangerous, or "
    "illegal content. Please ensure that your responses are socially unbiased and positive in nature.\n\nIf "
    "a question does not make any sense, or is not factually coherent, explain why instead of answering "
    "something not correct. If you don't know the answer to a question, please don't share false information.")
_IM = "<|im_start|>assistant\n"
_DS = "<｜Assistant｜>"
_DS_EOS = "<｜end▁of▁sentence｜>"

# SpecForge 0.2.0's registry (specforge/data/template.py), the templates a chat conversation can be
# parsed with by span markers. Checked entry by entry against the installed package in
# tests/test_training_view.py.
TRAIN_TEMPLATES: dict[str, TrainTemplate] = {
    "qwen3-thinking": _thinking(_IM, "<|im_end|>\n"),
    "qwen3.5": _thinking(_IM + "<think>\n", "<|im_end|>\n", system=""),
    "qwen3-next-thinking": _thinking(_IM + "<think>\n", "<|im_end|>\n"),
    "qwen3-instruct": _general(_IM, "<|im_end|>\n", ignore=("<think>\n\n</think>\n\n",)),
    "qwen": _general(_IM, "<|im_end|>\n"),
    "lfm": _general(_IM, "<|im_end|>\n", system=""),
    "kimi-k2-thinking": _thinking("<|im_assistant|>assistant<|im_middle|>", "<|im_end|>"),
    "kimi-k2-instruct": _general("<|im_assistant|>assistant<|im_middle|>", "<|im_end|>"),
    "kimi-k3-thinking": _thinking('<|open|>message role="assistant"<|sep|><|open|>think<|sep|>', "<|end_of_msg|>",
                                  system=None, render_thinking=None, ignore=("<|end_of_msg|>",)),
    "deepseek-v32": _thinking(_DS, _DS_EOS, system=""),
    "deepseek-v3": _general(_DS, _DS_EOS),
    "deepseek-v2": _general("Assistant: ", _DS_EOS, system=None),
    "glm-5.2": TrainTemplate(ChatFormat("<|assistant|><think>", "<|user|>", skip_after_header="</think>"),
                             None, keeps_reasoning=False, render_thinking=False, ignore=("<|user|>",)),
    "inkling-thinking": TrainTemplate(
        ChatFormat("<|message_model|>", "<|message_user|>", also_ends=("<|message_tool|>", "<|message_system|>")),
        None, keeps_reasoning=True, render_thinking=True,
        ignore=("<|message_user|>", "<|message_tool|>", "<|message_system|>")),
    "llama3": _general("<|start_header_id|>assistant<|end_header_id|>\n\n", "<|eot_id|>", system=_LLAMA2_SYSTEM),
    "llama4": _general("<|header_start|>assistant<|header_end|>\n\n", "<|eot|>"),
    "gemma": _general("<start_of_turn>model\n", "<end_of_turn>\n"),
    "phi3": _general("<|assistant|>\n", "<|end|>\n"),
    "phi4": _general("<|im_start|>assistant<|im_sep|>", "<|im_end|>"),
    "phi4-mini": _general("<|assistant|>", "<|end|>"),
    "ling-flash-2.0": _general("<role>ASSISTANT</role>", "<|role_end|>"),
    "longcat_xml": _general("<longcat_assistant>", "</longcat_s>"),
    "gpt-oss-naive": _general("<|start|>assistant<|channel|>analysis<|message|>", "<|end|>", system=None),
}


def answer_only_counterpart(name: str) -> str | None:
    """The training template that reads the same chat format without a think block (what data made
    with thinking off trains with), preferring one that takes the empty think block out of the mask;
    None when the registry has none."""
    thinking = TRAIN_TEMPLATES[name]
    header = thinking.fmt.assistant_header.removesuffix("<think>\n").removesuffix("<think>")
    plain = [other for other, t in TRAIN_TEMPLATES.items()
             if not t.keeps_reasoning and t.fmt.assistant_header == header and t.fmt.end_of_turn == thinking.fmt.end_of_turn]
    return min(plain, key=lambda other: not any("<think>" in i for i in TRAIN_TEMPLATES[other].ignore), default=None)

# The rest of SpecForge 0.2.0's registry, and why regen cannot judge data for it exactly.
UNSUPPORTED: dict[str, str] = {
    "gpt-oss": "SpecForge parses it with its Harmony parser (its own renderer and reasoning levels), "
               "not the model's chat template",
    "deepseek-r1-distill": "it has no end-of-turn token, so SpecForge's parser cannot build its span pattern",
    "longcat": "its spans end at a `[Round N] USER:` pattern regen does not reproduce",
}

DEFAULT_TRAIN_TEMPLATE = TRAIN_TEMPLATES["qwen3-thinking"]


@dataclass(frozen=True)
class TrainRecipe:
    """What the audit checks a sample against when the config leaves it empty: the training's max
    length and the fewest loss tokens worth a sample (SpecForge's run config for the template,
    where it ships one), and the fraction of samples that must be token-exact on-policy
    (regen.chat.onpolicy). Where the template adds a system prompt of its own, no sample the
    engine was served without one can be exact: the certificate is reported, not enforced."""

    max_length: int = 2048  # SpecForge's --max-length default
    min_loss_tokens: int = 16
    min_on_policy_fraction: float = 0.95


# SpecForge's shipped run configs, by the template they train with: its Qwen3.5/3.6 DFlash recipe
# trains at 4096 tokens, and DFlash needs only 2 consecutive loss tokens to learn from a sample.
RECIPES: dict[str, TrainRecipe] = {"qwen3.5": TrainRecipe(max_length=4096, min_loss_tokens=2)}


def recipe(template_name: str) -> TrainRecipe:
    found = RECIPES.get(template_name, TrainRecipe())
    if TRAIN_TEMPLATES.get(template_name, DEFAULT_TRAIN_TEMPLATE).system_prompt:
        return TrainRecipe(found.max_length, found.min_loss_tokens, 0.0)
    return found
