"""The audit sees each sample as training will: SpecForge 0.2.0's own parser is the oracle.

Multi- and single-turn rows with the real Qwen3 tokenizer and chat template go through `regen
export` (the file training reads) into SpecForge's ThinkingParser / GeneralParser, and through
regen's audit; the loss tokens must be equal sample by sample, uncut and at a max length that
cuts most samples (about 20 s: SpecForge encodes every prefix).
"""

from __future__ import annotations

import json
import random
import subprocess

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from regen.audit.dataset import audit_dataset
from regen.audit.findings import AuditThresholds
from regen.config import ConfigError, RunConfig
from regen.export import export_sharegpt
from regen.rows import ROW_SCHEMA
from support.engines import SGLANG_PYTHON
from support.paths import ROOT

ORACLE = ROOT / "tests" / "fixtures" / "specforge_oracle.py"
WORDS = ("the light scatters because shorter wavelengths bend more; naïve café 東京 42 % "
         "first we compute 17 * 23 = 391, then check: wait, is that right? yes. "
         "def f(x):\n    return x ** 2\n\n- a list item\n- another").split(" ")
UNCUT = 1_000_000


def text(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


def make_rows(thinking: bool, count: int = 60) -> list[dict]:
    """Rows as regen writes them: half single-turn, half with 2-3 regenerated turns (each earlier
    assistant turn with its own reasoning), some with their own system prompt."""
    rng = random.Random(7 if thinking else 8)
    rows = []
    for i in range(count):
        turns = 1 if i % 2 == 0 else rng.choice((2, 3))
        messages = [{"role": "system", "content": "Answer well.", "reasoning_content": None}] if i % 5 == 0 else []
        for k in range(turns):
            messages.append({"role": "user", "content": text(rng, rng.randint(5, 60)), "reasoning_content": None})
            if k < turns - 1:
                messages.append({"role": "assistant", "content": text(rng, rng.randint(5, 80)),
                                 "reasoning_content": text(rng, rng.randint(20, 300)) if thinking else None})
        rows.append({"id": f"r{i}", "messages": messages,
                     "reasoning_content": text(rng, rng.randint(20, 600)) if thinking else None,
                     "content": text(rng, rng.randint(3, 120)), "finish_reason": "stop",
                     "completion_tokens": 100, "error": None, "enable_thinking": thinking,
                     "turns": [{"finish_reason": "stop", "prompt_tokens": 10, "completion_tokens": 100}] * turns})
    return rows


def oracle(tokenizer_dir, export, template: str, lengths: list[int], last_turn_only: bool = False) -> dict[str, list[int]]:
    return run_oracle("counts", tokenizer_dir, export, template, lengths, last_turn_only)


def run_oracle(mode: str, tokenizer_dir, export, template: str, lengths: list[int], last_turn_only: bool = False) -> dict:
    out = subprocess.run([str(SGLANG_PYTHON), str(ORACLE), mode, str(tokenizer_dir), str(export), template,
                          *map(str, lengths), *(["--last-turn-only"] if last_turn_only else [])],
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("template, thinking, cut_at, layout", [
    ("qwen3-thinking", True, 256, "conversation"), ("qwen3-thinking", True, 256, "events"),
    ("qwen3.5", True, 256, "events"), ("qwen3-instruct", False, 96, "conversation")])
def test_loss_tokens_equal_specforges_parser_uncut_and_cut(qwen3_tokenizer_dir, tmp_path, template, thinking,
                                                           cut_at, layout):
    """Per sample as exported (a conversation, or an event ``ID#turnK`` trained on its last turn
    only, as ``train_only_last_turn`` does), regen's loss tokens are SpecForge's."""
    data = tmp_path / "out" / "data"
    data.mkdir(parents=True)
    rows = make_rows(thinking)
    pq.write_table(pa.Table.from_pylist(rows, schema=ROW_SCHEMA), data / "shard.parquet")
    export = tmp_path / "train.jsonl"
    written = export_sharegpt(data, export, expect_reasoning=thinking, layout=layout).written
    assert written == (60 if layout == "conversation" else sum(len(r["turns"]) for r in rows))

    audited = {}
    for length in (None, cut_at):
        report = audit_dataset(data, qwen3_tokenizer_dir, tmp_path / f"audit-{length}",
                               AuditThresholds(16, 1.0, template, length, layout), default_thinking=thinking)
        samples = pq.read_table(tmp_path / f"audit-{length}" / "samples.parquet").to_pylist()
        audited[length] = {s["id"]: s for s in samples}
        assert report.summary.audited == written
    expected = oracle(qwen3_tokenizer_dir, export, template, [UNCUT, cut_at], last_turn_only=layout == "events")
    assert set(expected) == set(audited[None])  # the audit judged exactly the rows the export wrote

    uncut = {i: audited[None][i]["loss_tokens"] for i in expected}
    cut = {i: audited[cut_at][i]["loss_tokens"] for i in expected}
    assert uncut == {i: v[0] for i, v in expected.items()}
    assert cut == {i: v[1] for i, v in expected.items()}
    shortened = [i for i in expected if "cut" in audited[cut_at][i]["findings"]]
    assert len(shortened) > 0.4 * written  # the cut shortens many samples: the check means something
    assert all(audited[cut_at][i]["tokens"] > cut_at for i in shortened)
    assert sum(uncut.values()) > sum(cut.values())
    assert min(uncut.values()) > 0


def test_qwen3_templates_drop_history_reasoning_so_the_default_layout_is_events(qwen3_tokenizer_dir, tiny_model):
    from regen.chat.render import load_tokenizer, train_layout
    from regen.chat.templates import TRAIN_TEMPLATES

    for directory in (qwen3_tokenizer_dir, tiny_model):
        tokenizer = load_tokenizer(str(directory))
        assert train_layout(tokenizer, TRAIN_TEMPLATES["qwen3-thinking"]) == "events"
        assert train_layout(tokenizer, TRAIN_TEMPLATES["qwen3-instruct"]) == "conversation"


def test_a_template_that_drops_reasoning_is_refused_with_thinking_on():
    with pytest.raises(ConfigError, match="train_template 'qwen'.*drops reasoning_content"):
        RunConfig.from_mapping({"train_template": "qwen", "enable_thinking": True})
    assert RunConfig.from_mapping({"train_template": "qwen", "enable_thinking": False}).audit.train_template == "qwen"


def test_the_token_export_trains_on_what_specforge_masks_from_the_generated_tokens(sim_servers, tmp_path, tiny_model):
    """Rows generated by the simulator with the tokens an engine returns (tiny model's tokenizer
    and template), multi-turn included: `regen export --format tokens` marks, in the engine's
    own tokens, exactly the tokens SpecForge's parser trains on for the same conversation, on
    every sample whose re-encoding agrees with the generated tokens."""
    from regen.audit.dataset import audit_dataset
    from regen.export import export_tokens
    from regen.generate import ShardRun
    from support.data import write_conversations

    prompts = write_conversations(tmp_path / "p.jsonl", 8, turns=3, singles=12)
    cfg, records = sim_servers(prompts=str(prompts), num_shards=1)
    ShardRun(cfg, [(r.url, r.api_key) for r in records], 0, "m").run()
    df = pq.read_table(f"{cfg.output}/data").to_pylist()
    assert all(r["prompt_token_ids"] and r["completion_token_ids"] for r in df)

    for layout, records in (("conversation", 20), ("events", 8 * 3 + 12)):
        audit_dataset(cfg.output, tiny_model, tmp_path / layout, AuditThresholds(1, 1.0, train_layout=layout))
        findings = {s["id"]: s["findings"] for s in pq.read_table(tmp_path / layout / "samples.parquet").to_pylist()}
        agree = {i for i, f in findings.items() if "retokenized_differs" not in f}
        assert len(agree) >= 15
        tokens, text = tmp_path / f"tokens-{layout}.jsonl", tmp_path / f"train-{layout}.jsonl"
        exported = export_tokens(cfg.output, tokens, tiny_model, "qwen3-thinking", layout)
        assert exported.written == records
        assert exported.checks["completion agrees with the rendering"] >= (15 if layout == "conversation" else 30)
        if layout == "events":  # history sent as visible content: the served prompt is the training prefix
            assert exported.checks["served prompt = the training prefix"] == 8  # conversations: own system prompt
        export_sharegpt(cfg.output, text, layout=layout)
        expected = run_oracle("masked", tiny_model, text, "qwen3-thinking", [UNCUT], last_turn_only=layout == "events")
        compared = 0
        for line in tokens.read_text().splitlines():
            row = json.loads(line)
            if row["id"] in agree:
                assert [t for t, m in zip(row["input_ids"], row["loss_mask"]) if m] == expected[row["id"]], row["id"]
                compared += 1
        assert compared >= 15


def test_an_answer_whose_text_re_encodes_to_other_tokens_is_found(qwen3_tokenizer_dir, tmp_path):
    from regen.chat.render import load_tokenizer

    tok = load_tokenizer(str(qwen3_tokenizer_dir))
    rows = make_rows(True, count=4)
    for row in rows:
        spans = f"<think>\n{row['reasoning_content']}\n</think>\n\n{row['content']}<|im_end|>"
        row["completion_token_ids"] = tok.encode(spans, add_special_tokens=False)
        row["prompt_token_ids"] = [1]
    rows[1]["completion_token_ids"] = tok.encode("hel", add_special_tokens=False) + rows[1]["completion_token_ids"]
    data = tmp_path / "out" / "data"
    data.mkdir(parents=True)
    pq.write_table(pa.Table.from_pylist(rows, schema=ROW_SCHEMA), data / "shard.parquet")
    audit_dataset(data, qwen3_tokenizer_dir, tmp_path / "audit", AuditThresholds(1, 1.0))
    findings = {s["id"]: s["findings"] for s in pq.read_table(tmp_path / "audit" / "samples.parquet").to_pylist()}
    assert [i.split("#")[0] for i, f in findings.items() if "retokenized_differs" in f] == ["r1"]
