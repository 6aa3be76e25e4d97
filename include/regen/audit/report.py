"""The audit's report.html: verdict, findings, histograms and the samples viewer, self-contained
(one file, no script)."""

from __future__ import annotations

import base64
import io
import json
from html import escape
from typing import Iterable

import numpy as np

from regen.audit import viewer
from regen.audit.findings import FINDINGS, AuditReport


def _histogram_png(values: Iterable[int], title: str, xlabel: str, threshold: int | None = None) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    arr = np.asarray(list(values))
    fig, ax = plt.subplots(figsize=(6.4, 3.2), dpi=100)
    if arr.size:
        bins = np.unique(np.geomspace(max(arr.min(), 1), max(arr.max(), 2), 40).astype(int))
        ax.hist(np.clip(arr, 1, None), bins=bins, color="#4472c4")
        ax.set_xscale("log")
    if threshold is not None:
        ax.axvline(threshold, color="#c00000", linestyle="--", label=f"min_loss_tokens {threshold}")
        ax.legend()
    ax.set_title(title)
    ax.set_xlabel(xlabel)
    ax.set_ylabel("samples")
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    plt.close(fig)
    return base64.b64encode(buf.getvalue()).decode()


def render_html(report: AuditReport, views: list[dict] | None = None) -> str:
    data = report.to_json()
    s = report.summary
    loss_png = _histogram_png(s.loss_tokens, "Loss tokens per sample", "loss tokens (log)",
                              report.thresholds.min_loss_tokens)
    comp_png = _histogram_png(s.completion_tokens, "Completion tokens per sample",
                              "completion tokens (log)")
    rows = "".join(f"<tr><td>{f}</td><td>{data['counts'][f]:,}</td>"
                   f"<td>{data['fractions'][f]:.2%}</td></tr>" for f in FINDINGS)
    colour = "#2e7d32" if report.passed else "#c62828"
    example = ""
    if s.example:
        example = f"<h2>A degenerate sample</h2><pre>{escape(json.dumps(s.example, indent=1))}</pre>"
    lines = "".join(f"<li>{escape(line)}</li>" for line in report.lines())
    return f"""<!doctype html><html><head><meta charset="utf-8"><title>regen audit</title>
<style>body{{font-family:sans-serif;max-width:60em;margin:2em auto}}td,th{{padding:.2em .8em;text-align:right}}
td:first-child{{text-align:left}}.verdict{{color:#fff;background:{colour};padding:.3em .8em}}
.muted{{color:#777}}pre.sample{{white-space:pre-wrap;background:#fafafa;border:1px solid #ddd;padding:.6em;font-size:.85em}}
mark{{background:#fff2b3}}.after-cut{{color:#aaa}}.cut-marker{{color:#c62828;font-weight:bold}}.gap{{color:#777;font-style:italic}}
details.sample-view{{margin:.4em 0}}summary{{cursor:pointer}}</style></head>
<body><h1>regen audit <span class="verdict" id="verdict">{report.verdict()}</span></h1>
<ul>{lines}</ul>
<h2>Findings</h2><table><tr><th>finding</th><th>samples</th><th>fraction</th></tr>{rows}</table>
<h2>Distributions</h2><img alt="loss tokens histogram" src="data:image/png;base64,{loss_png}">
<img alt="completion tokens histogram" src="data:image/png;base64,{comp_png}">
{example}
{viewer.render_html(views or [])}</body></html>"""
