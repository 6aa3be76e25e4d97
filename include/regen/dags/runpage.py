"""The run page: progress per shard and per server, tokens per second over time, ETA, the
canary's estimate and the audit's verdict, for one run of a regen DAG.

Served by the Airflow plugin (plugins/regen_plugin.py) inside Airflow's API server and shown as
an external view on each dag run. Airflow does not guard plugin routes, so every route here
depends on Airflow's own ``requires_access_dag`` (read access to the DAG's runs): the caller's
token (the UI's cookie, or a Bearer header) is checked by the deployment's auth manager.
"""

# No `from __future__ import annotations` here: FastAPI must see the real dependency types of
# the routes, which are defined inside create_app.
import html
import json
import secrets

from regen.config import ConfigError, RunConfig
from regen.dags.definitions import NotRegenDag, triggered_config
from regen.pipeline import SETUP_FAILED, run
from regen.status import attention, with_stopped_shards

PAGE_CSP = ("default-src 'none'; script-src 'nonce-{nonce}'; style-src 'unsafe-inline'; connect-src 'self'; "
            "frame-src 'self'; img-src 'self' data:; base-uri 'none'; form-action 'none'; frame-ancestors 'self'")
# `sandbox`: the report is a document of the run's own output (model text in it): whatever it
# holds runs nowhere, with no origin of Airflow's.
REPORT_CSP = ("default-src 'none'; img-src data:; style-src 'unsafe-inline'; base-uri 'none'; "
              "form-action 'none'; frame-ancestors 'self'; sandbox")


# The page polls /data every 5 s. For a run on an SSH node that is a command on the node: it gets
# this long (then the page says so), in a small pool of its own, so that a hung node holds at most
# these threads of the API server and none of its database sessions.
STATUS_DEADLINE_S = 10.0
_status_pool = None


def config_data(cfg: RunConfig, deadline_s: float = STATUS_DEADLINE_S) -> dict:
    """The status stage's document, read where the run's output lives (over SSH for a run on
    an SSH node, within ``deadline_s``: TimeoutError naming the node after that)."""
    global _status_pool
    if not cfg.ssh_conn_id:
        return run("status", cfg).model_dump(mode="json")
    import concurrent.futures

    if _status_pool is None:
        _status_pool = concurrent.futures.ThreadPoolExecutor(max_workers=4, thread_name_prefix="regen-status")
    future = _status_pool.submit(run, "status", cfg)
    try:
        data = future.result(timeout=deadline_s).model_dump(mode="json")
    except concurrent.futures.TimeoutError:
        future.cancel()
        raise TimeoutError(f"node {cfg.ssh_conn_id} did not answer within {deadline_s:.0f} s") from None
    data["output"] = f"{cfg.ssh_conn_id}:{data['output']}"
    return data


REPORT_MAX_BYTES = 64 * 2**20


def read_report(cfg: RunConfig) -> str:
    """The run's report.html, read through no symlink and within bounds (regen.files)."""
    from regen.files import read_in_folder

    return read_in_folder(cfg.layout.root, cfg.layout.audit.report_html, REPORT_MAX_BYTES).decode("utf-8", "replace")


def create_app():
    from fastapi import Depends, FastAPI, HTTPException
    from fastapi.responses import HTMLResponse
    from sqlalchemy import select

    from airflow.api_fastapi.core_api.security import requires_access_dag
    from airflow.api_fastapi.auth.managers.models.resource_details import DagAccessEntity
    from airflow.models.dagrun import DagRun
    from airflow.models.xcom import XComModel
    from airflow.utils.session import create_session

    # No /docs, /redoc or /openapi.json: Airflow does not guard a plugin's routes, and those
    # would answer anyone.
    app = FastAPI(title="regen run page", docs_url=None, redoc_url=None, openapi_url=None)
    guard = [Depends(requires_access_dag(method="GET", access_entity=DagAccessEntity.RUN))]

    @app.middleware("http")
    async def content_security_policy(request, call_next):
        """Every response says what may run in it: the page's own script (by nonce), nothing
        else; the report and the data run nothing at all."""
        response = await call_next(request)
        response.headers.setdefault("Content-Security-Policy", REPORT_CSP)
        response.headers["X-Content-Type-Options"] = "nosniff"
        return response

    def preflight_failure(dag_id: str, run_id: str) -> dict | None:
        """What the run's failed preflight pushed (its reason and next step), or None."""
        with create_session() as session:
            value = session.scalar(select(XComModel.value).where(
                XComModel.dag_id == dag_id, XComModel.run_id == run_id, XComModel.task_id == "preflight",
                XComModel.key == SETUP_FAILED))
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except ValueError:
                return None
        return value if isinstance(value, dict) and {"stage", "reason", "next"} <= set(value) else None

    def config_of(dag_id: str, run_id: str) -> tuple[RunConfig, str | None]:
        """The run's config and state; the database session is closed before anything reaches a node."""
        with create_session() as session:
            run = session.scalar(select(DagRun).where(DagRun.dag_id == dag_id, DagRun.run_id == run_id))
            conf = None if run is None else dict(run.conf or {})
            state = None if run is None else str(run.state.value if hasattr(run.state, "value") else run.state)
        if run is None:
            raise HTTPException(404, f"no run {run_id!r} of {dag_id!r}")
        try:  # a run whose conf was refused has nothing to show, and reaches no node
            return triggered_config(dag_id, conf), state
        except NotRegenDag as exc:
            raise HTTPException(404, str(exc)) from None
        except ConfigError as exc:
            raise HTTPException(409, str(exc)) from None

    @app.get("/runs/{dag_id}/{run_id}", response_class=HTMLResponse, dependencies=guard)
    def page(dag_id: str, run_id: str) -> str:
        config_of(dag_id, run_id)
        nonce = secrets.token_urlsafe(16)
        body = PAGE.replace("__TITLE__", html.escape(f"{dag_id} / {run_id}")).replace("__NONCE__", nonce)
        return HTMLResponse(body, headers={"Content-Security-Policy": PAGE_CSP.format(nonce=nonce)})

    @app.get("/runs/{dag_id}/{run_id}/data", dependencies=guard)
    def data(dag_id: str, run_id: str) -> dict:
        """The run's output as the status stage reads it, and the run's state in Airflow (a run
        marked failed by hand leaves shards that still say "running": they are shown stopped)."""
        cfg, state = config_of(dag_id, run_id)
        try:
            data = config_data(cfg)
        except TimeoutError as exc:
            raise HTTPException(504, str(exc)) from None
        # Silence was judged by the status stage, where the output lives (a node's clock).
        data["progress"] = with_stopped_shards(data["progress"], state, silent_after_s=None)
        if (failed := preflight_failure(dag_id, run_id)) is not None:
            data["progress"][SETUP_FAILED] = failed
        return {**data, "attention": attention(data["progress"], data["audit"]), "run_state": state}

    @app.get("/runs/{dag_id}/{run_id}/report", dependencies=guard)
    def report(dag_id: str, run_id: str):
        cfg, _ = config_of(dag_id, run_id)
        if cfg.ssh_conn_id:
            raise HTTPException(404, f"the report is on {cfg.ssh_conn_id}: {cfg.dataset_output}/audit/report.html")
        try:
            text = read_report(cfg)
        except FileNotFoundError:
            raise HTTPException(404, "the audit has not run yet") from None
        except OSError as exc:  # a symlink on the way (ELOOP), not a regular file
            raise HTTPException(404, f"the report is not served: {exc}") from None
        return HTMLResponse(text)

    return app


PAGE = r"""<!doctype html><html><head><meta charset="utf-8"><title>regen: __TITLE__</title>
<style>
body{font-family:system-ui,sans-serif;margin:1.5em;color:#222}h1{font-size:1.3em}h2{font-size:1.05em;margin-top:1.5em}
table{border-collapse:collapse}td,th{padding:.25em .7em;border-bottom:1px solid #ddd;text-align:right}
td:first-child,th:first-child{text-align:left}.bar{background:#e8eef8;width:12em;height:.8em;display:inline-block}
.fill{background:#4472c4;height:100%}.PASS{background:#2e7d32}.FAIL{background:#c62828}
.verdict{color:#fff;padding:.2em .7em;border-radius:3px}.muted{color:#777}
#attention>div{border-left:4px solid #c62828;background:#fdecea;padding:.5em 1em;margin:.6em 0}
#attention>div.stopped{border-color:#777;background:#f1f1f1}#attention ul{margin:.3em 0}.next{font-weight:600}
td.error{text-align:left;max-width:34em;font-size:.9em;color:#a00;word-break:break-word}
</style></head><body>
<h1>regen run <span class="muted" id="title">__TITLE__</span></h1>
<div id="summary" class="muted">loading...</div>
<div id="attention"></div>
<h2>Canary</h2><div id="canary" class="muted">not run yet</div>
<h2>Tokens per second</h2><svg id="chart" width="640" height="165" style="border:1px solid #ddd"></svg>
<div id="nodes-section" hidden><h2>Nodes</h2><table id="nodes"></table></div>
<h2>Shards</h2><table id="shards"></table>
<h2>Servers</h2><table id="servers"></table>
<h2>Audit</h2><div id="audit" class="muted">not run yet</div>
<script nonce="__NONCE__">
// Everything from the run goes in as text (textContent, attributes set one by one): a path or a
// finding can hold any character, and none of it is ever parsed as HTML.
const fmt = n => n == null ? "?" : Number(n).toLocaleString();
const dur = s => s == null ? "?" : s < 120 ? Math.round(s) + " s" : s < 7200 ? Math.round(s / 60) + " min" : (s / 3600).toFixed(1) + " h";
const SVG = "http://www.w3.org/2000/svg";
function el(tag, attrs, ...children) {
  const node = tag.startsWith("svg:") ? document.createElementNS(SVG, tag.slice(4)) : document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) node.setAttribute(k, v);
  for (const c of children) node.append(c instanceof Node ? c : document.createTextNode(String(c)));
  return node;
}
function table(id, head, rows) {
  const t = document.getElementById(id);
  t.replaceChildren(el("tr", {}, ...head.map(h => el("th", {}, h))), ...rows.map(r => el("tr", {}, ...r.map(c => el("td", {}, c)))));
}
function bar(done, total) {
  const pct = total ? Math.round(100 * done / total) : 0;
  const fill = el("span", {class: "fill"}); fill.style.display = "block"; fill.style.width = pct + "%";
  return el("span", {}, el("span", {class: "bar"}, fill), " " + pct + "%");
}
function chart(history, progress, average) {
  // A point every few seconds; a run shorter than that still shows where it stands now, and a run
  // over before any point measured a rate shows its average over its time.
  let points = history.slice();
  if (progress.updated && (!points.length || progress.updated > points[points.length - 1].t)) {
    points.push({t: progress.updated, tokens_per_s: progress.tokens_per_s || 0, done: progress.done || 0});
  }
  const svg = document.getElementById("chart"); svg.replaceChildren();
  if (!points.length) { svg.append(el("svg:text", {x: 12, y: 80, "font-size": 12}, "no throughput yet")); return; }
  if (points.length === 1) points.unshift({t: points[0].t - 1, tokens_per_s: 0, done: 0});
  if (!points.some(h => h.tokens_per_s > 0) && average) {
    points = [{t: average.start, tokens_per_s: average.rate}, {t: average.end, tokens_per_s: average.rate}];
  }
  const peak = Math.max(...points.map(h => h.tokens_per_s || 0));
  if (!(peak > 0)) { svg.append(el("svg:text", {x: 12, y: 80, "font-size": 12}, "no tokens generated yet")); return; }
  // axes: tokens per second (0 to the peak) up the left, time since the first point along the bottom
  const t0 = points[0].t, t1 = points[points.length - 1].t, X0 = 70, X1 = 630, Y0 = 130, Y1 = 10;
  const xy = h => `${X0 + (X1 - X0) * (h.t - t0) / Math.max(1, t1 - t0)},${Y0 - (Y0 - Y1) * (h.tokens_per_s || 0) / peak}`;
  svg.append(el("svg:line", {x1: X0, y1: Y0, x2: X1, y2: Y0, stroke: "#999"}), el("svg:line", {x1: X0, y1: Y0, x2: X0, y2: Y1, stroke: "#999"}));
  for (const [value, y] of [[0, Y0], [peak / 2, (Y0 + Y1) / 2], [peak, Y1]]) {
    svg.append(el("svg:text", {x: X0 - 6, y: y + 4, "font-size": 10, "text-anchor": "end"}, fmt(Math.round(value))));
  }
  svg.append(el("svg:text", {x: 4, y: Y1 + 4, "font-size": 10}, "tok/s"));
  for (const [frac, anchor] of [[0, "start"], [0.5, "middle"], [1, "end"]]) {
    svg.append(el("svg:text", {x: X0 + (X1 - X0) * frac, y: Y0 + 16, "font-size": 10, "text-anchor": anchor},
      frac === 0 ? "0" : dur((t1 - t0) * frac)));
  }
  svg.append(el("svg:text", {x: (X0 + X1) / 2, y: Y0 + 28, "font-size": 10, "text-anchor": "middle"}, "time since the first point"));
  svg.append(el("svg:polyline", {fill: "none", stroke: "#4472c4", "stroke-width": 2, points: points.map(xy).join(" ")}));
  for (const h of points) { const [x, y] = xy(h).split(","); svg.append(el("svg:circle", {cx: x, cy: y, r: 2.5, fill: "#4472c4"})); }
}
async function refresh() {
  const r = await fetch(location.pathname.replace(/\/$/, "") + "/data", {credentials: "same-origin"}).catch(() => null);
  if (!r || !r.ok) {  // a node slow to answer, a restart of the API server: asked again, never left stuck
    document.getElementById("summary").textContent = (r ? "error " + r.status : "no answer") + ", asking again";
    setTimeout(refresh, 5000);
    return;
  }
  const d = await r.json(), p = d.progress || {}, canary = p.canary || {};
  const ended = ["failed", "success"].includes(d.run_state);
  const shards = Object.values(p.shards || {}).sort((a, b) => a.shard - b.shard);
  const running = shards.some(s => s.state === "running");
  let line, average = null;
  if (!shards.length) {
    line = [el("b", {}, "no shard started"), ended ? "" : " yet"];
  } else if (!running) {  // the run's generation is over: what it made, how long it took, how fast
    const start = Math.min(...shards.map(s => s.started_at || Infinity));
    const end = Math.max(...shards.map(s => (s.started_at || 0) + (s.elapsed_s || 0)));
    const tokens = shards.reduce((n, s) => n + (s.tokens || 0), 0), took = end - start;
    if (isFinite(took) && took > 0) average = {start, end, rate: tokens / took};
    line = [el("b", {}, fmt(p.done)), ` of ${fmt(p.total)} rows, ${fmt(p.failed)} failed`,
      isFinite(took) && took > 0 ? `, generated in ${dur(took)} at ${fmt(Math.round(tokens / took))} tok/s on average` : ""];
  } else {
    line = [el("b", {}, fmt(p.done)), ` of ${fmt(p.total)} done, ${fmt(p.failed)} failed, ${fmt(Math.round(p.tokens_per_s || 0))} tok/s, ETA ${dur(p.eta_s)}`];
  }
  document.getElementById("summary").replaceChildren(...line,
    d.run_state ? ` \u00b7 run ${d.run_state}` : "",
    " \u00b7 ", el("span", {class: "muted", id: "output"}, d.output));
  document.getElementById("attention").replaceChildren(...(d.attention || []).map(t => el("div", {class: t.kind},
    el("b", {}, t.what), el("ul", {}, ...t.details.map(x => el("li", {}, x))), el("div", {class: "next"}, "next: " + t.next))));
  if (canary.passed !== undefined) {
    const est = canary.estimate || {};
    document.getElementById("canary").replaceChildren(
      el("span", {id: "canary-verdict", class: "verdict " + (canary.passed ? "PASS" : "FAIL")}, canary.passed ? "passed" : "failed"),
      canary.passed ? ` ${fmt(canary.samples)} samples \u00b7 estimate: ${est.text || "?"}` : ` ${fmt((canary.problems || []).length)} problem(s), listed above`);
  }
  chart(d.history || [], p, average);
  const nodes = d.nodes || [];
  document.getElementById("nodes-section").hidden = nodes.length < 2;
  table("nodes", ["node", "reached by", "servers", "shards running", "shards done", "rows", "tok/s"],
    nodes.map(n => [n.node, n.reached_by, n.servers.map(s => s.url).join(" "), `${fmt(n.shards_running)}/${fmt(n.max_shards)}`, fmt(n.shards_done), fmt(n.rows), fmt(Math.round(n.tokens_per_s))]));
  table("shards", ["shard", "node", "state", "progress", "done", "failed", "tok/s", "ETA", "last error"],
    shards.map(s => [`shard ${s.shard}/${s.num_shards}`, s.node || "", s.state, bar(s.done, s.total), `${fmt(s.done)}/${fmt(s.total)}`, fmt(s.failed), s.state === "running" ? fmt(Math.round(s.tokens_per_s || 0)) : "", s.state === "running" ? dur(s.eta_s) : "", s.last_error || ""]));
  for (const td of document.querySelectorAll("#shards td:last-child")) td.className = "error";
  table("servers", ["server", "healthy", "done", "failed", "in flight", "running", "queued", "accept length"],
    Object.entries(p.servers || {}).map(([url, s]) => { const m = s.metrics || {}; return [url, !running || ended ? "stopped" : s.healthy ? "yes" : "no", fmt(s.done), fmt(s.failed), running && !ended ? fmt(s.in_flight) : "", running && !ended ? fmt(m.running) : "", running && !ended ? fmt(m.queued) : "", m.spec_accept_length == null ? "" : m.spec_accept_length]; }));
  const a = d.audit;
  if (a) {
    const base = location.pathname.replace(/\/$/, "");
    const counts = el("table", {}, el("tr", {}, el("th", {}, "finding"), el("th", {}, "samples")),
      ...Object.entries(a.counts).map(([k, v]) => el("tr", {}, el("td", {}, k), el("td", {}, fmt(v)))));
    document.getElementById("audit").replaceChildren(
      el("span", {id: "verdict", class: "verdict " + (a.verdict === "PASS" ? "PASS" : "FAIL")}, a.verdict),
      ` degenerate fraction ${a.degenerate_fraction}`, el("ul", {}, ...a.summary.map(l => el("li", {}, l))),
      a.verdict === "PASS" ? el("p", {id: "next"}, "next: ", el("code", {}, `regen export --data ${d.output} --format specforge --out FOLDER`),
        " writes what SpecForge trains on") : "", counts,
      el("p", {}, el("a", {href: base + "/report"}, "full report: histograms and samples")),
      el("iframe", {src: base + "/report", sandbox: "", width: "100%", height: "900", style: "border:0"}));
  }
  if (!a && !ended) setTimeout(refresh, 5000);
}
refresh();
</script></body></html>
"""
