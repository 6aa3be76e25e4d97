"""Every assistant turn regenerated, in order; exactly once at the turn level (issue: multi-turn).

Real simulated servers that log every request they receive; SIGKILL where the issue says killed.
"""

from __future__ import annotations

import json
import subprocess
from collections import Counter
from pathlib import Path

import pandas as pd

from regen.audit.dataset import audit_dataset
from regen.audit.findings import AuditThresholds
from regen.canary import first_prompts
from regen.export import export_sharegpt
from regen.generate import ShardRun
from regen.layout import RunLayout
from regen.store import Journal
from support.data import FAST, ORIGINAL, cli, journaled, kill_when, write_conversations
from support.paths import ROOT


def logged_requests(log: Path) -> list[list[dict]]:
    return [json.loads(line)["messages"] for line in log.read_text().splitlines()] if log.exists() else []


def turn_key(messages: list[dict]) -> tuple[str, int]:
    """(conversation, turn) of a request: its first user message and how many it holds."""
    users = [m["content"] for m in messages if m["role"] == "user"]
    return users[0].split(",")[0], len(users) - 1


def test_every_turn_is_regenerated_in_order_on_the_models_own_answers(sim_servers, tmp_path):
    log = tmp_path / "requests.jsonl"
    prompts = write_conversations(tmp_path / "p.jsonl", 6, turns=3, singles=4)
    cfg, records = sim_servers(prompts=str(prompts), num_shards=1,
                               extra_server_args=["--sim-request-log", str(log)])
    result = ShardRun(cfg, [(r.url, r.api_key) for r in records], 0, "m", tuning=FAST).run()
    assert (result.done, result.failed) == (10, 0)

    requests = logged_requests(log)
    assert len(requests) == 6 * 3 + 4  # one request per user turn, nothing twice
    assert not any(ORIGINAL in json.dumps(m) for m in requests)  # the old answers are never sent
    # earlier answers go back as visible content only (SpecForge's way; the same prompt on every engine)
    assert not any("reasoning_content" in m for request in requests for m in request if m["role"] == "assistant")
    df = pd.read_parquet(RunLayout(cfg.output).data).set_index("id")
    for i in range(6):
        row = df.loc[f"c{i}"]
        messages = list(row["messages"])
        assert [m["role"] for m in messages] == ["system", "user", "assistant", "user", "assistant", "user"]
        earlier = [m for m in messages if m["role"] == "assistant"]
        assert all(m["content"] and m["content"] != ORIGINAL and m["reasoning_content"] for m in earlier)
        assert [t["finish_reason"] for t in row["turns"]] == ["stop"] * 3
        # turn k was asked with exactly the answers the row holds for turns before k
        for k in range(3):
            sent = [m for m in requests if turn_key(m) == (f"Conversation {i}", k)]
            assert len(sent) == 1
            assert [m["content"] for m in sent[0] if m["role"] == "assistant"] == [
                m["content"] for m in earlier[:k]]
        assert row["reasoning_content"] and row["content"]
    assert len(df.loc["s0"]["turns"]) == 1


def test_regenerate_turns_last_keeps_the_datasets_history(sim_servers, tmp_path):
    log = tmp_path / "requests.jsonl"
    prompts = write_conversations(tmp_path / "p.jsonl", 4, turns=3)
    cfg, records = sim_servers(prompts=str(prompts), num_shards=1, regenerate_turns="last",
                               extra_server_args=["--sim-request-log", str(log)])
    ShardRun(cfg, [(r.url, r.api_key) for r in records], 0, "m", tuning=FAST).run()
    requests = logged_requests(log)
    assert len(requests) == 4 and all(turn_key(m)[1] == 2 for m in requests)
    df = pd.read_parquet(RunLayout(cfg.output).data)
    assert all(m["content"] == ORIGINAL for row in df["messages"] for m in row if m["role"] == "assistant")
    assert all(len(t) == 1 for t in df["turns"])


def test_a_kill_mid_conversation_resumes_from_the_last_finished_turn(sim_servers, tmp_path):
    """SIGKILL while 3-turn conversations are under way; the rerun requests only the missing
    turns: every (conversation, turn) without a journaled answer, nothing else."""
    log = tmp_path / "requests.jsonl"
    prompts = write_conversations(tmp_path / "p.jsonl", 60, turns=3)
    cfg, records = sim_servers(prompts=str(prompts), num_shards=1, sim_tokens_per_second=400,
                               concurrency_per_server=4,
                               extra_server_args=["--sim-request-log", str(log)])
    output = tmp_path / "ds"
    args = cli("--prompts", cfg.prompts, "--output", str(output), "--endpoints", ",".join(r.url for r in records),
               "--num-shards", "1", "--concurrency-per-server", "4", "--api-key", records[0].api_key)
    journal = RunLayout(output).journal(0, 1)
    proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)

    def under_way() -> bool:
        partial = list(Journal.rows(journal, partial=True))
        return len({r["id"] for r in partial}) >= 15 and len(list(Journal.rows(journal))) >= 3

    kill_when(proc, under_way, records)
    finished, turns_done = journaled(journal)
    assert finished and any(0 < turns_done[i] < 3 for i in turns_done if i not in finished)
    expected = Counter()
    for i in range(60):
        if f"c{i}" not in finished:
            for k in range(turns_done[f"c{i}"], 3):
                expected[(f"Conversation {i}", k)] += 1

    log.unlink()
    rerun = subprocess.run(args, capture_output=True, text=True, timeout=300)
    assert rerun.returncode == 0, rerun.stderr[-2000:]
    assert Counter(turn_key(m) for m in logged_requests(log)) == expected
    df = pd.read_parquet(output / "data")
    assert sorted(df["id"]) == sorted(f"c{i}" for i in range(60))
    assert all(len(t) == 3 for t in df["turns"])


def test_the_export_holds_every_turn_and_passes_the_validators_rules(sim_servers, tmp_path):
    prompts = write_conversations(tmp_path / "p.jsonl", 5, turns=3, singles=5)
    cfg, records = sim_servers(prompts=str(prompts), num_shards=1)
    ShardRun(cfg, [(r.url, r.api_key) for r in records], 0, "m", tuning=FAST).run()
    out = tmp_path / "train.jsonl"
    result = export_sharegpt(cfg.output, out)
    assert (result.written, sum(result.left_out.values())) == (10, 0)
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    for line in lines:
        assert validator_problem(line) is None, (line["id"], validator_problem(line))
    assert Counter(sum(m["role"] == "assistant" for m in line["conversations"]) for line in lines) == {3: 5, 1: 5}


def expanded(conversation_file: Path) -> tuple[list[dict], int]:
    """SpecForge's scripts/expand_reasoning_conversations.py as its docs and code state it, in
    this test's own words: per valid conversation line, one event per assistant message, id
    ``ID#turnK`` (K counting assistant messages from 0), ``source_id``, ``source_row_index`` (the
    line's index), ``assistant_turn_index``, its messages the history up to that message with
    every earlier assistant message stripped of its reasoning, then that message whole; a
    conversation with any invalid turn is skipped whole. (events, skipped conversations)."""
    events, skipped = [], 0
    for index, line in enumerate(conversation_file.read_text().splitlines()):
        row = json.loads(line)
        if validator_problem(row) is not None:
            skipped += 1
            continue
        history, k = [], 0
        for message in row["conversations"]:
            if message["role"] == "assistant":
                events.append({"id": f"{row['id']}#turn{k}", "source_id": row["id"], "source_row_index": index,
                               "assistant_turn_index": k, "conversations": [*history, message],
                               "status": row["status"]})
                message = {key: v for key, v in message.items() if key != "reasoning_content"}
                k += 1
            history.append(message)
    return events, skipped


def test_the_events_export_is_specforges_expansion_of_the_conversation_file(sim_servers, tmp_path):
    prompts = write_conversations(tmp_path / "p.jsonl", 5, turns=3, singles=5)
    cfg, records = sim_servers(prompts=str(prompts), num_shards=1)
    ShardRun(cfg, [(r.url, r.api_key) for r in records], 0, "m", tuning=FAST).run()
    conversations, events = tmp_path / "train.jsonl", tmp_path / "events.jsonl"
    export_sharegpt(cfg.output, conversations)
    result = export_sharegpt(cfg.output, events, train_layout="events")
    expected, skipped = expanded(conversations)
    assert [json.loads(line) for line in events.read_text().splitlines()] == expected
    assert result.written == len(expected) == 5 * 3 + 5 and skipped == 0
    assert all("reasoning_content" in e["conversations"][-1] for e in expected)


def validator_problem(row: dict) -> str | None:
    """The rules of SpecForge's scripts/validate_regenerated_data.py with --expect-reasoning
    --strict-think-markers, as its README and code state them."""
    messages = row["conversations"]
    if row.get("status") != "success" or not isinstance(row.get("id"), str):
        return "status/id"
    expected, saw_user = "user", False
    for index, m in enumerate(messages):
        if not isinstance(m.get("content"), str) or not m["content"].strip():
            return f"message {index} content"
        if m["role"] == "system" and not saw_user:
            continue
        if m["role"] != expected:
            return f"message {index} role"
        saw_user, expected = True, "assistant" if m["role"] == "user" else "user"
        if m["role"] == "assistant":
            reasoning = m.get("reasoning_content")
            if not isinstance(reasoning, str) or not reasoning.strip():
                return f"assistant message {index} has empty reasoning_content"
            if any(t in (m["content"] + reasoning).lower() for t in ("<think>", "</think>")):
                return f"assistant message {index} think marker"
    return None if messages[-1]["role"] == "assistant" else "ends without assistant"


def test_the_export_leaves_out_a_history_the_validator_would_refuse(sim_servers, tmp_path):
    """regenerate_turns last keeps the dataset's history: no reasoning there, left out, counted."""
    prompts = write_conversations(tmp_path / "p.jsonl", 3, turns=2, singles=2)
    cfg, records = sim_servers(prompts=str(prompts), num_shards=1, regenerate_turns="last")
    ShardRun(cfg, [(r.url, r.api_key) for r in records], 0, "m", tuning=FAST).run()
    result = export_sharegpt(cfg.output, tmp_path / "train.jsonl")
    assert result.written == 2 and result.left_out == {"no reasoning": 3}
    events = export_sharegpt(cfg.output, tmp_path / "events.jsonl", train_layout="events")
    assert events.written == 2 and events.left_out == {"no reasoning": 3}  # skipped whole, as the expander does


def test_the_canary_takes_a_multi_turn_prompt_when_there_is_one(tmp_path):
    prompts = write_conversations(tmp_path / "p.jsonl", 1, turns=2, singles=30)
    lines = prompts.read_text().splitlines()
    prompts.write_text("\n".join(lines[1:] + lines[:1]) + "\n")  # the conversation comes last
    chosen, total = first_prompts(prompts, 8)
    assert total == 31 and len(chosen) == 8 and "c0" in [p.id for p in chosen]
    demo, _ = first_prompts(ROOT / "demo" / "prompts.jsonl", 8)
    assert any(sum(m["role"] == "user" for m in p.messages) > 1 for p in demo)


def test_a_truncated_earlier_turn_ends_its_conversation_as_an_error(sim_servers, tmp_path):
    """No later turn is built on an answer cut at max_tokens: the conversation stops there, as an
    error the audit counts (earlier_turn_cut); one-turn prompts, whose only turn is the last, are
    kept truncated as before."""
    log = tmp_path / "requests.jsonl"
    prompts = write_conversations(tmp_path / "p.jsonl", 3, turns=3, singles=2)
    cfg, records = sim_servers(prompts=str(prompts), num_shards=1, max_tokens=8, max_error_fraction=1.0,
                               extra_server_args=["--sim-request-log", str(log)])
    result = ShardRun(cfg, [(r.url, r.api_key) for r in records], 0, "m", tuning=FAST).run()
    assert (result.done, result.failed) == (2, 3)
    assert sorted(turn_key(m)[1] for m in logged_requests(log)) == [0, 0, 0, 0, 0]  # no turn 1 anywhere
    df = pd.read_parquet(RunLayout(cfg.output).data).set_index("id")
    for i in range(3):
        assert df.loc[f"c{i}", "error"].startswith("earlier turn unusable: turn 0 was truncated")
    assert pd.isna(df.loc["s0", "error"]) and df.loc["s0", "finish_reason"] == "length"
    report = audit_dataset(cfg.output, cfg.model_path, tmp_path / "audit", AuditThresholds(1, 1.0))
    assert report.summary.counts["earlier_turn_cut"] == 3
