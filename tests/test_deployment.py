"""A deployment's config folder (REGEN_CONFIG_DIR): one DAG per file, broken files as import
errors, scheduled runs under a real scheduler."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest
import yaml

from regen.layout import RunLayout
from regen.servers.records import read_state
from support.airflow import airflow_standalone
from support.data import read_ids
from support.paths import ROOT
from support.processes import wait_until

DAGS = ROOT / "dags"


def write_config(folder: Path, name: str, cfg, **extra) -> Path:
    path = folder / f"{name}.yaml"
    path.write_text(yaml.safe_dump({**json.loads(cfg.model_dump_json()), **extra}))
    return path


def dag_bag(monkeypatch, folder: Path):
    from airflow.dag_processing.dagbag import DagBag

    monkeypatch.setenv("REGEN_CONFIG_DIR", str(folder))
    return DagBag(dag_folder=str(DAGS))


def test_each_config_file_is_its_own_dag_and_a_broken_one_is_listed_not_hiding_the_others(
        monkeypatch, make_config, tmp_path):
    folder = tmp_path / "configs"
    folder.mkdir()
    chat = make_config(output=str(tmp_path / "chat"), temperature=0.7)
    code = make_config(output=str(tmp_path / "code"), max_tokens=2048)
    write_config(folder, "chat", chat, schedule="0 3 * * 6")
    write_config(folder, "code", code, schedule=["s3://checkpoints/coder/latest"])
    (folder / "broken.yaml").write_text("engine: sim\ntemperature: hot\n")

    bag = dag_bag(monkeypatch, folder)
    assert sorted(bag.dag_ids) == ["regenerate_chat", "regenerate_code"]
    [(path, error)] = bag.import_errors.items()
    assert path.endswith("regen_config_errors.py")
    assert "broken.yaml" in error and "'temperature'" in error and "hot" in error

    dag = bag.dags["regenerate_chat"]
    assert dag.timetable.expression == "0 3 * * 6"
    assert dag.params["output"] == chat.output and dag.params["temperature"] == 0.7
    assert {a.name for a in dag.get_task("audit").outlets if hasattr(a, "uri")} == {"regenerate_chat"}
    other = bag.dags["regenerate_code"]
    assert other.params["output"] == code.output and other.params["max_tokens"] == 2048
    assert [a.uri for a in other.timetable.asset_condition.objects] == ["s3://checkpoints/coder/latest"]


def test_without_the_folder_there_is_the_demo_dag_only(monkeypatch):
    from airflow.dag_processing.dagbag import DagBag

    monkeypatch.delenv("REGEN_CONFIG_DIR", raising=False)
    bag = DagBag(dag_folder=str(DAGS))
    assert bag.import_errors == {} and list(bag.dag_ids) == ["regenerate_dataset"]


def test_config_files_resolve_paths_against_their_folder_and_refuse_bad_names(tmp_path):
    from regen.config import ConfigError
    from regen.dags.definitions import configured_file

    (tmp_path / "nightly.yaml").write_text("prompts: data/prompts.jsonl\noutput: out\nschedule: '@daily'\n")
    run = configured_file(tmp_path / "nightly.yaml")
    assert run.dag_id == "regenerate_nightly" and run.schedule == "@daily"
    assert run.config.prompts == str(tmp_path / "data" / "prompts.jsonl")
    (tmp_path / "bad name.yaml").write_text("engine: sim\n")
    with pytest.raises(ConfigError, match="bad name.yaml"):
        configured_file(tmp_path / "bad name.yaml")
    (tmp_path / "when.yaml").write_text("schedule: 5\n")
    with pytest.raises(ConfigError, match=r"when.yaml: field 'schedule'"):
        configured_file(tmp_path / "when.yaml")


@pytest.mark.slow
def test_the_scheduler_runs_a_configured_dataset_and_the_next_run_sends_nothing(make_config, tmp_path):
    """`airflow standalone` with a config folder: one file scheduled every minute against
    simulated servers, one scheduled weekly, one broken. About 3 minutes."""
    folder = tmp_path / "configs"
    folder.mkdir()
    minutely = make_config(output=str(tmp_path / "minutely"), num_shards=2, canary_size=4)
    write_config(folder, "minutely", minutely, schedule="* * * * *")
    write_config(folder, "weekly", make_config(output=str(tmp_path / "weekly")), schedule="@weekly")
    (folder / "broken.yaml").write_text("engine: sim\nmax_tokens: -5\n")

    home = tmp_path / "airflow"
    home.mkdir()
    with airflow_standalone(home, REGEN_CONFIG_DIR=str(folder)) as deployment:
        api = httpx.Client(base_url=f"{deployment['base']}/api/v2", timeout=30,
                           headers={"Authorization": f"Bearer {deployment['token']}"})

        wait_until(lambda: api.get("/dags/regenerate_weekly").status_code == 200, 180, "DAGs parsed")
        dags = {d["dag_id"]: d for d in api.get("/dags").json()["dags"]}
        assert set(dags) == {"regenerate_minutely", "regenerate_weekly"}
        assert dags["regenerate_minutely"]["timetable_summary"] == "* * * * *"
        assert dags["regenerate_weekly"]["timetable_summary"] == "0 0 * * 0"  # Airflow spells @weekly out
        errors = api.get("/importErrors").json()["import_errors"]
        assert len(errors) == 1 and errors[0]["filename"].endswith("regen_config_errors.py")
        assert "broken.yaml" in errors[0]["stack_trace"] and "'max_tokens'" in errors[0]["stack_trace"]

        # Nobody triggers anything: unpaused, the scheduler makes the runs by itself.
        assert api.patch("/dags/regenerate_minutely", json={"is_paused": False}).status_code == 200

        def runs() -> list[dict]:
            return sorted(api.get("/dags/regenerate_minutely/dagRuns").json()["dag_runs"],
                          key=lambda r: r["logical_date"] or "")

        wait_until(lambda: len(runs()) >= 2 and all(r["state"] in ("success", "failed") for r in runs()[:2]),
                   300, "two scheduled runs")
        first, second = runs()[:2]
        assert (first["run_type"], second["run_type"]) == ("scheduled", "scheduled")
        assert (first["state"], second["state"]) == ("success", "success")
        ids = read_ids(Path(minutely.prompts))
        data = __import__("pandas").read_parquet(f"{minutely.output}/data")
        assert sorted(data["id"]) == sorted(ids)  # every id once

        def states(run_id: str) -> dict[str, set[str]]:
            out: dict[str, set[str]] = {}
            for ti in api.get(f"/dags/regenerate_minutely/dagRuns/{run_id}/taskInstances").json()["task_instances"]:
                out.setdefault(ti["task_id"], set()).add(ti["state"])
            return out

        later = states(second["dag_run_id"])
        assert later.pop("preflight") == {"success"}
        assert set(map(frozenset, later.values())) == {frozenset({"skipped"})}, later  # no server, no request
        assert read_state(RunLayout(minutely.output)) == []  # and none left from the first run
        assert not (tmp_path / "weekly").exists()
