"""Prompt formats, requests cut at the last user turn, bad records named by file:line, sharding."""

from __future__ import annotations

import json

import pandas as pd
import pytest

from regen.prompts import Prompt, PromptError, read_prompts, shard_of
from support.data import read_ids, write_jsonl
from support.paths import ROOT


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


def test_a_byte_order_mark_is_not_a_bad_first_line(tmp_path):
    """Editors on Windows write a UTF-8 BOM first; the first prompt reads (as read_at finds it
    again from the index), it is not "invalid character (byte 0)"."""
    from regen.prompts import read_at

    path = tmp_path / "p.jsonl"
    path.write_bytes(b"\xef\xbb\xbf" + b'{"id": "a", "prompt": "Q"}\n{"id": "b", "prompt": "R"}\n')
    prompts = list(read_prompts(path))
    assert [p.id for p in prompts] == ["a", "b"]
    assert [p.id for p in read_at(path, [(p.line, p.offset) for p in prompts])] == ["a", "b"]


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
    assert bad[2] == f"{path}:4: leading_assistant: the conversation starts with an assistant message (id 'x')"
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
    shards = [[i for i in read_ids(path) if shard_of(i, 5) == s] for s in range(5)]
    assert sorted(sum(shards, [])) == sorted(ids)
    assert all(len(s) > 20 for s in shards)  # roughly balanced
    # A prompt's shard depends on its id alone, not on its position or the file's length.
    bigger = write_jsonl(tmp_path / "more.jsonl",
                         [{"id": f"new-{i}", "prompt": "x"} for i in range(50)]
                         + path.read_text().splitlines())
    assert [i for i in read_ids(bigger) if shard_of(i, 5) == 2 and not i.startswith("new-")] == shards[2]


@pytest.mark.parametrize("messages, rule", [
    ([{"role": "user", "content": "u1"}, {"role": "user", "content": "u2"}], "role_order"),
    ([{"role": "assistant", "content": "a"}, {"role": "user", "content": "u"}], "leading_assistant"),
    ([{"role": "system", "content": "s"}, {"role": "assistant", "content": "a"}], "leading_assistant"),
    ([{"role": "user", "content": "u"}, {"role": "system", "content": "late"}], "late_system"),
    ([{"role": "user", "content": "  "}], "empty_content"),
    ([{"role": "user", "content": "u"}, {"role": "assistant", "content": None}], "empty_content"),
    ([{"role": "user", "content": "u"}, {"role": "tool", "content": "{}"}], "tool_message"),
    ([{"role": "system", "content": "only"}], "no_user"),
    ([{"role": "user", "content": "u"}, {"role": "assistant", "content": "a"}, {"role": "assistant", "content": "b"}],
     "role_order"),
])
def test_conversations_specforges_validator_refuses_are_named_by_rule(tmp_path, messages, rule):
    """The rules of SpecForge's regeneration input validator, each refused by its name; the
    conversations it accepts (system first, user and assistant alternating, ending on either)
    are read."""
    path = write_jsonl(tmp_path / "p.jsonl", [
        {"id": "bad", "messages": messages},
        {"id": "ok", "messages": [{"role": "system", "content": "s"}, {"role": "user", "content": "u1"},
                                  {"role": "assistant", "content": "a1"}, {"role": "user", "content": "u2"},
                                  {"role": "assistant", "content": "a2"}]},
    ])
    bad, ok = list(read_prompts(path))
    assert isinstance(bad, PromptError) and bad.rule == rule and bad.line == 1, bad
    assert isinstance(ok, Prompt) and [m["role"] for m in ok.messages] == ["system", "user", "assistant", "user"]


def test_a_line_nested_too_deep_or_too_long_is_refused_with_file_and_line(tmp_path, monkeypatch):
    """Named inputs get bounded work: a JSON line nested 100,000 deep, and a line longer than a
    record may be, are each a problem naming file:line; the records around them are read."""
    import regen.prompts as prompts_module

    monkeypatch.setattr(prompts_module, "MAX_LINE_BYTES", 300_000)
    path = tmp_path / "p.jsonl"
    good = '{"id": "a", "prompt": "hi"}\n'
    path.write_text(good + "[" * 100_000 + "]" * 100_000 + "\n" + '{"id": "b", "prompt": "' + "x" * 400_000 + '"}\n'
                    + good.replace('"a"', '"c"'))
    items = list(read_prompts(path))
    assert [getattr(i, "id", None) for i in items] == ["a", None, None, "c"]
    assert str(items[1]) == f"{path}:2: not valid JSON: nested too deep"
    assert str(items[2]) == f"{path}:3: longer than 300.0 kB: not a prompt record"
    assert items[3].line == 4 and items[3].offset == path.read_bytes().index(b'{"id": "c"')
