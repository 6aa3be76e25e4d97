"""Which GPUs a node's servers run on: the ones this worker was given.

A scheduler (Slurm, Kubernetes, a Celery worker started with a mask) hands a worker its GPUs in
``CUDA_VISIBLE_DEVICES``, as indices or UUIDs (``GPU-...``, ``MIG-...``); ``nvidia-smi`` lists
every GPU of the machine whatever the mask, so it is asked only when there is no mask. Each
server gets one entry of that list, written back into its own ``CUDA_VISIBLE_DEVICES`` as the
mask spelled it, so a server never lands on a GPU the worker was not given.
"""

from __future__ import annotations

import os
import shutil
import subprocess

from regen.config import RunConfig

NO_DEVICE = ("", "-1", "NoDevFiles", "none")


def detect_gpus() -> list[str]:
    """The GPUs this process may use, as ``CUDA_VISIBLE_DEVICES`` names them: the mask's entries
    in order when one is set, else nvidia-smi's indices; empty where there is none."""
    mask = os.environ.get("CUDA_VISIBLE_DEVICES")
    if mask is not None:
        entries = [e.strip() for e in mask.split(",")]
        return [] if mask.strip() in NO_DEVICE else [e for e in entries if e]
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return []
    try:
        out = subprocess.run([smi, "--query-gpu=index", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=30, check=True).stdout
    except (subprocess.SubprocessError, OSError):
        return []
    return [line.strip() for line in out.split() if line.strip().isdigit()]


def server_slots(cfg: RunConfig) -> list[str | None]:
    """One entry per server: its GPU as CUDA_VISIBLE_DEVICES names it, or None for a CPU server.
    ``gpus`` selects among the GPUs this worker was given, by position (without a mask the
    position is nvidia-smi's index)."""
    if cfg.engine == "sim" and not cfg.servers.gpus:
        return [None] * cfg.servers.num_servers
    visible = detect_gpus()
    if cfg.servers.gpus:
        if not visible:  # no GPU to check against (a CPU machine, the simulator): as configured
            return [str(g) for g in cfg.servers.gpus]
        missing = [g for g in cfg.servers.gpus if g >= len(visible)]
        if missing:
            raise ValueError(f"gpus {list(cfg.servers.gpus)}: this worker was given {len(visible)} GPU(s) "
                             f"({','.join(visible)}); no GPU at position(s) {missing}")
        return [visible[g] for g in cfg.servers.gpus]
    return list(visible) if visible else [None] * cfg.servers.num_servers
