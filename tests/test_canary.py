"""The canary through the real client and audit, against simulated servers."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from regen.canary import CanaryFailed, calls_not_parsed, canary, run_scope
from support.data import TOOLS, agentic_messages, as_after_preflight, write_jsonl
from support.paths import ROOT


def test_a_healthy_canary_passes_and_estimates_the_run(sim_servers):
    cfg, records = sim_servers(num_servers=2, sim_tokens_per_second=500)
    estimate = canary(cfg).estimate
    assert estimate["prompts"] == 280
    assert estimate["text"].startswith("280 prompts, about ")
    assert "tok/s" in estimate["text"]
    assert estimate["device_unit"] == "server-hours" and estimate["devices"] == 2  # the simulator has no GPU
    assert estimate["text"].endswith(f"; 2 servers: {estimate['device_hours']:,.1f} server-hours")
    assert estimate["device_hours"] == pytest.approx(estimate["eta_s"] / 3600 * 2, abs=0.01)
    progress = json.loads((Path(cfg.output) / "progress.json").read_text())
    assert progress["canary"]["passed"] is True
    assert progress["canary"]["estimate"]["tokens_per_sample"] > 40


def test_the_estimate_of_a_resumed_run_or_a_trial_is_for_what_is_left_to_do(sim_servers, tmp_path):
    """Half the shards written: the estimate before approval counts the rows still to come, says
    what share is done, and is about half the fresh run's time; a trial's is for its N prompts."""
    from regen.generate import ShardRun

    cfg, records = sim_servers(num_servers=2, sim_tokens_per_second=500, num_shards=2)
    fresh = canary(cfg).estimate
    done = ShardRun(cfg, [(r.url, r.api_key) for r in records], 0, "m").run().done
    resumed = canary(cfg).estimate
    assert resumed["done"] == done and resumed["prompts_total"] == 280 and resumed["prompts"] == 280 - done
    assert resumed["text"].startswith(f"{280 - done:,} of 280 prompts to go ({done / 280:.0%} done), about ")
    assert 0.3 < resumed["eta_s"] / fresh["eta_s"] < 0.7, (resumed, fresh)
    assert run_scope(cfg.model_copy(update={"limit": 40}), 280) == (40, 0)  # a trial's own folder: none done


def test_answers_cut_at_max_tokens_fail_the_canary_with_a_sample(sim_servers):
    cfg, records = sim_servers(num_servers=1, max_tokens=20, min_loss_tokens=4)
    with pytest.raises(CanaryFailed) as err:
        canary(cfg)
    message = str(err.value)
    # The value to set, from what the canary saw: every answer was cut, so twice the cut, rounded up.
    assert ("answers hit max_tokens 20 (above max_truncated_fraction 10%): raise max_tokens to at least 1,024 "
            "(no answer finished; the model's traces are longer)") in message
    assert "answers are empty" in message  # cut inside the thinking: no answer at all
    assert '"finish_reason": "length"' in message
    with pytest.raises(CanaryFailed) as err:  # the bound is the run's: every answer cut may be what it wants
        canary(cfg.model_copy(update={"max_truncated_fraction": 1.0}))
    assert "hit max_tokens" not in str(err.value) and "answers are empty" in str(err.value)


def test_servers_without_thinking_fail_naming_the_reason(sim_servers):
    cfg, records = sim_servers(num_servers=1, sim_ignore_thinking=True)
    with pytest.raises(CanaryFailed, match="without reasoning while enable_thinking is on"):
        canary(cfg)


def test_thinking_off_on_purpose_is_judged_by_the_loss_mask_only(sim_servers):
    cfg, records = sim_servers(num_servers=1, enable_thinking=False, min_loss_tokens=4,
                               train_template="qwen3-instruct")
    assert canary(cfg).estimate["prompts"] == 280


def test_thinking_asked_off_that_comes_back_thinking_fails_the_canary_and_the_audit(sim_servers, tmp_path):
    """The mirror of the seed's disaster: the request said no thinking, the server thought anyway
    (a template that ignores the flag); with a reasoning parser the trace is split off and every
    other check passes."""
    from regen.audit.dataset import audit_rows
    from regen.audit.findings import AuditThresholds
    from regen.generate import generate_rows
    from regen.prompts import read_prompts

    cfg, records = sim_servers(num_servers=1, enable_thinking=False, min_loss_tokens=4,
                               train_template="qwen3-instruct", extra_server_args=["--sim-always-think"])
    with pytest.raises(CanaryFailed, match=r"8 of 8 answers came back with reasoning while enable_thinking is off"):
        canary(cfg)
    rows, _ = generate_rows(cfg, list(read_prompts(cfg.prompts))[:4], [(r.url, r.api_key) for r in records])
    summary, _, results, _ = audit_rows(rows, cfg.model_path, AuditThresholds.from_config(cfg), False)
    assert all({"thinking_mode_mismatch", "degenerate"} <= set(r["findings"]) for r in results)
    assert summary.counts["thinking_mode_mismatch"] == len(results) > 0


def test_thinking_off_for_a_thinking_template_fails_the_canary(sim_servers):
    """The seed's lesson, before any shard: answers without reasoning, for a drafter trained with
    a thinking template, are left out of its training data, whatever their length."""
    cfg, records = sim_servers(num_servers=1, enable_thinking=False, train_template="qwen3-thinking")
    with pytest.raises(CanaryFailed, match="degenerate"):
        canary(cfg)


def test_the_estimate_accounts_for_batching_and_holds_on_the_run(sim_servers, tmp_path):
    """Servers that batch (each request slower as the batch fills): the canary's estimate of
    the whole run is within 25% of the run's own time. The former estimate (one request's
    speed x slots) was the time of a server that does not slow down."""
    from regen.generate import ShardRun

    cfg, records = sim_servers(num_servers=2, sim_tokens_per_second=300, concurrency_per_server=None,
                               extra_server_args=["--sim-batch-slowdown", "0.08", "--max-running-requests", "8"])
    estimate = canary(cfg).estimate
    assert estimate["batch_slowdown"] > 0.02, estimate
    fresh = cfg.model_copy(update={"output": str(tmp_path / "run"), "num_shards": 1})
    as_after_preflight(fresh)  # the probe's child is no part of what the canary estimates
    result = ShardRun(fresh, [(r.url, r.api_key) for r in records], 0, "m").run()
    assert result.failed == 0
    assert abs(estimate["eta_s"] - result.seconds) / result.seconds < 0.25, (estimate, result.seconds)


@pytest.mark.parametrize("parser", ["qwen25", None, "qwen3_coder"])
def test_a_tool_call_parser_that_does_not_read_the_models_calls_fails_the_canary(sim_servers, tmp_path, parser):
    """The canary takes an agentic prompt (the file's last here). The parser for the simulator's
    Qwen3 calls passes; none leaves the calls as text in the answer, and qwen3_coder (the parser of
    another call format) drops them, as SGLang does: either way every agentic row would end at its
    first step, and the canary says so, naming the field."""
    single = (ROOT / "demo" / "prompts.jsonl").read_text().splitlines()[:20]
    prompts = write_jsonl(tmp_path / "prompts.jsonl", [*single, {
        "id": "agent", "tools": TOOLS, "messages": agentic_messages("Agent", [["get_weather"], ["get_time"]])}])
    cfg, records = sim_servers(num_servers=1, prompts=str(prompts), tool_call_parser=parser)
    if parser == "qwen25":
        agent = canary(cfg).examples[0]  # examples are sorted by id
        assert (agent["id"], agent["turns"]) == ("agent", 3)  # two calls spliced, then the answer
        return
    with pytest.raises(CanaryFailed) as err:
        canary(cfg)
    message = str(err.value)
    assert "1 of 1 agentic conversations came back with no structured tool_calls where the model " \
           "wrote a call" in message
    assert f"tool_call_parser {parser!r}" in message and '"id": "agent"' in message


def test_an_empty_answer_is_a_dropped_call_only_where_the_dataset_calls():
    """An answer that stopped empty at the step where the dataset called a tool is SGLang's dropped
    call; an empty final answer after the spliced results (the tiny model on vLLM gave some) is the
    model's own, and the audit's business, not the parser's."""
    from regen.prompts import Prompt, request_messages

    messages = request_messages(agentic_messages("Agent", [["get_weather"]]))
    prompt = Prompt("a", messages, line=1, tools=TOOLS)
    step = {"finish_reason": "stop", "prompt_tokens": 1, "completion_tokens": 1, "completion_token_ids": None}
    row = {"id": "a", "tools": json.dumps(TOOLS), "tool_calls": None, "content": "", "finish_reason": "stop"}
    at_the_call = {**row, "error": "earlier_turn_cut: turn 0 came back with an empty answer", "turns": []}
    at_the_answer = {**row, "error": None, "turns": [step, step]}
    assert calls_not_parsed([at_the_call, at_the_answer], [prompt]) == [at_the_call]
    as_text = {**at_the_answer, "content": '<tool_call>\n{"name": "get_weather", "arguments": {}}\n</tool_call>'}
    assert calls_not_parsed([as_text], [prompt]) == [as_text]


def test_the_concurrency_sweep_measures_each_level_in_its_budget_and_the_shards_keep_its_choice(sim_servers):
    """canary_sweep_s: a quarter, half and all of each server's slots, each measured; on the
    simulator throughput only grows with concurrency, so the shards keep every slot. A sweep out
    of time stops before its next level; a level the sweep chose is what a shard runs at."""
    from regen.canary import level_to_keep
    from regen.generate import swept_concurrency

    cfg, records = sim_servers(num_servers=2, sim_tokens_per_second=400, concurrency_per_server=None,
                               canary_sweep_s=120, extra_server_args=["--sim-effective-max-running-requests", "8",
                                                                      "--sim-batch-slowdown", "0.05"])
    sweep = canary(cfg).estimate["sweep"]
    levels = [m["concurrency_per_server"] for m in sweep["levels"]]
    assert levels == [3, 6, 12]  # (8 running + the queue margin of 4) per server: a quarter, half, all
    rates = [m["tokens_per_s"] for m in sweep["levels"]]
    assert rates == sorted(rates) and sweep["best"] is None and swept_concurrency(cfg) is None

    cfg = cfg.model_copy(update={"canary_sweep_s": 0.001})
    assert [m["concurrency_per_server"] for m in canary(cfg).estimate["sweep"]["levels"]] == [3]

    measured = [{"concurrency_per_server": c, "tokens_per_s": r} for c, r in ((3, 900.0), (6, 1400.0), (12, 1100.0))]
    assert level_to_keep(measured, 12) == 6  # past 6 a GPU's pool preempts: fewer in flight deliver more
    assert level_to_keep(measured[:2], 12) is None  # every slot never measured: no choice
    assert level_to_keep([*measured[:2], {"concurrency_per_server": 12, "tokens_per_s": 1380.0}], 12) is None
    progress = Path(cfg.output) / "work" / "progress"
    doc = json.loads((progress / "canary.json").read_text())
    doc["estimate"]["sweep"]["best"] = 6
    (progress / "canary.json").write_text(json.dumps(doc))
    assert swept_concurrency(cfg) == 6
    assert swept_concurrency(cfg.model_copy(update={"concurrency_per_server": 4})) is None  # the config decides


def test_agentic_conversations_that_all_end_at_their_first_step_fail_the_canary(sim_servers, tmp_path):
    """A model that never calls what the data recorded: every agentic row would stop at step 0
    (the audit's max_divergence_fraction would fail the run days later)."""

    diverging = [{"id": f"d{i}", "tools": TOOLS, "messages": agentic_messages(
        f"D{i}", [["get_time"], ["get_weather"]], recorded=[["get_date"], ["get_weather"]])} for i in range(3)]
    chat = [json.loads(line) for line in (ROOT / "demo" / "prompts.jsonl").read_text().splitlines()[:5]]
    cfg, records = sim_servers(num_servers=1, tool_call_parser="qwen25",
                               prompts=str(write_jsonl(tmp_path / "p.jsonl", diverging + chat)))
    with pytest.raises(CanaryFailed, match=r"agentic conversations ended at their first step: the model called "
                                           r"other tools than the recorded ones"):
        canary(cfg)


def test_the_canary_measures_the_share_the_trainer_cuts(sim_servers):
    """Preflight estimates what train_max_length will cut from the prompts alone; the canary
    measures it on real answers (the simulator's traces run past 120 tokens here)."""
    cfg, records = sim_servers(num_servers=1, train_max_length=120, min_loss_tokens=4)
    report = canary(cfg)
    assert 0 < report.estimate["trainer_cut_fraction"] <= 1
    assert f"the trainer cuts {report.estimate['trainer_cut_fraction']:.0%} of its samples at train_max_length 120" \
        in report.summary
    roomy, _ = sim_servers(num_servers=1, train_max_length=8192, output=cfg.output + "-roomy")
    assert canary(roomy).estimate["trainer_cut_fraction"] == 0


def test_samples_that_are_not_what_the_engine_served_fail_the_canary_naming_why(sim_servers, qwen36_dir):
    """SpecForge's qwen3-thinking template adds a system prompt the Qwen3.5/3.6 server never saw:
    reported only by that template's recipe, but an on-policy bound the run sets fails the canary
    before any shard, with the cause per sample."""
    cfg, records = sim_servers(num_servers=1, model_path=str(qwen36_dir), train_template="qwen3-thinking")
    assert canary(cfg).estimate["prompts"] == 280  # the recipe's own bound: 0, reported
    with pytest.raises(CanaryFailed) as err:
        canary(cfg.model_copy(update={"audit": cfg.audit.model_copy(update={"min_on_policy_fraction": 0.95})}))
    every = re.search(r"canary: (\d+) of \1 samples are not token for token what the engine was served and "
                      r"generated \(min_on_policy_fraction 95% would not hold; why: on_policy \{'system_prompt': (\d+)\}",
                      str(err.value))
    assert every and every[1] == every[2], str(err.value)  # every sample, each for that cause


def test_the_advised_max_tokens_covers_the_longest_answer_that_finished():
    from regen.canary import max_tokens_advice

    rows = [{"finish_reason": "stop", "completion_tokens": 7000}, {"finish_reason": "length", "completion_tokens": 4096},
            {"finish_reason": "stop", "completion_tokens": 1200}]
    assert max_tokens_advice(rows, 4096) == ("raise max_tokens to at least 9,216 (the longest answer that finished "
                                             "took 7,000 tokens; the model's traces are longer)")
    assert max_tokens_advice(rows[1:], 4096).startswith("raise max_tokens to at least 8,192 ")


def test_a_template_that_loops_only_on_long_answers_fails_the_canary_at_its_bound(sim_servers, tmp_path, monkeypatch):
    """Preflight's samples pass; the canary's answers (longer than 40 characters) make the template
    loop: the canary fails naming the template within its render bound, long before its lease
    could go stale, instead of holding the servers for its two-hour deadline."""
    import shutil

    from regen.chat import render
    from regen.chat.render import TemplateTooSlow
    from support.data import write_prompts

    model = tmp_path / "slow-template-model"
    monkeypatch.setattr(render, "RENDER_SECONDS", 2.0)
    cfg, _ = sim_servers(num_servers=1, prompts=str(write_prompts(tmp_path / "p.jsonl", 4)))
    shutil.copytree(cfg.model_path, model)
    template = model / "chat_template.jinja"
    template.write_text("{%- for message in messages if message.role == 'assistant' and message.content | length > 40 %}"
                        "{%- for i in range(100000) %}{%- for j in range(100000) %}{%- endfor %}{%- endfor %}"
                        "{%- endfor %}" + template.read_text())
    render.load_tokenizer.cache_clear()
    with pytest.raises(TemplateTooSlow, match="more than 2 s to render one conversation"):
        canary(cfg.model_copy(update={"model_path": str(model)}))


def test_a_template_that_builds_a_huge_string_on_long_answers_fails_the_canary_at_its_memory_bound(
        sim_servers, tmp_path, monkeypatch):
    """As the slow template above, for memory: the render is held to its allowance of address space
    and the canary fails naming the template, instead of the node's memory going to a string; the
    process's limit is given back afterwards."""
    import resource
    import shutil

    from regen.chat import render
    from regen.chat.render import TemplateTooLarge
    from support.data import DOUBLING_ON_LONG_ANSWERS, write_prompts

    model = tmp_path / "large-template-model"
    monkeypatch.setattr(render, "RENDER_MEMORY_BYTES", 256 << 20)
    cfg, _ = sim_servers(num_servers=1, prompts=str(write_prompts(tmp_path / "p.jsonl", 4)))
    shutil.copytree(cfg.model_path, model)
    template = model / "chat_template.jinja"
    template.write_text(DOUBLING_ON_LONG_ANSWERS + template.read_text())
    render.load_tokenizer.cache_clear()
    before = resource.getrlimit(resource.RLIMIT_AS)
    with pytest.raises(TemplateTooLarge, match="needed more than 256 MB of memory to render one conversation"):
        canary(cfg.model_copy(update={"model_path": str(model)}))
    assert resource.getrlimit(resource.RLIMIT_AS) == before
