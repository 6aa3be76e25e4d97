"""One schema for YAML, flags and Params: bad values are refused with the field named."""

from __future__ import annotations

import os
import subprocess

import jsonschema
import pytest

from regen.cli import build_parser, load_config
from regen.config import ConfigError, RunConfig, run_fields
from regen.dags.params import param_schemas
from support.paths import BIN, ROOT


def test_demo_config_loads_with_paths_relative_to_the_file():
    cfg = RunConfig.load(ROOT / "demo" / "config.yaml")
    assert cfg.prompts == str(ROOT / "demo" / "prompts.jsonl")
    assert cfg.model_path == str(ROOT / "var" / "demo-model")
    assert cfg.engine == "sim"


@pytest.mark.parametrize("field, value, words", [
    ("max_tokens", 0, "greater than or equal to 1"),
    ("engine", "tgi", "'sglang', 'vllm' or 'sim'"),
    ("temperature", 5, "less than or equal to 2"),
    ("model_path", "/models/x\n; rm -rf /", "control characters"),
    ("host", "127.0.0.1; reboot", "host name"),
    ("extra_server_args", ["--tp-size", "2; curl evil"], "character no server flag needs"),
    ("api_key", "short", "8 to 256"),
    ("no_such_field", 1, "unknown field"),
    ("max_token", 100, "unknown field (did you mean 'max_tokens'?)"),
    ("num_shard", 2, "unknown field (did you mean 'num_shards'?)"),
])
def test_bad_values_are_refused_naming_the_field(field, value, words):
    with pytest.raises(ConfigError) as err:
        RunConfig.from_mapping({field: value}, source="run.yaml")
    message = str(err.value)
    assert f"run.yaml: field '{field}'" in message
    assert words in message


@pytest.mark.parametrize("data", [
    {"api_key": "bad key, not allowed"},  # the key itself refused
    {"api_key": "a-good-key-1234", "nodes": [{"name": "a"}, {"name": "a"}]},  # an error of the whole config
    {"servers": {"api_key": "a-good-key-1234"}, "queue": "q", "nodes": [{"name": "a"}]},
])
def test_a_key_is_never_repeated_in_an_error(data):
    """The error goes to task logs, alerts and import errors: it names what is wrong, never the key."""
    with pytest.raises(ConfigError) as err:
        RunConfig.from_mapping(data, source="run.yaml")
    key = data.get("api_key") or data["servers"]["api_key"]
    assert key not in str(err.value) and str(err.value).startswith("run.yaml: field ")


def test_every_error_is_listed_not_just_the_first():
    with pytest.raises(ConfigError) as err:
        RunConfig.from_mapping({"max_tokens": 0, "top_p": 3, "num_shards": 0})
    assert len(str(err.value).splitlines()) == 3


def test_yaml_errors_name_the_file(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("max_tokens: [1,\n")
    with pytest.raises(ConfigError, match=r"bad.yaml:2:1: not valid YAML"):
        RunConfig.load(bad)
    with pytest.raises(ConfigError, match="no such config file"):
        RunConfig.load(tmp_path / "missing.yaml")


def test_param_schemas_accept_the_defaults_and_refuse_what_pydantic_refuses():
    defaults = RunConfig().model_dump()
    for name, (default, schema) in param_schemas().items():
        assert default == defaults[name]
        jsonschema.validate(default, schema)
    schemas = param_schemas()
    for name, bad in (("max_tokens", 0), ("engine", "tgi"), ("speculative_algorithm", "MEDUSA"),
                      ("top_p", 0), ("gpus", ["0"])):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, schemas[name][1])
    jsonschema.validate(None, schemas["speculative_algorithm"][1])
    jsonschema.validate("NEXTN", schemas["speculative_algorithm"][1])


def test_the_trigger_form_renders_markdown_leaves_out_the_deployment_and_labels_the_empty_choice():
    """Airflow 3.3's form renders a Param's description_md as Markdown (a plain description shows
    backticks raw), labels an enum value by values_display (else None shows as "null"), and has no
    read-only input: the deployment's fields are not Params, the DAG's page shows their values."""
    from regen.config.deployment import DEPLOYMENT_FIELDS
    from regen.dags.definitions import RunDefinition

    deployment = RunConfig(engine_python="/opt/sglang/bin/python", api_key="k" * 32, approvers=["lead"])
    schemas = param_schemas(deployment)
    assert not set(schemas) & set(DEPLOYMENT_FIELDS) and "max_tokens" in schemas and "output" in schemas
    for name, (_, schema) in schemas.items():
        assert "description" not in schema and schema["description_md"], name
    assert "unique `id`" in schemas["prompts"][1]["description_md"]  # Markdown, rendered by the form
    spec = schemas["speculative_algorithm"][1]
    assert None in spec["enum"] and spec["values_display"] == {"null": "(empty: not set)"}
    page = RunDefinition("regenerate_chat", deployment, None).doc_md("### how it works\n\nbody")
    assert "| `engine_python` | `/opt/sglang/bin/python` |" in page and "| `approvers` | `[\"lead\"]` |" in page
    assert "| `api_key` | set (never shown) |" in page and "k" * 32 not in page


def test_cli_flags_override_the_yaml_with_the_same_names():
    args = build_parser().parse_args([
        "preflight", "--config", str(ROOT / "demo" / "config.yaml"), "--max-tokens", "77",
        "--no-enable-thinking", "--gpus", "0,3", "--extra-server-args", "--tp-size 2",
        "--speculative-algorithm", "NEXTN",
    ])
    cfg = load_config(args)
    assert cfg.sampling.max_tokens == 77
    assert cfg.enable_thinking is False
    assert cfg.servers.gpus == [0, 3]
    assert cfg.servers.extra_server_args == ["--tp-size", "2"]
    assert cfg.engine_options.speculative_algorithm == "NEXTN"
    assert cfg.num_shards == 4  # from the YAML


def test_each_flags_help_is_the_schemas_description_default_and_choices(monkeypatch):
    """`regen audit --help` says what a field does, its default and its choices (the same schema
    as the Params), not its title alone."""
    import contextlib
    import io
    import re

    from regen.config import run_fields

    monkeypatch.setenv("COLUMNS", "100000")  # one line per flag: no wrapping inside a word
    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit):
        build_parser().parse_args(["audit", "--help"])
    text = re.sub(r"\s+", " ", out.getvalue())
    engine = run_fields()["engine"].info
    assert re.sub(r"\s+", " ", engine.description.rstrip(".")) in text
    assert "Choices: sglang, vllm, sim. Default: sim" in text
    assert "Default: 0.02" in text.split("--max-loop-fraction")[-1].split("--")[0]


def test_a_broken_config_file_never_repeats_a_value_that_may_be_the_key(tmp_path):
    """Import Errors show a broken deployment file's message to every viewer."""
    from regen.config.fields import ConfigError
    from regen.config.run import RunConfig, read_config_file

    secret = "sk-" + "s" * 40
    misspelt = tmp_path / "misspelt.yaml"
    misspelt.write_text(f"api_kye: {secret}\n")
    with pytest.raises(ConfigError) as err:
        RunConfig.from_mapping(read_config_file(misspelt), source=str(misspelt))
    assert "api_kye" in str(err.value) and secret not in str(err.value)
    broken = tmp_path / "broken.yaml"
    broken.write_text(f"engine: sim\napi_key: {secret}: [\n")
    with pytest.raises(ConfigError) as err:
        read_config_file(broken)
    assert f"{broken}:2:" in str(err.value) and secret not in str(err.value)


def test_every_field_has_a_description_the_trigger_form_shows():
    assert [name for name, field in run_fields().items() if not (field.info.description or "").strip()] == []


def test_a_reader_that_stops_early_ends_the_command_quietly():
    """`regen config | head -1`: the pipe is closed before regen writes (no traceback, SIGPIPE's status)."""
    read, write = os.pipe()
    os.close(read)
    try:
        done = subprocess.run([str(BIN / "regen"), "config"], stdout=write, stderr=subprocess.PIPE, timeout=120)
    finally:
        os.close(write)
    assert done.returncode == 141 and b"Traceback" not in done.stderr, done.stderr.decode()[-2000:]
