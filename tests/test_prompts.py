"""Prompt formats, requests cut at the last user turn, bad records named by file:line, sharding."""

from __future__ import annotations

import json

import pandas as pd

from regen.prompts import Prompt, PromptError, read_prompts, read_shard, shard_of
from support.data import read_ids
from support.paths import ROOT


def write_jsonl(path, records):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records))
    return path


def test_the_three_formats_become_chat_messages(tmp_path):
    path = write_jsonl(tmp_path / "p.jsonl", [
        {"id": "a", "messages": [{"role": "system", "content": "S"}, {"role": "user", "content": "Q"}]},
        {"id": "b", "conversations": [{"from": "human", "value": "Q"}, {"from": "gpt", "value": "A"}]},
        {"id": "c", "conversations": [{"role": "user", "content": "Q"}]},
        {"id": 4, "prompt": "Q"},
    ])
    prompts = list(read_prompts(path))
    assert [p.id for p in prompts] == ["a", "b", "c", "4"]
    assert prompts[0].messages == [{"role": "system", "content": "S"}, {"role": "user", "content": "Q"}]
    # The request ends at the last user turn: the old answer is what gets regenerated.
    assert prompts[1].messages == [{"role": "user", "content": "Q"}]
    assert prompts[3].messages == [{"role": "user", "content": "Q"}]


def test_bad_records_are_reported_with_file_and_line_and_do_not_stop_the_read(tmp_path):
    path = write_jsonl(tmp_path / "p.jsonl", [
        {"id": "ok1", "prompt": "fine"},
        "{not json",
        {"prompt": "no id"},
        {"id": "x", "messages": [{"role": "assistant", "content": "no user"}]},
        {"id": "y", "messages": [{"role": "wizard", "content": "?"}]},
        {"id": "z"},
        {"id": "ok2", "prompt": "fine"},
    ])
    items = list(read_prompts(path))
    good = [i.id for i in items if isinstance(i, Prompt)]
    bad = [str(i) for i in items if isinstance(i, PromptError)]
    assert good == ["ok1", "ok2"]
    assert bad[0].startswith(f"{path}:2: not valid JSON")
    assert bad[1] == f"{path}:3: missing 'id'"
    assert bad[2] == f"{path}:4: no user turn"
    assert bad[3] == f"{path}:5: 'messages[0]' has unknown role 'wizard'"
    assert bad[4] == f"{path}:6: no 'messages', 'conversations' or 'prompt' field"


def test_parquet_prompts_read_like_jsonl(tmp_path):
    records = [json.loads(line) for line in (ROOT / "demo" / "prompts.jsonl").read_text().splitlines()]
    messages_only = [r for r in records if "messages" in r]
    pd.DataFrame(messages_only).to_parquet(tmp_path / "p.parquet")
    items = list(read_prompts(tmp_path / "p.parquet"))
    assert [p.id for p in items] == [r["id"] for r in messages_only]


def test_shards_partition_the_ids_and_are_stable_when_prompts_are_added(tmp_path):
    ids = read_ids(ROOT / "demo" / "prompts.jsonl")
    path = ROOT / "demo" / "prompts.jsonl"
    shards = [[p.id for p in read_shard(path, s, 5)] for s in range(5)]
    assert sorted(sum(shards, [])) == sorted(ids)
    assert all(len(s) > 20 for s in shards)  # roughly balanced
    # A prompt's shard depends on its id alone, not on its position or the file's length.
    assert all(shard_of(i, 5) == s for s, members in enumerate(shards) for i in members)
    bigger = write_jsonl(tmp_path / "more.jsonl",
                         [{"id": f"new-{i}", "prompt": "x"} for i in range(50)]
                         + path.read_text().splitlines())
    assert [p.id for p in read_shard(bigger, 2, 5) if not p.id.startswith("new-")] == shards[2]
