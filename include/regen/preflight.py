"""Preflight: every check that needs no GPU, all of them, before any GPU time is spent.

Each check adds problems instead of raising, so a failed preflight lists everything wrong at once,
one line each. The code check compiles every file that will run in a *separate* interpreter (the
one that will run it) and then imports the entry points there, so a SyntaxError such as the one
that idled seven B200s (``name 'MAX_OUTPUT_TOKENS' is used prior to global declaration``) is
reported as file:line before a single server starts.
"""

from __future__ import annotations

import json
import logging
import os
import random
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from regen.config import RunConfig
from regen.engines import engine
from regen.errors import RegenError
from regen.layout import parse_shard_file
from regen.modelconfig import context_length
from regen.paths import DAGS_DIR, PACKAGE_DIR
from regen.results import PreflightResult, StagedModel
from regen.stages import entry_modules
from regen.units import format_bytes

log = logging.getLogger("regen.preflight")

# Runs in the target interpreter: compiles each file, prints one JSON problem per failure.
_COMPILE_SCRIPT = r"""
import json, sys
for path in sys.argv[1:]:
    try:
        with open(path, "rb") as fh:
            compile(fh.read(), path, "exec", dont_inherit=True)
    except SyntaxError as exc:
        print(json.dumps({"file": exc.filename or path, "line": exc.lineno, "msg": f"{type(exc).__name__}: {exc.msg}"}))
    except (OSError, ValueError) as exc:
        print(json.dumps({"file": path, "line": 0, "msg": f"{type(exc).__name__}: {exc}"}))
"""

_IMPORT_SCRIPT = r"""
import importlib, json, sys
for module in sys.argv[1:]:
    try:
        importlib.import_module(module)
    except BaseException as exc:
        print(json.dumps({"module": module, "error": f"{type(exc).__name__}: {exc}"}), flush=True)
"""

class PreflightFailed(RegenError):
    def __init__(self, problems: list[str]):
        self.problems = problems
        super().__init__(f"preflight found {len(problems)} problem(s):\n" + "\n".join(problems))

    def detail(self) -> dict:
        return {"problems": self.problems}

    @classmethod
    def from_detail(cls, message: str, detail: dict) -> "PreflightFailed":
        return cls(list(detail.get("problems") or [message]))


@dataclass
class PreflightReport:
    problems: list[str] = field(default_factory=list)
    info: dict = field(default_factory=dict)
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return not self.problems


def code_files(extra: list[str] | None = None) -> list[Path]:
    files = sorted(PACKAGE_DIR.rglob("*.py"))
    if DAGS_DIR.exists():
        files += sorted(DAGS_DIR.rglob("*.py"))
    return files + [Path(p) for p in extra or []]


def check_code(python: str = sys.executable, files: list[Path] | None = None,
               entry_points: list[str] | None = None) -> list[str]:
    """Compile, then import, in a fresh ``python``: what the stages will really run (default:
    every module of the stage registry and every program regen starts)."""
    files = files if files is not None else code_files()
    entry_points = entry_points if entry_points is not None else entry_modules()
    try:
        out = subprocess.run([python, "-c", _COMPILE_SCRIPT, *map(str, files)], capture_output=True,
                             text=True, timeout=120)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return [f"{python}: cannot run the interpreter: {exc}"]
    problems = []
    for line in out.stdout.splitlines():
        item = json.loads(line)
        problems.append(f"{item['file']}:{item['line']}: {item['msg']}")
    if out.returncode != 0:
        problems.append(f"{python}: compile check crashed: {out.stderr.strip()[-500:]}")
    if problems:
        return problems  # imports would only repeat the same errors
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(PACKAGE_DIR.parent), env.get("PYTHONPATH", "")])
    # Every entry point in one fresh interpreter, each in its own try: one start-up, and a broken
    # module is named without hiding the others.
    out = subprocess.run([python, "-c", _IMPORT_SCRIPT, *entry_points], capture_output=True,
                         text=True, timeout=300, env=env)
    for line in out.stdout.splitlines():
        item = json.loads(line)
        problems.append(f"import {item['module']} fails in {python}: {item['error']}")
    if out.returncode != 0:
        problems.append(f"{python}: import check crashed: {out.stderr.strip()[-500:]}")
    return problems


def check_prompts(cfg: RunConfig, report: PreflightReport, max_listed: int = 20) -> None:
    """Every record readable, every id once, every conversation one SpecForge's validator takes
    (or, with skip_invalid, those it refuses listed in the skipped file, never sent); the prompt
    index of the run manifest on the way."""
    from regen.files import atomic_write_text
    from regen.manifest import PromptIndexWriter
    from regen.prompts import PromptError, read_prompts

    path = Path(cfg.prompts)
    if not path.is_file():
        report.problems.append(f"prompts {path}: file not found")
        return
    index = PromptIndexWriter(cfg)
    bad: list[str] = []
    duplicates: list[str] = []
    refused: dict[str, list[PromptError]] = {}
    count, longest_chars, longest, with_history, agentic = 0, 0, None, 0, 0
    sample: list[tuple[list[dict], list[dict] | None]] = []  # a reservoir, for the trainer-cut estimate
    pick = random.Random(0)
    try:
        for item in read_prompts(path):
            problem = index.feed(item)
            if isinstance(item, PromptError) and item.rule is not None:
                refused.setdefault(item.rule, []).append(item)
                continue
            if problem is not None:
                (bad if isinstance(item, PromptError) else duplicates).append(problem)
            if isinstance(item, PromptError):
                continue
            count += 1
            with_history += any(m["role"] == "assistant" for m in item.messages)
            agentic += item.agentic
            chars = sum(len(m["content"]) for m in item.messages)
            if len(sample) < CUT_SAMPLE:
                sample.append((item.messages, item.tools))
            elif (slot := pick.randrange(count)) < CUT_SAMPLE:
                sample[slot] = (item.messages, item.tools)
            if chars > longest_chars:
                longest_chars, longest = chars, item
    except (OSError, ValueError) as exc:
        report.problems.append(f"prompts {path}: cannot be read: {exc}")
        return
    report.info["prompts"] = count
    report.info["agentic_prompts"] = agentic
    report.info["longest_prompt_chars"] = longest_chars
    report.info["_longest_prompt"] = longest
    report.info["_sample_prompts"] = sample
    report.info["_index"] = index
    for lines, what in ((bad, "unreadable record"), (duplicates, "duplicate id")):
        report.problems.extend(lines[:max_listed])
        if len(lines) > max_listed:
            report.problems.append(f"prompts {path}: ... and {len(lines) - max_listed} more {what}s")
    if refused:
        counts = ", ".join(f"{rule} {len(items):,}" for rule, items in sorted(refused.items()))
        if cfg.generation.skip_invalid:
            skipped = cfg.layout.skipped_prompts
            skipped.parent.mkdir(parents=True, exist_ok=True)
            atomic_write_text(skipped, "".join(
                json.dumps({"file": e.file, "line": e.line, "rule": e.rule, "reason": e.reason}) + "\n"
                for items in refused.values() for e in items))
            report.info["skipped_conversations"] = {rule: len(items) for rule, items in refused.items()}
            log.warning("prompts %s: %s", path, f"{sum(map(len, refused.values())):,} conversations "
                        f"SpecForge's validator refuses are skipped ({counts}), listed in {skipped}")
        else:
            report.problems.append(f"prompts {path}: {sum(map(len, refused.values())):,} conversations "
                                   f"SpecForge's validator refuses ({counts}); fix them, or set "
                                   f"skip_invalid to leave them out")
            for rule, items in sorted(refused.items()):
                report.problems.extend(f"  {e}" for e in items[:3])
    if cfg.generation.regenerate_turns == "last" and cfg.enable_thinking and with_history:
        report.problems.append(
            f"regenerate_turns last with thinking on: {with_history:,} conversations keep "
            f"the dataset's own earlier assistant turns, which have no reasoning; SpecForge's expander "
            f"and validator would drop every one after the GPU time is spent. Use regenerate_turns all")
    if agentic and not cfg.engine_options.tool_call_parser:
        report.problems.append(
            f"prompts {path}: {agentic:,} agentic conversations (tools, tool calls) and no tool_call_parser: "
            f"the engine would answer every call as text, so no recorded result could be spliced in; set "
            f"tool_call_parser to the model's (e.g. qwen25 for Qwen3)")
    if count == 0 and not bad:
        report.problems.append(f"prompts {path}: no prompts in the file")


def check_model(cfg: RunConfig, report: PreflightReport) -> None:
    model = Path(cfg.model_path)
    if not model.is_dir():
        report.problems.append(f"model_path {model}: directory not found")
        return
    if not (model / "config.json").is_file():
        report.problems.append(f"model_path {model}: no config.json (not a model directory)")
        return
    try:
        model_cfg = json.loads((model / "config.json").read_text())
    except (OSError, ValueError) as exc:
        report.problems.append(f"model_path {model}/config.json: unreadable: {exc}")
        return
    report.info["model_bytes"] = sum(f.stat().st_size for f in model.rglob("*") if f.is_file())
    context = cfg.engine_options.context_length or context_length(model_cfg)
    if not (model / "tokenizer.json").is_file():
        report.problems.append(f"model_path {model}: no tokenizer.json (the audit needs a fast tokenizer)")
        return
    from regen.audit.findings import AuditThresholds
    from regen.childpool import ChildFailed, OverBudget, call_bounded

    longest = report.info.get("_longest_prompt")
    try:
        problems, info = call_bounded("regen.preflight:tokenizer_checks", (
            str(model), AuditThresholds.from_config(cfg), cfg.enable_thinking,
            (longest.id, longest.messages) if longest is not None else None, cfg.sampling.max_tokens, context,
            report.info.get("_sample_prompts") or [], cfg.audit.train_max_length),
            TEMPLATE_SECONDS, TEMPLATE_MEMORY_BYTES)
    except OverBudget as exc:
        where = next((model / n for n in ("chat_template.jinja", "tokenizer_config.json") if (model / n).is_file()), model)
        report.problems.append(f"{where}: the chat template (with the tokenizer, on a probe and the longest prompt) "
                               f"{exc}: a template is a program, and this one is refused")
        return
    except ChildFailed as exc:  # regen's own modules did not import (check_code names why)
        report.problems.append(f"model_path {model}: the tokenizer checks could not run: {exc}")
        return
    report.problems.extend(problems)
    report.info.update(info)


# The chat template and the tokenizer run in a child held to these (the template is a program
# a model folder brings): seconds for a real one, whatever the prompts; and what may be read of
# the longest prompt to count its tokens (beyond that it cannot fit the context anyway).
TEMPLATE_SECONDS = 60.0
TEMPLATE_MEMORY_BYTES = 3 * 2**30
LONGEST_PROMPT_CHARS_PER_TOKEN = 16
CUT_SAMPLE = 256  # conversations whose prompts are tokenized for the trainer-cut estimate


def tokenizer_checks(model: str, thresholds, enable_thinking: bool, longest: tuple[str, list[dict]] | None,
                     max_tokens: int, context: int | None, sample: list[tuple[list[dict], list[dict] | None]] = (),
                     train_max_length: int | None = None) -> tuple[list[str], dict]:
    """preflight's checks that run the model's tokenizer and chat template: (problems, info);
    run through regen.childpool.call_bounded."""
    from regen.audit.dataset import resolved
    from regen.chat.render import load_tokenizer, render_generation_prompt, template_problems
    from regen.chat.templates import DEFAULT_TRAIN_TEMPLATE, TRAIN_TEMPLATES
    from regen.errors import DataError

    problems: list[str] = []
    info: dict = {}
    try:
        tokenizer = load_tokenizer(model)
    except Exception as exc:  # any loader failure is a finding, named with its type
        return [f"model_path {model}: tokenizer does not load: {type(exc).__name__}: {exc}"], info
    template = DEFAULT_TRAIN_TEMPLATE
    try:
        thresholds = resolved(thresholds, tokenizer)
    except DataError as exc:
        problems.append(f"train_template: {exc}")
    else:
        template = TRAIN_TEMPLATES[thresholds.train_template]
        info["train_template"] = thresholds.train_template
        info["train_layout"] = thresholds.train_layout
        if enable_thinking and not template.keeps_reasoning:
            problems.append(f"train_template {thresholds.train_template!r}: SpecForge's parser for it "
                            f"drops reasoning_content, so training would see empty think blocks")
        if not enable_thinking and thresholds.train_layout == "events":
            problems.append(f"train_layout events (train_template {thresholds.train_template!r}) with "
                            f"enable_thinking off: SpecForge's expander takes only turns with reasoning, so "
                            f"every row would be left out of the export; set train_layout: conversation")
    for problem in template_problems(tokenizer, enable_thinking, template.fmt):
        problems.append(f"model_path {model}: {problem}")
    if sample and train_max_length:
        info["trainer_cut"] = trainer_cut(tokenizer, sample, enable_thinking, max_tokens, train_max_length)
    if longest is None or not context:
        return problems, info
    prompt_id, messages = longest
    cut, whole = bounded(messages, context)
    try:
        prompt_tokens = len(tokenizer.encode(render_generation_prompt(tokenizer, cut, enable_thinking),
                                             add_special_tokens=False))
    except Exception:  # template errors are reported above
        return problems, info
    info["longest_prompt_tokens"] = prompt_tokens
    if prompt_tokens + max_tokens > context:
        at_least = "" if whole else "at least "
        problems.append(f"max_tokens {max_tokens} + longest prompt ({prompt_id!r}, {at_least}{prompt_tokens} "
                        f"tokens) = {prompt_tokens + max_tokens} passes the context length {context}")
    return problems, info


def bounded(messages: list[dict], tokens: int) -> tuple[list[dict], bool]:
    """(the messages with at most the characters ``tokens`` tokens can hold, whether that is all
    of them): what is counted of a prompt that may be huge."""
    budget = LONGEST_PROMPT_CHARS_PER_TOKEN * (tokens + 1)
    cut = []
    for message in messages:
        content = message.get("content")
        if isinstance(content, str):
            message = {**message, "content": content[:max(budget, 0)]}
            budget -= len(content)
        cut.append(message)
    return cut, budget >= 0


def trainer_cut(tokenizer, sample: list[tuple[list[dict], list[dict] | None]], enable_thinking: bool, max_tokens: int,
                train_max_length: int) -> dict:
    """What SpecForge's --max-length will cut, estimated from sampled prompts before any answer
    exists: each prompt (the conversation up to its last user message or tool result, as the
    generation prompt renders it, with its tools) plus an answer of max_tokens, the most it can be. The canary
    then measures it on real answers."""
    from regen.chat.render import render_generation_prompt
    from regen.prompts import request_messages

    lengths = []
    for messages, tools in sample:
        try:
            asked, _ = bounded(request_messages(messages), train_max_length)  # past it, all is cut anyway
            text = render_generation_prompt(tokenizer, asked, enable_thinking, tools)
        except Exception:  # template errors are reported by the checks above
            continue
        lengths.append(len(tokenizer.encode(text, add_special_tokens=False)))
    if not lengths:
        return {}
    lengths.sort()
    total = sum(n + max_tokens for n in lengths)
    over = sum(max(0, n + max_tokens - train_max_length) for n in lengths)
    return {"sampled": len(lengths), "median_prompt_tokens": lengths[len(lengths) // 2],
            "max_prompt_tokens": lengths[-1], "train_max_length": train_max_length, "max_tokens": max_tokens,
            "prompts_over": sum(n >= train_max_length for n in lengths),
            "worst_share": round(over / total, 4),
            "answer_room_at_median": max(0, train_max_length - lengths[len(lengths) // 2])}


def trainer_cut_line(cut: dict) -> str:
    """The estimate in one line, or "" when nothing can be cut."""
    if not cut or not cut["worst_share"]:
        return ""
    line = (f"trainer cut (train_max_length {cut['train_max_length']:,}): up to {cut['worst_share']:.0%} of "
            f"tokens if answers run to max_tokens {cut['max_tokens']:,}; a median prompt ({cut['median_prompt_tokens']:,} "
            f"tokens) leaves {cut['answer_room_at_median']:,} for its answer")
    if cut["prompts_over"]:
        line += f"; {cut['prompts_over']} of {cut['sampled']} sampled prompts alone pass it"
    return line + " (the canary measures it)"


def check_engine(cfg: RunConfig, report: PreflightReport) -> None:
    """The engine's interpreter, its parsers and launch flags, and options it would ignore."""
    adapter = engine(cfg.engine)
    if cfg.engine != "sim" and cfg.servers.engine_python and not Path(cfg.servers.engine_python).is_file():
        report.problems.append(f"engine_python {cfg.servers.engine_python}: not found")
    else:  # the other checks below still run: every problem is listed at once
        check_installed_engine(cfg, report)
    if cfg.enable_thinking and not cfg.engine_options.reasoning_parser:
        report.problems.append("reasoning_parser: empty while enable_thinking is on; the thinking "
                               "trace would stay inside content")
    for name in adapter.ignored_options:
        if cfg.flat_value(name) is not None:
            report.problems.append(f"{name}: engine {cfg.engine} has no equivalent option and would "
                                   f"ignore it; unset it")
    if (cfg.generation.concurrency_per_server and cfg.engine_options.max_running_requests
            and cfg.generation.concurrency_per_server > cfg.engine_options.max_running_requests):
        report.problems.append(
            f"concurrency_per_server {cfg.generation.concurrency_per_server} is above max_running_requests "
            f"{cfg.engine_options.max_running_requests}: the extra requests would only queue")


def check_installed_engine(cfg: RunConfig, report: PreflightReport) -> None:
    """Parser names and launch flags as the engine installed here (``engine_python``) knows
    them: preflight passing must mean the launch on the GPU node parses."""
    from regen.engines.installed import ask_engine
    from regen.servers.lifecycle import build_command

    installed = ask_engine(cfg, build_command(cfg, cfg.model_path, cfg.servers.base_port))
    report.info["engine"] = installed.source
    report.info["launch_checked_by"] = f"{installed.source}: {installed.checked}"
    named = False
    for option, known in (("reasoning_parser", installed.reasoning_parsers),
                          ("tool_call_parser", installed.tool_call_parsers)):
        value = cfg.flat_value(option)
        if value and value not in known:
            named = True
            report.problems.append(f"{option} {value!r}: {installed.source} has no such parser "
                                   f"(valid: {', '.join(sorted(known))})")
    if installed.launch_error and not named:
        report.problems.append(f"the launch command is refused by {installed.source}: {installed.launch_error}")


def output_bytes_per_row(prompt_chars: int, max_tokens: int) -> float:
    """The disk a row takes at the peak, publishing: its journal line (the prompt, up to
    max_tokens of text at ~4 bytes a token, and every token id as JSON, ~7 bytes each, a prompt
    token per ~4 characters) plus its compressed copy in the shard file (about half)."""
    journal = prompt_chars + max_tokens * 4 + (prompt_chars / 4 + max_tokens) * 7
    return journal * 1.5


def check_space(cfg: RunConfig, report: PreflightReport) -> None:
    output = Path(cfg.output)
    probe_dir = output
    while not probe_dir.exists() and probe_dir != probe_dir.parent:
        probe_dir = probe_dir.parent
    if not os.access(probe_dir, os.W_OK):
        report.problems.append(f"output {output}: not writable ({probe_dir} denies writing)")
    else:
        prompts = report.info.get("prompts", 0)
        longest = report.info.get("longest_prompt_chars", 0)
        need = int(prompts * output_bytes_per_row(longest, cfg.sampling.max_tokens))
        free = shutil.disk_usage(probe_dir).free
        report.info["output_estimate_bytes"] = need
        if need > free:
            report.problems.append(f"output {output}: needs about {format_bytes(need)} for "
                                   f"{prompts:,} rows, {format_bytes(free)} free")
    if cfg.stage_weights and "model_bytes" in report.info:
        staging = Path(cfg.staging_dir)
        probe = staging
        while not probe.exists() and probe != probe.parent:
            probe = probe.parent
        free = shutil.disk_usage(probe).free
        from regen.weights import staged_path

        already = staged_path(Path(cfg.model_path), staging)
        have = sum(f.stat().st_size for f in already.rglob("*") if f.is_file()) if already.exists() else 0
        need = report.info["model_bytes"]
        if need > free + have:
            report.problems.append(f"staging_dir {staging}: needs {format_bytes(need)} for the model, "
                                   f"{format_bytes(free + have)} free")


def check_output(cfg: RunConfig, report: PreflightReport) -> None:
    """An output made with another shard count would end with ids twice: refuse it."""
    counts = {parse_shard_file(p.name)[1] for p in cfg.layout.shard_files()}
    other = sorted(counts - {cfg.num_shards})
    if other:
        report.problems.append(
            f"output {cfg.output}: data/ holds shards of a {'/'.join(map(str, other))}-shard run; "
            f"use num_shards {other[0]} to resume or add to it, or a new output directory")


def check_ports(cfg: RunConfig, report: PreflightReport) -> None:
    """The servers this node would launch (the plan ``regen serve --dry-run`` prints) fit its
    GPUs, and their ports are free or already ours."""
    from regen.servers.gpus import GpuLayoutError
    from regen.servers.lifecycle import is_healthy, port_is_free, server_plan
    from regen.servers.records import read_state

    try:
        servers = server_plan(cfg).servers
    except GpuLayoutError as exc:
        report.problems.append(str(exc))
        return
    report.info["servers"] = [s.model_dump() for s in servers]
    if engine(cfg.engine).needs_gpu and any(s.cuda_visible_devices is None for s in servers):
        mask = os.environ.get("CUDA_VISIBLE_DEVICES")
        smi = shutil.which("nvidia-smi")
        report.problems.append(
            f"engine {cfg.engine}: needs a GPU per server and none is visible here (CUDA_VISIBLE_DEVICES "
            f"{'unset' if mask is None else repr(mask)}; nvidia-smi {'lists none' if smi else 'not found'}): run "
            f"on a GPU node (its Celery queue or SSH connection), or rehearse on a CPU with engine sim")
    ours = {r.port for r in read_state(cfg.layout) if is_healthy(r.url)}
    taken = [s.port for s in servers if s.port not in ours and not port_is_free(cfg.servers.host, s.port)]
    if taken:
        report.problems.append(f"port{'s' if len(taken) > 1 else ''} {', '.join(map(str, taken))} "
                               f"on {cfg.servers.host} already in use: free them or change base_port")


def check_map_length(cfg: RunConfig, report: PreflightReport, max_map_length: int | None) -> None:
    if max_map_length is not None and cfg.num_shards > max_map_length:
        report.problems.append(
            f"num_shards {cfg.num_shards} is above this Airflow's max_map_length {max_map_length} "
            f"([core] max_map_length): the generate task could not be mapped; use at most "
            f"{max_map_length} shards or raise the setting")


def check_nodes(cfg: RunConfig, report: PreflightReport, dag_nodes: list[str] | None,
                dag_queue: str | None = None) -> None:
    """Each node's tasks are routed to its queue when the DAG is parsed: a run cannot add,
    drop or rename nodes, or move a one-node run to another queue, from the trigger form."""
    asked = [spec.name for spec in cfg.nodes]
    if dag_nodes is not None and asked != dag_nodes:
        report.problems.append(f"nodes {asked} differ from the nodes this DAG was built for {dag_nodes}: "
                               f"change the nodes in the deployment's config file, not in the trigger form")
    if dag_nodes is not None and cfg.queue != dag_queue:
        report.problems.append(f"queue {cfg.queue!r} differs from the queue this DAG was built for {dag_queue!r}: "
                               f"change it in the deployment's config file, not in the trigger form")


def run_preflight(cfg: RunConfig, code: bool = True, max_map_length: int | None = None,
                  scope: str = "all", dag_nodes: list[str] | None = None,
                  dag_queue: str | None = None) -> PreflightReport:
    """``scope``: "all" (a one-node run), "run" (what every node shares: config, prompts,
    output) or "node" (what each node has: code, engine, model, staging space, ports). A shard
    count left empty is the fleet's, as :func:`check` records it."""
    from regen.servers.gpus import fleet_size

    started = time.monotonic()
    cfg = cfg.with_num_shards(fleet_size(cfg))
    report = PreflightReport()
    if code:
        report.problems.extend(check_code())
    if scope != "node":
        check_map_length(cfg, report, max_map_length)
        check_nodes(cfg, report, dag_nodes, dag_queue)
    if scope != "run":
        check_engine(cfg, report)
    if scope != "node":
        check_prompts(cfg, report)
    check_model(cfg, report)
    check_space(cfg, report)
    if scope != "node":
        check_output(cfg, report)
    if scope != "run":
        check_ports(cfg, report)
    report.seconds = time.monotonic() - started
    return report


def stage_weights(cfg: RunConfig) -> StagedModel:
    """The stage_weights stage of one node: a listed node's own checks first, on that node's
    interpreter (its code, engine, model, staging space and ports; the run's own node had them
    in preflight), then its weights staged."""
    from regen.weights import staged_model

    if not cfg.this_node().is_run_node:
        report = run_preflight(cfg, scope="node")
        if not report.ok:
            raise PreflightFailed([f"node {cfg.node}: {problem}" for problem in report.problems])
        log.info("node %s: preflight passed in %.1f s (engine %s; %s)", cfg.node, report.seconds, cfg.engine,
                 plan_line(report.info.get("servers", [])))
    return staged_model(cfg)


def live_runs(cfg: RunConfig) -> set[str]:
    """The runs that show life on the output, on every node: a live lease, a pending approval,
    a running server of this machine's."""
    from regen.coordination import approval_pending, live_leases
    from regen.files import read_json
    from regen.servers.records import read_state

    runs: set[str] = set()
    for spec in cfg.node_specs():
        layout = cfg.for_node(spec).layout
        runs |= {lease.get("run_id", "") for lease in live_leases(layout)}
        if approval_pending(layout):
            runs.add((read_json(layout.approval_hold) or {}).get("run_id", ""))
        runs |= {r.owner for r in read_state(layout) if r.is_here() and r.running()}
    return runs


def preflight(cfg: RunConfig, code: bool = True, run_id: str = "cli",
          max_map_length: int | None = None, dag_nodes: list[str] | None = None,
          dag_queue: str | None = None) -> PreflightResult:
    """The preflight stage: every check, here, with this interpreter; PreflightFailed listing
    every problem, else the run manifest written (the prompt index) and the shards to map over.
    ``max_map_length``: the deployment's limit on mapped tasks (the DAG passes Airflow's);
    ``dag_nodes`` and ``dag_queue``: the listed node names and the run's queue the DAG was built with."""
    from regen.manifest import Manifest
    from regen.servers.gpus import fleet_size

    cfg = cfg.with_num_shards(fleet_size(cfg))  # recorded with the prompt index below
    report = run_preflight(cfg, code=code, max_map_length=max_map_length,
                           scope="run" if cfg.nodes else "all", dag_nodes=dag_nodes, dag_queue=dag_queue)
    if not report.ok:
        raise PreflightFailed(report.problems)
    if run_id != "cli":  # a DAG run; the operator's own CLI claims nothing
        from regen.coordination import OutputHeld, claim_output

        try:
            claim_output(cfg.layout, run_id, live_runs(cfg))
        except OutputHeld as exc:
            raise PreflightFailed([str(exc)]) from None
    from regen.generate import shards_to_run  # only now: the code it is in has just been checked
    Manifest(cfg.layout).write_prompts(cfg, report.info["_index"], run_id)
    info = {k: v for k, v in report.info.items() if not k.startswith("_")}
    shards = shards_to_run(cfg)
    if not shards and run_id != "cli":  # up to date: no task of this run will use the output
        from regen.coordination import release_output

        release_output(cfg.layout, run_id)
    work = (f"{len(shards)} of {cfg.num_shards} shards with work" if shards else
            "up to date: every prompt has a good row of this model and settings, nothing to send")
    return PreflightResult(shards=shards, up_to_date=not shards, info=info, seconds=round(report.seconds, 2),
                           summary=f"preflight passed in {report.seconds:.1f} s: "
                                   f"{info.get('prompts', 0):,} prompts"
                                   + (f" ({sum(info['skipped_conversations'].values()):,} skipped)"
                                      if info.get("skipped_conversations") else "")
                                   + (f", {info['agentic_prompts']:,} of them agentic"
                                      if info.get("agentic_prompts") else "")
                                   + f", engine {cfg.engine}, training as {info.get('train_template')} "
                                   f"({info.get('train_layout')} layout); {work}"
                                   + (f"\n{plan_line(info['servers'])}" if "servers" in info else "")
                                   + (f"\nlaunch command checked by {info['launch_checked_by']}"
                                      if cfg.engine != "sim" and "launch_checked_by" in info else "")
                                   + (f"\n{line}" if (line := trainer_cut_line(info.get("trainer_cut") or {})) else ""))


def plan_line(servers: list[dict]) -> str:
    """The server plan in one line: each server's port and GPUs (the argv is in the result)."""
    return f"{len(servers)} server(s): " + "; ".join(
        f":{s['port']} on " + (f"GPU {s['cuda_visible_devices']}" if s["cuda_visible_devices"] else "CPU")
        for s in servers)
