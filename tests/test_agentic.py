"""Agentic conversations: every assistant message a step, the model's own tool calls, the recorded
results spliced in by call, a divergence ending the conversation (issue: agentic conversations).

Real simulated servers that answer tool calls as SGLang does and log every request they receive;
SIGKILL where the issue says killed."""

from __future__ import annotations

import json
import subprocess
from collections import Counter

import pandas as pd
import pytest

from regen.layout import RunLayout
from regen.manifest import Manifest
from regen.prompts import Prompt, PromptError, read_prompts
from support.data import TOOLS, agentic_messages, cli, journaled, kill_when, write_jsonl

OPENAI = {"id": "o", "tools": TOOLS, "messages": [
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
    {"role": "tool", "tool_call_id": "c1", "content": {"celsius": 18}},
    {"role": "assistant", "content": "18 C."}]}


def test_openai_and_sharegpt_spellings_become_one_shape(tmp_path):
    """Tool calls with object arguments, the older `function_call`, ShareGPT's `function_call`
    and `observation` turns with `tools` as a JSON string: one normalized conversation."""
    legacy = {"id": "l", "functions": None, "tools": TOOLS, "messages": [
        OPENAI["messages"][0], {"role": "assistant", "content": "", "function_call": {
            "name": "get_weather", "arguments": '{"city": "Paris"}'}},
        {"role": "function", "name": "get_weather", "content": '{"celsius": 18}'}, OPENAI["messages"][3]]}
    sharegpt = {"id": "s", "tools": json.dumps(TOOLS), "conversations": [
        {"from": "human", "value": "Weather in Paris?"},
        {"from": "function_call", "value": json.dumps({"name": "get_weather", "arguments": {"city": "Paris"}})},
        {"from": "observation", "value": '{"celsius": 18}'}, {"from": "gpt", "value": "18 C."}]}
    prompts = list(read_prompts(write_jsonl(tmp_path / "p.jsonl", [OPENAI, legacy, sharegpt])))
    assert all(isinstance(p, Prompt) and p.agentic and p.tools == TOOLS for p in prompts), prompts
    for p in prompts:
        user, call, result = p.messages  # the final answer is the step regenerated last
        assert call["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": '{"city": "Paris"}'}
        assert result == {"role": "tool", "tool_call_id": call["tool_calls"][0]["id"], "content": '{"celsius": 18}',
                          **({"name": "get_weather"} if p.id == "l" else {})}


@pytest.mark.parametrize("messages, rule, where", [
    ([{"role": "user", "content": "u"}, {"role": "tool", "content": "{}"}], "tool_message", "message 1"),
    ([{"role": "user", "content": "u"}, {"role": "assistant", "content": "", "tool_calls": [
        {"id": "a", "function": {"name": "get_time", "arguments": "{}"}}]},
      {"role": "tool", "tool_call_id": "b", "content": "{}"}], "tool_message", "tool_call_id 'b'"),
    ([{"role": "user", "content": "u"}, {"role": "assistant", "content": "", "tool_calls": [
        {"id": "a", "function": {"name": "get_time", "arguments": "{}"}}]}, {"role": "user", "content": "u2"}],
     "unanswered_call", "['get_time']"),
])
def test_what_cannot_be_replayed_is_refused_by_rule_naming_the_line(tmp_path, messages, rule, where):
    path = write_jsonl(tmp_path / "p.jsonl", [OPENAI, {"id": "bad", "messages": messages}])
    good, bad = read_prompts(path)
    assert isinstance(good, Prompt)
    assert isinstance(bad, PromptError) and (bad.rule, bad.line) == (rule, 2) and where in bad.reason, bad


def test_preflight_counts_agentic_rows_and_asks_for_the_tool_call_parser(make_config, tmp_path, qwen36_dir):
    """The parser it asks for is the one that reads the calls the model's template writes: Qwen3's
    JSON in <tool_call> (qwen25), Qwen3.5/3.6's <function=...> (qwen3_coder, never qwen25)."""
    from regen.pipeline import run
    from regen.preflight import PreflightFailed

    path = write_jsonl(tmp_path / "p.jsonl", [OPENAI, {"id": "chat", "prompt": "Hello?"}])
    for model, parser in ((None, "qwen25"), (qwen36_dir, "qwen3_coder")):
        with pytest.raises(PreflightFailed) as err:
            run("preflight", make_config(prompts=str(path), **({"model_path": str(model)} if model else {})))
        assert any("1 agentic conversations (tools, tool calls) and no tool_call_parser" in p
                   and f"({parser}: its chat template writes calls in that format)" in p for p in err.value.problems)
    result = run("preflight", make_config(prompts=str(path), tool_call_parser="qwen25"))
    assert result.info["agentic_prompts"] == 1 and "2 prompts, 1 of them agentic" in result.summary


FIVE = [["get_weather"], ["get_time"], ["get_date"], ["get_weather"]]  # four tool steps, then the answer
PARALLEL = [["get_weather", "get_time"], ["get_date"]]


def agentic_rows(five_step: int) -> list[dict]:
    """``five_step`` conversations of FIVE (ids a0, ...), one of PARALLEL, and one whose
    dataset recorded get_date where the prompt asks for get_time (its step 1 diverges)."""
    return [{"id": f"a{i}", "tools": TOOLS, "messages": agentic_messages(f"Agent {i}", FIVE)} for i in range(five_step)] + [
        {"id": "parallel", "tools": TOOLS, "messages": agentic_messages("Parallel", PARALLEL)},
        {"id": "diverges", "tools": TOOLS, "messages": agentic_messages(
            "Diverges", [["get_weather"], ["get_time"]], recorded=[["get_weather"], ["get_date"]])}]


def logged_steps(log) -> list[tuple[str, int]]:
    """(conversation, step) of every request a server received: its marker and how many
    assistant messages it already holds."""
    out = []
    for line in log.read_text().splitlines():
        messages = json.loads(line)["messages"]
        user = next(m["content"] for m in messages if m["role"] == "user")
        out.append((user.split(":")[0], sum(m["role"] == "assistant" for m in messages)))
    return out


def test_a_kill_mid_way_through_five_step_conversations_resumes_step_by_step(sim_servers, tmp_path):
    """Five-step conversations (four tool steps, then the answer), one with parallel calls,
    one whose model calls another tool than the dataset recorded, one preflight refuses;
    SIGKILL while they are under way; the rerun requests only the steps without a journaled
    answer, and the rows hold every recorded result after the model's own call, by call id."""
    rows = agentic_rows(24) + [{"id": "refused", "messages": [{"role": "user", "content": "Refused: hi"},
                                            {"role": "tool", "content": "a result nobody asked for"}]}]
    prompts = write_jsonl(tmp_path / "p.jsonl", rows)
    log = tmp_path / "requests.jsonl"
    cfg, records = sim_servers(prompts=str(prompts), num_shards=1, sim_tokens_per_second=400, concurrency_per_server=4,
                               tool_call_parser="qwen25", skip_invalid=True,
                               extra_server_args=["--sim-request-log", str(log)])
    output = tmp_path / "ds"
    args = cli("--prompts", cfg.prompts, "--output", str(output), "--endpoints", ",".join(r.url for r in records),
               "--num-shards", "1", "--concurrency-per-server", "4", "--api-key", records[0].api_key,
               "--tool-call-parser", "qwen25", "--skip-invalid")
    from regen.layout import RunLayout

    journal = RunLayout(output).journal(0, 1)
    proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)

    def under_way() -> bool:  # some finished, and one of the rest has a step journaled: the kill lands mid-way
        # (not "a step past the second": conversations go in waves, and under load the kill once
        # came after the first wave had finished and before the next had journaled a step)
        finished, done = journaled(journal)
        return bool(finished) and any(0 < done[i] < 5 for i in done if i not in finished)

    kill_when(proc, under_way, records)
    finished, done = journaled(journal)
    assert finished and any(0 < done[i] < 5 for i in done if i not in finished), (finished, done)
    steps = {f"a{i}": ("Agent " + str(i), 5) for i in range(24)} | {"parallel": ("Parallel", 3),
                                                                     "diverges": ("Diverges", 2)}
    expected = Counter({(marker, k): 1 for i, (marker, count) in steps.items() if i not in finished
                        for k in range(done[i], count)})

    assert not [k for k in logged_steps(log) if k[0] == "Refused"]  # preflight's refusal: never sent
    log.unlink()
    rerun = subprocess.run(args, capture_output=True, text=True, timeout=300)
    assert rerun.returncode == 0, rerun.stderr[-2000:]
    assert Counter(logged_steps(log)) == expected
    df = pd.read_parquet(output / "data").set_index("id")
    assert sorted(df.index) == sorted(steps)  # the refused row: never sent, no row
    for i in [f"a{i}" for i in range(24)] + ["parallel"]:
        messages = [{**m, "tool_calls": json.loads(m["tool_calls"]) if m["tool_calls"] else None}
                    for m in df.loc[i, "messages"]]
        calls = {c["id"]: c["function"]["name"] for m in messages for c in m["tool_calls"] or []}
        results = [m for m in messages if m["role"] == "tool"]
        assert len(results) == len(calls) == (2 * 1 + 1 if i == "parallel" else 4), (i, messages)
        for m in results:  # each recorded result answers the model's own call of that function
            recorded_id = m["content"].removeprefix("result of ")
            position = int(recorded_id.rsplit("-", 2)[1]), int(recorded_id.rsplit("-", 1)[1])
            assert calls[m["tool_call_id"]] == (FIVE if i != "parallel" else PARALLEL)[position[0]][position[1]]
        assert pd.isna(df.loc[i, "divergence"]) and df.loc[i, "spliced_results"] == len(results)
        assert df.loc[i, "argument_diffs"] == len(calls)  # the model's arguments kept, not the recorded ones
        assert df.loc[i, "finish_reason"] == "stop" and json.loads(df.loc[i, "tools"]) == TOOLS
    diverged = df.loc["diverges"]
    assert diverged["divergence"] == ("tool_divergence: step 1: the model called ['get_time'] where the recorded "
                                      "step calls ['get_date']")
    assert pd.isna(diverged["error"]) and json.loads(diverged["tool_calls"])[0]["function"]["name"] == "get_time"
    assert len(diverged["turns"]) == 2 and diverged["spliced_results"] == 1


def test_the_audit_counts_agentic_rows_and_the_viewer_shows_their_calls(sim_servers, tmp_path, tiny_model):
    """Agentic rows generated against the simulator (the tiny model's tokens, its template with
    tools): in both layouts the audit counts rows, steps, spliced results, changed arguments and
    divergences by kind, finds the generated tokens where the template renders them, and the
    samples viewer shows the calls and the results."""
    import pyarrow.parquet as pq

    from regen.audit.dataset import audit_dataset
    from regen.audit.findings import AuditThresholds
    from regen.generate import ShardRun

    rows = agentic_rows(6) + [{"id": "chat", "prompt": "Why is the sky blue?"}]
    cfg, records = sim_servers(prompts=str(write_jsonl(tmp_path / "p.jsonl", rows)), num_shards=1,
                               tool_call_parser="qwen25")
    ShardRun(cfg, [(r.url, r.api_key) for r in records], 0, "m").run()
    for layout, samples in (("conversation", 9), ("events", 6 * 5 + 3 + 2 + 1)):
        report = audit_dataset(cfg.output, tiny_model, tmp_path / layout, AuditThresholds(1, 1.0, train_layout=layout))
        assert report.summary.samples == samples
        assert report.to_json()["agentic"] == {"rows": 8, "steps": 6 * 5 + 3 + 2, "spliced_results": 6 * 4 + 3 + 1,
                                               "argument_diffs": 6 * 4 + 3 + 1,
                                               "divergences": {"another function": 1},
                                               "history_reasoning": {"tool_steps": 8}}  # the tiny Qwen3-style template's
        line = next(line for line in report.lines() if line.startswith("agentic: 8 rows, 35 steps, 28 recorded results"))
        assert line.endswith("; earlier reasoning sent back: tool_steps 8")
        assert report.passed  # 1 of 8 ended at a divergence; no bound given
        for bound, passed in ((0.1, False), (0.125, True)):
            bounded = audit_dataset(cfg.output, tiny_model, tmp_path / f"{layout}-{bound}",
                                    AuditThresholds(1, 1.0, train_layout=layout, max_divergence_fraction=bound))
            assert bounded.passed is passed and bounded.to_json()["divergence_fraction"] == 0.125
        findings = {s["id"]: s["findings"] for s in pq.read_table(tmp_path / layout / "samples.parquet").to_pylist()}
        assert not [i for i, f in findings.items() if "retokenized_differs" in f or "degenerate" in f], findings
        views = json.loads((tmp_path / layout / "samples_view.json").read_text())
        calls = [text for v in views for kind, text in v["segments"] if kind == "loss" and "<tool_call>" in text]
        results = [text for v in views for kind, text in v["segments"] if kind == "prompt" and "<tool_response>" in text]
        assert calls and results  # the calls trained on, the results in the prompt


def test_parallel_calls_in_another_order_diverge_and_are_never_spliced_onto_the_wrong_call():
    """The recorded step calls get_weather then get_date; a model that calls them the other way
    round would take each result under the other call's id: the step diverges instead, naming both."""
    from regen.turns import Conversation

    messages = agentic_messages("order", [["get_weather", "get_date"]])
    conversation = Conversation("order", messages, tools=TOOLS)
    swapped = [{"id": f"call-{i}", "type": "function", "function": {"name": name, "arguments": '{"city": "Paris"}'}}
               for i, name in enumerate(["get_date", "get_weather"])]
    reason = conversation.divergence({"tool_calls": swapped, "finish_reason": "tool_calls"})
    assert reason == ("tool_divergence: step 0: the model called ['get_date', 'get_weather'] where the "
                      "recorded step calls ['get_weather', 'get_date']")
    same = [dict(c, function=dict(c["function"])) for c in reversed(swapped)]
    assert conversation.divergence({"tool_calls": same, "finish_reason": "tool_calls"}) is None


@pytest.mark.parametrize("model, history_reasoning", [("qwen3", "template"), ("qwen36", "template"),
                                                      ("drops_reasoning", "template"), ("qwen3", "never")])
def test_a_step_is_asked_with_the_reasoning_the_models_template_renders(sim_servers, tmp_path, tiny_model,
                                                                        qwen3_tokenizer_dir, qwen36_dir, model,
                                                                        history_reasoning):
    """history_reasoning template: step k of the agent loop (after the last user message) is sent
    with step k-1's reasoning, and the server's template renders it into the prompt it serves; an
    earlier chat turn's reasoning is never sent (Qwen3's and Qwen3.6's templates drop it). A
    template that renders no earlier reasoning is sent none; history_reasoning never sends none."""
    import shutil

    from regen.chat.render import load_tokenizer
    from regen.generate import ShardRun
    from regen.preflight import preflight

    folder = tmp_path / "model"
    if model == "qwen36":
        folder = qwen36_dir
    else:
        shutil.copytree(tiny_model, folder)
        if model == "qwen3":  # the real Qwen3 tokenizer and its official template
            (folder / "chat_template.jinja").unlink()
            for name in ("tokenizer.json", "tokenizer_config.json"):
                shutil.copy(qwen3_tokenizer_dir / name, folder / name)
        else:
            template = folder / "chat_template.jinja"
            template.write_text(template.read_text().replace("(loop.index0 > last_user.index and reasoning)", "false"))
    loop = agentic_messages("Loop", [["get_weather"], ["get_time"]])
    chat = agentic_messages("Chat", [["get_weather"], ["get_time"]]) + [
        {"role": "user", "content": "And tomorrow?"}, {"role": "assistant", "content": "Also fine."}]
    prompts = write_jsonl(tmp_path / "p.jsonl", [{"id": "loop", "tools": TOOLS, "messages": loop},
                                                 {"id": "chat", "tools": TOOLS, "messages": chat}])
    log = tmp_path / "requests.jsonl"
    cfg, records = sim_servers(model_path=str(folder), prompts=str(prompts), num_servers=1, num_shards=1,
                               tool_call_parser="qwen3_coder" if model == "qwen36" else "qwen25",
                               sim_follow_recorded=True, history_reasoning=history_reasoning,
                               extra_server_args=["--sim-request-log", str(log)])
    preflight(cfg, code=False)
    ShardRun(cfg, [(r.url, r.api_key) for r in records], 0, "m").run()

    rows = pd.read_parquet(f"{cfg.output}/data").set_index("id")
    assert rows["error"].isna().all() and [len(rows.loc[i, "turns"]) for i in ("loop", "chat")] == [3, 4]
    sent_any = history_reasoning == "template" and model != "drops_reasoning"
    requests = [json.loads(line)["messages"] for line in log.read_text().splitlines()]
    assert len(requests) == 7
    for marker in ("Loop", "Chat"):
        reasoning = [m["reasoning_content"] for m in rows.loc[marker.lower(), "messages"] if m["role"] == "assistant"]
        assert all(reasoning)
        asked = [r for r in requests if r[1]["content"].startswith(marker)]
        for k, request in enumerate(sorted(asked, key=len)):
            last_user = max(i for i, m in enumerate(request) if m["role"] == "user")
            steps = [(i, m) for i, m in enumerate(request) if m["role"] == "assistant"]
            assert len(steps) == k
            for step, (i, message) in enumerate(steps):  # after the last user message: the loop's steps
                expected = reasoning[step] if sent_any and i > last_user else None
                assert message.get("reasoning_content") == expected, (marker, k, step, message)
    # At the server: the loop's last step was served a prompt holding both earlier steps' reasoning
    # exactly when it was sent; after the second user message no template renders the loop's.
    tokenizer = load_tokenizer(str(folder))
    for i, rendered in (("loop", sent_any), ("chat", False)):
        prompt = tokenizer.decode(rows.loc[i, "prompt_token_ids"])
        reasoning = [m["reasoning_content"] for m in rows.loc[i, "messages"] if m["role"] == "assistant"]
        assert [r in prompt for r in reasoning[:2]] == [rendered, rendered], (i, prompt)
    # Training sees each step with the context it was generated from: the row says what was sent,
    # and the events of the audit (and of the export) keep exactly that reasoning in their history.
    from regen.layout import RunLayout
    from regen.rows import iter_batches
    from regen.training import training_samples

    assert rows["history_reasoning"].fillna("none").tolist() == ["tool_steps" if sent_any else "none"] * 2
    loop_row = [r for batch in iter_batches(RunLayout(cfg.output)) for r in batch if r["id"] == "loop"]
    events = training_samples(loop_row, "events", True)
    reasoning = [m["reasoning_content"] for m in rows.loc["loop", "messages"] if m["role"] == "assistant"]
    for k, event in enumerate(events):
        kept = [m.get("reasoning_content") for m in event["messages"] if m["role"] == "assistant"]
        assert kept == (reasoning[:k] if sent_any else [None] * k), (k, event["messages"])


def test_a_run_against_endpoints_sends_history_reasoning_as_the_served_models_template_says(sim_servers, tmp_path,
                                                                                           tiny_model):
    """`regen generate --endpoints` with no model named: the run's model_path is the demo model,
    whose template renders an agent loop's earlier reasoning; the servers serve a model whose
    template renders none. The decision follows the served template (/server_info's model_path):
    no step is sent an earlier step's reasoning, where the demo model's template would send it."""
    import shutil

    from regen.chat.render import history_reasoning_rendered, load_tokenizer
    from regen.config import RunConfig

    demo = RunConfig.model_fields["model_path"].default
    assert history_reasoning_rendered(load_tokenizer(demo), True)["tool_steps"]  # the demo's says: send it
    served = tmp_path / "served-model"
    shutil.copytree(tiny_model, served)
    template = served / "chat_template.jinja"
    template.write_text(template.read_text().replace("(loop.index0 > last_user.index and reasoning)", "false"))
    assert not history_reasoning_rendered(load_tokenizer(str(served)), True)["tool_steps"]
    prompts = write_jsonl(tmp_path / "p.jsonl", [{"id": f"loop{i}", "tools": TOOLS,
                                                  "messages": agentic_messages(f"Loop {i}", [["get_weather"], ["get_time"]])}
                                                 for i in range(3)])
    log = tmp_path / "requests.jsonl"
    _, records = sim_servers(model_path=str(served), prompts=str(prompts), num_servers=1, tool_call_parser="qwen25",
                             sim_follow_recorded=True,
                             extra_server_args=["--sim-request-log", str(log)])
    done = subprocess.run(cli("--prompts", str(prompts), "--output", str(tmp_path / "ds"), "--endpoints", records[0].url,
                              "--api-key", records[0].api_key, "--tool-call-parser", "qwen25"),
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    requests = [json.loads(line)["messages"] for line in log.read_text().splitlines()]
    steps = [m for request in requests for m in request if m["role"] == "assistant"]
    assert len(requests) == 9 and len(steps) == 3 * (0 + 1 + 2)  # each step after the first had earlier ones
    assert not any(m.get("reasoning_content") for m in steps)
    rows = pd.read_parquet(tmp_path / "ds" / "data")
    assert rows["error"].isna().all() and rows["history_reasoning"].isna().all()


def test_first_steps_go_out_while_the_template_decides_what_later_steps_send(sim_servers, tmp_path, tiny_model,
                                                                            monkeypatch):
    """Deciding what a later step sends renders the served template with transformers (seconds,
    in every shard process). A first step carries no earlier one, so the run's first requests go
    out while it is decided; the rows record the decision, and the manifest keeps it by the
    template's text, so that a staged copy's shards (and the next process) render nothing."""
    import shutil
    import threading

    from regen import client, generate as stage
    from regen.chat.render import template_digest

    prompts = write_jsonl(tmp_path / "p.jsonl", [{"id": f"loop{i}", "tools": TOOLS,
                                                  "messages": agentic_messages(f"Loop {i}", [["get_weather"], ["get_time"]])}
                                                 for i in range(3)])
    cfg, records = sim_servers(model_path=str(tiny_model), prompts=str(prompts), num_servers=1,
                               tool_call_parser="qwen25", sim_follow_recorded=True)
    sent = threading.Event()
    payload, probed = client.Generator.payload, stage.reasoning_probed

    def sending(self, endpoint, request):
        sent.set()
        return payload(self, endpoint, request)

    def after_a_request_went_out(model, enable_thinking, manifest=None, in_child=False):
        assert sent.wait(60), "no request went out while the template was being decided"
        return probed(model, enable_thinking, manifest, in_child)

    monkeypatch.setattr(client.Generator, "payload", sending)
    monkeypatch.setattr(stage, "reasoning_probed", after_a_request_went_out)
    monkeypatch.setattr(stage, "findings_folder", lambda: tmp_path / "findings")  # a render of its own
    result = stage.generate(cfg, [0], endpoints=[records[0].url])
    assert result.failed == 0
    rows = pd.read_parquet(cfg.layout.data)
    assert rows["error"].isna().all() and set(rows["history_reasoning"]) == {"tool_steps"}
    record = Manifest(cfg.layout).read()["history_reasoning"]
    assert record["template"] == template_digest(tiny_model) and record["tool_steps"] and not record["chat_turns"]
    staged = tmp_path / "dev-shm-copy"
    shutil.copytree(tiny_model, staged)
    assert stage.reasoning_recorded(cfg, Manifest(cfg.layout).read(), [str(staged)]) == (False, True)


def test_a_served_template_that_loops_on_the_probe_ends_in_its_budget_and_sends_at_both(tmp_path, tiny_model,
                                                                                         monkeypatch):
    """The probe of the served template runs in a child held to preflight's template budget (a
    thread has no render bound): a template that loops on an earlier step's reasoning passes it,
    and the run sends reasoning at both places, as for any template that fails to render."""
    import shutil
    import time

    from regen import generate as stage
    from regen.preflight import template as budget

    served = tmp_path / "looping-model"
    shutil.copytree(tiny_model, served)
    template = served / "chat_template.jinja"
    template.write_text("{%- for message in messages if message.reasoning_content is defined %}"
                        "{%- for i in range(100000) %}{%- for j in range(100000) %}{%- endfor %}{%- endfor %}"
                        "{%- endfor %}" + template.read_text())
    monkeypatch.setattr(budget, "TEMPLATE_SECONDS", 3.0)
    monkeypatch.setattr(stage, "findings_folder", lambda: tmp_path / "findings")
    manifest = Manifest(RunLayout(str(tmp_path / "out")))
    started = time.monotonic()
    assert stage.reasoning_probed(str(served), True, manifest, in_child=True) == (True, True)
    assert time.monotonic() - started < 30
    assert manifest.read()["history_reasoning"]["failed"].startswith("OverBudget")
    # kept: the next process (or one waiting on the first) does not spend the budget again
    monkeypatch.setattr(budget, "TEMPLATE_SECONDS", 600.0)
    started = time.monotonic()
    assert stage.reasoning_probed(str(served), True, manifest, in_child=True) == (True, True)
    assert time.monotonic() - started < 2
    assert not (tmp_path / "findings").exists()  # the output's record only: a busy node's timeout is not the template's


def test_shard_processes_started_together_render_the_template_once(tmp_path, tiny_model, monkeypatch):
    """Every `regen generate --shard` process of a CLI run probes the template (seconds of CPU
    each; seven of them on a 2-core node ate the cores their first requests needed): one renders
    it, the others wait on its lock off their event loops and take its record; a later run on a
    new output takes this user's finding for the same template text. Threads here, each with a
    lock descriptor of its own, as processes have."""
    import shutil
    import threading
    from concurrent.futures import ThreadPoolExecutor

    from regen import generate as stage
    from regen.chat import render
    from regen.coordination import FileLock

    manifest = Manifest(RunLayout(str(tmp_path / "out")))
    waiting, renders, all_waiting = [], [], threading.Event()
    probe = render.history_reasoning_of

    acquire = FileLock.acquire

    def counted(self, blocking=True):
        if self.path == manifest.layout.template_probe_lock:
            waiting.append(1)
            if len(waiting) == 4:
                all_waiting.set()
        acquire(self, blocking)

    def rendered_once_all_wait(model, thinking):
        renders.append(model)
        assert all_waiting.wait(20), "the other callers never came to the lock"
        return probe(model, thinking)

    monkeypatch.setattr(FileLock, "acquire", counted)
    monkeypatch.setattr(stage, "findings_folder", lambda: tmp_path / "findings")
    monkeypatch.setattr(render, "history_reasoning_of", rendered_once_all_wait)
    with ThreadPoolExecutor(4) as pool:
        found = list(pool.map(lambda _: stage.reasoning_probed(str(tiny_model), True, manifest), range(4)))
    assert found == [(False, True)] * 4 and renders == [str(tiny_model)]
    # a later run on another output of this node: the user's finding for this template text
    later = Manifest(RunLayout(str(tmp_path / "later")))
    assert stage.reasoning_probed(str(tiny_model), True, later) == (False, True) and len(renders) == 1
    assert later.read()["history_reasoning"]["tool_steps"]
    # a template edited in place between two runs on one output is probed again, not taken by its path
    edited = tmp_path / "edited-model"
    shutil.copytree(tiny_model, edited)
    again = Manifest(RunLayout(str(tmp_path / "again")))
    stage.reasoning_probed(str(edited), True, again)
    assert again.read()["history_reasoning"]["model_path"] == str(edited) and len(renders) == 1
    (edited / "chat_template.jinja").write_text((edited / "chat_template.jinja").read_text() + "{#- edited #}")
    stage.reasoning_probed(str(edited), True, again)
    assert len(renders) == 2
