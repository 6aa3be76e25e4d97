"""SpecForge's chat templates as regen needs them: the markers of what training learns from, and
what its data parser does with a conversation for each ``--chat-template`` name. Pure data: the
config validates ``train_template`` against this registry."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ChatFormat:
    """The markers that delimit what training learns from (Qwen/ChatML family)."""

    assistant_header: str = "<|im_start|>assistant\n"
    end_of_turn: str = "<|im_end|>\n"
    think_start: str = "<think>"
    think_end: str = "</think>"

    @property
    def after_eos(self) -> str:
        """What training renders after the end-of-turn token, which the engine does not generate
        (the newline of ``<|im_end|>\n``)."""
        return self.end_of_turn[len(self.end_of_turn.rstrip("\n")):]


QWEN = ChatFormat()


@dataclass(frozen=True)
class TrainTemplate:
    """What SpecForge's data parser does with a conversation for one ``--chat-template`` name:
    the markers of what it trains on, the system prompt it adds when there is none, whether its
    parser keeps ``reasoning_content`` (ThinkingParser) or drops it (the general parser), whether
    it renders with ``enable_thinking=True``, and strings whose tokens it takes out of the mask."""

    fmt: ChatFormat
    system_prompt: str | None
    keeps_reasoning: bool
    enable_thinking: bool
    ignore: tuple[str, ...] = ()

    @property
    def message_keys(self) -> frozenset[str]:
        base = {"role", "content", "tool_calls"}
        return frozenset(base | {"reasoning_content", "name", "tool_call_id"} if self.keeps_reasoning else base)


_HELPFUL = "You are a helpful assistant."


TRAIN_TEMPLATES: dict[str, TrainTemplate] = {
    "qwen3-thinking": TrainTemplate(QWEN, _HELPFUL, keeps_reasoning=True, enable_thinking=True),
    "qwen3-next-thinking": TrainTemplate(ChatFormat(assistant_header="<|im_start|>assistant\n<think>\n"),
                                         _HELPFUL, keeps_reasoning=True, enable_thinking=True),
    "qwen": TrainTemplate(QWEN, _HELPFUL, keeps_reasoning=False, enable_thinking=False),
    "qwen3-instruct": TrainTemplate(QWEN, _HELPFUL, keeps_reasoning=False, enable_thinking=False,
                                    ignore=("<think>\n\n</think>\n\n",)),
}


DEFAULT_TRAIN_TEMPLATE = TRAIN_TEMPLATES["qwen3-thinking"]
