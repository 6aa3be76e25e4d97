"""Reading an engine's own endpoints, and the SGLang interpreter the contract tests check against."""

import os
from pathlib import Path

import httpx


def sim_requests_total(url: str) -> int:
    for line in httpx.get(f"{url}/metrics").text.splitlines():
        if line.startswith("sglang:num_requests_total"):
            return int(float(line.rsplit(" ", 1)[1]))
    raise AssertionError("no sglang:num_requests_total")


def sim_running(url: str) -> int:
    """Requests the simulator has received and not answered yet (queued, prefilling, decoding)."""
    return httpx.get(f"{url}/server_info").json()["internal_states"][0]["sim_requests_in_flight"]


SGLANG_PYTHON = Path(os.environ.get("REGEN_SGLANG_PYTHON") or next(
    iter(sorted((Path.home() / ".cache" / "regen").glob("sglang-*/bin/python"))), "missing"))
VLLM_PYTHON = Path(os.environ.get("REGEN_VLLM_PYTHON", "missing"))
TRAINED_MODEL = Path(os.environ.get("REGEN_TRAINED_MODEL", "missing"))
# `datasets` 4.0.0 and 5.x (`make datasets`): what SpecForge's trainer may load the export with.
DATASETS_PYTHONS = {"4.0.0": Path(os.environ.get("REGEN_DATASETS4_PYTHON", "missing")),
                    "5.2.0": Path(os.environ.get("REGEN_DATASETS5_PYTHON", "missing"))}
