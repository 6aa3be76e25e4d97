"""Text from a run (a model's output, a conf's values) shown in Markdown as itself: a hub, the
approval form and a card render Markdown and raw HTML, and a reader copies commands from it."""

from __future__ import annotations

import re
import shlex

_MARKDOWN_PUNCTUATION = re.compile(r"([\\`*_{}\[\]()<>#+\-.!|~&\"'=:])")


def markdown_literal(text: object, limit: int | None = 400) -> str:
    """``text`` as itself in a Markdown body: one line, cut at ``limit`` characters, every
    punctuation mark escaped, so a link, an image (fetched by the reader's browser), a heading or
    raw HTML in it stays text."""
    flat = " ".join(("" if text is None else str(text)).split())
    if limit is not None and len(flat) > limit:
        flat = flat[:limit] + "..."
    return _MARKDOWN_PUNCTUATION.sub(r"\\\1", flat)


def code_block(*commands: list[str]) -> str:
    """Shell commands as a fenced block a reader can paste: every argument quoted for the shell,
    the fence longer than any run of backticks inside (so no value can close it)."""
    body = "\n".join(shlex.join(argv) for argv in commands)
    fence = "`" * max(3, 1 + max((len(run) for run in re.findall(r"`+", body)), default=0))
    return f"{fence}\n{body}\n{fence}\n"
