"""regen's simulator (`regen sim`): SGLang's HTTP API, launched with SGLang's flags plus its own
`--sim-*` knobs, so it goes through the same server manager and client paths as SGLang."""

from __future__ import annotations

import sys

from regen.config import RunConfig
from regen.engines.sglang import SGLang


class Simulator(SGLang):
    name = "sim"
    reasoning_parsers = frozenset({"qwen3", "qwen3-thinking", "deepseek-r1"})

    def module_argv(self, cfg: RunConfig) -> list[str]:
        # Always regen's own interpreter: the simulator is part of regen.
        return [sys.executable, "-m", "regen", "sim"]

    def own_flags(self, cfg: RunConfig) -> list[str]:
        argv = ["--sim-tokens-per-second", str(cfg.sim_tokens_per_second),
                "--sim-ttft", str(cfg.sim_ttft_s),
                "--sim-failure-rate", str(cfg.sim_failure_rate),
                "--sim-hang-rate", str(cfg.sim_hang_rate)]
        if cfg.sim_ignore_thinking:
            argv.append("--sim-ignore-thinking")
        return argv
