"""One adapter per inference engine: everything regen knows about an engine, in one file.

Preflight asks an adapter which reasoning parsers exist and which options it would ignore, the
server manager asks it for the launch command, and the client asks it where the concurrency limit
is reported, which field holds the reasoning and what the metrics are called.
"""

from __future__ import annotations

from regen.engines.base import Engine
from regen.engines.sglang import SGLang
from regen.engines.sim import Simulator
from regen.engines.vllm import VLLM

ENGINES: dict[str, Engine] = {engine.name: engine for engine in (SGLang(), VLLM(), Simulator())}


def engine(name: str) -> Engine:
    return ENGINES[name]


def engine_of_server(models_doc: dict, default: str) -> Engine:
    """The engine behind a running server, from its /v1/models answer (``owned_by``); the
    configured one when the answer does not tell (the simulator answers as SGLang does)."""
    owners = {str(m.get("owned_by", "")).lower() for m in models_doc.get("data") or [] if isinstance(m, dict)}
    if "vllm" in owners:
        return ENGINES["vllm"]
    if "sglang" in owners and default == "vllm":
        return ENGINES["sglang"]
    return ENGINES[default]
