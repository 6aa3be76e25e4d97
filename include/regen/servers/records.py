"""What was started, recorded: ``servers.json`` (without the keys) and the keys beside it.

Every later task and every re-run reads the node's servers from here: the node a server runs
on, the run that owns it, its process (PID and start time), its launch arguments (with the key
replaced by a placeholder) and the model it serves. The keys are kept outside the output
directory (an output is shared, copied and archived), in an owner-only folder of the node's user.

The output is data, never commands: anyone who can write the dataset's share could edit
``servers.json``. So this node's records are read from their copy in that private folder, never
from the output (a deleted or edited ``servers.json`` orphans nothing: the watchdog, the teardown
and ``serve --stop`` still see every server), and a record of another node counts only with its
MAC, keyed by the servers' API key, which no writer of the share holds: a forged record is never
opened, and the key is never sent to where it points. The watchdog's own state lives in the
private folder too.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Sequence

from regen import procs
from regen.errors import RegenError
from regen.files import atomic_write_json, read_json
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


def _mac(item: dict, api_key: str) -> str:
    """The record's MAC under the servers' key: only a holder of the key can write a record
    another node will send that key to."""
    body = json.dumps({k: v for k, v in item.items() if k != "mac"}, sort_keys=True, default=str).encode()
    return hmac.new(hashlib.sha256(b"regen server record\0" + api_key.encode()).digest(), body, "sha256").hexdigest()


# The size past which a servers.json is not a record regen wrote (64 servers hold a few KB).
MAX_STATE_BYTES = 1 << 20


def read_state(layout: RunLayout, api_key: str | None = None) -> list[ServerRecord]:
    """The recorded servers; none once the last stop removed them. This node's from the private
    copy; another node's from the output's ``servers.json``, each only with a valid MAC under the
    key it would be sent (``api_key``, the run's configured one; else the one this node's private
    folder holds for it, when the nodes share that folder), else left out with a warning."""
    known = {f.name for f in fields(ServerRecord)}
    private = read_json(key_file(layout), max_bytes=MAX_STATE_BYTES)
    private = private if isinstance(private, dict) else {}
    keys = private.get("keys", {})
    records = [ServerRecord(**{k: v for k, v in item.items() if k in known} | {"api_key": keys.get(str(item["index"]))})
               for item in private.get("records", [])]
    records = [r for r in records if r.is_here()]
    shared = read_json(layout.servers_state, max_bytes=MAX_STATE_BYTES)
    for item in shared.get("servers", []) if isinstance(shared, dict) else []:
        if not isinstance(item, dict) or not item.get("node") or item.get("node") == node_name():
            continue
        key = api_key or keys.get(str(item.get("index")))
        if not key or not hmac.compare_digest(str(item.get("mac", "")), _mac(item, key)):
            log.warning("server record %s of node %s in %s has no valid MAC under the run's key (planted, or "
                        "changed since): ignored, nothing is sent to it", item.get("index"), item.get("node"),
                        layout.servers_state)
            continue
        records.append(ServerRecord(**{k: v for k, v in item.items() if k in known} | {"api_key": key}))
    return records


def key_file(layout: RunLayout) -> Path:
    """Where the servers' API keys of an output directory are kept: outside it (an output is
    shared, copied and archived), in the node user's private folder (regen.procs.private_dir)."""
    root = procs.private_dir()
    name = str(layout.root.resolve()) + (f"#{layout.node}" if layout.node else "")
    return root / (hashlib.sha256(name.encode()).hexdigest()[:24] + ".json")


def write_state(layout: RunLayout, records: Sequence[ServerRecord]) -> None:
    """The records and their keys in :func:`key_file` (what this node acts on); servers.json,
    without the keys and each with its MAC, for the other nodes and for people."""
    path, keys = layout.servers_state, key_file(layout)
    if not records:
        path.unlink(missing_ok=True)
        keys.unlink(missing_ok=True)
        return
    items = [{**asdict(r), "api_key": None} for r in records]
    atomic_write_json(keys, {"keys": {str(r.index): r.api_key for r in records}, "records": items}, private=True)
    atomic_write_json(path, {"servers": [{**item, "mac": _mac(item, r.api_key)} if r.api_key else item
                                         for r, item in zip(records, items)]}, private=True)


def watchdog_file(layout: RunLayout) -> Path:
    """The watchdog's process (PID, start time, idle shutdown), in the private folder beside the
    keys: a PID read from the output could name any process of this user's to signal."""
    keys = key_file(layout)
    return keys.with_name(keys.stem + ".watchdog.json")
