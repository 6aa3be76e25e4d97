"""Which GPUs a node's servers run on."""

from __future__ import annotations

import shutil
import subprocess

from regen.config import RunConfig


def detect_gpus() -> list[int]:
    """GPU indices from nvidia-smi; empty where there is none."""
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return []
    try:
        out = subprocess.run([smi, "--query-gpu=index", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=30, check=True).stdout
    except (subprocess.SubprocessError, OSError):
        return []
    return [int(line) for line in out.split() if line.strip().isdigit()]


def server_slots(cfg: RunConfig) -> list[int | None]:
    """One entry per server: its GPU index, or None for a CPU server."""
    if cfg.servers.gpus:
        return list(cfg.servers.gpus)
    if cfg.engine != "sim":
        gpus = detect_gpus()
        if gpus:
            return gpus
    return [None] * cfg.servers.num_servers
