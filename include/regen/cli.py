"""``regen SUBCOMMAND``: the command line over the same functions the DAG runs.

Every command that takes ``--config FILE`` also takes one flag per config field
(``--max-tokens 2048``, ``--no-enable-thinking``), so the YAML, the flags and the DAG's Params are
the same names for the same schema.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import logging
import os
import shlex
import sys
import typing
from collections import Counter
from pathlib import Path
from typing import Any

from regen.config import RunConfig, run_fields
from regen.errors import DataError, RegenError
from regen.files import read_json
from regen.objectstore import is_store_url, local_path
from regen.pipeline import execute, run
from regen.units import format_duration

EXIT_FAILED = 1
EXIT_USAGE = 2


def _add_config_flags(parser: argparse.ArgumentParser, skip: tuple[str, ...] = ()) -> None:
    parser.add_argument("--config", type=Path, help="YAML file with the run's fields")
    parser.add_argument("--config-json", help="the run's fields as one JSON object (how a stage "
                        "is handed to an SSH node)")
    group = parser.add_argument_group("config fields (override the YAML)")
    for name, flat in run_fields().items():
        if name in skip:
            continue
        field = flat.info
        flag = "--" + name.replace("_", "-")
        help_text = _field_help(field)
        base = _base_type(field.annotation)
        if base is bool:
            group.add_argument(flag, dest=name, action=argparse.BooleanOptionalAction, default=None,
                               help=help_text)
        elif name == "nodes":
            group.add_argument(flag, dest=name, default=None, metavar="JSON",
                               help=f"{help_text} (a JSON list of objects)")
        elif name == "extra_server_args":
            group.add_argument(flag, dest=name, default=None, metavar="'--FLAG VALUE ...'",
                               help=f"{help_text} (one string, split as a shell would, never run by one)")
        elif base is list:
            group.add_argument(flag, dest=name, default=None, metavar="A,B", help=f"{help_text} (comma-separated)")
        else:
            kind = base if base in (int, float) else str
            nullable = type(None) in typing.get_args(field.annotation) and field.default is not None
            group.add_argument(flag, dest=name, default=None, type=_or_none(kind) if nullable else kind,
                               help=help_text + (" ('none': unset)" if nullable else ""))


def _field_help(field) -> str:
    """The schema's description of a field, its default and its choices (argparse's % escaped)."""
    text = (field.description or field.title or "").rstrip(".")
    choices = typing.get_args(field.annotation) if typing.get_origin(field.annotation) is typing.Literal else ()
    if choices:
        text += f". Choices: {', '.join(map(str, choices))}"
    if field.default_factory is None and field.default is not None and field.default != "":
        text += f". Default: {field.default}"
    return text.replace("%", "%%")


class _Unset:
    """A flag given as 'none': the field set to null, over the YAML's value and the default."""


def _or_none(kind: type):
    def parse(text: str):
        return _Unset if text.strip().lower() in ("none", "") else kind(text)
    parse.__name__ = kind.__name__
    return parse


def _base_type(annotation: Any) -> type:
    args = [a for a in typing.get_args(annotation) if a is not type(None)]
    if typing.get_origin(annotation) in (list,) or list in [typing.get_origin(a) for a in args]:
        return list
    if typing.get_origin(annotation) is typing.Literal:
        return str
    if args and annotation not in (bool, int, float, str):
        first = args[0]
        if typing.get_origin(first) is typing.Literal:
            return str
        return first if isinstance(first, type) else str
    return annotation if isinstance(annotation, type) else str


def _overrides(args: argparse.Namespace) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name in run_fields():
        value = getattr(args, name, None)
        if value is None:
            continue
        if name == "gpus":
            value = [int(v) for v in str(value).split(",") if v.strip()]
        elif name == "extra_server_args":
            value = shlex.split(value)
        elif name == "nodes":
            value = json.loads(value)
        out[name] = None if value is _Unset else value
    return out


def load_config(args: argparse.Namespace) -> RunConfig:
    overrides = _overrides(args)
    if getattr(args, "config_json_file", None):  # an SSH node's stage: read once, then removed
        path = Path(args.config_json_file)
        args.config_json_file, args.config_json = None, path.read_text()
        path.unlink()
    if getattr(args, "config_json", None):
        return RunConfig.from_mapping({**json.loads(args.config_json), **overrides},
                                      source="--config-json")
    # Flags given on the command line are relative to where the command runs.
    cwd_relative = {k: str(local_path(v).resolve()) for k, v in overrides.items()
                    if k in ("model_path", "prompts", "output", "staging_dir", "work_dir") and v
                    and not is_store_url(v)}
    overrides.update(cwd_relative)
    cfg = RunConfig.load(args.config, overrides, base_dir=None if args.config else Path.cwd())
    # `--node NAME`: that node's stage. Without it the run's config: a shard then claims any of its
    # nodes, and a per-node stage runs for the first (regen.pipeline).
    return cfg.for_node(cfg.this_node()) if cfg.node else cfg


def _setup_logging(verbose: bool = False) -> None:
    logging.basicConfig(level=logging.DEBUG if verbose else logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s", datefmt="%H:%M:%S")
    logging.getLogger("httpx").setLevel(logging.WARNING)


# Each command runs its stage through regen.pipeline (here, or on the config's SSH node) and
# prints the parts of its result a person needs. What only one command uses is imported when it
# runs: a shard process (`regen generate --shard K`) starts without the audit, the export or the
# simulator, and seven of them start at once on a node.

def cmd_preflight(args) -> int:
    from regen.preflight import PreflightFailed

    try:
        run("preflight", load_config(args), code=not args.skip_code)
    except PreflightFailed as exc:
        for problem in exc.problems:
            print(problem)
        print(f"preflight: {len(exc.problems)} problem(s)", file=sys.stderr)
        return EXIT_FAILED
    return 0


def cmd_stage(args) -> int:
    print(run("stage_weights", load_config(args)).path)
    return 0


def cmd_serve(args) -> int:
    cfg = load_config(args)
    if args.dry_run:
        planned = run("server_plan", cfg, model_path=args.served_model_path, gpu=args.gpu)
        if args.json:
            print(planned.model_dump_json(indent=1))
        else:
            print(f"{len(planned.servers)} {cfg.engine} server(s); each launches as (paste to run it by hand):")
            for server in planned.servers:
                devices = f"CUDA_VISIBLE_DEVICES={server.cuda_visible_devices} " if server.cuda_visible_devices else ""
                print(f"  server {server.index}, port {server.port}:\n    {devices}{shlex.join(server.argv)}")
        for line in (planned.operating_point or {}).get("summary") or [(planned.operating_point or {}).get("problem")]:
            if line:
                print(f"per server: {line}", file=sys.stderr)
        return 0
    if args.stop:
        print(run("stop_servers", cfg, run_id=args.run_id, every=args.every, log_summary=False).summary)
        return 0
    for url in run("start_servers", cfg, served_model_path=args.served_model_path, run_id=args.run_id).urls:
        print(url)
    print(f"state and logs: {cfg.layout.servers}; stop with `regen serve --stop` and "
          f"the same config", file=sys.stderr)
    return 0


def cmd_logs(args) -> int:
    result = run("server_logs", load_config(args), lines=args.lines, log_summary=False)
    print(result.summary)
    return 0 if result.logs else EXIT_FAILED


def cmd_canary(args) -> int:
    run("canary", load_config(args))
    return 0


def cmd_generate(args) -> int:
    cfg = load_config(args)
    endpoints = [u.strip() for u in args.endpoints.split(",") if u.strip()] if args.endpoints else None
    # Servers named by URL serve what they report, unless a model directory is named too.
    model_from = "model_path" if (args.config or args.config_json or args.model_path) else "servers"
    if endpoints:
        cfg = cfg.with_num_shards(len(endpoints))
    else:
        from regen.servers.gpus import fleet_size  # here: a broken module is preflight's to report

        cfg = cfg.with_num_shards(fleet_size(cfg))
    shards = [args.shard] if args.shard is not None else list(range(cfg.num_shards))
    run("generate", cfg, shards=shards, endpoints=endpoints, model_from=model_from)  # all at once: one client
    return 0


def cmd_audit(args) -> int:
    from regen.audit.findings import AuditFailed

    try:
        doc = run("audit", load_config(args), data=args.data, tokenizer=args.tokenizer,
                  report_dir=args.report, log_summary=False).model_dump(mode="json")
    except AuditFailed as exc:
        doc = exc.summary
    for line in doc.get("summary") or []:
        print(line)
    if args.summary_json:
        print(json.dumps(doc))
    return 0 if doc.get("verdict") == "PASS" else EXIT_FAILED


def cmd_export(args) -> int:
    """Every format writes the recipe the output was audited with (regen.export.export_recipe);
    flags override it, and one that contradicts it is refused unless --force."""
    from regen.export import (RecipeConflict, RecipeIncomplete, export_recipe, export_sharegpt, export_specforge,
                              export_tokens)
    from regen.layout import RunLayout

    cfg = load_config(args)
    data = RunLayout.from_data_arg(args.data, cfg.work_dir)  # a bucket's audit and manifest are in work_dir
    try:
        recipe = export_recipe(data, {"train_template": cfg.audit.train_template,
                                           "train_layout": cfg.audit.train_layout,
                                           "train_max_length": cfg.audit.train_max_length}, force=args.force)
    except RecipeConflict as exc:
        print(exc, file=sys.stderr)
        return EXIT_FAILED
    tokenizer = args.tokenizer or ("model_path" not in _overrides(args) and not args.config and recipe["model_path"]
                                   or cfg.model_path)
    if args.format == "specforge":
        try:
            result = export_specforge(data, args.out, tokenizer, recipe["train_template"], recipe["train_layout"],
                                      recipe["train_max_length"], workers=args.workers,
                                      memory_gb=cfg.audit.audit_memory_gb)
        except RecipeIncomplete as exc:
            print(exc, file=sys.stderr)
            return EXIT_FAILED
        print(result.summary())
        return 0
    if args.format == "tokens":
        result = export_tokens(data, args.out, tokenizer, recipe["train_template"], recipe["train_layout"],
                               cfg.enable_thinking)
    else:
        result = export_sharegpt(data, args.out, expect_reasoning=args.expect_reasoning,
                                 train_layout="events" if recipe["train_layout"] == "events" else "conversation")
    print(result.summary())
    return 0


def cmd_run_stage(args) -> int:
    """How an SSH node runs a stage for regen.pipeline: the result document on one marked line."""
    cfg = load_config(args)
    doc = execute(args.stage, cfg, json.loads(args.kwargs_json))
    if not doc["ok"]:
        logging.getLogger("regen").error("%s: %s", doc["error"]["type"], doc["error"]["message"])
    sys.stdout.write(f"\n{args.result_marker}{json.dumps(doc)}\n")
    sys.stdout.flush()
    return 0 if doc["ok"] else EXIT_FAILED


def cmd_config(args) -> int:
    if args.params_reference:
        from regen.config.reference import params_reference

        print(params_reference(), end="")
        return 0
    cfg = load_config(args)
    print(cfg.model_dump_json() if args.json else cfg.to_yaml(), end="\n" if args.json else "")
    return 0


def cmd_progress(args) -> int:
    """What the run page shows: a few lines, or its whole document with --json."""
    status = run("status", load_config(args))
    if args.json:
        print(status.model_dump_json())
        return 0
    progress = status.progress
    shards = Counter(s.get("state", "?") for s in (progress.get("shards") or {}).values())
    eta = progress.get("eta_s")
    print(f"rows:    {status.summary} of {status.output}")
    print(f"speed:   {progress.get('tokens_per_s', 0):,.0f} tok/s now" + (f", ETA {format_duration(eta)}" if eta else ""))
    if shards:
        print("shards:  " + ", ".join(f"{n} {state}" for state, n in sorted(shards.items())))
    for node in status.nodes:
        print(f"node {node['node']}: {len(node['servers'])} server(s) recorded, {node['shards_running']} shard(s) running")
    audit = status.audit
    print("audit:   " + (f"{audit.get('verdict')}: " + "; ".join(audit.get("summary", [])[:1]) if audit else "not run yet"))
    for item in status.attention:
        print(f"! {item['what']}\n    next: {item['next']}")
    return 0


def cmd_summary(args) -> int:
    """Where the dataset and the report are, and the audit's five lines: readable in seconds."""
    from regen.status import attention, with_stopped_shards

    layout = load_config(args).layout
    progress = with_stopped_shards(read_json(layout.progress_file) or {})
    print(f"dataset:  {layout.data}  ({progress.get('done', 0):,} rows done, "
          f"{progress.get('failed', 0):,} failed, of {progress.get('total', 0):,})")
    print(f"progress: {layout.progress_file}")
    canary = progress.get("canary")
    if canary is not None:
        estimate = (canary.get("estimate") or {}).get("text")
        print("canary:   " + ("passed" if canary.get("passed") else "FAILED")
              + (f"; estimate: {estimate}" if estimate and canary.get("passed") else ""))
    summary = read_json(layout.audit.summary_json)
    todo = attention(progress, summary)
    for item in todo:
        print(f"! {item['what']}")
        for detail in item["details"]:
            print(f"    {detail}")
        print(f"    next: {item['next']}")
    if summary is None:
        print("audit:    not run yet")
        return EXIT_FAILED
    print(f"audit:    {layout.audit.root}  (report.html, summary.json, samples.parquet)")
    for line in summary["summary"]:
        print("  " + line)
    return 0 if summary["verdict"] == "PASS" and not todo else EXIT_FAILED


def cmd_demo_model(args) -> int:
    from regen.tinymodel import build_tiny_model

    print(build_tiny_model(args.out, force=args.force))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="regen", description=__doc__.splitlines()[0])
    parser.add_argument("-v", "--verbose", action="store_true")
    parser.add_argument("--no-progress-bar", action="store_true",
                        help="log lines only, even on a terminal")
    sub = parser.add_subparsers(dest="command", required=True)

    sub.add_parser("sim", help="an SGLang-compatible simulator on 127.0.0.1:PORT", add_help=False)

    p = sub.add_parser("preflight", help="every check that needs no GPU; exit 0 when clean")
    _add_config_flags(p)
    p.add_argument("--skip-code", action="store_true", help="skip the compile/import check")
    p.set_defaults(func=cmd_preflight)

    p = sub.add_parser("stage", help="copy the model to the staging dir; prints the staged path")
    _add_config_flags(p)
    p.set_defaults(func=cmd_stage)

    p = sub.add_parser("serve", help="start one server per GPU and wait until healthy")
    _add_config_flags(p)
    p.add_argument("--served-model-path", help="serve this path (e.g. the staged copy)")
    p.add_argument("--stop", action="store_true", help="stop the servers of this config instead")
    p.add_argument("--run-id", default="cli", help="the run that owns the servers (default: cli); "
                   "--stop stops only that run's")
    p.add_argument("--every", action="store_true", help="with --stop: every recorded server, "
                   "whichever run owns it")
    p.add_argument("--dry-run", action="store_true", help="print the plan (each server's port, GPUs and "
                   "launch line) and start nothing")
    p.add_argument("--json", action="store_true", help="with --dry-run: the plan as JSON")
    p.add_argument("--gpu", help="with --dry-run: plan each server's concurrency on this GPU (H100, H200, "
                   "B200, or its memory in MiB; default: the node's own)")
    p.set_defaults(func=cmd_serve)

    p = sub.add_parser("logs", help="the last lines of each server's log")
    _add_config_flags(p)
    p.add_argument("--lines", type=int, default=40)
    p.set_defaults(func=cmd_logs)

    p = sub.add_parser("canary", help="a few real requests through the full path")
    _add_config_flags(p)
    p.set_defaults(func=cmd_canary)

    p = sub.add_parser("generate", help="generate one shard (or all) against running servers")
    _add_config_flags(p)
    p.add_argument("--endpoints", help="URL[,URL...] of running servers; default: the recorded ones")
    p.add_argument("--shard", type=int, help="shard index I (0-based); default: every shard in turn")
    p.add_argument("--no-thinking", dest="enable_thinking", action="store_false", default=None,
                   help="send enable_thinking=false")
    p.set_defaults(func=cmd_generate)

    p = sub.add_parser("audit", help="the loss-mask audit of a dataset; non-zero exit when it fails")
    _add_config_flags(p)
    p.add_argument("--data", help="an output directory or its data/ (default: the config's output)")
    p.add_argument("--tokenizer", help="tokenizer directory (default: the model path)")
    p.add_argument("--report", help="report directory (default: next to data/, in audit/)")
    p.add_argument("--no-thinking", dest="enable_thinking", action="store_false", default=None,
                   help="rows without enable_thinking were generated with thinking off")
    p.add_argument("--summary-json", action="store_true", help="also print summary.json's content")
    p.set_defaults(func=cmd_audit)

    p = sub.add_parser("export", help="write the dataset as SpecForge/DFlash training JSONL")
    _add_config_flags(p)
    p.add_argument("--data", required=True, help="an output directory or its data/")
    p.add_argument("--format", choices=["sharegpt", "tokens", "specforge"], default="sharegpt",
                   help="sharegpt: conversations (text); tokens: input_ids and loss_mask from the "
                        "tokens the engine returned; specforge: every file of SpecForge's recipe, in the "
                        "folder --out, with the `data:` block of each. Every format writes the recipe the output's "
                        "audit judged (template, layout, max length); --train-layout picks one record per "
                        "prompt (conversation: what SpecForge's regenerate script writes and its validator "
                        "checks) or per assistant turn (events: what its expand_reasoning_conversations.py "
                        "writes; train with train_only_last_turn)")
    p.add_argument("--tokenizer", help="tokens, specforge: tokenizer directory (default: the model path)")
    p.add_argument("--out", required=True, type=Path, help="JSONL file to write (specforge: a folder)")
    p.add_argument("--expect-reasoning", action=argparse.BooleanOptionalAction, default=True,
                   help="leave out rows without reasoning (default), as training with thinking needs")
    p.add_argument("--workers", type=int, help="specforge: processes writing the lines (default: every core "
                                               "when the data has 4,096 rows or more, else 1; at most as many "
                                               "as --audit-memory-gb holds)")
    p.add_argument("--force", action="store_true",
                   help="write a recipe (--train-template, --train-layout, --train-max-length) other than the one "
                        "the output's audit judged")
    p.set_defaults(func=cmd_export)

    p = sub.add_parser("config", help="print the validated config (YAML, or JSON for --conf)")
    _add_config_flags(p)
    p.add_argument("--json", action="store_true", help="one line of JSON, e.g. for `airflow dags test --conf`")
    p.add_argument("--params-reference", action="store_true",
                   help="the Params reference page (docs/params.md), written from the schema")
    p.set_defaults(func=cmd_config)

    p = sub.add_parser("progress", help="rows, speed, shards and the audit's verdict (--json: the run page's whole document)")
    _add_config_flags(p)
    p.add_argument("--json", action="store_true", help="the run page's document: progress, history, audit, nodes")
    p.set_defaults(func=cmd_progress)

    p = sub.add_parser("summary", help="where the outputs are, and the audit summary")
    _add_config_flags(p)
    p.set_defaults(func=cmd_summary)

    p = sub.add_parser("run-stage", help="internal: run one stage and print its result document "
                       "on a marked line (how an SSH node runs a stage)")
    p.add_argument("stage", help="the stage's name (regen.stages)")
    _add_config_flags(p)
    p.add_argument("--config-json-file", type=Path, help="a file holding --config-json's object, removed once "
                   "read (how regen hands a stage to an SSH node: not on a command line)")
    p.add_argument("--kwargs-json", default="{}")
    p.add_argument("--result-marker", required=True)
    p.set_defaults(func=cmd_run_stage)

    p = sub.add_parser("demo-model", help="build the tiny local model and tokenizer of the demo")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--force", action="store_true")
    p.set_defaults(func=cmd_demo_model)
    return parser


class _PandasHidden:
    """An import finder and loader for which pandas is not installed: its import fails as a missing
    module's does, while ``importlib.util.find_spec`` still answers (a library asking whether
    pandas exists keeps working)."""

    @staticmethod
    def find_spec(name, path=None, target=None):
        if name == "pandas" or name.startswith("pandas."):
            return importlib.util.spec_from_loader(name, _PandasHidden)
        return None

    @staticmethod
    def create_module(spec):
        raise ModuleNotFoundError(f"No module named {spec.name!r} (hidden in a shard's process: "
                                  f"regen.cli.hide_pandas)", name=spec.name)

    @staticmethod
    def exec_module(module) -> None:
        """Never reached: :meth:`create_module` fails first."""


def hide_pandas() -> None:
    """pyarrow imports pandas the first time it builds an array and when its dataset module loads
    (apache/arrow#34994; both guarded, as for an install without pandas): 0.25 s of CPU in each
    shard process, on the cores that serve the model, which regen never needs (its rows are
    Python objects and Arrow tables). Hidden for the life of the process (pyarrow's compiled
    import reads a None in sys.modules as the module, so a finder it is)."""
    if "pandas" not in sys.modules and _PandasHidden not in sys.meta_path:
        sys.meta_path.insert(0, _PandasHidden)


def main(argv: list[str] | None = None) -> int:
    """``argv`` None: the ``regen`` command, in a process of its own; else a call from Python."""
    own_process = argv is None
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "sim":
        from regen.engines.simulator.app import main as simulator_main

        return simulator_main(argv[1:])
    parser = build_parser()
    args = parser.parse_args(argv)
    _setup_logging(args.verbose)
    if args.no_progress_bar:
        os.environ["REGEN_NO_PROGRESS_BAR"] = "1"
    if own_process and (args.func is cmd_generate or args.func is cmd_run_stage and args.stage == "generate"):
        hide_pandas()
    try:
        return args.func(args)
    except RegenError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_USAGE if isinstance(exc, (ValueError, DataError)) else EXIT_FAILED
    except BrokenPipeError:  # `regen progress | head`: the reader has what it wanted
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no second error at exit
        return 141  # what a shell reports for SIGPIPE


if __name__ == "__main__":
    sys.exit(main())
