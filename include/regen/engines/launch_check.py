"""The engine's own word on a launch command, run by the engine's interpreter (``engine_python``).

Preflight runs this file with the node's engine Python, so the parser names and flags are checked
by the engine that will serve, not by a list in regen that drifts from it. It imports only the
standard library and the engine: regen need not be installed in the engine's venv.

    ENGINE_PYTHON launch_check.py sglang|vllm [LAUNCH ARG ...]

prints one JSON line: ``{"engine", "version", "reasoning_parsers", "tool_call_parsers", "error",
"checked", "not_checked"}``; ``error`` is the engine's own message on the arguments (argparse's
names the valid choices), or null; ``checked`` says which of the engine's checks ran, and
``not_checked`` each one that could not run here; ``engine`` is null when the engine does not import.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import sys

# This file's folder holds regen's adapters sglang.py and vllm.py: off the path, or they would be
# imported in place of the engines.
sys.path[:] = [p for p in sys.path if os.path.realpath(p or ".") != os.path.dirname(os.path.realpath(__file__))]


def sglang(argv: list[str]) -> dict:
    import sglang as package
    from sglang.srt.function_call.parser_names import TOOL_CALL_PARSER_NAMES
    from sglang.srt.parser.reasoning_parser_names import REASONING_PARSER_NAMES
    from sglang.srt.server_args import prepare_server_args

    found = {"version": package.__version__, "reasoning_parsers": sorted(REASONING_PARSER_NAMES),
             "tool_call_parsers": sorted(TOOL_CALL_PARSER_NAMES)}
    # SGLang checks a model's arguments against its checkpoint in ServerArgs.resolve_once, which
    # imports its vision and GPU packages: a launch-time check on the node, not one run here.
    return {**found, "error": verdict(lambda: prepare_server_args(argv)), "checked": "its argument parser",
            "not_checked": ["SGLang's checks of the arguments against the model (ServerArgs.resolve_once imports "
                            "its GPU packages): they run at launch"]}


def vllm(argv: list[str]) -> dict:
    import vllm as package
    try:  # where the OpenAI server's parser lives since vLLM 0.2x (api_server's main imports it)
        from vllm.entrypoints.launchers.cli_args import make_arg_parser, validate_parsed_serve_args
    except ImportError:
        from vllm.entrypoints.openai.cli_args import make_arg_parser, validate_parsed_serve_args
    from vllm.reasoning import ReasoningParserManager
    from vllm.tool_parsers import ToolParserManager
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    found = {"version": package.__version__,
             "reasoning_parsers": sorted(ReasoningParserManager.list_registered()),
             "tool_call_parsers": sorted(ToolParserManager.list_registered())}

    def parse() -> None:
        validate_parsed_serve_args(make_arg_parser(FlexibleArgumentParser()).parse_args(argv))
    return {**found, "error": verdict(parse), "checked": "its argument parser and validate_parsed_serve_args"}


def verdict(parse) -> str | None:
    """None when ``parse`` accepts; else what the engine said (argparse writes it to stderr)."""
    said = io.StringIO()
    try:
        with contextlib.redirect_stderr(said):
            parse()
    except SystemExit as exc:
        lines = [line for line in said.getvalue().splitlines() if line.strip()]
        return (lines[-1] if lines else f"exit {exc.code}")[:2000]
    except Exception as exc:  # the engine refused the arguments its own way
        return f"{type(exc).__name__}: {exc}"[:2000]
    return None


def main() -> int:
    name, argv = sys.argv[1], sys.argv[2:]
    try:
        check = {"sglang": sglang, "vllm": vllm}[name]
        with contextlib.redirect_stdout(sys.stderr):  # engines log to stdout while importing
            result = check(argv)
    except ImportError as exc:
        result = {"engine": None, "error": f"{type(exc).__name__}: {exc}"}
    else:
        result = {"engine": name, **result}
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
