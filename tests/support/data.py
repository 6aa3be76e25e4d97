"""Prompts, conversations and generated rows written the way users and regen write them."""

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from regen.dispatch import ClientTuning
from regen.rows import ROW_SCHEMA
from support.engines import sim_running
from support.paths import BIN, ROOT
from support.processes import wait_until

QUESTION = [{"role": "user", "content": "Reply with OK."}]
DEMO = [json.loads(line) for line in (ROOT / "demo" / "prompts.jsonl").read_text().splitlines()]
ORIGINAL = "THE DATASET'S OLD ANSWER"
# A chat template that doubles a string 31 times when an assistant answer is longer than 40
# characters: preflight's samples pass; real answers would make it build 2 GiB (3 GiB touched).
DOUBLING_ON_LONG_ANSWERS = ("{%- for message in messages if message.role == 'assistant' and message.content | length > 40 %}"
                            "{%- set ns = namespace(s='x') %}{%- for i in range(31) %}{%- set ns.s = ns.s ~ ns.s %}"
                            "{%- endfor %}{%- endfor %}")


def as_after_preflight(cfg) -> None:
    """The template's finding on earlier reasoning in ``cfg``'s manifest, as a DAG run's preflight
    leaves it: a shard started directly then renders nothing (the probe's child, seconds on a busy
    machine, would delay its first rows past a test's short deadline)."""
    from regen.generate import reasoning_probed
    from regen.manifest import Manifest

    reasoning_probed(cfg.model_path, cfg.enable_thinking, Manifest(cfg.layout))


def turn_requests(path: Path, ids=None) -> dict[str, int]:
    """Per prompt (of ``ids``, default all): the requests it makes with regenerate_turns all,
    one per user turn."""
    from regen.prompts import Prompt, read_prompts
    from regen.turns import steps

    return {p.id: steps(p.messages) for p in read_prompts(path)
            if isinstance(p, Prompt) and (ids is None or p.id in ids)}


def read_ids(path: Path) -> list[str]:
    from regen.prompts import Prompt, read_prompts

    return [p.id for p in read_prompts(path) if isinstance(p, Prompt)]


def row(i, reasoning="Let me think about this step by step. " * 6, content="The answer is 4.",
        finish="stop", error=None, thinking=True, messages=QUESTION, completion=60, rid=None):
    return {"id": rid or f"s{i}", "messages": messages, "reasoning_content": reasoning,
            "content": content, "finish_reason": finish, "prompt_tokens": 10,
            "completion_tokens": completion, "error": error, "enable_thinking": thinking,
            "model": "m", "server": "http://s", "attempts": 1, "latency_s": 1.0,
            "settings_hash": "x"}


def write_dataset(path, rows, files=2):
    path.mkdir(parents=True)
    for f in range(files):
        part = rows[f::files]
        pq.write_table(pa.Table.from_pylist(part, schema=ROW_SCHEMA), path / f"shard-{f}.parquet")
    return path


FAST = ClientTuning(retry_backoff_s=0.02, retry_backoff_max_s=0.2, probe_interval_s=0.1,
                    progress_interval_s=0.5, all_down_timeout_s=10)


def write_prompts(path: Path, count: int, drop=(), edit=()) -> Path:
    """``count`` prompts with ids p0..; ``drop`` leaves ids out, ``edit`` changes their text."""
    with path.open("w") as fh:
        for i in range(count):
            if i in drop:
                continue
            record = dict(DEMO[i % len(DEMO)], id=f"p{i}")
            if i in edit:
                record = {"id": f"p{i}", "prompt": f"An edited question, number {i}?"}
            fh.write(json.dumps(record) + "\n")
    return path


def cli(*args: str) -> list[str]:
    return [str(BIN / "regen"), "--no-progress-bar", "generate", *args]


def settle(records) -> None:
    """Requests in flight at a kill finish on the servers before anything is counted."""
    for r in records:
        wait_until(lambda: sim_running(r.url) == 0, 30, "servers idle")


def write_conversations(path: Path, count: int, turns: int = 3, singles: int = 0) -> Path:
    """``count`` conversations of ``turns`` user turns, each followed by the dataset's own
    assistant answer except the last; ``singles`` one-turn prompts after them."""
    with path.open("w") as fh:
        for i in range(count):
            messages = [{"role": "system", "content": "Be brief."}]
            for k in range(turns):
                messages.append({"role": "user", "content": f"Conversation {i}, question {k}: why is the sky blue?"})
                if k < turns - 1:
                    messages.append({"role": "assistant", "content": ORIGINAL})
            fh.write(json.dumps({"id": f"c{i}", "messages": messages}) + "\n")
        for i in range(singles):
            fh.write(json.dumps({"id": f"s{i}", "prompt": f"Single question {i}?"}) + "\n")
    return path


TOOLS = [{"type": "function", "function": {"name": name, "description": f"The {what} of a city.", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
    for name, what in (("get_weather", "weather"), ("get_time", "local time"), ("get_date", "date"))]


def agentic_messages(marker: str, plan: list[list[str]], recorded: list[list[str]] | None = None) -> list[dict]:
    """A conversation whose user asks for ``plan`` (the simulator's ``[tools: a+b; c]``: calls
    made at once, then the next) and whose dataset holds the ``recorded`` calls (default: the
    plan), each answered by its result, then a final answer."""
    text = "; ".join("+".join(group) for group in plan)
    messages = [{"role": "system", "content": "Use the tools."},
                {"role": "user", "content": f"{marker}: what about Paris? [tools: {text}]"}]
    for k, group in enumerate(recorded or plan):
        calls = [{"id": f"{marker}-{k}-{j}", "type": "function",
                  "function": {"name": name, "arguments": json.dumps({"city": "Paris"})}}
                 for j, name in enumerate(group)]
        messages.append({"role": "assistant", "content": "", "tool_calls": calls})
        messages += [{"role": "tool", "tool_call_id": c["id"], "content": f"result of {c['id']}"} for c in calls]
    messages.append({"role": "assistant", "content": "Done: it is fine in Paris."})
    return messages


def write_jsonl(path: Path, records: list) -> Path:
    """One record a line: an object as JSON, a string as it is (a broken line, on purpose)."""
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records))
    return path


def kill_when(proc, ready, records) -> None:
    """SIGKILL ``proc`` once ``ready()`` holds (or it ended by itself), then let the servers
    finish what was in flight before anything is counted."""
    import signal

    try:
        wait_until(lambda: ready() or proc.poll() is not None, 120, "conversations under way", max_pause=0.02)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    settle(records)


def journaled(journal: Path):
    """(the conversations a journal holds finished, a Counter of the steps each has done)."""
    from collections import Counter

    from regen.store import Journal

    done: Counter = Counter()
    for row in Journal.rows(journal, partial=True):
        done[row["id"]] = max(done[row["id"]], row["turn"] + 1)
    return {r["id"] for r in Journal.rows(journal)}, done
