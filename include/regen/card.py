"""The dataset card: README.md beside data/, in Hugging Face's dataset-card form.

Written by every audit (a failing one too: the card then says FAIL first), so that whoever finds the
folder or the bucket prefix, or pushes it to a hub, reads what it is without regen: the model and how
it was served, the sampling, the counts, the audit's verdict and histograms, and how to train on it.
"""

from __future__ import annotations

import json
import logging
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from regen.config import RunConfig
from regen.files import atomic_write_text
from regen.layout import RunLayout
from regen.markdown import code_block, markdown_literal

log = logging.getLogger("regen.card")

CARD_NAME = "README.md"
BAR_WIDTH = 30
# Loss tokens per sample: where a drafter's training signal is thin, and where it is long.
LOSS_EDGES = (16, 64, 256, 1024, 4096, 16384)


def _size_category(rows: int) -> str:
    for limit, name in ((1_000, "n<1K"), (10_000, "1K<n<10K"), (100_000, "10K<n<100K"),
                        (1_000_000, "100K<n<1M"), (10_000_000, "1M<n<10M")):
        if rows < limit:
            return name
    return "10M<n<100M"


def histogram(values: list[int], edges: tuple[int, ...] = LOSS_EDGES) -> str:
    """A Markdown table of counts per range, with a bar each: readable on a hub's page and in a terminal."""
    if not values:
        return "_no samples_\n"
    bounds = [0, *edges, math.inf]
    counts = [sum(lo <= v < hi for v in values) for lo, hi in zip(bounds, bounds[1:])]
    top = max(counts) or 1
    lines = ["| loss tokens | samples | |", "| --- | ---: | --- |"]
    for lo, hi, n in zip(bounds, bounds[1:], counts):
        span = f"{lo:,}+" if hi == math.inf else f"{lo:,}-{hi - 1:,}"
        lines.append(f"| {span} | {n:,} | {'█' * round(BAR_WIDTH * n / top)} |")
    return "\n".join(lines) + "\n"


def _table(rows: list[tuple[str, Any]]) -> str:
    cells = [f"| {k} | {markdown_literal(v, limit=None)} |" for k, v in rows]
    return "\n".join(["| | |", "| --- | --- |", *cells]) + "\n"


NOT_RECORDED = "not recorded with the data"


@dataclass(frozen=True)
class MadeWith:
    """What the card says made the rows: the run's config for its own output; for an audit of
    data (``--data``), what the output recorded (its manifest, each row's ``made_by``), never the
    auditing command's defaults."""

    name: str
    model: str
    enable_thinking: bool | None
    engine: str | None
    reasoning_parser: str | None
    tool_call_parser: str | None
    speculative_algorithm: str | None
    sampling: dict[str, Any] | None

    @classmethod
    def of_run(cls, cfg: RunConfig) -> "MadeWith":
        e = cfg.engine_options
        return cls(cfg.dataset_output.rstrip("/").rsplit("/", 1)[-1], cfg.model_path, cfg.enable_thinking, cfg.engine,
                   e.reasoning_parser, e.tool_call_parser, e.speculative_algorithm, cfg.sampling_settings())

    @classmethod
    def recorded(cls, layout: RunLayout, manifest: dict, doc: dict, tokenizer: str) -> "MadeWith":
        kwargs = (manifest.get("prompts") or {}).get("chat_template_kwargs") or {}
        makers = (doc.get("provenance") or {}).get("makers") or []

        def one(key: str) -> str | None:  # one setup made every row: say it; several: the table says
            values = {m.get(key) for m in makers}
            return values.pop() if len(values) == 1 else None

        thinking = kwargs.get("enable_thinking")
        return cls(str(layout.dataset or layout.root).rstrip("/").rsplit("/", 1)[-1], tokenizer,
                   thinking if isinstance(thinking, bool) else None, one("engine"), one("reasoning_parser"),
                   one("tool_call_parser"), None, manifest.get("sampling"))


def render_card(cfg: RunConfig | MadeWith, doc: dict, loss_tokens: list[int], rows: int, manifest: dict) -> str:
    """The card's text from the audit's summary (``doc``, regen.audit.findings), the run's manifest
    and what made the rows (a run's config, or MadeWith)."""
    made = cfg if isinstance(cfg, MadeWith) else MadeWith.of_run(cfg)
    name = made.name
    verdict = doc["verdict"]
    front = {"pretty_name": name, "tags": ["regen", "synthetic", "speculative-decoding", "reasoning"],
             "task_categories": ["text-generation"], "size_categories": [_size_category(rows)],
             "configs": [{"config_name": "default", "data_files": [{"split": "train", "path": "data/*.parquet"}]}]}
    t, counts = doc["thresholds"], doc["counts"]
    reasons = "".join(f"- {markdown_literal(r, limit=None)}\n" for r in doc.get("reasons") or [])
    thinking = {True: "with thinking on", False: "with thinking off", None: "(thinking not recorded)"}
    sampling = made.sampling if made.sampling is not None else {"settings": NOT_RECORDED}
    agentic = doc.get("agentic") or {}
    return f"""---
{_yaml(front)}---

# {markdown_literal(name)}

**Audit: {verdict}.** {markdown_literal(doc['summary'][0], limit=None)}
{("" if verdict == "PASS" else chr(10) + "Not fit to train on as it is:" + chr(10) + chr(10) + reasons)}
Every assistant turn of {rows:,} conversations regenerated by the target model {markdown_literal(made.model)}
{thinking[made.enable_thinking]}, by regen,
for training speculative-decoding drafters (EAGLE-3, MTP, DFlash) on
what the model itself writes. Load it with `datasets.load_dataset("parquet", data_dir="data")` or
`pandas.read_parquet("data")`.

## Model and serving

{_table([("model", made.model), ("served as (fingerprint)", manifest.get("model_identity")),
         ("engine", made.engine), ("reasoning parser", made.reasoning_parser),
         ("tool-call parser", made.tool_call_parser), ("speculative decoding", made.speculative_algorithm),
         ("settings hash", manifest.get("settings_hash"))])}
{_makers((doc.get("provenance") or {}).get("makers") or [])}
## Sampling

{_table([(k, json.dumps(v) if isinstance(v, (dict, list, bool)) or v is None else v)
         for k, v in sampling.items()])}
## Counts

{_table([("rows (one per conversation)", f"{rows:,}"), ("training samples", f"{doc['samples']:,}"),
         ("audited", f"{doc['audited']:,}"), ("error rows", f"{counts['error']:,}"),
         ("duplicate ids", f"{counts['duplicate_id']:,}"),
         ("reasoning present", f"{doc['reasoning_rows']:,} of {doc['thinking_rows']:,} that asked for thinking"),
         ("agentic rows", f"{agentic.get('rows', 0):,}"),
         ("prompts file", (manifest.get("prompts") or {}).get("path"))])}
## Audit

The loss mask of every sample as {markdown_literal(doc['train_view']['template'])} trains on it
({doc['train_view']['layout']} layout{f", cut at {doc['train_view']['max_length']:,} tokens" if doc['train_view']['max_length'] else ""}):
degenerate fraction {doc['degenerate_fraction']:.4f} (limit {t['max_degenerate_fraction']:.4f}, a sample
under {t['min_loss_tokens']} loss tokens or without reasoning is degenerate).

{histogram(loss_tokens)}
{"".join(f"- {markdown_literal(line, limit=None)}{chr(10)}" for line in doc["summary"][1:-1])}
The full report (histograms, the worst samples as training sees them) is `audit/report.html`
where the run wrote it; `audit/samples.parquet` holds each sample's loss tokens and findings.

## Training on it

{code_block(["regen", "export", "--data", ".", "--format", "specforge", "--out", "recipe/",
             "--tokenizer", made.model])}
writes every file of SpecForge's recipe (`regenerated.jsonl`, its expanded events, the agentic
conversations, the error and skipped files) and `recipe/specforge_data.yaml`, the `data:` block of a
SpecForge training config for each, the one this run's layout trains on marked `recommended`.
`--format sharegpt` writes the single JSONL that SpecForge's and DFlash's loaders read.
"""


def _makers(makers: list[dict]) -> str:
    """What made the rows (each records it: regen.dispatch.made_by), one line per setup."""
    if not makers:
        return ""
    lines = ["| rows | engine | version | reasoning / tool-call parser | chat template | launch |",
             "| ---: | --- | --- | --- | --- | --- |"]
    lines += [f"| {m.get('rows', 0):,} | {markdown_literal(m.get('engine'))} | {markdown_literal(m.get('version'))} | "
              f"{markdown_literal(m.get('reasoning_parser'))} / {markdown_literal(m.get('tool_call_parser'))} | "
              f"{markdown_literal(m.get('chat_template'))} | {markdown_literal(m.get('launch'))} |" for m in makers]
    return "Made by:\n\n" + "\n".join(lines) + "\n"


def _yaml(doc: dict) -> str:
    import yaml

    return yaml.safe_dump(doc, sort_keys=False, allow_unicode=True)


def written_by_regen(card: bytes) -> bool:
    """A README.md whose front matter tags it regen's: an audit may write over it, over no other
    (``regen audit --data`` may be pointed at a dataset someone else wrote and described)."""
    text = card[:8192].decode("utf-8", "replace")
    if not text.startswith("---\n") or "\n---" not in text[3:]:
        return False
    import yaml

    try:
        front = yaml.safe_load(text[4:text.index("\n---", 3)])
    except yaml.YAMLError:
        return False
    return isinstance(front, dict) and "regen" in (front.get("tags") or [])


def _card_kept(where: str, text: str, report_dir: Path) -> str:
    """The card beside the audit's report, where the data's own README.md is not regen's."""
    path = report_dir / CARD_NAME
    atomic_write_text(path, text)
    log.warning("%s is not a card regen wrote: left as it is; this audit's card is %s", where, path)
    return str(path)


def write_card(cfg: RunConfig, layout: RunLayout, doc: dict, loss_tokens: list[int], rows: int,
               report_dir: Path, tokenizer: str | None = None) -> str | None:
    """README.md beside data/ (in the bucket for an object-store output), or in ``report_dir`` where a
    README.md there is not regen's; where it went, or None when it could not be written (a reader
    without write access): the card informs, the audit decides.
    ``tokenizer``: an audit of data (not the run's own output) that this model's template judged."""
    from regen.manifest import Manifest

    manifest = Manifest(layout).read() if layout.work.exists() else {}
    made = MadeWith.recorded(layout, manifest, doc, tokenizer) if tokenizer else cfg
    text = render_card(made, doc, loss_tokens, rows, manifest)
    try:
        if layout.dataset:
            store = layout.store()
            if store.exists(CARD_NAME) and not written_by_regen(store.read(CARD_NAME)):
                return _card_kept(store.url_of(CARD_NAME), text, report_dir)
            store.put(CARD_NAME, text.encode())
            return store.url_of(CARD_NAME)
        card = layout.root / CARD_NAME
        if card.exists() and not written_by_regen(card.read_bytes()):
            return _card_kept(str(card), text, report_dir)
        atomic_write_text(card, text)
        return str(card)
    except OSError as exc:
        log.warning("dataset card not written beside %s: %s", layout.data, exc)
        return None
