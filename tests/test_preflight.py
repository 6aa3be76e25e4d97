"""Preflight: every problem found before any GPU time, one clear line each."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import time
from pathlib import Path

import pytest
import yaml

from regen.preflight import check_code, run_preflight
from support.airflow import _conf, deploy
from support.paths import BIN, ROOT
from support.processes import processes_with_args

SEED_BUG = '''

MAX_OUTPUT_TOKENS = 4096
CONCURRENCY_PER_SERVER = 48


def configure(args):
    if MAX_OUTPUT_TOKENS > args.max_tokens:
        pass
    global MAX_OUTPUT_TOKENS, CONCURRENCY_PER_SERVER
    MAX_OUTPUT_TOKENS = args.max_tokens
'''


@pytest.fixture
def project_with_seed_bug(tmp_path):
    """A copy of the project whose generator module carries the bug that idled seven B200s."""
    copy = tmp_path / "project"
    for part in ("include", "dags", "demo"):
        shutil.copytree(ROOT / part, copy / part, ignore=shutil.ignore_patterns("__pycache__"))
    generator = copy / "include" / "regen" / "generate.py"
    source = generator.read_text()
    generator.write_text(source + SEED_BUG)
    line = source.count("\n") + SEED_BUG.splitlines().index(
        "    global MAX_OUTPUT_TOKENS, CONCURRENCY_PER_SERVER") + 1
    return copy, generator, line


def test_the_seeds_global_after_use_bug_is_reported_with_file_and_line(project_with_seed_bug):
    copy, generator, line = project_with_seed_bug
    files = sorted((copy / "include" / "regen").rglob("*.py")) + sorted((copy / "dags").glob("*.py"))
    problems = check_code(files=files)
    assert problems == [f"{generator}:{line}: SyntaxError: name 'MAX_OUTPUT_TOKENS' is used prior "
                        f"to global declaration"]


def test_regen_preflight_reports_the_seed_bug_instead_of_crashing_on_it(project_with_seed_bug, make_config,
                                                                        tmp_path):
    """The preflight stage itself must not import the code it is about to check."""
    copy, generator, line = project_with_seed_bug
    config = tmp_path / "run.yaml"
    config.write_text(make_config().to_yaml())
    out = subprocess.run([str(BIN / "regen"), "preflight", "--config", str(config)], capture_output=True,
                         text=True, env=dict(os.environ, PYTHONPATH=str(copy / "include")), timeout=120)
    assert out.returncode == 1, out.stderr[-2000:]
    assert f"{generator}:{line}: SyntaxError: name 'MAX_OUTPUT_TOKENS'" in out.stdout
    assert "Traceback" not in out.stderr


def test_clean_code_passes_compile_and_import():
    assert check_code() == []


def test_an_import_error_is_reported_from_a_fresh_interpreter(tmp_path):
    (tmp_path / "broken_hook.py").write_text("import no_such_module_anywhere\n")
    env_path = os.environ.get("PYTHONPATH", "")
    os.environ["PYTHONPATH"] = f"{tmp_path}:{env_path}"
    try:
        problems = check_code(files=[tmp_path / "broken_hook.py"], entry_points=("broken_hook",))
    finally:
        os.environ["PYTHONPATH"] = env_path
    assert len(problems) == 1
    assert "import broken_hook fails" in problems[0]
    assert "No module named 'no_such_module_anywhere'" in problems[0]


@pytest.mark.slow
def test_the_dag_fails_at_preflight_before_staging_or_any_server(project_with_seed_bug, make_config,
                                                                  tmp_path, airflow_db):
    copy, generator, line = project_with_seed_bug
    cfg = make_config()
    (tmp_path / "regen-configs").mkdir()
    deploy(cfg, tmp_path / "regen-configs")
    env = dict(os.environ, PYTHONPATH=str(copy / "include"), REGEN_CONFIG_DIR=str(tmp_path / "regen-configs"),
               AIRFLOW__CORE__DAGS_FOLDER=str(copy / "dags"))
    started = time.monotonic()
    out = subprocess.run([str(BIN / "airflow"), "dags", "test", "regenerate_dataset", "--conf",
                          json.dumps(_conf(cfg))], capture_output=True, text=True, env=env, timeout=300)
    elapsed = time.monotonic() - started
    log = out.stdout + out.stderr
    assert out.returncode != 0
    assert f"{generator}:{line}: SyntaxError: name 'MAX_OUTPUT_TOKENS'" in log
    assert not (tmp_path / "shm").exists()  # no weights staged
    for i in range(cfg.servers.num_servers):
        assert processes_with_args("--port", str(cfg.servers.base_port + i)) == []
    assert not (tmp_path / "out" / "work" / "servers").exists()  # no server ever launched
    assert elapsed < 120  # measured in bench/bench_preflight.py


def problems_for(make_config, **overrides):
    return run_preflight(make_config(**overrides), code=False).problems


def test_a_missing_engine_interpreter_hides_no_other_engine_problem(make_config, tmp_path):
    problems = problems_for(make_config, engine="sglang", engine_python=str(tmp_path / "no-python"),
                            reasoning_parser=None)
    assert any(p.startswith(f"engine_python {tmp_path / 'no-python'}: not found on ") and "set engine_python" in p
               for p in problems), problems
    assert any(p.startswith("reasoning_parser: empty while enable_thinking is on") for p in problems)


def test_an_engine_that_does_not_import_in_engine_python_is_refused_naming_the_interpreter(make_config):
    """The seed's DAG staged 55 GB and launched seven servers that died on `No module named sglang`:
    preflight asks the interpreter, and refuses with the import error and how to install it."""
    import sys

    problems = problems_for(make_config, engine="sglang", engine_python=sys.executable)
    refused = [p for p in problems if p.startswith(f"engine_python {sys.executable}: sglang does not import there")]
    assert len(refused) == 1, problems
    assert "No module named 'sglang'" in refused[0] and "pip install -r requirements-gpu.txt" in refused[0]


def test_an_engine_that_needs_a_gpu_with_none_visible_is_refused(make_config, tmp_path, monkeypatch):
    """SGLang on a machine with no GPU in sight was planned as "2 servers on CPU" and passed; with
    `gpus` listed explicitly it was planned on the listed GPUs and launched seven servers."""
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.setenv("PATH", "/usr/bin:/bin")  # no nvidia-smi
    for gpus in (None, list(range(7))):
        problems = problems_for(make_config, engine="sglang", gpus=gpus, num_servers=2 if gpus is None else 7)
        given = f"gpus {gpus} name GPUs, but " if gpus else ""
        assert any(p.startswith(f"engine sglang: needs a GPU per server; {given}none is visible on ")
                   and "(CUDA_VISIBLE_DEVICES unset; nvidia-smi not found)" in p for p in problems), problems
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert any("CUDA_VISIBLE_DEVICES ''" in p for p in problems_for(make_config, engine="sglang", gpus=[0, 1]))
    smi = tmp_path / "bin" / "nvidia-smi"
    smi.parent.mkdir()
    smi.write_text("#!/bin/sh\n[ \"$1\" = -L ] && { echo 'NVIDIA-SMI has failed because it could not communicate "
                   "with the NVIDIA driver.' >&2; exit 9; }\nexit 9\n")
    smi.chmod(0o755)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    monkeypatch.setenv("PATH", f"{smi.parent}:/usr/bin:/bin")
    assert any("nvidia-smi -L: NVIDIA-SMI has failed because it could not communicate" in p
               for p in problems_for(make_config, engine="sglang", gpus=[0]))
    smi.write_text("#!/bin/sh\nprintf '0\\n1\\n'\n")
    assert not any("needs a GPU" in p for p in problems_for(make_config, engine="sglang"))
    assert not any("needs a GPU" in p for p in problems_for(make_config))  # the simulator runs on a CPU


def test_a_clean_config_has_no_problem(make_config):
    assert problems_for(make_config) == []


def test_missing_model_path(make_config, tmp_path):
    assert problems_for(make_config, model_path=str(tmp_path / "nope")) == [
        f"model_path {tmp_path / 'nope'}: directory not found"]


def test_missing_prompts_file(make_config, tmp_path):
    assert problems_for(make_config, prompts=str(tmp_path / "none.jsonl")) == [
        f"prompts {tmp_path / 'none.jsonl'}: file not found"]


def test_duplicate_ids_and_bad_lines_are_listed_with_file_and_line(make_config, tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text('{"id": "a", "prompt": "x"}\n{"id": "b", "prompt": "y"}\n{oops\n'
                    '{"id": "a", "prompt": "z"}\n')
    problems = problems_for(make_config, prompts=str(path))
    assert problems[0].startswith(f"{path}:3: not valid JSON")
    assert problems[1] == f"{path}:4: duplicate id 'a' (first at line 1)"
    assert len(problems) == 2


def test_a_template_that_prefills_an_empty_think_block(make_config, tiny_model, tmp_path):
    model = tmp_path / "model"
    shutil.copytree(tiny_model, model)
    template = (model / "chat_template.jinja").read_text()
    template = template.replace("{%- if enable_thinking is defined and enable_thinking is false %}",
                                "{%- if true %}")
    (model / "chat_template.jinja").write_text(template)
    problems = problems_for(make_config, model_path=str(model))
    assert problems == [f"model_path {model}: chat template pre-fills an empty think block with "
                        f"enable_thinking=true: the model would answer without reasoning"]


def test_prompt_plus_max_tokens_over_the_context(make_config):
    problems = problems_for(make_config, max_tokens=8190)
    assert len(problems) == 1
    assert "max_tokens 8190 + longest prompt" in problems[0]
    assert "passes the context length 8192" in problems[0]


def test_max_tokens_past_a_context_nested_in_text_config_is_refused(make_config, tiny_model, tmp_path):
    """Qwen3.5/3.6 ship the vision-language layout: the context length sits under text_config."""
    model = tmp_path / "model"
    shutil.copytree(tiny_model, model)
    config = json.loads((model / "config.json").read_text())
    text = {k: config.pop(k) for k in list(config) if k not in ("architectures", "model_type")}
    (model / "config.json").write_text(json.dumps({**config, "text_config": text}))
    problems = problems_for(make_config, model_path=str(model), max_tokens=400_000)
    assert len(problems) == 1 and "passes the context length 8192" in problems[0], problems


def test_too_little_space_for_output_and_staging(make_config, tmp_path):
    mount = tmp_path / "small"
    mount.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(mount)], check=True)
    try:
        problems = problems_for(make_config, output=str(mount / "out"), staging_dir=str(mount / "shm"),
                                max_tokens=4096)
    finally:
        subprocess.run(["umount", str(mount)], check=True)
    assert any(p.startswith(f"output {mount / 'out'}: needs about") and "free" in p for p in problems)
    assert any(p.startswith(f"staging_dir {mount / 'shm'}: needs") for p in problems)
    assert len(problems) == 2


def test_a_taken_port(make_config):
    cfg = make_config()
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", cfg.servers.base_port + 1))
        sock.listen()
        problems = run_preflight(cfg, code=False).problems
    assert problems == [f"port {cfg.servers.base_port + 1} on 127.0.0.1 already in use: free them or change "
                        f"base_port"]


def test_engine_combinations(make_config):
    problems = problems_for(make_config, engine="vllm", reasoning_parser="qwen3-thinking",
                            max_mamba_cache_size=80, concurrency_per_server=64,
                            max_running_requests=32)
    assert any(p.startswith("engine_python ") and "vllm does not import there" in p for p in problems)
    assert any(p.startswith("reasoning_parser 'qwen3-thinking': vllm 0.32.0's list has no such parser")
               for p in problems)
    assert any(p.startswith("max_mamba_cache_size: engine vllm has no equivalent option") for p in problems)
    assert any("concurrency_per_server 64 is above max_running_requests 32" in p for p in problems)


def test_every_problem_is_listed_at_once(make_config, tmp_path):
    problems = problems_for(make_config, model_path=str(tmp_path / "m"), prompts=str(tmp_path / "p"),
                            reasoning_parser=None)
    assert len(problems) == 3


def test_cli_exit_codes_and_one_line_per_problem(make_config, tmp_path):
    cfg = make_config()
    good = tmp_path / "good.yaml"
    good.write_text(yaml.safe_dump(json.loads(cfg.model_dump_json())))
    ok = subprocess.run([str(BIN / "regen"), "preflight", "--config", str(good)],
                        capture_output=True, text=True, timeout=120)
    assert ok.returncode == 0, ok.stdout + ok.stderr
    assert ok.stdout == ""
    bad = subprocess.run([str(BIN / "regen"), "preflight", "--config", str(good), "--model-path",
                          str(tmp_path / "missing"), "--prompts", str(tmp_path / "none.jsonl")],
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode == 1
    assert bad.stdout.splitlines() == [f"prompts {tmp_path / 'none.jsonl'}: file not found",
                                       f"model_path {tmp_path / 'missing'}: directory not found"]


def test_an_output_made_with_another_shard_count_is_refused(make_config):
    cfg = make_config(num_shards=4)
    data = Path(cfg.output) / "data"
    data.mkdir(parents=True)
    (data / "shard-00001-of-00008.parquet").write_bytes(b"")
    assert run_preflight(cfg, code=False).problems == [
        f"output {cfg.output}: data/ holds shards of a 8-shard run; use num_shards 8 to resume or "
        f"add to it, or a new output directory"]


def test_conversations_specforge_refuses_fail_preflight_or_are_skipped_never_sent(make_config, tmp_path):
    """Each rule counted with examples before any GPU time; with skip_invalid they are listed in
    work/skipped.jsonl and left out of the prompt index (nothing of them can be sent)."""
    from regen.manifest import Manifest
    from regen.preflight import preflight

    prompts = tmp_path / "p.jsonl"
    records = [{"id": "ok", "prompt": "fine"},
               {"id": "twice", "messages": [{"role": "user", "content": "u1"}, {"role": "user", "content": "u2"}]},
               {"id": "lead", "messages": [{"role": "assistant", "content": "a"}, {"role": "user", "content": "u"}]},
               {"id": "tool", "messages": [{"role": "user", "content": "u"}, {"role": "tool", "content": "{}"}]}]
    prompts.write_text("".join(json.dumps(r) + "\n" for r in records))
    problems = problems_for(make_config, prompts=str(prompts))
    assert problems[0] == (f"prompts {prompts}: 3 conversations SpecForge's validator refuses (leading_assistant 1, "
                           f"role_order 1, tool_message 1); fix them, or set skip_invalid to leave them out")
    assert any(f"{prompts}:2: role_order" in p for p in problems)
    cfg = make_config(prompts=str(prompts), skip_invalid=True)
    result = preflight(cfg, code=False)
    assert result.info["skipped_conversations"] == {"role_order": 1, "leading_assistant": 1, "tool_message": 1}
    skipped = [json.loads(line) for line in cfg.layout.skipped_prompts.read_text().splitlines()]
    assert sorted(s["line"] for s in skipped) == [2, 3, 4] and {s["rule"] for s in skipped} == {
        "role_order", "leading_assistant", "tool_message"}
    indexed = [Manifest(cfg.layout).shard_prompts(s).ids for s in range(cfg.num_shards)]
    assert sorted(sum(indexed, [])) == ["ok"]


def test_regenerate_turns_last_with_thinking_is_refused_when_history_has_answers(make_config, tmp_path):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"id": "c", "messages": [
        {"role": "user", "content": "u1"}, {"role": "assistant", "content": "a1"}, {"role": "user", "content": "u2"}]}) + "\n")
    problems = problems_for(make_config, prompts=str(prompts), regenerate_turns="last")
    assert len(problems) == 1 and problems[0].startswith("regenerate_turns last with thinking on: 1 conversations")
    assert problems_for(make_config, prompts=str(prompts)) == []  # all: every turn regenerated with reasoning


@pytest.mark.parametrize("bomb", [
    "{%- set s = 'x' * 4000000000 %}{{ s }}",  # a string of gigabytes
    "{%- for i in range(100000) %}{%- for j in range(100000) %}{%- endfor %}{%- endfor %}",  # a loop for hours
])
def test_a_chat_template_bomb_is_refused_within_its_budget_naming_the_file(make_config, tiny_model, tmp_path,
                                                                           monkeypatch, bomb):
    import regen.preflight.inputs as inputs

    monkeypatch.setattr(inputs, "TEMPLATE_SECONDS", 5.0)
    model = tmp_path / "model"
    shutil.copytree(tiny_model, model)
    (model / "chat_template.jinja").write_text(bomb + (model / "chat_template.jinja").read_text())
    started = time.monotonic()
    problems = problems_for(make_config, model_path=str(model))
    assert time.monotonic() - started < 30
    assert len(problems) == 1 and problems[0].startswith(f"{model / 'chat_template.jinja'}: the chat template"), problems


def test_the_longest_prompt_is_counted_on_a_bounded_prefix(make_config, tmp_path):
    """A 40 MB prompt: counted on what could fit the context at all, and refused at once."""
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"id": "huge", "prompt": "word " * 8_000_000}) + "\n"
                       + json.dumps({"id": "small", "prompt": "hi"}) + "\n")
    started = time.monotonic()
    problems = problems_for(make_config, prompts=str(prompts))
    assert time.monotonic() - started < 60
    assert len(problems) == 1 and "longest prompt ('huge', at least" in problems[0], problems


def test_thinking_off_with_a_thinking_template_is_refused_and_the_way_out_passes_the_canary(make_config, sim_servers):
    """The seed's disaster, caught before any GPU time: thinking off while training reads reasoning.
    The refusal names the template and the layout to use; that config passes preflight, and the
    canary then judges the answers themselves (the suggestion leads to no template failure)."""
    from regen.canary import canary

    for layout in ("events", "auto", "conversation"):  # auto: the tiny Qwen3's template drops history reasoning
        problems = problems_for(make_config, enable_thinking=False, train_layout=layout)
        assert len(problems) == 1 and problems[0].startswith("train_template 'qwen3-thinking' trains on reasoning"), problems
        assert "set train_template: qwen3-instruct and train_layout: conversation" in problems[0]
    fix = dict(enable_thinking=False, train_template="qwen3-instruct", train_layout="conversation")
    assert problems_for(make_config, **fix) == []
    assert any(p.startswith("train_layout events with enable_thinking off") and "set train_layout: conversation" in p
               for p in problems_for(make_config, enable_thinking=False, train_template="qwen3-instruct",
                                     train_layout="events"))
    # The simulator answers "OK." without thinking (the seed's answers): the masks are that answer
    # and its end of turn, nothing of a think block; the canary passes at a bound that short answers meet.
    cfg, _ = sim_servers(num_servers=1, sim_tokens_per_second=2000, min_loss_tokens=2, **fix)
    assert canary(cfg).passed


def test_the_share_the_trainer_will_cut_is_estimated_before_any_gpu_time(make_config, tmp_path):
    """A fifth of the prompts are longer than train_max_length on their own: the estimate, on a
    sample of the file, finds about that share, and says how much room a median prompt leaves;
    with room for everything it says nothing."""
    from regen.preflight import preflight
    from regen.preflight.template import CUT_SAMPLE

    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"id": f"p{i}", "prompt": ("word " * 1000 if i % 5 == 0 else f"question {i}?")})
                               + "\n" for i in range(400)))
    result = preflight(make_config(prompts=str(prompts), max_tokens=1024, train_max_length=2048), code=False)
    cut = result.info["trainer_cut"]
    assert cut["sampled"] == CUT_SAMPLE
    assert 0.1 < cut["prompts_over"] / cut["sampled"] < 0.3
    assert cut["max_prompt_tokens"] > 2048 > 2048 - 1024 > cut["median_prompt_tokens"]
    assert cut["answer_room_at_median"] == 2048 - cut["median_prompt_tokens"]
    assert 0.2 < cut["worst_share"] < 1
    assert "trainer cut (train_max_length 2,048): up to" in result.summary
    roomy = preflight(make_config(prompts=str(prompts), max_tokens=1024, train_max_length=8192,
                                  output=str(tmp_path / "roomy")), code=False)
    assert roomy.info["trainer_cut"]["worst_share"] == 0 and "trainer cut" not in roomy.summary
