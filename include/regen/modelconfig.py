"""A model's config.json as the engines read it: where its context length is.

Qwen3.5/3.6 ship the vision-language layout, whose language model's settings sit under
``text_config``; others name the length differently (``max_sequence_length``, ``seq_length``,
``model_max_length`` ...), and a rope scaling factor stretches it. SGLang's own rule
(``sglang.srt.utils.hf_transformers.common.get_context_length`` over the text config) is
followed key for key; a test checks both on the same configs.
"""

from __future__ import annotations

from typing import Any

# In SGLang's order of preference: a config with two of them takes the first.
CONTEXT_LENGTH_KEYS = ("max_sequence_length", "seq_length", "max_seq_len", "model_max_length",
                       "max_position_embeddings")


def text_config(config: dict[str, Any]) -> dict[str, Any]:
    """The language model's part: ``text_config`` when the config nests one."""
    nested = config.get("text_config")
    return nested if isinstance(nested, dict) else config


def context_length(config: dict[str, Any]) -> int | None:
    """The longest prompt plus answer the model takes, as SGLang derives it; None when the config
    names none (SGLang would assume 2,048)."""
    text = text_config(config)
    rope = text.get("rope_scaling") or {}
    factor = 1.0
    if isinstance(rope, dict) and rope:
        factor = rope.get("factor", 1) or 1
        if "original_max_position_embeddings" in rope or rope.get("rope_type") == "llama3":
            factor = 1
    for key in CONTEXT_LENGTH_KEYS:
        value = text.get(key)
        if value is not None:
            return int(factor * value)
    return None
