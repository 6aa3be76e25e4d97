"""What was started, recorded: ``servers.json`` (without the keys) and the keys beside it.

Every later task and every re-run reads the node's servers from here: the node a server runs
on, the run that owns it, its process (PID and start time), its launch arguments (with the key
replaced by a placeholder) and the model it serves. The keys are kept outside the output
directory (an output is shared, copied and archived), in an owner-only folder of the node's user.

The output is data, never commands: anyone who can write the dataset's share could edit
``servers.json``, so each record of this node is sealed by its digest in that private folder,
and a record whose seal does not match (planted, or edited since) is ignored: never relaunched,
signalled or opened. The watchdog's own state lives there too, never in the output.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import stat
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Sequence

from regen import procs
from regen.errors import RegenError
from regen.files import atomic_write_json
from regen.layout import RunLayout
from regen.machine import node_name

log = logging.getLogger("regen.servers")

@dataclass
class ServerRecord:
    index: int
    gpu: str | int | None  # as CUDA_VISIBLE_DEVICES names it (older records: an index)
    host: str
    port: int
    pid: int
    log_path: str
    api_key: str | None
    start_ticks: int | None = None
    node: str = ""
    owner: str = ""
    launch: list[str] | None = None  # the launch argv (it never holds the key: the environment does)
    model_path: str = ""
    model_fingerprint: str | None = None
    served_model: str | None = None  # the name /v1/models gave once the server was healthy
    env: dict[str, str] | None = None  # the engine's launch environment (a relaunch reuses it)
    engine: str = ""  # the engine adapter that launched it (a relaunch hands it its key the same way)

    @property
    def url(self) -> str:
        host = "127.0.0.1" if self.host in ("0.0.0.0", "::") else self.host
        return f"http://{host}:{self.port}"

    def is_here(self) -> bool:
        """Recorded on this machine: a PID means nothing elsewhere (``/proc`` is local), so a
        record of another node is never signalled, relaunched or overwritten from here."""
        return not self.node or self.node == node_name()

    def running(self) -> bool:
        """This machine's record of a live process; another node's is never judged from here."""
        if not self.is_here():
            raise ValueError(f"server {self.index} runs on node {self.node}: its process cannot be "
                             f"checked from {node_name()}")
        return procs.is_running(self.pid, self.start_ticks)

    def public(self) -> dict:
        """Without the API key: what a result document and a log may carry."""
        return {"index": self.index, "url": self.url, "pid": self.pid, "gpu": self.gpu,
                "node": self.node, "owner": self.owner, "log": self.log_path,
                "model": self.served_model, "model_fingerprint": self.model_fingerprint}


def _seal(item: dict) -> str:
    return hashlib.sha256(json.dumps(item, sort_keys=True, default=str).encode()).hexdigest()


def read_state(layout: RunLayout) -> list[ServerRecord]:
    """The recorded servers; none once the last stop removed the record (even while we read).
    A record of this node whose seal does not match is left out, with a warning."""
    try:
        servers = json.loads(layout.servers_state.read_text())["servers"]
    except FileNotFoundError:
        return []
    known = {f.name for f in fields(ServerRecord)}
    try:
        private = json.loads(key_file(layout).read_text())
    except FileNotFoundError:
        private = {}
    keys, seals = private.get("keys", {}), private.get("seals", {})
    records = []
    for item in servers:
        record = ServerRecord(**{k: v for k, v in item.items() if k in known} | {"api_key": keys.get(str(item["index"]))})
        if record.is_here() and seals.get(str(record.index)) != _seal(item):
            log.warning("server record %s in %s was not written by regen on this node (or was changed since): "
                        "ignored, nothing of it is run, signalled or opened", item.get("index"), layout.servers_state)
            continue
        records.append(record)
    return records


def key_file(layout: RunLayout) -> Path:
    """Where the servers' API keys of an output directory are kept: outside it (an output is
    shared, copied and archived), in the node user's private folder (regen.procs.private_dir)."""
    root = procs.private_dir()
    name = str(layout.root.resolve()) + (f"#{layout.node}" if layout.node else "")
    return root / (hashlib.sha256(name.encode()).hexdigest()[:24] + ".json")


def write_state(layout: RunLayout, records: Sequence[ServerRecord]) -> None:
    """servers.json without the keys; the keys in :func:`key_file`."""
    path, keys = layout.servers_state, key_file(layout)
    if not records:
        path.unlink(missing_ok=True)
        keys.unlink(missing_ok=True)
        return
    items = [{**asdict(r), "api_key": None} for r in records]
    atomic_write_json(keys, {"keys": {str(r.index): r.api_key for r in records},
                             "seals": {str(r.index): _seal(item) for r, item in zip(records, items)}}, private=True)
    atomic_write_json(path, {"servers": items}, private=True)


def watchdog_file(layout: RunLayout) -> Path:
    """The watchdog's process (PID, start time, idle shutdown), in the private folder beside the
    keys: a PID read from the output could name any process of this user's to signal."""
    keys = key_file(layout)
    return keys.with_name(keys.stem + ".watchdog.json")
