"""The seed's own model family rehearsed end to end on a CPU: a Qwen3.6-shaped config (the VL
config layout, a generation prompt that opens the think block, <function=...> calls read by
qwen3_coder, max_tokens 32768) over multi-turn and agentic rows, through the real DAG
(``dag.test()`` on the metadata DB), the simulator serving the Qwen3.6-layout model directory
and calling what the data records (``sim_follow_recorded``)."""

from __future__ import annotations

import json

import pandas as pd
import pyarrow.parquet as pq

from support.airflow import _conf, _states, assert_no_server_left
from support.data import write_jsonl

TOOLS = [{"type": "function", "function": {"name": name, "description": what, "parameters": {
    "type": "object", "properties": properties, "required": sorted(properties)}}}
    for name, what, properties in (
        ("search", "Search the web.", {"query": {"type": "string"}, "limit": {"type": "integer"}}),
        ("get_weather", "The weather of a city.", {"city": {"type": "string"}, "days": {"type": "integer"}}),
        ("get_time", "The local time of a city.", {"city": {"type": "string"}}))]


def _call(i: str, name: str, **arguments) -> dict:
    return {"id": i, "type": "function", "function": {"name": name, "arguments": json.dumps(arguments)}}


def agentic_row(n: int, city: str) -> dict:
    """A research agent's conversation: a search, two calls at once, an answer, then a second user
    turn and one more call; the user never names the tools."""
    return {"id": f"agent-{n}", "tools": TOOLS, "messages": [
        {"role": "system", "content": "You are a travel research agent. Use the tools before answering."},
        {"role": "user", "content": f"I fly to {city} on Friday. What should I pack, and when do I land locally?"},
        {"role": "assistant", "content": "", "tool_calls": [_call("r1", "search", query=f"{city} in spring", limit=3)]},
        {"role": "tool", "tool_call_id": "r1", "content": f"1. {city} in spring: mild, showers. 2. ... 3. ..."},
        {"role": "assistant", "content": "", "tool_calls": [_call("r2", "get_weather", city=city, days=2),
                                                            _call("r3", "get_time", city=city)]},
        {"role": "tool", "tool_call_id": "r2", "content": "Fri 14 C rain; Sat 17 C sun"},
        {"role": "tool", "tool_call_id": "r3", "content": "09:40 local"},
        {"role": "assistant", "content": f"Pack a rain jacket; {city} is at 09:40 now."},
        {"role": "user", "content": "And on Sunday?"},
        {"role": "assistant", "content": "", "tool_calls": [_call("r4", "get_weather", city=city, days=3)]},
        {"role": "tool", "tool_call_id": "r4", "content": "Sun 19 C sun"},
        {"role": "assistant", "content": "Sunny, 19 C."}]}


def chat_row(n: int) -> dict:
    return {"id": f"chat-{n}", "messages": [
        {"role": "system", "content": "Answer briefly."},
        {"role": "user", "content": f"Question {n}: why do leaves change colour?"},
        {"role": "assistant", "content": "Chlorophyll breaks down."},
        {"role": "user", "content": "And why red?"},
        {"role": "assistant", "content": "Anthocyanins."}]}


def test_a_qwen36_shaped_config_rehearses_agentic_and_multi_turn_rows_to_a_pass(
        airflow_db, deployed_dag, make_config, qwen36_dir, tmp_path):
    cities = ["Lisbon", "Kyoto", "Oslo", "Lima", "Perth", "Quito"]
    prompts = write_jsonl(tmp_path / "agentic.jsonl",
                          [agentic_row(n, c) for n, c in enumerate(cities)] + [chat_row(n) for n in range(4)])
    cfg = make_config(model_path=str(qwen36_dir), prompts=str(prompts), num_shards=2, max_tokens=32768,
                      reasoning_parser="qwen3", tool_call_parser="qwen3_coder", train_template="qwen3.5",
                      sim_follow_recorded=True)
    run = deployed_dag(cfg).test(run_conf=_conf(cfg))
    states = _states(run)
    assert run.state == "success", states
    assert states["canary"] == ["success"] and states["audit"] == ["success"], states

    df = pd.read_parquet(f"{cfg.output}/data").set_index("id")
    assert len(df) == 10 and df["error"].isna().all()
    agents = df.loc[[f"agent-{n}" for n in range(6)]]
    assert agents["divergence"].isna().all()  # every row went to its last step
    assert (agents["spliced_results"] == 4).all()  # every recorded result answers the model's own call
    assert (agents["argument_diffs"] == 0).all()  # typed arguments survive <function=...> and qwen3_coder
    assert all(len(turns) == 5 for turns in agents["turns"])
    assert all(len(turns) == 2 for turns in df.loc[[f"chat-{n}" for n in range(4)]]["turns"])

    summary = json.loads((tmp_path / "out" / "audit" / "summary.json").read_text())
    assert summary["verdict"] == "PASS", summary
    assert summary["agentic"]["rows"] == 6 and summary["agentic"]["spliced_results"] == 24
    findings = [f for s in pq.read_table(tmp_path / "out" / "audit" / "samples.parquet").to_pylist()
                for f in s["findings"]]
    assert "retokenized_differs" not in findings and not [f for f in findings if "degenerate" in f], findings
    assert_no_server_left(cfg)
