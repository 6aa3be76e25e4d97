"""regen's simulator (`regen sim`, regen.engines.simulator): SGLang's HTTP API, launched with
SGLang's flags plus its own `--sim-*` knobs, so it goes through the same server manager and
client paths as SGLang."""

from __future__ import annotations

import sys

from regen.config import RunConfig
from regen.engines.sglang import SGLang
from regen.engines.simulator.calls import TOOL_CALL_PARSERS
from regen.engines.simulator.settings import SimSettings, to_argv


class Simulator(SGLang):
    name = "sim"
    needs_gpu = False  # SGLang's API, served on a CPU
    version = ""
    reasoning_parsers = frozenset({"qwen3", "qwen3-thinking", "deepseek-r1"})
    tool_call_parsers = frozenset(TOOL_CALL_PARSERS)
    # Its knobs, but not those that name a file on the node.
    run_flags = SGLang.run_flags | SimSettings.run_flags()

    def module_argv(self, cfg: RunConfig) -> list[str]:
        # Always regen's own interpreter: the simulator is part of regen.
        return [sys.executable, "-m", "regen", "sim"]

    def own_flags(self, cfg: RunConfig) -> list[str]:
        options = cfg.sim.model_dump()  # the config's simulator options are SimSettings' fields
        follow = options.pop("follow_recorded")
        return to_argv(**options) + (["--sim-follow-recorded", cfg.prompts] if follow else [])
