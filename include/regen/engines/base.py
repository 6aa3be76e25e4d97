"""What every engine adapter answers. Adapters are stateless; they read a RunConfig."""

from __future__ import annotations

import sys
from typing import Any, ClassVar

from regen.config import RunConfig


def flag(name: str, value: Any) -> list[str]:
    return [name, str(value)] if value is not None else []


def parallel_flags(cfg: RunConfig, tp_flag: str, dp_flag: str) -> list[str]:
    """Tensor and data parallel sizes, left out at 1 (the engines' default) so that a
    one-GPU server's launch line is the same as before they existed."""
    argv = []
    if cfg.engine_options.tp_size != 1:
        argv += [tp_flag, str(cfg.engine_options.tp_size)]
    if cfg.engine_options.dp_size != 1:
        argv += [dp_flag, str(cfg.engine_options.dp_size)]
    return argv


class Engine:
    name: ClassVar[str]
    needs_gpu: ClassVar[bool] = False  # a server cannot run on a CPU
    # The release whose parser names are listed below (requirements-*.txt pins it).
    version: ClassVar[str] = ""
    # `--reasoning-parser` and `--tool-call-parser` values that release knows; preflight asks the
    # engine installed on the node instead, where there is one (regen.engines.launch_check).
    reasoning_parsers: ClassVar[frozenset[str]]
    tool_call_parsers: ClassVar[frozenset[str]] = frozenset()
    # Flags a run triggered in Airflow may add to extra_server_args (regen.config.deployment):
    # tuning only; none loads code, opens a path, or changes where the server listens.
    run_flags: ClassVar[frozenset[str]] = frozenset()
    # RunConfig fields the engine has no equivalent for: a set value would be silently ignored.
    ignored_options: ClassVar[tuple[str, ...]] = ()
    # Where the message of a chat completion carries the thinking trace, first found wins.
    reasoning_fields: ClassVar[tuple[str, ...]] = ("reasoning_content",)
    # The key of a request's assistant message whose reasoning the engine hands its chat template.
    history_reasoning_field: ClassVar[str] = "reasoning_content"
    # Server-info endpoints, newest first.
    info_paths: ClassVar[tuple[str, ...]] = ()
    # Prometheus metric name (without the engine's prefix) -> regen's name for it.
    metric_names: ClassVar[dict[str, str]] = {}
    metric_prefix: ClassVar[str] = ""
    # Engine-specific request fields: the reasoning apart from the answer, and the tokens as the
    # engine saw and produced them.
    request_fields: ClassVar[dict[str, Any]] = {}

    def token_ids(self, body: dict, choice: dict) -> tuple[list[int] | None, list[int] | None]:
        """(prompt token ids, completion token ids) of a response, where the engine returns them."""
        return None, None

    def python(self, cfg: RunConfig) -> str:
        return cfg.servers.engine_python or sys.executable

    def launch_argv(self, cfg: RunConfig, model_path: str, port: int) -> list[str]:
        """The server's command: what is recorded and compared, and what the engine's own parser
        checks at preflight. It never holds the key (:meth:`server_argv`, :meth:`key_env`)."""
        raise NotImplementedError

    def server_argv(self, launch: list[str]) -> list[str]:
        """The command line the server process runs with (a wrapper that hands it the key, where
        the engine reads its key only from its arguments)."""
        return launch

    def key_env(self, api_key: str) -> dict[str, str]:
        """The environment that gives the server its key."""
        raise NotImplementedError

    def launch_env(self, gpu: str | None) -> dict[str, str]:
        """Environment a server of this engine needs on its GPU (``None``: on the CPU), over the
        node's own; a variable the node sets already keeps the node's value."""
        return {}

    def effective_limit(self, info: dict, launch_limit: int | None) -> int | None:
        """How many requests the server really runs at once, from its server info; never above
        what it was launched with."""
        return launch_limit

    def served_model_path(self, info: dict) -> str | None:
        """The model directory the server says it loaded (to check it serves what we staged)."""
        return None

    def reasoning(self, message: dict) -> str | None:
        for name in self.reasoning_fields:
            value = message.get(name)
            if value is not None:
                return value
        return None

    def metric(self, name: str) -> str | None:
        """regen's name for a scraped metric, or None when it is not one regen shows."""
        prefix, _, base = name.partition(":")
        if not base or prefix != self.metric_prefix:
            return None
        return self.metric_names.get(base)
