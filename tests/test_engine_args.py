"""regen's launch commands and parser names, judged by SGLang's and vLLM's own parsers (no GPU needed)."""

from __future__ import annotations

import json
import subprocess

from regen.servers.plan import build_command
from support.engines import SGLANG_PYTHON, VLLM_PYTHON

PARSE = """
import json, sys
from sglang.srt.server_args import prepare_server_args
args = prepare_server_args(sys.argv[1:])
keys = ["model_path", "host", "port", "api_key", "enable_metrics", "reasoning_parser",
        "speculative_algorithm", "speculative_num_steps", "speculative_eagle_topk",
        "speculative_num_draft_tokens", "mem_fraction_static", "max_running_requests",
        "max_mamba_cache_size", "context_length", "random_seed", "tp_size", "dp_size", "tool_call_parser"]
print(json.dumps({k: getattr(args, k) for k in keys}))
"""


def parse(argv: list[str], key: str | None = None) -> subprocess.CompletedProcess:
    """SGLang's parser on the arguments the server process gets: run as the server is, through
    regen's key wrapper (the key from the environment), with a probe module in place of
    sglang.launch_server."""
    import os
    import tempfile
    from pathlib import Path

    from regen.engines import engine

    assert SGLANG_PYTHON.exists(), f"{SGLANG_PYTHON}: run `make test`, which installs SGLang's parser"
    assert argv[1:3] == ["-m", "sglang.launch_server"]
    python, wrapper, module, *args = engine("sglang").server_argv(argv)
    assert module == "sglang.launch_server"
    with tempfile.TemporaryDirectory() as probe_dir:
        (Path(probe_dir) / "sglang_parse_probe.py").write_text(PARSE)
        env = {**os.environ, "PYTHONPATH": probe_dir, **({"REGEN_SERVER_API_KEY": key} if key else {})}
        return subprocess.run([str(SGLANG_PYTHON), wrapper, "sglang_parse_probe", *args], capture_output=True,
                              text=True, timeout=120, env=env)


def test_the_default_launch_command_parses(make_config):
    cfg = make_config(engine="sglang")
    out = parse(build_command(cfg, "/dev/shm/regen/Qwen3-32B", 30000), key="k" * 48)
    assert out.returncode == 0, out.stderr[-2000:]
    args = json.loads(out.stdout.strip().splitlines()[-1])
    assert args["model_path"] == "/dev/shm/regen/Qwen3-32B"
    assert (args["host"], args["port"], args["api_key"]) == ("127.0.0.1", 30000, "k" * 48)  # through the wrapper
    assert args["enable_metrics"] is True
    assert args["reasoning_parser"] == "qwen3"


def test_the_seeds_mtp_configuration_parses(make_config):
    """The 7 x B200 run: NEXTN (MTP), 3 steps, top-k 1, 4 draft tokens, 80 Mamba cache slots."""
    cfg = make_config(engine="sglang", speculative_algorithm="NEXTN", speculative_num_steps=3,
                      speculative_eagle_topk=1, speculative_num_draft_tokens=4,
                      max_mamba_cache_size=80, mem_fraction_static=0.85, max_running_requests=48,
                      context_length=65536, seed=7)
    out = parse(build_command(cfg, "/dev/shm/regen/Qwen3.6-27B", 30003))
    assert out.returncode == 0, out.stderr[-2000:]
    args = json.loads(out.stdout.strip().splitlines()[-1])
    assert args["speculative_algorithm"] in ("NEXTN", "EAGLE")  # NEXTN is an alias of EAGLE
    assert (args["speculative_num_steps"], args["speculative_eagle_topk"],
            args["speculative_num_draft_tokens"]) == (3, 1, 4)
    assert (args["max_mamba_cache_size"], args["max_running_requests"]) == (80, 48)
    assert (args["mem_fraction_static"], args["context_length"], args["random_seed"]) == (0.85, 65536, 7)
    assert args["api_key"] is None


def test_a_flag_sglang_does_not_know_is_refused_by_its_parser(make_config):
    cfg = make_config(engine="sglang", extra_server_args=["--speculative-tree-width", "3"])
    out = parse(build_command(cfg, "/m", 30000))
    assert out.returncode == 2
    assert "unrecognized arguments: --speculative-tree-width" in out.stderr


def test_preflight_asks_the_installed_sglang_for_its_names_and_flags(make_config):
    """SGLang 0.5.23 calls Nemotron 3's parser `nemotron_3` (regen once accepted `nano_v3`, and
    the launch failed on the GPU node): preflight asks the SGLang that will serve, through
    engine_python, and refuses what it does not know, listing what it does. One launch check
    costs about 10 s (SGLang's argument module imports slowly)."""
    from regen.preflight import PreflightReport, check_engine

    def problems(**fields) -> tuple[list[str], dict]:
        report = PreflightReport()
        check_engine(make_config(engine="sglang", engine_python=str(SGLANG_PYTHON), **fields), report)
        return report.problems, report.info

    refused, info = problems(reasoning_parser="nano_v3", tool_call_parser="qwen3_coder")
    assert info["engine"] == f"sglang 0.5.23 at {SGLANG_PYTHON}"
    # What was checked is said, and what was not, one line each: its resolution against the model.
    assert info["launch_checked_by"] == f"sglang 0.5.23 at {SGLANG_PYTHON}: its argument parser"
    assert info["not_checked"] == ["SGLang's checks of the arguments against the model (ServerArgs.resolve_once "
                                   "imports its GPU packages): they run at launch"]
    assert len(refused) == 1 and refused[0].startswith(f"reasoning_parser 'nano_v3': sglang 0.5.23 at {SGLANG_PYTHON} "
                                                       f"has no such parser (valid: ")
    assert "nemotron_3" in refused[0] and "deepseek-v4" in refused[0]
    assert problems(reasoning_parser="nemotron_3", tool_call_parser="qwen3_coder", tp_size=2, dp_size=2)[0] == []
    flag = problems(extra_server_args=["--speculative-tree-width", "3"])[0]
    assert len(flag) == 1 and flag[0].startswith(f"the launch command is refused by sglang 0.5.23 at {SGLANG_PYTHON}: ")
    assert "--speculative-tree-width" in flag[0]
    tool = problems(tool_call_parser="qwen3-coder")[0]
    assert len(tool) == 1 and tool[0].startswith("tool_call_parser 'qwen3-coder': ") and "did you mean 'qwen3_coder'?" in tool[0]
    assert problems(tool_call_parser="none")[0] == []  # no parser: the flag is left out


def test_without_sglang_installed_preflight_refuses_and_still_names_bad_parsers(make_config):
    """A machine with no SGLang: refused (the servers could not start), and the pinned release's
    names still catch a parser that would fail the launch, so both show at once."""
    from regen.preflight import PreflightReport, check_engine

    report = PreflightReport()
    check_engine(make_config(engine="sglang", reasoning_parser="nano_v3"), report)
    assert report.problems[0].startswith("engine_python ") and "sglang does not import there" in report.problems[0]
    assert report.problems[1].startswith("reasoning_parser 'nano_v3': sglang 0.5.23's list has no such parser")
    assert "nemotron_3" in report.problems[1]


def test_a_tensor_and_data_parallel_launch_parses(make_config):
    cfg = make_config(engine="sglang", tp_size=2, dp_size=4, tool_call_parser="qwen3_coder")
    out = parse(build_command(cfg, "/m", 30000))
    assert out.returncode == 0, out.stderr[-2000:]
    args = json.loads(out.stdout.strip().splitlines()[-1])
    assert (args["tp_size"], args["dp_size"], args["tool_call_parser"]) == (2, 4, "qwen3_coder")


def test_vllms_own_parser_takes_regens_vllm_commands(make_config):
    """vLLM 0.32's OpenAI server parser (make_arg_parser + validate_parsed_serve_args, what its
    api_server runs first) on regen's vLLM launch lines: plain, speculative, tensor and data
    parallel, with a tool-call parser. About 30 s (vLLM imports slowly)."""
    from regen.engines.installed import ask_engine

    for fields in ({}, {"speculative_algorithm": "EAGLE3", "speculative_num_steps": 3, "max_running_requests": 48,
                        "mem_fraction_static": 0.8, "context_length": 4096, "seed": 3},
                   {"tp_size": 2, "dp_size": 2, "tool_call_parser": "hermes"}):
        cfg = make_config(engine="vllm", engine_python=str(VLLM_PYTHON), **fields)
        argv = build_command(cfg, "/dev/shm/regen/Qwen3-8B", 30000)
        assert argv[1:3] == ["-m", "vllm.entrypoints.openai.api_server"]
        installed = ask_engine(cfg, argv)
        assert installed.source == f"vllm 0.32.0 at {VLLM_PYTHON}"
        assert installed.launch_error is None, (fields, installed.launch_error)


def test_preflight_asks_the_installed_vllm_for_its_names(make_config):
    """vLLM calls gpt-oss's reasoning parser `openai_gptoss` (regen once accepted `gpt_oss`)."""
    from regen.preflight import PreflightReport, check_engine

    report = PreflightReport()
    check_engine(make_config(engine="vllm", engine_python=str(VLLM_PYTHON), reasoning_parser="gpt_oss"), report)
    assert len(report.problems) == 1
    assert report.problems[0].startswith(f"reasoning_parser 'gpt_oss': vllm 0.32.0 at {VLLM_PYTHON} has no such parser")
    assert "openai_gptoss" in report.problems[0]
    flag = PreflightReport()
    check_engine(make_config(engine="vllm", engine_python=str(VLLM_PYTHON), extra_server_args=["--no-such-flag"]), flag)
    assert len(flag.problems) == 1 and "--no-such-flag" in flag.problems[0]
    assert flag.problems[0].startswith(f"the launch command is refused by vllm 0.32.0 at {VLLM_PYTHON}: ")


FLAGS = """
import argparse, json, sys
if sys.argv[1] == "sglang":
    from sglang.srt.server_args import ServerArgs
    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
else:
    from vllm.entrypoints.launchers.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser
    parser = make_arg_parser(FlexibleArgumentParser())
print(json.dumps(sorted({s for a in parser._actions for s in a.option_strings})))
"""


def test_the_tuning_flags_a_run_may_add_are_the_engines_own():
    """The allow-lists of flags a triggered run may add drift from the engines unless the engines
    read them: every one must be an option of SGLang 0.5.23's and vLLM 0.32's own parsers."""
    from regen.engines import engine

    for name, python in (("sglang", SGLANG_PYTHON), ("vllm", VLLM_PYTHON)):
        out = subprocess.run([str(python), "-c", FLAGS, name], capture_output=True, text=True, timeout=300)
        assert out.returncode == 0, out.stderr[-2000:]
        options = set(json.loads(out.stdout.strip().splitlines()[-1]))
        assert sorted(engine(name).run_flags - options) == [], name
