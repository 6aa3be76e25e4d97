"""Export to SpecForge's regenerated-data JSONL, checked against its validator's documented rules."""

from __future__ import annotations

import json
import subprocess

from support.data import row, write_dataset
from support.paths import BIN


def assert_specforge_valid(path, expect_reasoning=True):
    """The rules of SpecForge's validate_regenerated_data.py --expect-reasoning
    --strict-think-markers, restated: one object a line, a non-empty string id, status success,
    a conversation ending with an assistant turn whose reasoning is a string, no think markers."""
    ids = []
    for line in path.read_text().splitlines():
        record = json.loads(line)
        assert isinstance(record["id"], str) and record["id"].strip()
        assert record["status"] == "success"
        conv = record["conversations"]
        assert conv[0]["role"] in ("system", "user") and conv[-1]["role"] == "assistant"
        for message in conv:
            assert set(message) <= {"role", "content", "reasoning_content"}
            assert isinstance(message["content"], str)
            if message["role"] == "assistant":
                for text in (message["content"], message.get("reasoning_content") or ""):
                    assert "<think>" not in text and "</think>" not in text
        if expect_reasoning:  # every assistant turn, not only the last
            assert all(isinstance(m.get("reasoning_content"), str) and m["reasoning_content"].strip()
                       for m in conv if m["role"] == "assistant")
        ids.append(record["id"])
    return ids


def test_export_writes_valid_conversations_and_counts_what_it_left_out(tmp_path):
    regenerated = [{"role": "user", "content": "Q1"},
                   {"role": "assistant", "content": "A1", "reasoning_content": "R1"},
                   {"role": "user", "content": "Q2"}]
    original = [{"role": "user", "content": "Q1"}, {"role": "assistant", "content": "A1"},
                {"role": "user", "content": "Q2"}]  # regenerate_turns last: the dataset's history
    rows = [row(i) for i in range(10)] + [
        row(10, messages=regenerated),
        row(15, messages=original),
        row(11, reasoning=None, content=None, finish=None, error="HTTP 400: too long"),
        row(12, reasoning=None),
        row(13, content="</think> leaked"),
        row(14, content=""),
    ]
    data = write_dataset(tmp_path / "data", rows)
    out = subprocess.run([str(BIN / "regen"), "export", "--data", str(data), "--format", "sharegpt",
                          "--out", str(tmp_path / "train.jsonl")], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    assert "wrote 11 conversations" in out.stdout
    for reason in ("failed 1", "no reasoning 2", "think markers 1", "empty answer 1"):
        assert reason in out.stdout
    ids = assert_specforge_valid(tmp_path / "train.jsonl")
    assert sorted(ids) == sorted(f"s{i}" for i in range(11))
    records = {json.loads(l)["id"]: json.loads(l) for l in (tmp_path / "train.jsonl").read_text().splitlines()}
    assert [m["role"] for m in records["s10"]["conversations"]] == ["user", "assistant", "user", "assistant"]
    assert records["s0"]["conversations"][-1]["reasoning_content"].startswith("Let me think")
    assert not list(tmp_path.glob(".train.jsonl.*"))  # no temporary file left behind


def test_audit_and_export_take_an_output_directory_or_its_data(tmp_path, tiny_model):
    """A new user passes the output directory; the DESIGN form passes its data/. Both work."""
    output = tmp_path / "out"
    write_dataset(output / "data", [row(i) for i in range(12)])
    for data in (output, output / "data"):
        audit = subprocess.run([str(BIN / "regen"), "audit", "--data", str(data), "--tokenizer",
                                str(tiny_model)], capture_output=True, text=True, timeout=120)
        assert audit.returncode == 0, audit.stderr[-2000:]
        assert audit.stdout.startswith("audit PASS: 0 of 12 samples degenerate")
        assert (output / "audit" / "report.html").exists()
        assert json.loads((output / "progress.json").read_text())["audit"]["samples"] == 12
        export = subprocess.run([str(BIN / "regen"), "export", "--data", str(data), "--format",
                                 "sharegpt", "--out", str(tmp_path / "train.jsonl")],
                                capture_output=True, text=True, timeout=120)
        assert export.returncode == 0, export.stderr[-2000:]
        assert len(assert_specforge_valid(tmp_path / "train.jsonl")) == 12
