"""``regen SUBCOMMAND``: the command line over the same functions the DAG runs.

Every command that takes ``--config FILE`` also takes one flag per config field
(``--max-tokens 2048``, ``--no-enable-thinking``), so the YAML, the flags and the DAG's Params are
the same names for the same schema.
"""

from __future__ import annotations

import argparse
import logging
import shlex
import sys
import typing
from pathlib import Path
from typing import Any

from regen.config import ConfigError, RunConfig

EXIT_FAILED = 1
EXIT_USAGE = 2


def _add_config_flags(parser: argparse.ArgumentParser, skip: tuple[str, ...] = ()) -> None:
    parser.add_argument("--config", type=Path, help="YAML file with the run's fields")
    parser.add_argument("--config-json", help="the run's fields as one JSON object (how a stage "
                        "is handed to an SSH node)")
    group = parser.add_argument_group("config fields (override the YAML)")
    for name, field in RunConfig.model_fields.items():
        if name in skip:
            continue
        flag = "--" + name.replace("_", "-")
        help_text = field.title or name
        base = _base_type(field.annotation)
        if base is bool:
            group.add_argument(flag, dest=name, action=argparse.BooleanOptionalAction, default=None,
                               help=help_text)
        elif base is list:
            group.add_argument(flag, dest=name, default=None, metavar="A,B",
                               help=f"{help_text} (comma-separated; server args: one string)")
        else:
            group.add_argument(flag, dest=name, default=None, type=base if base in (int, float) else str,
                               help=help_text)


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
    for name in RunConfig.model_fields:
        value = getattr(args, name, None)
        if value is None:
            continue
        if name == "gpus":
            value = [int(v) for v in str(value).split(",") if v.strip()]
        elif name == "extra_server_args":
            value = shlex.split(value)
        out[name] = value
    return out


def load_config(args: argparse.Namespace) -> RunConfig:
    overrides = _overrides(args)
    if getattr(args, "config_json", None):
        import json

        return RunConfig.from_mapping({**json.loads(args.config_json), **overrides},
                                      source="--config-json")
    # Flags given on the command line are relative to where the command runs.
    cwd_relative = {k: str(Path(v).resolve()) for k, v in overrides.items()
                    if k in ("model_path", "prompts", "output", "staging_dir") and v}
    overrides.update(cwd_relative)
    return RunConfig.load(args.config, overrides, base_dir=None if args.config else Path.cwd())


def _setup_logging(verbose: bool = False) -> None:
    logging.basicConfig(level=logging.DEBUG if verbose else logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s", datefmt="%H:%M:%S")
    logging.getLogger("httpx").setLevel(logging.WARNING)


def cmd_preflight(args) -> int:
    from regen.pipeline import state_dir
    from regen.preflight import run_preflight

    cfg = load_config(args)
    report = run_preflight(cfg, state_dir(cfg), code=not args.skip_code)
    for problem in report.problems:
        print(problem)
    if report.ok:
        print(f"preflight ok in {report.seconds:.1f} s: {report.info.get('prompts', 0):,} prompts, "
              f"{cfg.num_shards} shards, engine {cfg.engine}", file=sys.stderr)
        return 0
    print(f"preflight: {len(report.problems)} problem(s) in {report.seconds:.1f} s", file=sys.stderr)
    return EXIT_FAILED


def cmd_stage(args) -> int:
    from regen.pipeline import stage_weights

    print(stage_weights(load_config(args)))
    return 0


def cmd_serve(args) -> int:
    from regen.pipeline import start_servers, state_dir, stop_servers

    cfg = load_config(args)
    if args.stop:
        stopped = stop_servers(cfg)
        print(f"stopped {stopped} server(s)")
        return 0
    model = args.served_model_path or cfg.model_path
    for url in start_servers(cfg, model):
        print(url)
    print(f"state and logs: {state_dir(cfg)}; stop with `regen serve --stop` and the same config",
          file=sys.stderr)
    return 0


def cmd_logs(args) -> int:
    from regen.pipeline import server_logs

    logs = server_logs(load_config(args), args.lines)
    print(logs or "no servers recorded")
    return 0 if logs else EXIT_FAILED


def cmd_canary(args) -> int:
    from regen.canary import CanaryFailed
    from regen.pipeline import canary

    try:
        estimate = canary(load_config(args))
    except CanaryFailed as exc:
        print(exc)
        return EXIT_FAILED
    print(f"canary passed; {estimate.get('text', 'no estimate')}")
    return 0


def cmd_generate(args) -> int:
    from regen.generate import GenerationSettings, ShardFailed, generate_shard

    cfg = load_config(args)
    if args.endpoints:
        endpoints = [(u.strip(), cfg.api_key) for u in args.endpoints.split(",") if u.strip()]
    else:
        from regen.pipeline import endpoints as recorded

        endpoints = recorded(cfg)
    settings = GenerationSettings.from_config(cfg)
    if args.endpoints and not (args.config or args.config_json or args.model_path):
        # Servers named by URL only: the model they serve is unknown here, so rows already in
        # the output cannot be proven to come from it; they are regenerated, not reused.
        settings.model_fingerprint = None
    shards = [args.shard] if args.shard is not None else list(range(cfg.num_shards))
    bar = None if args.no_progress_bar else _progress_bar()
    try:
        for shard in shards:
            result = generate_shard(cfg.prompts, cfg.output, endpoints, shard, cfg.num_shards,
                                    settings, on_row=bar)
            print(result.summary())
    except ShardFailed as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_FAILED
    finally:
        if hasattr(bar, "close"):
            bar.close()
    return 0


def _progress_bar():
    """A tqdm bar on a terminal; nothing otherwise (logs carry the progress lines)."""
    if not sys.stderr.isatty():
        return None
    from tqdm import tqdm

    bar = tqdm(unit="row", dynamic_ncols=True)

    class Bar:
        def __call__(self, row: dict) -> None:
            bar.update(1)
            if row.get("error"):
                bar.set_postfix_str(f"last error: {row['error'][:40]}")

        def close(self) -> None:
            bar.close()

    return Bar()


def cmd_audit(args) -> int:
    from regen.audit import AuditThresholds, audit_dataset

    cfg = load_config(args)
    data = Path(args.data) if args.data else Path(cfg.output) / "data"
    tokenizer = args.tokenizer or cfg.model_path
    report_dir = Path(args.report) if args.report else data.parent / "audit"
    try:
        report = audit_dataset(data, tokenizer, report_dir,
                               AuditThresholds(cfg.min_loss_tokens, cfg.max_degenerate_fraction),
                               default_thinking=cfg.enable_thinking)
    except (FileNotFoundError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    for line in report.lines():
        print(line)
    if args.summary_json:
        import json

        print(json.dumps(report.to_json()))
    return 0 if report.passed else EXIT_FAILED


def cmd_export(args) -> int:
    from regen.export import export_sharegpt

    try:
        result = export_sharegpt(args.data, args.out, expect_reasoning=args.expect_reasoning)
    except (FileNotFoundError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    print(result.summary())
    return 0


def cmd_config(args) -> int:
    cfg = load_config(args)
    print(cfg.model_dump_json() if args.json else cfg.to_yaml(), end="\n" if args.json else "")
    return 0


def cmd_progress(args) -> int:
    """What the run page shows, as one line of JSON (how the page reads an SSH node's run)."""
    import json

    from regen.web import run_data

    print(json.dumps(run_data(Path(load_config(args).output)), default=str))
    return 0


def cmd_summary(args) -> int:
    """Where the dataset and the report are, and the audit's five lines: readable in seconds."""
    import json

    cfg = load_config(args)
    output = Path(cfg.output)
    progress = json.loads((output / "progress.json").read_text()) if (output / "progress.json").exists() else {}
    print(f"dataset:  {output / 'data'}  ({progress.get('done', 0):,} rows done, "
          f"{progress.get('failed', 0):,} failed, of {progress.get('total', 0):,})")
    print(f"progress: {output / 'progress.json'}")
    summary_path = output / "audit" / "summary.json"
    if not summary_path.exists():
        print("audit:    not run yet")
        return EXIT_FAILED
    summary = json.loads(summary_path.read_text())
    print(f"audit:    {output / 'audit'}  (report.html, summary.json, samples.parquet)")
    for line in summary["summary"]:
        print("  " + line)
    return 0 if summary["verdict"] == "PASS" else EXIT_FAILED


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
    p.add_argument("--data", help="the dataset's data/ directory (default: OUTPUT/data)")
    p.add_argument("--tokenizer", help="tokenizer directory (default: the model path)")
    p.add_argument("--report", help="report directory (default: next to data/, in audit/)")
    p.add_argument("--no-thinking", dest="enable_thinking", action="store_false", default=None,
                   help="rows without enable_thinking were generated with thinking off")
    p.add_argument("--summary-json", action="store_true", help="also print summary.json's content")
    p.set_defaults(func=cmd_audit)

    p = sub.add_parser("export", help="write the dataset as SpecForge/DFlash training JSONL")
    p.add_argument("--data", required=True, help="the dataset's data/ directory")
    p.add_argument("--format", choices=["sharegpt"], default="sharegpt")
    p.add_argument("--out", required=True, type=Path, help="JSONL file to write")
    p.add_argument("--expect-reasoning", action=argparse.BooleanOptionalAction, default=True,
                   help="leave out rows without reasoning (default), as training with thinking needs")
    p.set_defaults(func=cmd_export)

    p = sub.add_parser("config", help="print the validated config (YAML, or JSON for --conf)")
    _add_config_flags(p)
    p.add_argument("--json", action="store_true", help="one line of JSON, e.g. for `airflow dags test --conf`")
    p.set_defaults(func=cmd_config)

    p = sub.add_parser("progress", help="progress, throughput history and audit summary as JSON")
    _add_config_flags(p)
    p.set_defaults(func=cmd_progress)

    p = sub.add_parser("summary", help="where the outputs are, and the audit summary")
    _add_config_flags(p)
    p.set_defaults(func=cmd_summary)

    p = sub.add_parser("demo-model", help="build the tiny local model and tokenizer of the demo")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--force", action="store_true")
    p.set_defaults(func=cmd_demo_model)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "sim":
        from regen import sim

        return sim.main(argv[1:])
    parser = build_parser()
    args = parser.parse_args(argv)
    _setup_logging(args.verbose)
    try:
        return args.func(args)
    except ConfigError as exc:
        print(exc, file=sys.stderr)
        return EXIT_USAGE
    except Exception as exc:
        from regen.generate import ShardFailed
        from regen.preflight import PreflightFailed
        from regen.servers import ServerError
        from regen.stage import StageError

        if isinstance(exc, (ShardFailed, PreflightFailed, ServerError, StageError, RuntimeError)):
            print(f"error: {exc}", file=sys.stderr)
            return EXIT_FAILED
        raise


if __name__ == "__main__":
    sys.exit(main())
