"""Preflight: how fast it reads a million prompts, and how fast the seed's bug stops a run.

1. A 1,000,000-prompt JSONL (the three formats): regen's prompt checks (parse, normalise, unique
   ids, longest prompt, unreadable lines) versus a bare ``json.loads`` loop over the same file,
   the least any check must do.
2. The seed's bug (``global`` after use) in the generator module: time from triggering the DAG
   (``airflow dags test``) to its failure, and servers started; versus doing it by hand in the
   seed's order (servers first, then the generator), which finds the bug only after the servers
   are up and leaves them idle.

    .venv/bin/python bench/bench_preflight.py
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from harness import write_section

from regen.config import RunConfig
from regen.paths import PROJECT_ROOT
from regen.preflight import PreflightReport, check_prompts, run_preflight
from regen.servers.probe import free_port_base

BIN = Path(sys.executable).parent
SEED_BUG = ("\n\nMAX_OUTPUT_TOKENS = 4096\n\n\ndef configure(max_tokens):\n"
            "    if MAX_OUTPUT_TOKENS > max_tokens:\n        pass\n"
            "    global MAX_OUTPUT_TOKENS\n    MAX_OUTPUT_TOKENS = max_tokens\n")


def many_prompts(path: Path, count: int) -> None:
    rng = random.Random(1)
    words = "alpha beta gamma delta explain why how compute the value of a system in detail".split()
    with path.open("w") as fh:
        for i in range(count):
            text = " ".join(rng.choice(words) for _ in range(rng.randint(8, 40)))
            record = ({"id": f"p{i}", "messages": [{"role": "user", "content": text}]}, 
                      {"id": f"p{i}", "conversations": [{"from": "human", "value": text}]},
                      {"id": f"p{i}", "prompt": text})[i % 3]
            fh.write(json.dumps(record) + "\n")


def timed(fn) -> float:
    started = time.perf_counter()
    fn()
    return time.perf_counter() - started


def seed_bug_project(tmp: Path) -> Path:
    copy = tmp / "project"
    for part in ("include", "dags", "demo"):
        shutil.copytree(PROJECT_ROOT / part, copy / part, ignore=shutil.ignore_patterns("__pycache__"))
    generator = copy / "include" / "regen" / "generate.py"
    generator.write_text(generator.read_text() + SEED_BUG)
    return copy


def main() -> None:
    from regen.tinymodel import build_tiny_model

    parser = argparse.ArgumentParser()
    parser.add_argument("--prompts", type=int, default=1_000_000)
    args = parser.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        prompts = tmp / "prompts.jsonl"
        many_prompts(prompts, args.prompts)
        model = build_tiny_model(tmp / "model")
        cfg = RunConfig.from_mapping({"model_path": str(model), "prompts": str(prompts),
                                      "output": str(tmp / "out"), "staging_dir": str(tmp / "shm"),
                                      "base_port": free_port_base(1), "num_shards": 8})
        bare = timed(lambda: sum(1 for line in prompts.open("rb") for _ in [json.loads(line)]))
        report = PreflightReport()
        checks = timed(lambda: check_prompts(cfg, report))
        assert not report.problems and report.info["prompts"] == args.prompts, report.problems[:3]
        whole = timed(lambda: report.__dict__.update(run_preflight(cfg).__dict__))
        assert report.ok, report.problems[:3]  # a time of a preflight that failed early measures nothing

        copy = seed_bug_project(tmp)
        small = cfg.model_copy(update={"prompts": str(PROJECT_ROOT / "demo" / "prompts.jsonl")})
        # Deployed as a team would (its file in REGEN_CONFIG_DIR), triggered with the form's conf.
        configs = tmp / "regen-configs"
        configs.mkdir()
        (configs / "dataset.yaml").write_text(small.to_yaml())
        env = dict(os.environ, PYTHONPATH=str(copy / "include"), REGEN_CONFIG_DIR=str(configs),
                   AIRFLOW_HOME=os.environ.get("AIRFLOW_HOME", str(PROJECT_ROOT / "var" / "airflow")),
                   AIRFLOW__CORE__LOAD_EXAMPLES="False", AIRFLOW__CORE__DAGS_FOLDER=str(copy / "dags"))
        conf = {k: v for k, v in json.loads(small.model_dump_json()).items() if k not in ("node", "api_key")}
        started = time.perf_counter()
        dag = subprocess.run([str(BIN / "airflow"), "dags", "test", "regenerate_dataset", "--conf",
                              json.dumps(conf)], capture_output=True, text=True, env=env)
        regen_fail = time.perf_counter() - started
        assert dag.returncode != 0 and "used prior to global declaration" in dag.stdout + dag.stderr, (
            dag.stdout[-3000:] + dag.stderr[-3000:])
        regen_servers = len(list((tmp / "out" / "work" / "servers").glob("server-*.log")))
        config = tmp / "run.yaml"
        config.write_text(small.to_yaml())
        started = time.perf_counter()
        cli = subprocess.run([str(BIN / "regen"), "preflight", "--config", str(config)],
                             capture_output=True, text=True, env=env)
        cli_fail = time.perf_counter() - started
        assert cli.returncode == 1 and "used prior to global declaration" in cli.stdout, cli.stdout
        cli_servers = len(list((tmp / "out" / "work" / "servers").glob("server-*.log"))) - regen_servers

        # By hand, in the seed's order: servers up first, then the generator script.
        started = time.perf_counter()
        subprocess.run([str(BIN / "regen"), "serve", "--config", "/dev/null", "--model-path", str(model),
                        "--output", str(tmp / "hand"), "--base-port", str(free_port_base(1))], check=True,
                       capture_output=True, env=env)
        up = time.perf_counter() - started
        crash = subprocess.run([sys.executable, str(copy / "include" / "regen" / "generate.py")],
                               capture_output=True, text=True)
        hand_fail = time.perf_counter() - started
        assert "used prior to global declaration" in crash.stderr
        from regen.layout import RunLayout
        from regen.servers.records import read_state

        idle = sum(r.running() for r in read_state(RunLayout(tmp / "hand")))  # up, and nothing to serve
        subprocess.run([str(BIN / "regen"), "serve", "--stop", "--config", "/dev/null", "--output",
                        str(tmp / "hand")], check=True, capture_output=True)
    body = (
        "| step | seconds |\n| --- | --- |\n"
        f"| bare `json.loads` over {args.prompts:,} prompts (baseline) | {bare:.1f} |\n"
        f"| regen's prompt checks over the same file | {checks:.1f} |\n"
        f"| the whole preflight (code compiled and imported, config, template, prompts, space, ports) | {whole:.1f} |\n\n"
        "| the seed's bug in the generator module | seconds to the failure | servers started |\n"
        "| --- | --- | --- |\n"
        f"| regen: trigger the DAG (`airflow dags test`), fails at preflight with file:line | {regen_fail:.1f} | {regen_servers} |\n"
        f"| regen: `regen preflight --config FILE` on the same code | {cli_fail:.1f} | {cli_servers} |\n"
        f"| by hand: start the servers, then run the generator | {hand_fail:.1f} (servers up after {up:.1f}) | {idle}, left running idle |\n\n"
        "Most of the DAG's time is Airflow's own (`dags test` parses, creates the run, starts the "
        "task). By hand the crash comes as fast, but only after the servers hold the GPUs: the "
        "simulated servers start in under a second; the seed's SGLang servers took about 60 s to "
        "load a 52 GB model, and then sat idle until someone looked.")
    write_section("Preflight", ".venv/bin/python bench/bench_preflight.py", body)


if __name__ == "__main__":
    main()
