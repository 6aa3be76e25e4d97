"""Which GPUs a node's servers run on: the ones this worker was given.

A scheduler (Slurm, Kubernetes, a Celery worker started with a mask) hands a worker its GPUs in
``CUDA_VISIBLE_DEVICES``, as indices or UUIDs (``GPU-...``, ``MIG-...``); ``nvidia-smi`` lists
every GPU of the machine whatever the mask, so it is asked only when there is no mask. Each
server gets ``tp_size x dp_size`` consecutive entries of that list, written back into its own
``CUDA_VISIBLE_DEVICES`` as the mask spelled them, so a server never lands on a GPU the worker was
not given.
"""

from __future__ import annotations

import os
import shutil
import subprocess

from regen.config import RunConfig
from regen.errors import RegenError

NO_DEVICE = ("", "-1", "NoDevFiles", "none")


class GpuLayoutError(RegenError, ValueError):
    """Servers this worker's GPUs cannot hold; the message names the layout and the GPUs."""


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


def gpu_visibility() -> str:
    """What this process was told about GPUs, for the message that says none is visible: the
    mask, and nvidia-smi's own words."""
    mask = os.environ.get("CUDA_VISIBLE_DEVICES")
    said = f"CUDA_VISIBLE_DEVICES {'unset' if mask is None else repr(mask)}"
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return said + "; nvidia-smi not found"
    try:
        out = subprocess.run([smi, "-L"], capture_output=True, text=True, timeout=30)
    except (subprocess.SubprocessError, OSError) as exc:
        return said + f"; nvidia-smi failed: {exc}"
    words = (out.stdout.strip() or out.stderr.strip() or f"exit {out.returncode}").splitlines()
    return said + f"; nvidia-smi -L: {words[0][:200] if words else 'nothing'}"


def detect_gpu_memory_mib() -> int | None:
    """The smallest total memory among this machine's GPUs (MiB, as nvidia-smi reports it); None
    without one. The smallest: one plan must fit every server of the node."""
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return None
    try:
        out = subprocess.run([smi, "--query-gpu=memory.total", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=30, check=True).stdout
    except (subprocess.SubprocessError, OSError):
        return None
    sizes = [int(line.strip()) for line in out.splitlines() if line.strip().isdigit() and int(line.strip()) > 0]
    return min(sizes) if sizes else None


def gpus_per_server(cfg: RunConfig) -> int:
    """tp_size x dp_size: the GPUs one server is launched on."""
    return cfg.engine_options.tp_size * cfg.engine_options.dp_size


def server_devices(cfg: RunConfig) -> list[str | None]:
    """One entry per server: its ``CUDA_VISIBLE_DEVICES`` (its tp_size x dp_size GPUs, comma-joined,
    server i the i-th group), or None for a CPU server. ``gpus`` selects among the GPUs this worker
    was given, by position (without a mask the position is nvidia-smi's index)."""
    if cfg.engine == "sim" and not cfg.servers.gpus:
        return [None] * cfg.servers.num_servers
    visible = detect_gpus()
    chosen = list(visible)
    if cfg.servers.gpus:
        if not visible:  # no GPU to check against (a CPU machine, the simulator): as configured
            chosen = [str(g) for g in cfg.servers.gpus]
        else:
            missing = [g for g in cfg.servers.gpus if g >= len(visible)]
            if missing:
                raise GpuLayoutError(f"gpus {list(cfg.servers.gpus)}: this worker was given {len(visible)} GPU(s) "
                                 f"({','.join(visible)}); no GPU at position(s) {missing}")
            chosen = [visible[g] for g in cfg.servers.gpus]
    if not chosen:
        return [None] * cfg.servers.num_servers
    per = gpus_per_server(cfg)
    if len(chosen) % per:
        layout = f"tp_size {cfg.engine_options.tp_size} x dp_size {cfg.engine_options.dp_size}"
        raise GpuLayoutError(
            f"{layout} = {per} GPUs per server: the {len(chosen)} GPU(s) {','.join(chosen)} "
            + ("cannot hold one server" if len(chosen) < per else f"leave {len(chosen) % per} unused")
            + f"; list a multiple of {per} in gpus, or change tp_size/dp_size")
    return [",".join(chosen[i:i + per]) for i in range(0, len(chosen), per)]


def fleet_size(cfg: RunConfig) -> int:
    """How many servers the run starts, every node's: this node's plan for a one-node run; for a
    listed node (its GPUs are its own machine's), its ``gpus`` or ``num_servers`` by server size."""
    if not cfg.nodes:
        try:
            return len(server_devices(cfg))
        except GpuLayoutError:  # preflight names it
            return 1
    total = 0
    for spec in cfg.node_specs():
        node = cfg.for_node(spec)
        total += max(1, node.servers.count_hint() // (gpus_per_server(node) if node.servers.gpus else 1))
    return total
