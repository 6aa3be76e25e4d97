"""One run over several GPU nodes: where each shard generates, and what each node did.

Every node stages, serves and tears down on its own (the DAG maps those tasks over ``nodes``).
A shard claims a node when it starts: one of ``max_shards`` slot files of that node, held with
``flock`` for as long as the shard runs, so the kernel hands the slot back however the shard ends.
It takes the node with the most free slots among those whose servers answer, so a node that
finishes its shards sooner takes more of them: with many more shards than nodes, the work splits
by each node's real speed without anyone measuring it. A node that is lost stops answering; its
shards fail, Airflow retries them, and each retry claims a node that answers and resumes from the
shard's journal: the output directory is shared by every node (an NFS or Lustre mount on a GPU
cluster), so journals, shard files and claims are wherever the shard lands.
"""

from __future__ import annotations

import contextlib
import logging
import time
from typing import Any, Iterator

from regen.config import RunConfig
from regen.errors import RegenError

log = logging.getLogger("regen.nodes")

CLAIM_POLL_S = 1.0
# A shard whose node stops answering gives up after this long, so that its retry can claim
# another node (with one node it waits longer: there is nowhere else to go).
NODE_LOST_AFTER_S = 15.0


class NoNodeAnswers(RegenError):
    """No node of the run has a server that answers: nothing to generate on."""


def node_answers(node_cfg: RunConfig) -> bool:
    """At least one of the node's recorded servers answers /health."""
    from regen.servers import is_healthy, read_state

    return any(is_healthy(r.url, timeout=3.0) for r in read_state(node_cfg.layout) if r.url)


@contextlib.contextmanager
def claim_node(cfg: RunConfig, shard: int, give_up_after_s: float = 600.0) -> Iterator[RunConfig]:
    """The config of the node this shard generates on, held until the block ends. Waits while
    every answering node is full; NoNodeAnswers when none answers for ``give_up_after_s``."""
    from regen.budget import SlotBudget

    specs = {spec.name: spec for spec in cfg.nodes}
    claims = {name: SlotBudget(cfg.layout.node_claims(name), spec.max_shards) for name, spec in specs.items()}
    silent_since = time.monotonic()
    while True:
        answering = [name for name in specs if node_answers(cfg.for_node(name))]
        if answering:
            silent_since = time.monotonic()
        elif time.monotonic() - silent_since > give_up_after_s:
            raise NoNodeAnswers(f"no node of this run answers ({', '.join(specs)}) for "
                                f"{give_up_after_s:.0f} s: restart their servers (clear start_servers_NODE) "
                                f"and retry the shard; finished rows are kept")
        by_room = sorted(answering, key=lambda n: -claims[n].free() / claims[n].size)
        for name in by_room:
            if not claims[name].take(1):
                continue
            log.info("shard %d generates on node %s (%d of its %d shard slots taken)", shard, name,
                     claims[name].size - claims[name].free(), claims[name].size)
            try:
                yield cfg.for_node(name)
            finally:
                claims[name].close()
            return
        time.sleep(CLAIM_POLL_S)


def generate_shard(cfg: RunConfig, shard: int, run_id: str, strict_index: bool = True) -> dict:
    """A shard: on the run's one node, or on the node it claims when the run has several;
    there, or on the node over SSH (:func:`regen.pipeline.run`)."""
    from regen.generate import generate
    from regen.pipeline import run

    if not cfg.nodes:
        return run(generate, cfg, shard=shard, strict_index=strict_index, run_id=run_id)
    with claim_node(cfg, shard) as node_cfg:
        result = run(generate, node_cfg, shard=shard, strict_index=strict_index, run_id=run_id,
                     give_up_after_s=NODE_LOST_AFTER_S)
    return {**result, "node": node_cfg.node}


def node_view(cfg: RunConfig, progress: dict) -> list[dict[str, Any]]:
    """Per node: its servers, the shards it generated or generates, its throughput now."""
    from regen.servers import read_state

    shards = progress.get("shards") or {}
    view = []
    for spec in cfg.node_specs():
        node_cfg = cfg.for_node(spec.name)
        mine = {name: s for name, s in shards.items() if s.get("node", "local") == spec.name}
        running = [s for s in mine.values() if s.get("state") == "running"]
        view.append({
            "node": spec.name,
            "reached_by": (f"ssh {node_cfg.ssh_conn_id}" if node_cfg.ssh_conn_id else
                           f"queue {spec.queue}" if spec.queue else "this machine"),
            "servers": [{"url": r.url, "gpu": r.gpu, "pid": r.pid} for r in read_state(node_cfg.layout)],
            "shards_done": sum(s.get("state") == "done" for s in mine.values()),
            "shards_running": len(running),
            "rows": sum(s.get("done", 0) for s in mine.values()),
            "tokens_per_s": round(sum(s.get("tokens_per_s", 0) for s in running), 1),
            "max_shards": spec.max_shards,
        })
    return view


def node_balance(shards: dict[str, dict]) -> dict[str, Any]:
    """How well the work split over the nodes, from the shards' progress: per node, the tokens
    it generated over the time it was busy (the union of its shards' spans) is its real capacity;
    the ideal makespan is all tokens over all nodes' capacity, both finishing together."""
    spans: dict[str, list[tuple[float, float]]] = {}
    tokens: dict[str, int] = {}
    for s in shards.values():
        if s.get("started_at") is None or s.get("updated") is None:
            continue
        spans.setdefault(s.get("node", "local"), []).append((s["started_at"], s["updated"]))
        tokens[s.get("node", "local")] = tokens.get(s.get("node", "local"), 0) + s.get("tokens", 0)
    nodes = {}
    for node, intervals in spans.items():
        busy, end = 0.0, float("-inf")
        for start, stop in sorted(intervals):
            start = max(start, end)
            busy += max(0.0, stop - start)
            end = max(end, stop)
        nodes[node] = {"tokens": tokens[node], "busy_s": round(busy, 2),
                       "tokens_per_s": round(tokens[node] / busy, 1) if busy else 0.0}
    if not nodes:
        return {"nodes": {}, "makespan_s": None, "ideal_s": None}
    first = min(a for intervals in spans.values() for a, _ in intervals)
    last = max(b for intervals in spans.values() for _, b in intervals)
    capacity = sum(n["tokens_per_s"] for n in nodes.values())
    ideal = sum(tokens.values()) / capacity if capacity else None
    return {"nodes": nodes, "makespan_s": round(last - first, 2),
            "ideal_s": round(ideal, 2) if ideal else None}
