"""Export to SpecForge's regenerated-data JSONL, checked against its validator's documented rules and,
where a SpecForge clone is at hand, its own scripts."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest

from regen.markdown import markdown_literal
from support.data import TOOLS, row, write_dataset
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


SPECFORGE_REPO = Path(os.environ.get("REGEN_SPECFORGE_REPO", "/work/.mirror/sgl-project+SpecForge/repo"))
SPECFORGE_COMMIT = "a6b6b0230009d15ec2a97a57384e6f53f0f96946"  # its v0.3.0 line; scripts read at run time
SPECFORGE_SCRIPTS = ("validate_regenerated_data.py", "expand_reasoning_conversations.py", "conversation_validation.py")


def specforge_scripts(folder: Path) -> Path | None:
    """SpecForge's data scripts as its git repository has them at SPECFORGE_COMMIT, copied into
    ``folder`` (never into the project); None where no clone is at hand (REGEN_SPECFORGE_REPO)."""
    if not (SPECFORGE_REPO / "HEAD").exists() and not (SPECFORGE_REPO / ".git").exists():
        return None
    folder.mkdir(parents=True, exist_ok=True)
    for name in SPECFORGE_SCRIPTS:
        (folder / name).write_bytes(subprocess.run(["git", "-C", str(SPECFORGE_REPO), "show", f"{SPECFORGE_COMMIT}:scripts/{name}"],
                                                   capture_output=True, check=True).stdout)
    return folder


def test_the_specforge_recipe_accounts_for_every_prompt_and_its_files_pass_its_scripts(sim_servers, tmp_path,
                                                                                        tiny_model, caplog):
    """One run of chat, multi-turn and agentic rows, one conversation preflight skipped and one
    prompt past the servers' context: `regen export --format specforge` writes the chat file its
    validator passes, the events file its expander writes from it (record for record), the
    agentic rows in a file of their own (tools a JSON string), the errors and the skipped in its
    script's shape, success + error + skipped = the prompts, and the `data:` block of each file.
    A run with a shard not generated is refused and nothing is written."""
    from support.data import agentic_messages

    import regen.export as regen_export
    from regen.export import RecipeIncomplete, export_specforge
    from regen.generate import ShardRun
    from regen.preflight import preflight

    records = [{"id": f"single{i}", "prompt": f"Question {i}: why is the sky blue?"} for i in range(4)]
    records += [{"id": f"multi{i}", "messages": [
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": f"Multi {i}: what is rain?"},
        {"role": "assistant", "content": "Water."}, {"role": "user", "content": "And snow?"}]} for i in range(3)]
    records += [{"id": f"agent{i}", "tools": TOOLS, "messages": agentic_messages(f"Agent {i}", [["get_weather"], ["get_time"]])}
                for i in range(3)]
    records += [{"id": "twice", "messages": [{"role": "user", "content": "u1"}, {"role": "user", "content": "u2"}]},
                {"id": "long", "prompt": "long " + "word " * 1500}]
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps(r) + "\n" for r in records))
    cfg, servers = sim_servers(num_servers=1, prompts=str(prompts), num_shards=1, tool_call_parser="qwen25",
                               skip_invalid=True, max_error_fraction=1.0, extra_server_args=["--context-length", "2200"])
    preflight(cfg, code=False)
    ShardRun(cfg, [(s.url, s.api_key) for s in servers], 0, "m").run()

    out = tmp_path / "recipe"
    result = export_specforge(cfg.output, out, tiny_model, max_length=2048)
    counts = result.counts
    assert (counts["chat"], counts["agentic"], counts["error"], counts["skipped"]) == (7, 3, 1, 1)
    assert result.prompts == len(records) and result.train_layout == "events"
    read = lambda name: [json.loads(line) for line in (out / name).read_text().splitlines()]  # noqa: E731
    chat, events, agentic = read("regenerated.jsonl"), read("regenerated_events.jsonl"), read("regenerated_agentic.jsonl")
    assert sorted(r["id"] for r in chat) == sorted([f"single{i}" for i in range(4)] + [f"multi{i}" for i in range(3)])
    assert_specforge_valid(out / "regenerated.jsonl")
    assert len(events) == 4 + 3 * 2 == counts["events"]
    index = [e["source_row_index"] for e in events]  # its conversation's line in the chat file
    assert index == sorted(index) and sorted(set(index)) == list(range(7))
    assert all(chat[e["source_row_index"]]["id"] == e["source_id"] for e in events)
    assert sorted({r["source_row_index"] for r in agentic}) == [0, 1, 2]
    assert all(isinstance(r["tools"], str) and json.loads(r["tools"])[0]["type"] == "function" for r in agentic)
    assert {r["source_id"] for r in agentic} == {f"agent{i}" for i in range(3)}  # events: one per step
    assert any(m["role"] == "tool" for r in agentic for m in r["conversations"])
    [error] = read("regenerated_error.jsonl")
    assert error["id"] == "long" and error["status"] == "error" and "context length" in error["error"]
    [skipped] = read("regenerated_skipped.jsonl")
    assert skipped["status"] == "skipped" and skipped["error"].startswith("role_order") and skipped["data"]["line"] == 11
    # In worker processes, batches of 3 rows: the same bytes in every file (the events and the
    # agentic steps numbered across batches as one process numbers them).
    parallel = export_specforge(cfg.output, tmp_path / "parallel", tiny_model, max_length=2048, workers=2, batch_size=3)
    assert parallel.counts == counts
    for name in (regen_export.RECIPE_CHAT, regen_export.RECIPE_EVENTS, regen_export.RECIPE_AGENTIC, regen_export.RECIPE_ERROR,
                 regen_export.RECIPE_SKIPPED, regen_export.RECIPE_CONFIG):
        assert (tmp_path / "parallel" / name).read_text() == (out / name).read_text().replace(
            str(out.resolve()), str((tmp_path / "parallel").resolve())), name
    # Workers asked for beyond the memory the export may take (the audit's bound): as many as fit.
    with caplog.at_level(logging.INFO, "regen.export"):
        bounded = export_specforge(cfg.output, tmp_path / "bounded", tiny_model, max_length=2048, workers=4,
                                   memory_gb=0.5)
    assert bounded.counts == counts and "in 1 worker process(es) (of 4 asked: memory)" in caplog.text
    import yaml

    blocks = yaml.safe_load((out / "specforge_data.yaml").read_text())
    assert [name for name, b in blocks.items() if b["recommended"]] == ["regenerated_events.jsonl", "regenerated_agentic.jsonl"]
    assert blocks["regenerated_events.jsonl"]["data"] == {
        "train_data_path": str((out / "regenerated_events.jsonl").resolve()), "chat_template": "qwen3-thinking",
        "max_length": 2048, "train_only_last_turn": True}

    # Exported from the shell without --config: the recipe the audit judged, not the built-in
    # defaults; a flag that contradicts it is refused unless forced.
    audited = subprocess.run([str(BIN / "regen"), "audit", "--data", cfg.output, "--tokenizer", str(tiny_model),
                              "--train-max-length", "4096"], capture_output=True, text=True, timeout=300)
    assert json.loads((Path(cfg.output) / "audit" / "summary.json").read_text())["train_view"]["max_length"] == 4096, \
        audited.stderr[-2000:]
    card = (Path(cfg.output) / "README.md").read_text()  # rewritten by this audit, from what the run recorded
    assert "cut at 4,096 tokens" in card and f"target model {markdown_literal(str(tiny_model))}" in card
    assert f"| temperature | {markdown_literal(cfg.sampling.temperature)} |" in card and "not recorded" not in card

    def export(folder: str, *flags: str) -> subprocess.CompletedProcess:
        return subprocess.run([str(BIN / "regen"), "export", "--data", cfg.output, "--format", "specforge", "--tokenizer",
                               str(tiny_model), "--out", str(tmp_path / folder), *flags],
                              capture_output=True, text=True, timeout=300)

    assert export("as-audited").returncode == 0
    data = yaml.safe_load((tmp_path / "as-audited" / "specforge_data.yaml").read_text())["regenerated_events.jsonl"]["data"]
    assert (data["chat_template"], data["max_length"]) == ("qwen3-thinking", 4096)
    refused = export("contradicts", "--train-max-length", "2048")
    assert refused.returncode != 0 and not (tmp_path / "contradicts").exists()
    assert "train_max_length 2048: the audit of" in refused.stderr and "with train_max_length 4096" in refused.stderr
    assert export("forced", "--train-max-length", "2048", "--force").returncode == 0
    assert yaml.safe_load((tmp_path / "forced" / "specforge_data.yaml").read_text())[
        "regenerated_events.jsonl"]["data"]["max_length"] == 2048

    # The chat file alone (--format sharegpt) on a run with agentic rows: they are left out and
    # counted, so the file passes SpecForge's validator (which refuses tool messages).
    shared = subprocess.run([str(BIN / "regen"), "export", "--data", cfg.output, "--format", "sharegpt", "--tokenizer",
                             str(tiny_model), "--train-layout", "conversation", "--out", str(tmp_path / "chat.jsonl")],
                            capture_output=True, text=True, timeout=300)
    assert shared.returncode == 0, shared.stderr[-2000:]
    assert "wrote 7 conversations" in shared.stdout and "agentic, in --format specforge's own file 3" in shared.stdout
    assert sorted(assert_specforge_valid(tmp_path / "chat.jsonl")) == sorted(r["id"] for r in chat)

    scripts = specforge_scripts(tmp_path / "specforge")
    if scripts is not None:  # SpecForge's own scripts on the same files
        checked = subprocess.run([sys.executable, str(scripts / "validate_regenerated_data.py"), "--data-path",
                                  str(tmp_path / "chat.jsonl"), "--expect-reasoning", "--strict-think-markers"],
                                 capture_output=True, text=True, timeout=120)
        assert checked.returncode == 0, checked.stdout + checked.stderr
        checked = subprocess.run([sys.executable, str(scripts / "validate_regenerated_data.py"), "--data-path",
                                  str(out / "regenerated.jsonl"), "--expect-reasoning", "--strict-think-markers"],
                                 capture_output=True, text=True, timeout=120)
        assert checked.returncode == 0, checked.stdout + checked.stderr
        expanded = tmp_path / "expanded.jsonl"
        ran = subprocess.run([sys.executable, str(scripts / "expand_reasoning_conversations.py"), "--input-file-path",
                              str(out / "regenerated.jsonl"), "--output-file-path", str(expanded)],
                             capture_output=True, text=True, timeout=120)
        assert ran.returncode == 0, ran.stdout + ran.stderr
        assert [json.loads(line) for line in expanded.read_text().splitlines()] == events

    # A run with a shard never generated: refused, nothing written.
    unfinished, others = sim_servers(num_servers=1, prompts=str(prompts), num_shards=2, skip_invalid=True,
                                     tool_call_parser="qwen25", output=str(tmp_path / "unfinished"))
    preflight(unfinished, code=False)
    ShardRun(unfinished, [(s.url, s.api_key) for s in others], 0, "m").run()
    with pytest.raises(RecipeIncomplete, match=r"have no row \(is every shard finished\?\)"):
        export_specforge(unfinished.output, tmp_path / "refused", tiny_model)
    assert not list((tmp_path / "refused").glob("*.jsonl"))


def test_an_export_killed_mid_write_leaves_no_temporary_once_one_runs_again(tmp_path):
    """A writer SIGKILLed inside its temporary (as a killed export, audit or publish is) left a
    `.tmp` beside the file for ever; the next export of that file removes it, and never a live
    writer's."""
    data = write_dataset(tmp_path / "data", [row(i) for i in range(6)])
    out = tmp_path / "train.jsonl"
    killed = subprocess.run([sys.executable, "-c", (
        "import os, signal, sys\nfrom regen.files import atomic_file\n"
        f"with atomic_file({str(out)!r}) as fh:\n"
        "    fh.write('half a line'); fh.flush(); os.kill(os.getpid(), signal.SIGKILL)")])
    assert killed.returncode == -9 and len(list(tmp_path.glob(".train.jsonl.*.tmp"))) == 1
    live = tmp_path / f".train.jsonl.{os.uname().nodename.replace('.', '-')}-{os.getpid()}.abc.tmp"
    live.write_text("a writer of this test's own process, still alive")
    done = subprocess.run([str(BIN / "regen"), "export", "--data", str(data), "--out", str(out)],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert sorted(tmp_path.glob(".train.jsonl.*.tmp")) == [live] and len(out.read_text().splitlines()) == 6


def test_an_export_larger_than_the_disks_free_space_is_refused_before_it_writes(tmp_path):
    """A 256 KB disk and ~1 MB of conversations: refused at once, naming the estimate and the free
    space, with nothing written there (a seed-sized export is tens of GB)."""
    rows = [row(i, reasoning="Step by step, with care. " * 150) for i in range(300)]
    data = write_dataset(tmp_path / "data", rows)
    mount = tmp_path / "small"
    mount.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(mount)], check=True)
    try:
        for form, target in (("sharegpt", mount / "train.jsonl"), ("specforge", mount / "recipe")):
            out = subprocess.run([str(BIN / "regen"), "export", "--data", str(data), "--format", form, "--out",
                                  str(target)], capture_output=True, text=True, timeout=120)
            assert out.returncode != 0 and "the export needs about" in out.stderr and "GB free" in out.stderr, out.stderr
            assert [p for p in mount.rglob("*") if p.is_file()] == []
        fits = subprocess.run([str(BIN / "regen"), "export", "--data", str(data), "--format", "sharegpt", "--out",
                               str(tmp_path / "train.jsonl")], capture_output=True, text=True, timeout=120)
        assert fits.returncode == 0, fits.stderr
    finally:
        subprocess.run(["umount", str(mount)], check=True)
