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


class SpecForgeOracle:
    """SpecForge's parser in one process of the SGLang venv, asked job after job: its start
    (torch, transformers) is paid once per xdist worker, not once per case."""

    def __init__(self, log):
        self.log = log
        self.process = subprocess.Popen([str(SGLANG_PYTHON), str(ORACLE), "serve"], stdin=subprocess.PIPE,
                                        stdout=subprocess.PIPE, stderr=log.open("w"), text=True)

    def ask(self, mode: str, tokenizer_dir=None, export=None, template: str = "", lengths=(),
            last_turn_only: bool = False) -> dict:
        job = ["registry"] if mode == "registry" else [
            mode, str(tokenizer_dir), str(export), template, [int(n) for n in lengths], last_turn_only]
        self.process.stdin.write(json.dumps(job) + "\n")
        self.process.stdin.flush()
        answer = self.process.stdout.readline()
        assert answer, f"SpecForge's oracle ended: {self.log.read_text()[-3000:]}"
        result = json.loads(answer)
        assert "error" not in result, result["error"]
        return result

    def close(self):
        self.process.stdin.close()
        self.process.wait(timeout=60)


@pytest.fixture(scope="session")
def specforge(tmp_path_factory):
    oracle = SpecForgeOracle(tmp_path_factory.mktemp("specforge") / "oracle.log")
    yield oracle
    oracle.close()


def make_agentic_rows(thinking: bool, count: int = 30) -> list[dict]:
    """Agentic rows as regen writes them: tools on the row (JSON), assistant steps with their
    calls (one or several at once) and reasoning, each recorded result a tool message answering
    the model's call id, then a final answer; some go on with a second user turn, some end with
    a step that calls a tool (a divergence), one's calls have arguments that are not JSON."""
    from support.data import TOOLS

    rng = random.Random(11 if thinking else 12)
    rows = []
    for i in range(count):
        messages = [{"role": "system", "content": "Use the tools."}] if i % 3 == 0 else []
        turns_out = []
        for turn in range(1 if i % 4 else 2):
            messages.append({"role": "user", "content": text(rng, rng.randint(5, 40))})
            for step in range(rng.randint(1, 3)):
                calls = [{"id": f"call_{i}_{turn}_{step}_{j}", "type": "function", "function": {
                    "name": rng.choice(TOOLS)["function"]["name"],
                    "arguments": "{not json" if i == 5 else json.dumps({"city": text(rng, 2)}, ensure_ascii=False)}}
                    for j in range(rng.choice((1, 1, 2)))]
                messages.append({"role": "assistant", "content": text(rng, 6) if step % 2 else "",
                                 "reasoning_content": text(rng, rng.randint(10, 80)) if thinking else None,
                                 "tool_calls": json.dumps(calls)})
                messages += [{"role": "tool", "tool_call_id": c["id"], "content": text(rng, rng.randint(3, 30))}
                             for c in calls]
                turns_out.append({"finish_reason": "tool_calls", "prompt_tokens": 10, "completion_tokens": 50})
            if turn == 0 and i % 4 == 0:
                messages.append({"role": "assistant", "content": text(rng, 20),
                                 "reasoning_content": text(rng, 40) if thinking else None})
                turns_out.append({"finish_reason": "stop", "prompt_tokens": 10, "completion_tokens": 50})
        diverged = i % 7 == 6
        final_calls = [{"id": f"call_{i}_end", "type": "function", "function": {
            "name": "get_date", "arguments": '{"city": "Oslo"}'}}] if diverged else None
        turns_out.append({"finish_reason": "tool_calls" if diverged else "stop", "prompt_tokens": 10,
                          "completion_tokens": 100})
        rows.append({"id": f"t{i}", "messages": messages, "tools": json.dumps(TOOLS),
                     "reasoning_content": text(rng, rng.randint(20, 300)) if thinking else None,
                     "content": "" if diverged else text(rng, rng.randint(3, 80)),
                     "tool_calls": json.dumps(final_calls) if final_calls else None,
                     "divergence": "tool_divergence: step 1: ..." if diverged else None,
                     "finish_reason": "tool_calls" if diverged else "stop", "completion_tokens": 100, "error": None,
                     "enable_thinking": thinking, "turns": turns_out})
    return rows


def assert_loss_tokens_are_specforges(specforge, tokenizer_dir, tmp_path, rows, template, thinking, cut_at, layout):
    """Per sample as exported (a conversation, or an event ``ID#turnK`` trained on its last turn
    only, as ``train_only_last_turn`` does), regen's loss tokens are SpecForge's, uncut and cut."""
    data = tmp_path / "out" / "data"
    data.mkdir(parents=True)
    pq.write_table(pa.Table.from_pylist(rows, schema=ROW_SCHEMA), data / "shard.parquet")
    export = tmp_path / "train.jsonl"
    written = export_sharegpt(data, export, expect_reasoning=thinking, train_layout=layout, agentic=True).written
    assert written == (len(rows) if layout == "conversation" else sum(len(r["turns"]) for r in rows))

    audited = {}
    for length in (0, cut_at):  # 0: no cut
        report = audit_dataset(data, tokenizer_dir, tmp_path / f"audit-{length}",
                               AuditThresholds(16, 1.0, template, length, layout), default_thinking=thinking)
        samples = pq.read_table(tmp_path / f"audit-{length}" / "samples.parquet").to_pylist()
        audited[length] = {s["id"]: s for s in samples}
        assert report.summary.audited == written
    expected = specforge.ask("counts", tokenizer_dir, export, template, [UNCUT, cut_at], layout == "events")
    assert set(expected) == set(audited[0])  # the audit judged exactly the rows the export wrote

    uncut = {i: audited[0][i]["loss_tokens"] for i in expected}
    cut = {i: audited[cut_at][i]["loss_tokens"] for i in expected}
    assert uncut == {i: v[0] for i, v in expected.items()}
    assert cut == {i: v[1] for i, v in expected.items()}
    shortened = [i for i in expected if "cut" in audited[cut_at][i]["findings"]]
    assert len(shortened) > 0.4 * written  # the cut shortens many samples: the check means something
    assert all(audited[cut_at][i]["tokens"] > cut_at for i in shortened)
    assert sum(uncut.values()) > sum(cut.values())
    assert min(uncut.values()) > 0
    return export


@pytest.mark.parametrize("template, thinking, cut_at, layout", [
    ("qwen3-thinking", True, 256, "conversation"), ("qwen3-thinking", True, 256, "events"),
    ("qwen3.5", True, 256, "events"), ("qwen3-instruct", False, 96, "conversation")])
def test_loss_tokens_equal_specforges_parser_uncut_and_cut(specforge, qwen3_tokenizer_dir, tmp_path, template,
                                                           thinking, cut_at, layout):
    assert_loss_tokens_are_specforges(specforge, qwen3_tokenizer_dir, tmp_path, make_rows(thinking), template,
                                      thinking, cut_at, layout)


@pytest.mark.parametrize("template, thinking, cut_at, layout", [
    ("qwen3-thinking", True, 384, "conversation"), ("qwen3-thinking", True, 256, "events"),
    ("qwen3-instruct", False, 256, "conversation")])
def test_agentic_loss_tokens_equal_specforges_parser_with_tools(specforge, qwen3_tokenizer_dir, tmp_path, template,
                                                                thinking, cut_at, layout):
    """Agentic rows, rendered with their tools by the real Qwen3 template: the tool calls and
    results in the history, calls made at once, a row that ends on a call, arguments that are
    not JSON (SpecForge renders them as {}): regen's loss tokens are SpecForge's in both
    layouts, and the export is SpecForge's tool-use shape."""
    rows = make_agentic_rows(thinking)
    export = assert_loss_tokens_are_specforges(specforge, qwen3_tokenizer_dir, tmp_path, rows, template, thinking,
                                               cut_at, layout)
    records = [json.loads(line) for line in export.read_text().splitlines()]
    assert all(isinstance(r["tools"], list) and r["tools"][0]["type"] == "function" for r in records)
    calls = [m for r in records for m in r["conversations"] if m.get("tool_calls")]
    results = [m for r in records for m in r["conversations"] if m["role"] == "tool"]
    assert calls and results and all(m["tool_call_id"].startswith("call_") for m in results)
    assert any(r["conversations"][-1].get("tool_calls") for r in records)  # a row that ends on a call


@pytest.mark.parametrize("agentic, cut_at, layout", [
    (False, 256, "events"), (False, 384, "conversation"), (True, 256, "events"), (True, 384, "conversation")])
def test_qwen36_layout_loss_tokens_equal_specforges_qwen3_5_parser(specforge, qwen36_dir, tmp_path, agentic, cut_at,
                                                                   layout):
    """The seed's model family (Qwen3.5/3.6: the generation prompt opens the think block, history
    turns render without one, calls as <function=...> with their arguments as a mapping): chat
    and agentic rows, as SpecForge 0.2.0 trains them with `qwen3.5`, in both layouts."""
    rows = make_agentic_rows(True) if agentic else make_rows(True)
    assert_loss_tokens_are_specforges(specforge, qwen36_dir, tmp_path, rows, "qwen3.5", True, cut_at, layout)


def test_qwen3_templates_drop_history_reasoning_so_the_default_layout_is_events(qwen3_tokenizer_dir, tiny_model):
    from regen.chat.render import default_train_layout, load_tokenizer
    from regen.chat.templates import TRAIN_TEMPLATES

    for directory in (qwen3_tokenizer_dir, tiny_model):
        tokenizer = load_tokenizer(str(directory))
        assert default_train_layout(tokenizer, TRAIN_TEMPLATES["qwen3-thinking"]) == "events"
        assert default_train_layout(tokenizer, TRAIN_TEMPLATES["qwen3-instruct"]) == "conversation"


def test_a_template_that_drops_reasoning_is_refused_with_thinking_on():
    with pytest.raises(ConfigError, match="train_template 'qwen'.*drops reasoning_content"):
        RunConfig.from_mapping({"train_template": "qwen", "enable_thinking": True})
    assert RunConfig.from_mapping({"train_template": "qwen", "enable_thinking": False}).audit.train_template == "qwen"


def test_the_token_export_trains_on_what_specforge_masks_from_the_generated_tokens(specforge, sim_servers, tmp_path,
                                                                                   tiny_model):
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
            assert exported.checks["served prompt = the training prefix"] == 8 * 3  # every turn: own system prompt
            assert exported.checks["served prompt differs from the training prefix: system_prompt"] == 12  # singles
        export_sharegpt(cfg.output, text, train_layout=layout)
        expected = specforge.ask("masked", tiny_model, text, "qwen3-thinking", [UNCUT], layout == "events")
        compared = 0
        for line in tokens.read_text().splitlines():
            row = json.loads(line)
            if row["id"] in agree:
                assert [t for t, m in zip(row["input_ids"], row["loss_mask"]) if m] == expected[row["id"]], row["id"]
                compared += 1
        assert compared >= 15


def test_the_token_export_keeps_tool_call_steps_whole_and_never_splices_ids_of_other_text(sim_servers, tmp_path,
                                                                                          tiny_model):
    """Agentic rows (each step a sample of the events layout, the engine's ids of every step): a
    tool-call step's ids are followed by the newline the template renders after its end of turn,
    as after an answer, so every step's ids agree with the rendering. Ids whose text is not the
    rendering's (a think block opened twice, as an engine and a template that disagree make) are
    never spliced in: the sample keeps the rendering's tokens, and the export counts it."""
    from regen.chat.render import load_tokenizer
    from regen.export import export_tokens
    from regen.generate import ShardRun
    from support.data import TOOLS, agentic_messages

    records = [{"id": f"agent{i}", "tools": TOOLS,
                "messages": agentic_messages(f"Agent {i}", [["get_weather"], ["get_time"]])} for i in range(4)]
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps(r) + "\n" for r in records))
    cfg, servers = sim_servers(prompts=str(prompts), num_shards=1, num_servers=1, tool_call_parser="qwen25")
    ShardRun(cfg, [(s.url, s.api_key) for s in servers], 0, "m").run()

    exported = export_tokens(cfg.output, tmp_path / "tokens.jsonl", tiny_model, "qwen3-thinking", "events")
    assert exported.written == 4 * 3
    assert exported.checks["completion agrees with the rendering"] == 4 * 3, exported.checks

    table = pq.read_table(f"{cfg.output}/data").to_pylist()
    twice = load_tokenizer(str(tiny_model)).encode("<think>\n", add_special_tokens=False)
    table[0]["completion_token_ids"] = twice + table[0]["completion_token_ids"]
    planted = tmp_path / "planted" / "data"
    planted.mkdir(parents=True)
    pq.write_table(pa.Table.from_pylist(table, schema=ROW_SCHEMA), planted / "shard-00000-of-00001.parquet")
    again = export_tokens(planted.parent, tmp_path / "planted.jsonl", tiny_model, "qwen3-thinking", "events")
    assert again.checks["completion differs from the rendering: template_drift (rendered tokens kept)"] == 1, again.checks
    assert again.checks["completion agrees with the rendering"] == 4 * 3 - 1
    read = lambda path: {r["id"]: r for r in map(json.loads, path.read_text().splitlines())}  # noqa: E731
    assert read(tmp_path / "planted.jsonl") == read(tmp_path / "tokens.jsonl")  # the rendering's tokens, as before


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


def test_regens_template_registry_is_specforges(specforge):
    """Every template regen knows, field by field as SpecForge 0.2.0 registers it; every other
    name of its registry refused with a reason."""
    from regen.chat.templates import TRAIN_TEMPLATES, UNSUPPORTED

    registry = specforge.ask("registry")
    assert set(registry) - {"custom"} == set(TRAIN_TEMPLATES) | set(UNSUPPORTED)
    for name, t in TRAIN_TEMPLATES.items():
        theirs = registry[name]
        assert (t.fmt.assistant_header, t.fmt.end_of_turn) == (theirs["assistant_header"], theirs["end_of_turn_token"]), name
        assert (t.system_prompt or None) == (theirs["system_prompt"] or None), name
        assert t.keeps_reasoning == (theirs["parser_type"] == "thinking"), name
        assert t.ignore == tuple(theirs["ignore_token"] or ()), name
        expected_render = True if theirs["parser_type"] == "thinking" and theirs["enable_thinking"] else (
            False if theirs["parser_type"] == "glm" else None)
        assert t.render_thinking == expected_render, name
        assert (t.fmt.skip_after_header, bool(t.fmt.also_ends)) == (
            "</think>" if theirs["assistant_pattern_type"] == "glm" else "",
            theirs["assistant_pattern_type"] == "inkling"), name


def chat_template_for(name: str) -> str:
    """A chat template of this test's own that renders with the markers of SpecForge's template
    ``name``: a stand-in for the model family's own, on the tiny model's tokenizer. A turn
    without reasoning renders as the family does (GLM: ``<think></think>`` right after the header,
    which training must not learn)."""
    from regen.chat.templates import TRAIN_TEMPLATES

    fmt = TRAIN_TEMPLATES[name].fmt
    eot = fmt.end_of_turn
    user = eot if name in ("glm-5.2", "inkling-thinking") else "<|user_turn|>\n"  # the next turn ends a turn
    think_open = "" if fmt.opens_thinking or fmt.assistant_header.endswith("<think>") else "<think>\n"
    after = "" if user == eot else eot
    closed = fmt.skip_after_header  # GLM closes an empty thought right after its header
    q = lambda text: json.dumps(text)  # noqa: E731 (a Jinja string literal)
    return ("{%- for m in messages %}"
            "{%- if m.role == 'system' %}{{ " + q("<|sys|>") + " + m.content + " + q("\n") + " }}"
            "{%- elif m.role == 'user' %}{{ " + q(user) + " + m.content + " + q("\n") + " }}"
            "{%- else %}{{ " + q(fmt.assistant_header) + " }}"
            "{%- if m.reasoning_content %}{{ " + q(think_open) + " + m.reasoning_content + " + q("\n</think>\n\n") + " }}"
            "{%- else %}{{ " + q(closed) + " }}"
            "{%- endif %}{{ m.content + " + q(after) + " }}{%- endif %}{%- endfor %}")


def test_every_other_template_gives_specforges_loss_tokens(specforge, tmp_path, tiny_model):
    """Each template of the registry (the Qwen ones are checked above on the real tokenizer),
    on a tokenizer whose chat template renders with its markers: regen's audit counts, uncut
    and cut, equal SpecForge's parser's, per sample, in each layout the template trains in."""
    import shutil

    from regen.chat.templates import TRAIN_TEMPLATES

    jobs, audited = {}, {}
    for name, template in TRAIN_TEMPLATES.items():
        if name.startswith("qwen3"):
            continue
        tokenizer = tmp_path / name / "tokenizer"
        shutil.copytree(tiny_model, tokenizer, ignore=shutil.ignore_patterns("*.safetensors", "*.bin"))
        (tokenizer / "chat_template.jinja").write_text(chat_template_for(name))
        thinking = template.keeps_reasoning
        data = tmp_path / name / "out" / "data"
        data.mkdir(parents=True)
        pq.write_table(pa.Table.from_pylist(make_rows(thinking, count=12), schema=ROW_SCHEMA), data / "shard.parquet")
        for layout in ("conversation", "events") if thinking else ("conversation",):
            export = tmp_path / name / f"{layout}.jsonl"
            export_sharegpt(data, export, expect_reasoning=thinking, train_layout=layout)
            for length in (0, 128):  # 0: no cut
                report_dir = tmp_path / name / f"audit-{layout}-{length}"
                audit_dataset(data, tokenizer, report_dir, AuditThresholds(1, 1.0, name, length, layout),
                              default_thinking=thinking)
                audited[(name, layout, length)] = {
                    s["id"]: s["loss_tokens"] for s in pq.read_table(report_dir / "samples.parquet").to_pylist()}
            jobs[f"{name}/{layout}"] = ("counts", tokenizer, export, name, [UNCUT, 128], layout == "events")
    expected = {job: specforge.ask(*args) for job, args in jobs.items()}
    assert len(expected) >= 20
    for job, counts in expected.items():
        name, layout = job.split("/")
        assert counts and min(v[0] for v in counts.values()) > 0, job
        assert audited[(name, layout, 0)] == {i: v[0] for i, v in counts.items()}, job
        assert audited[(name, layout, 128)] == {i: v[1] for i, v in counts.items()}, job


def _model_copy(source, target, old: str, new: str):
    """The model directory with its chat template edited (one exact replacement)."""
    import shutil

    shutil.copytree(source, target)
    template = target / "chat_template.jinja"
    text = template.read_text()
    assert text.count(old) == 1, old
    template.write_text(text.replace(old, new))
    return target


def test_the_on_policy_certificate_holds_on_every_chat_sample_and_names_each_cause_when_not(
        sim_servers, qwen36_dir, tmp_path):
    """A sim run on the Qwen3.5/3.6-layout model returns the token ids of every request: under
    qwen3.5 every sample (each turn of a multi-turn row, in the events layout) is token for token
    what the engine was served and generated. Then one cause at a time: a training template that
    drifted from the served one, SpecForge's qwen3-thinking system prompt the engine never saw,
    and earlier reasoning the engine was sent (its template renders it) that training drops. Each
    is caught and named per sample, in the summary, the verdict and the samples viewer."""
    from regen.generate import ShardRun
    from support.data import write_conversations

    prompts = write_conversations(tmp_path / "p.jsonl", 4, turns=3, singles=6)
    cfg, servers = sim_servers(prompts=str(prompts), num_shards=1, num_servers=1, model_path=str(qwen36_dir))
    ShardRun(cfg, [(s.url, s.api_key) for s in servers], 0, "m").run()

    def audit(tokenizer, name: str, template: str = "qwen3.5"):
        report = audit_dataset(cfg.output, tokenizer, tmp_path / name, AuditThresholds(None, 1.0, template))
        samples = {s["id"]: s for s in pq.read_table(tmp_path / name / "samples.parquet").to_pylist()}
        return report, samples

    report, samples = audit(qwen36_dir, "served")
    assert report.thresholds.train_layout == "events" and report.thresholds.min_on_policy_fraction == 0.95
    assert len(samples) == 4 * 3 + 6
    assert {s["on_policy"] for s in samples.values()} == {"exact"}, samples
    assert report.summary.on_policy == {"checked": 18, "exact": 18, "reasons": {}} and report.passed
    assert "on-policy: 18 of 18 samples" in "\n".join(report.lines())

    drifted = _model_copy(qwen36_dir, tmp_path / "drifted", "'<|im_start|>user\\n' + m.content",
                          "'<|im_start|>user\\n\\n' + m.content")
    report, samples = audit(drifted, "drift")
    assert {s["on_policy"] for s in samples.values()} == {"template_drift"}
    assert all("off_policy" in s["findings"] for s in samples.values())
    assert not report.passed and "the others: template_drift 18" in "\n".join(report.lines())
    views = json.loads((tmp_path / "drift" / "samples_view.json").read_text())
    assert views and all(v["on_policy"] == "template_drift" for v in views)
    assert "NOT WHAT THE ENGINE SAW: the training template renders" in (tmp_path / "drift" / "report.html").read_text()

    report, samples = audit(qwen36_dir, "system", template="qwen3-thinking")
    assert {i: s["on_policy"] for i, s in samples.items() if i.startswith("s")} == {
        f"s{i}#turn0": "system_prompt" for i in range(6)}
    assert {s["on_policy"] for i, s in samples.items() if i.startswith("c")} == {"exact"}  # their own system prompt
    assert report.thresholds.min_on_policy_fraction == 0.0 and report.passed  # reported, not enforced

    everywhere = _model_copy(qwen36_dir, tmp_path / "renders-history", "loop.index0 > ns.last_user and m.reasoning_content",
                             "m.reasoning_content")
    cfg2, servers2 = sim_servers(prompts=str(prompts), num_shards=1, num_servers=1, model_path=str(everywhere),
                                 output=cfg.output + "-history")
    ShardRun(cfg2, [(s.url, s.api_key) for s in servers2], 0, "m").run()
    rows = pq.read_table(f"{cfg2.output}/data").to_pylist()
    assert all("chat_turns" in r["history_reasoning"] for r in rows if r["id"].startswith("c"))
    report = audit_dataset(cfg2.output, qwen36_dir, tmp_path / "history", AuditThresholds(None, 1.0, "qwen3.5"))
    samples = {s["id"]: s for s in pq.read_table(tmp_path / "history" / "samples.parquet").to_pylist()}
    later = {i: s["on_policy"] for i, s in samples.items() if i.startswith("c") and not i.endswith("#turn0")}
    assert set(later.values()) == {"history_reasoning"} and len(later) == 4 * 2
    assert {s["on_policy"] for i, s in samples.items() if i.endswith("#turn0")} == {"exact"}
    assert not report.passed


@pytest.mark.parametrize("model, template", [("qwen3", "qwen3-thinking"), ("qwen36", "qwen3.5")])
def test_the_agentic_file_loads_alike_in_datasets_4_and_5_and_trains_as_specforges_parser_says(
        specforge, sim_servers, tmp_path, tiny_model, qwen3_tokenizer_dir, qwen36_dir, model, template):
    """The agentic rows of `regen export --format specforge`, their tools' schemas differing from
    row to row (a property only some rows have, a `default` of another type): loaded with
    `datasets` 4.0.0 and 5.x as SpecForge's trainer loads them, SpecForge's parser makes the same
    input_ids of every sample from both and from the file itself, and its loss tokens are the
    audit's, sample by sample (the real Qwen3 template; the Qwen3.5/3.6 layout)."""
    import shutil

    from support.data import TOOLS, agentic_messages
    from support.engines import DATASETS_PYTHONS

    from regen.export import export_specforge
    from regen.generate import ShardRun
    from regen.preflight import preflight

    folder = tmp_path / "model"
    if model == "qwen36":
        folder = qwen36_dir
    else:  # the real Qwen3 tokenizer and its official template
        shutil.copytree(tiny_model, folder)
        (folder / "chat_template.jinja").unlink()
        for name in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copy(qwen3_tokenizer_dir / name, folder / name)
    extra = [{}, {"unit": {"type": "string", "default": "celsius"}}, {"days": {"type": "integer", "default": 3}}]
    records = []
    for i, more in enumerate(extra):
        tools = json.loads(json.dumps(TOOLS))
        tools[0]["function"]["parameters"]["properties"].update(more)
        records.append({"id": f"agent{i}", "tools": tools,
                        "messages": agentic_messages(f"Agent {i}", [["get_weather"], ["get_time", "get_date"]])})
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps(r) + "\n" for r in records))
    cfg, servers = sim_servers(model_path=str(folder), prompts=str(prompts), num_servers=1, num_shards=1,
                               tool_call_parser="qwen3_coder" if model == "qwen36" else "qwen25")
    preflight(cfg, code=False)
    ShardRun(cfg, [(s.url, s.api_key) for s in servers], 0, "m").run()
    result = export_specforge(cfg.output, tmp_path / "recipe", folder, template)
    agentic = tmp_path / "recipe" / "regenerated_agentic.jsonl"
    assert result.counts["agentic"] == 3 and result.train_layout == "events"

    loaded = {}
    for version, python in DATASETS_PYTHONS.items():
        assert python.is_file(), f"{python}: run `make datasets`"
        out = tmp_path / f"loaded-{version}.jsonl"
        ran = subprocess.run([str(python), str(ROOT / "tests" / "fixtures" / "datasets_load.py"), str(agentic),
                              str(out), str(tmp_path / f"cache-{version}")], capture_output=True, text=True,
                             timeout=300, env={**__import__("os").environ, "HF_DATASETS_OFFLINE": "1"})
        assert ran.returncode == 0, ran.stderr[-3000:]
        assert ran.stdout.strip().splitlines()[-1] == version
        loaded[version] = out
    # What the JSON string prevents: written as a list, datasets 4.0.0 merges every row's tool
    # schemas (a property of one row appears as null in the others' tools).
    as_list = tmp_path / "tools-as-list.jsonl"
    written = [json.loads(line) for line in agentic.read_text().splitlines()]
    as_list.write_text("".join(json.dumps({**r, "tools": json.loads(r["tools"])}) + "\n" for r in written))
    merged = tmp_path / "merged.jsonl"
    subprocess.run([str(DATASETS_PYTHONS["4.0.0"]), str(ROOT / "tests" / "fixtures" / "datasets_load.py"), str(as_list),
                    str(merged), str(tmp_path / "cache-list")], check=True, capture_output=True, timeout=300)
    assert [json.loads(line)["tools"] for line in merged.read_text().splitlines()] != [
        json.loads(r["tools"]) for r in written]
    files = {"as written": agentic, **loaded}
    parsed = {name: specforge.ask("tokens", folder, path, template, [UNCUT], True) for name, path in files.items()}
    assert len(parsed["as written"]) == 3 * 3  # three steps a row
    assert parsed["4.0.0"] == parsed["as written"] and parsed["5.2.0"] == parsed["as written"]

    audit_dataset(cfg.output, folder, tmp_path / "audit", AuditThresholds(1, 1.0, template, 0, "events"))
    audited = {s["id"]: s["loss_tokens"] for s in pq.read_table(tmp_path / "audit" / "samples.parquet").to_pylist()}
    assert {i: audited[i] for i in parsed["as written"]} == {i: sum(mask) for i, (_, mask) in parsed["as written"].items()}
    assert all(audited[i] > 0 for i in parsed["as written"])
