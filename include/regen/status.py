"""What a run looks like now, read from its output directory: progress, the throughput history,
the audit's summary, and each node's part (what the run page and `regen progress` show)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from regen.config import RunConfig
from regen.files import json_lines, read_in_folder
from regen.layout import RunLayout
from regen.results import RunStatus
from regen.servers.records import read_state

HISTORY_POINTS = 2000
# What one poll of the run page reads at most, per file: a progress document of thousands of
# shards fits; a planted link to a device or a huge file costs no more than this.
DOCUMENT_MAX_BYTES = 16 * 2**20
HISTORY_MAX_BYTES = 2 * 2**20  # the history's last lines: HISTORY_POINTS of them fit


def _document(layout: RunLayout, path: Path) -> Any:
    """A JSON document of the output, read without following links and within bounds; None
    when it is missing, refused or not (yet) whole."""
    try:
        return json.loads(read_in_folder(layout.root, path, DOCUMENT_MAX_BYTES))
    except (OSError, ValueError):
        return None


def run_data(layout: RunLayout) -> dict:
    """What the run page shows: progress, the throughput history and the audit's summary."""
    try:
        history = read_in_folder(layout.root, layout.history, HISTORY_MAX_BYTES, tail=True)
        cut = len(history) == HISTORY_MAX_BYTES
    except OSError:
        history, cut = b"", False
    return {"output": str(layout.root), "progress": _document(layout, layout.progress_file) or {},
            "history": json_lines(history, last=HISTORY_POINTS, cut_first=cut),
            "audit": _document(layout, layout.audit.summary_json)}


def node_view(cfg: RunConfig, progress: dict) -> list[dict[str, Any]]:
    """Per node: its servers, the shards it generated or generates, its throughput now."""
    shards = progress.get("shards") or {}
    view = []
    for spec in cfg.node_specs():
        node_cfg = cfg.for_node(spec)
        mine = {name: s for name, s in shards.items() if s.get("node") == spec.name}
        running = [s for s in mine.values() if s.get("state") == "running"]
        view.append({
            "node": spec.name,
            "reached_by": spec.reached_by(node_cfg.ssh_conn_id),
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
        node = s.get("node", "")
        spans.setdefault(node, []).append((s["started_at"], s["updated"]))
        tokens[node] = tokens.get(node, 0) + s.get("tokens", 0)
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


def status(cfg: RunConfig) -> RunStatus:
    """The status stage: run_data of the run's output, read where the output lives."""
    data = run_data(cfg.layout)
    progress = data["progress"]
    return RunStatus(**data, nodes=node_view(cfg, progress),
                     summary=f"{progress.get('done', 0):,} of {progress.get('total', 0):,} done, "
                             f"{progress.get('failed', 0):,} failed")
