"""What a run looks like now, read from its output directory: progress, the throughput history,
the audit's summary, and each node's part (what the run page and `regen progress` show)."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from regen.config import RunConfig
from regen.files import json_lines, read_in_folder
from regen.layout import RunLayout
from regen.progress import HISTORY_POINTS
from regen.results import RunStatus
from regen.servers.records import read_state
from regen.units import format_duration

# What one poll of the run page reads at most, per file: a progress document of thousands of
# shards fits; a planted link to a device or a huge file costs no more than this.
DOCUMENT_MAX_BYTES = 16 * 2**20
HISTORY_MAX_BYTES = 2 * 2**20  # the history's last lines: far more than HISTORY_POINTS of them fit


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
            "servers": [{"url": r.url, "gpu": r.gpu, "pid": r.pid} for r in read_state(node_cfg.layout, node_cfg.servers.api_key)],
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


# What to do about a failed shard, by what its error says; the first rule that matches.
NEXT_STEPS = (
    ("maximum context length", "prompt plus max_tokens exceed the model's context: lower max_tokens (a new run: a "
     "run's Params are fixed) or raise the servers' --context-length in extra_server_args"),
    ("passed its deadline", "no row came in to move the shard's deadline past where it was (4x what its rest took at "
     "its pace): a hung node or server? check the node and `regen logs`, then clear it"),
    ("lost its claim", "another attempt of this shard holds it now: nothing to do unless that one fails"),
    ("HTTP 4", "the servers refuse these requests: fix what the error names (a new run if it is a field)"),
    ("HTTP 5", "the servers failed on these requests: read their logs (`regen logs`, or the serve task's log)"),
    ("no server answers", "the servers are gone: clear the run from start_servers (untick 'only failed')"),
    ("cannot write", "the output's disk or store refused a write: free space or fix its permissions"),
)
SHARDS_NAMED = 5  # per kind of failure, on the page and in `regen summary`
# A running shard writes its progress every few seconds (regen.dispatch's progress_interval_s):
# one silent this long has no attempt behind it.
SHARD_SILENT_S = 120.0
RUN_ENDED = ("success", "failed")
RESUME = "then clear the failed shards (the run's Clear, 'only failed'): each resumes from what it finished"


def next_step(*texts: str | None) -> str:
    """What a person does about a failed shard, from its failure and its last failed prompt."""
    joined = " ".join(t for t in texts if t)
    for needle, step in NEXT_STEPS:
        if needle in joined:
            return f"{step}; {RESUME}" if needle != "lost its claim" else step
    return RESUME[0].upper() + RESUME[1:].removeprefix("hen ")


def with_stopped_shards(progress: dict, run_state: str | None = None, now: float | None = None,
                        silent_after_s: float | None = SHARD_SILENT_S) -> dict:
    """``progress`` with each shard that says "running" but has no attempt behind it shown as
    stopped: its run ended in Airflow (a run marked failed by hand ends its attempts before they
    can say so), or it wrote nothing for ``silent_after_s`` (an attempt killed, a node gone;
    None: not judged here, as on another machine than the output's, whose clock may differ)."""
    now = time.time() if now is None else now
    shards = {}
    for name, shard in (progress.get("shards") or {}).items():
        if shard.get("state") == "running":
            silent = now - shard.get("updated", now)
            if run_state in RUN_ENDED:
                shard = {**shard, "state": "stopped", "stopped_why": f"the run is {run_state} in Airflow",
                         "run_ended": True}
            elif silent_after_s is not None and silent > silent_after_s:
                shard = {**shard, "state": "stopped",
                         "stopped_why": f"no word from its attempt for {format_duration(silent)}"}
        shards[name] = shard
    if not any(s.get("state") == "stopped" for s in shards.values()):
        return progress
    running = [s for s in shards.values() if s.get("state") == "running"]  # the rate is theirs alone
    return {**progress, "shards": shards, "tokens_per_s": round(sum(s.get("tokens_per_s", 0.0) for s in running), 1),
            "eta_s": progress.get("eta_s") if running else None}


def _rows_kept(shard: dict) -> str:
    return (f"shard {shard.get('shard')}/{shard.get('num_shards')}" + (f" on {shard['node']}" if shard.get("node") else "")
            + f": {shard.get('done', 0):,} of {shard.get('total', 0):,} rows kept")


def attention(progress: dict, audit: dict | None) -> list[dict[str, Any]]:
    """What went wrong and what to do, most urgent first: shards stopped unfinished (see
    with_stopped_shards), a failed canary and its problems, each failed shard's reason, last
    error and next step, a failed audit and why. Empty: nothing to do. Each item's ``kind`` is
    "stopped" or "problem"."""
    items = []
    for key in sorted(k for k in progress if k.startswith("setup_failed")):  # regen.pipeline.SETUP_FAILED
        setup = progress[key]
        items.append({"kind": "problem", "what": f"{setup['stage']} failed: {setup['reason']}",
                      "details": setup.get("details") or [], "next": setup["next"]})
    by_shard = sorted((progress.get("shards") or {}).values(), key=lambda s: s.get("shard", 0))
    stopped = [s for s in by_shard if s.get("state") == "stopped"]
    if stopped:
        names = ", ".join(f"{s.get('shard')}/{s.get('num_shards')}" for s in stopped[:SHARDS_NAMED])
        more = f" and {len(stopped) - SHARDS_NAMED} more" if len(stopped) > SHARDS_NAMED else ""
        items.append({"kind": "stopped",
                      "what": f"{len(stopped)} shard{'s' if len(stopped) > 1 else ''} stopped unfinished ({names}{more}): "
                              f"{stopped[0]['stopped_why']}",
                      "details": [_rows_kept(s) for s in stopped[:SHARDS_NAMED]],
                      "next": "clear the whole run ('only failed' unticked: a run marked failed skipped its audit); "
                              "each shard resumes from what it finished" if stopped[0].get("run_ended") else
                              "its task's retry resumes it, if it has one left; else, once the task has failed, "
                              "clear it: it resumes from what it finished"})
    canary = progress.get("canary") or {}
    if canary.get("passed") is False:
        items.append({"kind": "problem", "what": f"canary failed: {len(canary.get('problems') or [])} problem(s); no shard started",
                      "details": [p[:600] for p in canary.get("problems") or []],
                      "next": "fix what each problem names (a field: trigger a new run with it changed), then run again"})
    failed: dict[str, list[dict]] = {}  # by next step: 64 shards failing alike are one item
    for s in by_shard:
        if s.get("state") == "failed":
            failed.setdefault(next_step(s.get("reason"), s.get("last_error")), []).append(s)
    for step, shards in failed.items():
        names = ", ".join(f"{s.get('shard')}/{s.get('num_shards')}" for s in shards[:SHARDS_NAMED])
        more = f" and {len(shards) - SHARDS_NAMED} more" if len(shards) > SHARDS_NAMED else ""
        details = [shards[0]["reason"]] if shards[0].get("reason") else []
        details += [_rows_kept(s) + (f"; last failed prompt: {s['last_error']}" if s.get("last_error") else "")
                    for s in shards[:SHARDS_NAMED]]
        items.append({"kind": "problem", "what": f"{len(shards)} shard{'s' if len(shards) > 1 else ''} failed ({names}{more})",
                      "details": details, "next": step})
    quality = progress.get("quality") or {}
    drained = quality.get("drained") or {}
    if drained:
        items.append({"kind": "problem",
                      "what": f"{len(drained)} server{'s' if len(drained) > 1 else ''} drained by the quality guard "
                              f"(no new request; the run goes on without {'them' if len(drained) > 1 else 'it'})",
                      "details": [f"{url}: {d.get('why')}" for url, d in sorted(drained.items())],
                      "next": "read the server's log (its launch arguments, its template, its engine); restart it "
                              "fixed (clear start_servers) to bring it back"})
    if quality.get("stopped"):
        items.append({"kind": "problem", "what": "the quality guard stopped the run: nothing more is sent",
                      "details": [quality["stopped"].get("why", "")],
                      "next": "fix the servers or the sampling, clear start_servers, then clear the failed shards"})
    if audit and audit.get("verdict") == "FAIL":
        items.append({"kind": "problem", "what": "audit FAIL: the data is not fit to train on",
                      "details": audit.get("reasons") or audit.get("summary", [])[:1],
                      "next": "read the report (histograms, worst samples); fix the cause, then regenerate"})
    return items


def status(cfg: RunConfig) -> RunStatus:
    """The status stage: run_data of the run's output, read where the output lives."""
    data = run_data(cfg.layout)
    progress = data["progress"] = with_stopped_shards(data["progress"])
    return RunStatus(**data, nodes=node_view(cfg, progress), attention=attention(progress, data["audit"]),
                     summary=f"{progress.get('done', 0):,} of {progress.get('total', 0):,} done, "
                             f"{progress.get('failed', 0):,} failed")
