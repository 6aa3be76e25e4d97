"""The DAG under a real Airflow: parse hygiene, wiring, Params, and whole runs with dag.test()."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pandas as pd
import pytest

from regen.layout import RunLayout
from regen.servers.records import read_state
from support.airflow import _conf, _states, assert_no_server_left, asset_events, load_dag
from support.data import read_ids
from support.paths import DAG_FILE, ROOT

HEAVY = ("pandas", "pyarrow", "transformers", "tokenizers", "httpx", "matplotlib", "numpy")


@pytest.mark.parametrize("configs", [0, 20])
def test_dagbag_imports_without_db_connections_or_heavy_modules(configs, make_config, tmp_path):
    """Parse-time hygiene, in a fresh interpreter: no SQL, no connection look-up, nothing heavy,
    with no config file and with a deployment's 20 (20 DAGs). The parse time is printed, not
    asserted: a loaded CI machine once took 1.5 s for what takes 0.3 s here."""
    env = dict(os.environ)
    env.pop("REGEN_CONFIG_DIR", None)
    expected = ["regenerate_dataset"]
    if configs:
        folder = tmp_path / "configs"
        folder.mkdir()
        for i in range(configs):
            cfg = make_config(output=str(tmp_path / f"set{i}"))
            (folder / f"set{i:02d}.yaml").write_text(cfg.to_yaml() + "schedule: '0 3 * * 6'\n")
        env["REGEN_CONFIG_DIR"] = str(folder)
        expected = [f"regenerate_set{i:02d}" for i in range(configs)]
    script = textwrap.dedent(f"""
        import json, runpy, sys, time
        import airflow.sdk
        from sqlalchemy import event
        from sqlalchemy.engine import Engine
        queries, lookups = [], []
        event.listen(Engine, "before_cursor_execute", lambda *a, **k: queries.append(a[2]))
        from airflow.sdk import BaseHook, Connection
        BaseHook.get_connection = classmethod(lambda cls, *a, **k: lookups.append(a))
        Connection.get = classmethod(lambda cls, *a, **k: lookups.append(a))
        from airflow.dag_processing.dagbag import DagBag
        before = set(sys.modules)
        started = time.perf_counter()
        bag = DagBag(dag_folder={str(DAG_FILE.parent)!r})
        seconds = time.perf_counter() - started
        heavy = sorted(m for m in set(sys.modules) - before if m.split(".")[0] in {HEAVY!r})
        print(json.dumps({{"queries": queries, "lookups": len(lookups), "heavy": heavy, "seconds": seconds,
                          "errors": {{k: str(v) for k, v in bag.import_errors.items()}},
                          "dags": sorted(bag.dag_ids)}}))
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode == 0, out.stderr[-2000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["errors"] == {}
    assert result["dags"] == expected
    assert result["queries"] == []
    assert result["lookups"] == 0
    assert result["heavy"] == []
    print(f"parse of the dags folder with {configs} config files: {result['seconds']:.2f} s")


def test_each_configured_dag_opens_its_page_with_its_own_name_dataset_and_schedule(make_config, tmp_path, monkeypatch):
    from airflow.dag_processing.dagbag import DagBag

    folder = tmp_path / "configs"
    folder.mkdir()
    for name, schedule in (("chat", "'0 3 * * 6'"), ("agents", "null")):
        cfg = make_config(output=str(tmp_path / name))
        (folder / f"{name}.yaml").write_text(cfg.to_yaml() + f"schedule: {schedule}\n")
    monkeypatch.setenv("REGEN_CONFIG_DIR", str(folder))
    bag = DagBag(dag_folder=str(ROOT / "dags"))
    for name, when in (("chat", "on a schedule: `0 3 * * 6`"), ("agents", "when triggered")):
        doc = bag.dags[f"regenerate_{name}"].doc_md
        assert doc.startswith(f"### regenerate_{name}\n") and f"into `{tmp_path / name}`, {when}." in doc
        assert "### How a regen DAG works" not in doc and "`preflight` → `stage_weights`" in doc


def test_stages_are_wired_in_order_with_a_teardown():
    dag = load_dag()
    down = {t.task_id: set(t.downstream_task_ids) for t in dag.tasks}
    assert down["preflight"] >= {"stage_weights"}
    assert "start_servers" in down["stage_weights"]
    assert "canary" in down["start_servers"]
    assert down["canary"] == {"approval_gate"}
    assert down["approval_gate"] == {"approve", "generate"} and down["approve"] == {"generate"}
    assert down["generate"] >= {"audit", "stop_servers"}
    assert dag.get_task("start_servers").is_setup
    assert dag.get_task("stop_servers").is_teardown and dag.get_task("stop_servers").on_failure_fail_dagrun
    assert dag.get_task("generate").map_index_template == "{{ shard_label }}"


def test_only_a_run_marked_failed_is_failed_by_its_teardown():
    """The states Airflow 3.3 leaves (test_ui marks a real run, then clears it): a marking fails
    the running tasks and skips the audit, which a clear of only the failed tasks leaves skipped;
    a shard that fails by itself leaves the audit upstream_failed; a rejected approval skips the
    shards and fails nothing."""
    from regen.dags.runstate import marked_failed_by_hand

    teardowns = {"stop_servers"}
    marked = {"canary": "success", "approve": "skipped", "generate_0": "failed", "generate_1": "skipped",
              "audit": "skipped", "stop_servers": "running"}
    assert "marked failed while generate_0 ran" in marked_failed_by_hand(marked, teardowns)
    failed_alone = {**marked, "generate_1": "failed", "audit": "upstream_failed"}
    assert marked_failed_by_hand(failed_alone, teardowns) is None
    rejected = {"canary": "success", "approve": "success", "generate": "skipped", "audit": "skipped",
                "stop_servers": "running"}
    assert marked_failed_by_hand(rejected, teardowns, "Reject") is None
    assert marked_failed_by_hand({**rejected, "stop_servers": "failed"}, teardowns, "Reject") is None  # its own
    waiting = {"canary": "success", "approve": "skipped", "generate_0": "skipped", "generate_1": "skipped",
               "audit": "skipped", "stop_servers": "running"}  # no slot in a shared pool: nothing ran
    assert "while its shards waited to start" in marked_failed_by_hand(waiting, teardowns)
    approved = {**waiting, "approve": "success"}
    assert "while its shards waited to start" in marked_failed_by_hand(approved, teardowns, "Approve")
    cleared_only_failed = {**marked, "generate_0": "success", "stop_servers": "running"}  # the audit stays skipped
    assert "cleared with 'only failed'" in marked_failed_by_hand(cleared_only_failed, teardowns)


def test_model_output_in_the_approval_body_stays_text():
    """The approval's body is Markdown the reviewer's browser renders: a link, an image (fetched
    on sight) or HTML the model wrote shows as text, with the DAG's own filter."""
    from markdown_it import MarkdownIt

    dag = load_dag()
    approve = dag.get_task("approve")
    examples = [{"id": "p1 ![id](http://evil.example/id.png)", "turns": 1,  # ids come from the prompt file
                 "reasoning_content": "![pixel](http://evil.example/p.png?k=1)",
                 "content": "[click](javascript:alert(1)) <img src=x onerror=alert(1)>\n# Heading"}]

    class TaskInstance:
        def xcom_pull(self, task_ids):
            return {"estimate": {"text": "1 h at 900 tok/s"}, "examples": examples}

    env = dag.get_template_env()
    body = env.from_string(approve.body).render(ti=TaskInstance(), dag_run={"dag_id": dag.dag_id})
    html = MarkdownIt("commonmark").render(body)
    assert "<img" not in html and "<a " not in html and "<h1>" not in html
    assert "evil.example" in html and "javascript" in html  # shown, as text


def test_the_approval_is_answered_by_the_users_the_deployment_names(deployed_dag, make_config):
    dag = deployed_dag(make_config(approve_after_canary=True, approvers=["alice", "bob"]))
    assert dag.get_task("approve").assigned_users == [{"id": "alice", "name": "alice"}, {"id": "bob", "name": "bob"}]
    assert deployed_dag(make_config()).get_task("approve").assigned_users is None


def test_every_config_field_is_a_param_with_a_valid_default():
    from regen.config import run_fields
    from regen.dags.params import NOT_PARAMS

    dag = load_dag()
    params = dag.params
    assert set(params.keys()) == set(run_fields()) - NOT_PARAMS
    for name in params.keys():
        param = params.get_param(name)
        param.resolve()  # validates the default against the JSON schema
        assert param.schema.get("title"), name
        assert param.schema.get("section"), name


@pytest.mark.parametrize("conf, field", [
    ({"max_tokens": -5}, "max_tokens"),
    ({"engine": "tgi"}, "engine"),
    ({"temperature": "hot"}, "temperature"),
])
def test_invalid_params_are_refused_with_the_field_named(airflow_db, conf, field):
    from airflow.sdk.exceptions import ParamValidationError

    dag = load_dag()
    with pytest.raises(ParamValidationError) as err:
        dag.test(run_conf=conf)
    assert field in str(err.value)


@pytest.mark.slow
def test_dag_run_writes_one_row_per_prompt_and_stops_servers(airflow_db, deployed_dag, make_config):
    cfg = make_config(num_shards=3, sim_tokens_per_second=2000)
    run = deployed_dag(cfg).test(run_conf=_conf(cfg))
    states = _states(run)
    assert run.state == "success", states
    assert states["generate"] == ["success"] * 3
    df = pd.read_parquet(f"{cfg.output}/data")
    assert sorted(df["id"]) == sorted(read_ids(ROOT / "demo" / "prompts.jsonl"))
    for column in ("id", "messages", "reasoning_content", "content", "finish_reason",
                   "prompt_tokens", "completion_tokens", "error"):
        assert column in df.columns
    assert df["reasoning_content"].notna().all()
    assert (ROOT / cfg.output / "audit" / "report.html").exists()
    # The finished dataset is announced as an asset event with its row count and verdict.
    events = asset_events(f"file://{cfg.output}/data")
    assert len(events) == 1
    assert events[0]["rows"] == 280 and events[0]["verdict"] == "PASS"
    assert read_state(RunLayout(cfg.output)) == []  # teardown cleared the state
    assert_no_server_left(cfg)


@pytest.mark.slow
def test_servers_without_thinking_fail_the_canary_and_teardown_still_stops_them(airflow_db, deployed_dag, make_config,
                                                                                  monkeypatch, tmp_path):
    monkeypatch.setenv("REGEN_ALERT_FILE", str(tmp_path / "alerts.jsonl"))
    cfg = make_config(sim_ignore_thinking=True)
    state_file = f"{cfg.output}/work/servers/servers.json"
    run = deployed_dag(cfg).test(run_conf=_conf(cfg))
    states = _states(run)
    assert run.state == "failed"
    assert states["canary"] == ["failed"]
    assert states["stop_servers"] == ["success"]
    assert states["audit"] == ["upstream_failed"]
    # No shard ever ran, so no GPU minute was spent generating a worthless dataset.
    assert all(s in ("upstream_failed", "None") for s in states.get("generate", ["upstream_failed"]))
    assert not (ROOT / cfg.output / "data").exists()
    logs = sorted((ROOT / cfg.output / "work" / "servers").glob("server-*.log"))
    assert len(logs) == cfg.servers.num_servers  # they did start, and were stopped:
    assert_no_server_left(cfg)
    assert not (ROOT / state_file).exists()
    alerts = [json.loads(line) for line in (tmp_path / "alerts.jsonl").read_text().splitlines()]
    assert [a["stage"] for a in alerts] == ["canary"]
    assert "CanaryFailed" in alerts[0]["reason"] and "without reasoning" in alerts[0]["reason"]
    assert alerts[0]["run_id"] == run.run_id


@pytest.mark.slow
def test_thinking_lost_after_the_canary_stops_the_run_in_generation(airflow_db, deployed_dag, make_config):
    """The canary passes (the servers think at first); once they stop, the live quality guard
    drains them and the shards fail in seconds, naming why: few requests are paid for, and
    there is no audit to wait for."""
    cfg = make_config(extra_server_args=["--sim-ignore-thinking-after", "6"])
    run = deployed_dag(cfg).test(run_conf=_conf(cfg))
    states = _states(run)
    assert run.state == "failed"
    assert states["canary"] == ["success"]
    assert states["generate"] == ["failed"] * cfg.num_shards
    assert states["audit"] != ["success"] and states["stop_servers"] == ["success"]
    progress = json.loads((ROOT / cfg.output / "progress.json").read_text())
    assert "quality guard" in progress["quality"]["stopped"]["why"]
    assert all("quality guard" in s["reason"] for s in progress["shards"].values())
    assert _sent(cfg) < 280 / 2
    assert asset_events(f"file://{cfg.output}/data") == []  # a failed run announces nothing
    assert_no_server_left(cfg)


def one_server_loses_thinking(cfg, after: int = 6):
    """``cfg`` whose second server stops thinking after ``after`` requests (the canary passes),
    with a bound tight enough that the rows it made before the guard drained it fail the audit."""
    servers = cfg.servers.model_copy(update={"extra_server_args": [
        "--sim-ignore-thinking-after", str(after), "--sim-faults-on-port", str(cfg.servers.base_port + 1)]})
    return cfg.model_copy(update={"servers": servers, "audit": cfg.audit.model_copy(
        update={"max_degenerate_fraction": 0.002})})


def _sent(cfg) -> int:
    progress = json.loads((ROOT / cfg.output / "progress.json").read_text())
    return sum(s.get("sent", 0) for s in progress["shards"].values())


@pytest.mark.slow
def test_scheduled_reruns_are_incremental(airflow_db, deployed_dag, make_config, tmp_path):
    cfg = make_config(num_shards=2)
    dag = deployed_dag(cfg)
    first = dag.test(run_conf=_conf(cfg))
    assert first.state == "success"
    assert _sent(cfg) == 280
    # A claim the first run left fresh (its teardown never ran): taken over only because Airflow
    # says that run has ended.
    (Path(cfg.output) / "work" / "owner.json").write_text(json.dumps(
        {"run_id": f"{dag.dag_id}/{first.run_id}", "since": time.time(), "renewed": time.time()}))
    rerun = dag.test(run_conf=_conf(cfg))
    assert rerun.state == "success"
    states = _states(rerun)  # same prompts, model and settings: no weights, no server, no request
    assert states.pop("preflight") == ["success"]
    assert set(map(tuple, states.values())) == {("skipped",)}, states
    more = tmp_path / "more.jsonl"
    more.write_text((ROOT / "demo" / "prompts.jsonl").read_text() + "".join(
        json.dumps({"id": f"new-{i}", "prompt": f"New question number {i}?"}) + "\n" for i in range(100)))
    grown = cfg.model_copy(update={"prompts": str(more)})
    assert dag.test(run_conf=_conf(grown)).state == "success"
    assert _sent(grown) == 100  # exactly the new prompts
    df = pd.read_parquet(f"{cfg.output}/data")
    assert len(df) == 380 and df["id"].is_unique


@pytest.mark.slow
def test_a_rerun_of_an_output_whose_audit_failed_audits_it_again(airflow_db, deployed_dag, make_config):
    """Up to date is not good: a scheduled rerun of data that failed its audit fails again (nothing
    sent), and only a passing audit of the whole output lets later reruns skip everything."""
    # One server loses thinking after the canary's requests: the guard drains it, the run ends on the
    # other, and the rows it made before that fail the audit.
    cfg = one_server_loses_thinking(make_config(num_shards=2))
    dag = deployed_dag(cfg)
    assert dag.test(run_conf=_conf(cfg)).state == "failed"
    assert _sent(cfg) == 280
    rerun = dag.test(run_conf=_conf(cfg))
    states = _states(rerun)
    assert rerun.state == "failed" and states["audit"] == ["failed"], states
    assert _sent(cfg) == 0  # this run's shards had nothing to send
    relaxed = cfg.model_copy(update={"audit": cfg.audit.model_copy(update={"max_degenerate_fraction": 1.0})})
    assert dag.test(run_conf=_conf(relaxed)).state == "success"
    quiet = _states(dag.test(run_conf=_conf(relaxed)))
    assert quiet.pop("preflight") == ["success"] and set(map(tuple, quiet.values())) == {("skipped",)}, quiet
    assert len(pd.read_parquet(f"{cfg.output}/data")) == 280


def test_the_api_key_is_in_no_log_and_no_file_regen_writes(airflow_db, deployed_dag, make_config, tmp_path, capfd, monkeypatch):
    """SGLang (and the simulator, as SGLang does) logs its arguments, API key included: after a
    whole run and after a failed server start, neither the task logs nor any file under the
    output holds the key; the server logs hold the redaction mark instead."""
    from regen.servers.lifecycle import ServerError, launch_servers

    monkeypatch.setenv("REGEN_KEY_DIR", str(tmp_path / "keys"))
    key = "regen-test-key-" + "k3y" * 8
    cfg = make_config(api_key=key, num_shards=2)
    assert deployed_dag(cfg).test(run_conf=_conf(cfg)).state == "success"
    # One server: with two, the second may be stopped (the first failed) before it logs anything.
    broken = make_config(api_key=key, output=str(tmp_path / "broken"), num_servers=1)
    (tmp_path / "not-a-model").mkdir()
    with pytest.raises(ServerError) as failed:
        launch_servers(broken, str(tmp_path / "not-a-model"))
    assert "server_args" in str(failed.value) and key not in str(failed.value)  # the tail, redacted
    logs = capfd.readouterr()
    assert key not in logs.out and key not in logs.err
    written = [p for out in (cfg.output, broken.output) for p in Path(out).rglob("*") if p.is_file()]
    assert [p for p in written if key.encode() in p.read_bytes()] == []
    server_logs = [p for p in written if p.name.startswith("server-") and p.suffix == ".log"]
    assert server_logs and all(b"api_key='<redacted>'" in p.read_bytes() for p in server_logs)
    assert all(p.stat().st_mode & 0o077 == 0 for p in server_logs)  # owner only


def test_every_task_has_a_deadline_and_a_shards_is_a_backstop_no_estimate_sets():
    """Each task's execution_timeout is its stage's deadline (regen.stages) plus the remote grace;
    a start's hook sets it from the run's own startup timeout. A shard's is the stage's week
    whatever the canary estimated: regen holds the shard's deadline, which moves with its pace."""
    from datetime import timedelta

    from regen.remote import DEADLINE_GRACE_S

    dag = load_dag()
    for task in dag.tasks:
        assert task.execution_timeout is not None, task.task_id
    assert dag.get_task("approve").response_timeout == timedelta(days=1)  # the servers' approval hold

    class Running:  # the task instance's operator, whose timeout the runner reads after the hook
        execution_timeout = None

    shard, start = Running(), Running()
    context = {"params": {"startup_timeout_s": 60}}
    dag.get_task("generate").partial_kwargs["pre_execute"]({**context, "task": shard})
    assert shard.execution_timeout == timedelta(days=7, seconds=DEADLINE_GRACE_S)
    dag.get_task("start_servers")._pre_execute_hook({**context, "task": start})
    assert start.execution_timeout == timedelta(seconds=60 + 900 + DEADLINE_GRACE_S)


def test_a_shard_over_its_error_bound_fails_again_on_the_schedulers_retry(airflow_db, deployed_dag, make_config,
                                                                          monkeypatch, tmp_path):
    """Errors are bounded over the shard, not the attempt: a shard that fails at 3 errors of 43
    (bound 5%; 3 prompts past the context the servers were launched with, which no retry fixes)
    is retried by Airflow (try 2) and fails again without sending them again, where counting
    only the retry's own errors would pass it with the errors in the dataset."""
    monkeypatch.setenv("REGEN_SHARD_RETRIES", "1")
    monkeypatch.setenv("REGEN_SHARD_RETRY_DELAY_S", "0")
    lines = (ROOT / "demo" / "prompts.jsonl").read_text().splitlines()[:40]
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("\n".join(lines + [json.dumps({"id": f"long-{i}", "prompt": f"long {i} " + "word " * 1500})
                                          for i in range(3)]) + "\n")
    requests = tmp_path / "requests.jsonl"
    cfg = make_config(prompts=str(prompts), num_shards=1, num_servers=1, max_error_fraction=0.05,
                      extra_server_args=["--context-length", "2200", "--sim-request-log", str(requests)])
    run = deployed_dag(cfg).test(run_conf=_conf(cfg))
    generate = [ti for ti in run.get_task_instances() if ti.task_id == "generate"]
    assert run.state == "failed"
    assert [(str(ti.state), ti.try_number) for ti in generate] == [("failed", 2)]
    assert _states(run)["audit"] == ["upstream_failed"] and not (ROOT / cfg.output / "data").exists()
    sent = [line for line in requests.read_text().splitlines() if '"content": "long ' in line]
    assert len(sent) == 3  # once each, in try 1: the retry counted them and sent nothing
    assert_no_server_left(cfg)
