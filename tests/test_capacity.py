"""The servers' operating point (regen.servers.capacity) against SGLang 0.5.23's own sizing code,
on a Qwen3.6-27B-shaped checkpoint (48 Gated-DeltaNet and 16 attention layers, MTP, vision)."""

import json
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from regen.servers import capacity
from support.engines import SGLANG_PYTHON

FIXTURES = Path(__file__).parent / "fixtures"
QWEN36 = FIXTURES / "qwen36-27b-shape"

CASES = [  # (GPU, launch flags): the defaults with MTP, and each flag the plan suggests
    ("H200", capacity.LaunchFlags(speculative_num_draft_tokens=4)),
    ("B200", capacity.LaunchFlags(speculative_num_draft_tokens=4)),
    ("H200", capacity.LaunchFlags()),
    ("B200", capacity.LaunchFlags(mamba_ssm_dtype="bfloat16", speculative_num_draft_tokens=4)),
    ("H200", capacity.LaunchFlags(disable_radix_cache=True, max_running_requests=64)),
    ("H200", capacity.LaunchFlags(tp_size=2, max_mamba_cache_size=300, speculative_num_draft_tokens=4)),
    # The seed's own servers: 7 x B200, MTP, --max-running-requests 48 --max-mamba-cache-size 80.
    ("B200", capacity.LaunchFlags(max_running_requests=48, max_mamba_cache_size=80, speculative_num_draft_tokens=4)),
]


@pytest.mark.skipif(not SGLANG_PYTHON.exists(), reason="SGLang's parser venv is built by `make test`")
def test_the_plan_is_sglangs_own_sizing_on_h200_and_b200(tmp_path):
    shape = capacity.ModelShape.of(QWEN36)
    points = [capacity.plan(shape, capacity.gpu_memory_mib(gpu), flags) for gpu, flags in CASES]
    # The flags as SGLang resolves them: a speculative server's default request cap.
    resolved = [replace(flags, max_running_requests=flags.max_running_requests or (
        capacity.SPECULATIVE_DEFAULT_CAP if flags.speculative_num_draft_tokens else None)) for _, flags in CASES]
    cases = []
    for (gpu, flags), given, point in zip(CASES, resolved, points):
        chunk, graph_bs = capacity.graph_sizes(point.gpu_mib, given)
        cases.append({"prefill_chunk": chunk, "decode_graph_bs": graph_bs,
            "model_dir": str(QWEN36), "tp_size": flags.tp_size, "mamba_ssm_dtype": flags.mamba_ssm_dtype,
            "disable_radix_cache": flags.disable_radix_cache, "max_running_requests": given.max_running_requests,
            "max_mamba_cache_size": flags.max_mamba_cache_size or (
                flags.max_running_requests if flags.disable_radix_cache else None),
            "mamba_full_memory_ratio": flags.mamba_full_memory_ratio,
            "speculative_num_draft_tokens": flags.speculative_num_draft_tokens,
            "pools_gib": point.pools_gib, "context_length": shape.context_length,
            "kv_bytes_per_token": point.kv_kib_per_token * 1024, "gpu_mib": point.gpu_mib,
            "base_fraction": capacity.static_fraction(point.gpu_mib, replace(shape, vision_layers=0), given)})
    (tmp_path / "cases.json").write_text(json.dumps(cases))
    out = subprocess.run([str(SGLANG_PYTHON), str(FIXTURES / "sglang_capacity.py"), str(tmp_path / "cases.json")],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    for (gpu, flags), given, point, theirs in zip(CASES, resolved, points,
                                                  json.loads(out.stdout.strip().splitlines()[-1])):
        ours = {"state_bytes_per_request": round(point.state_mib_per_request * capacity.MIB),
                "state_slots": point.state_slots, "kv_tokens": point.kv_tokens,
                "max_running_requests": point.max_running_requests,
                "state_slots_per_request": point.state_slots_per_request}
        assert ours == {k: theirs[k] for k in ours}, (gpu, flags)
        chunk, graph_bs = capacity.graph_sizes(point.gpu_mib, given)
        assert capacity.graph_reserve_mib(graph_bs, chunk) == theirs["graph_reserve_mb"], (gpu, flags)
        assert point.static_fraction == pytest.approx(theirs["static_fraction"], abs=1e-9), (gpu, flags)


def test_the_dry_run_shows_what_limits_a_qwen36_server_and_the_flags_that_raise_it(make_config, tmp_path):
    """`regen serve --dry-run --gpu` on the seed's layout: 7 servers with MTP; the request state
    pool binds, not the KV cache, and each suggested flag raises the cap when applied."""
    cfg = make_config(model_path=str(QWEN36), engine="sglang", gpus=list(range(7)), max_tokens=32768,
                      speculative_algorithm="NEXTN", speculative_num_steps=3, speculative_eagle_topk=1,
                      speculative_num_draft_tokens=4, tool_call_parser="qwen3_coder")
    config = tmp_path / "run.yaml"
    config.write_text(cfg.model_dump_json())
    caps = {}
    for gpu in ("H200", "B200"):
        out = subprocess.run([str(Path(sys.executable).parent / "regen"), "serve", "--config", str(config), "--dry-run", "--json", "--gpu", gpu],
                             capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr[-2000:]
        planned = json.loads(out.stdout)
        point = planned["operating_point"]
        assert len(planned["servers"]) == 7 and point["limited_by"] == "the request state pool"
        assert f"runs up to {point['max_running_requests']} requests per server" in out.stderr
        assert "--mamba-ssm-dtype bfloat16" in out.stderr and "--disable-radix-cache" in out.stderr
        caps[gpu] = point["max_running_requests"]
    assert 0 < caps["H200"] < caps["B200"] < capacity.SPECULATIVE_DEFAULT_CAP
    shape, flags = capacity.ModelShape.of(QWEN36), capacity.LaunchFlags.of(cfg)
    base = capacity.plan(shape, capacity.gpu_memory_mib("H200"), flags)
    assert base.max_running_requests == caps["H200"]
    for better in (replace(flags, mamba_ssm_dtype="bfloat16"), replace(flags, disable_radix_cache=True)):
        assert capacity.plan(shape, capacity.gpu_memory_mib("H200"), better).max_running_requests > caps["H200"]


def test_a_launched_server_far_from_the_plan_is_named(make_config, tmp_path, monkeypatch):
    """On a GPU node (an nvidia-smi that reports an H200) the server's own /server_info is read
    after launch: one that runs 7 requests where the plan says more is named with the plan."""
    from regen.servers.lifecycle import launch_servers, stop_records
    from regen.servers.plan import against_plan

    smi = tmp_path / "bin" / "nvidia-smi"
    smi.parent.mkdir()
    smi.write_text("#!/bin/sh\necho 143771\n")
    smi.chmod(0o755)
    monkeypatch.setenv("PATH", f"{smi.parent}:{os.environ['PATH']}")
    point = capacity.plan(capacity.ModelShape.of(QWEN36), capacity.gpu_memory_mib("H200"), capacity.LaunchFlags())
    planned = {"kv_tokens": point.kv_tokens, "max_running_requests": point.max_running_requests,
               "limited_by": point.limited_by}
    assert capacity.compare(planned, point.kv_tokens, point.max_running_requests) is None
    for effective, tokens, named in ((point.max_running_requests, point.kv_tokens, False), (7, point.kv_tokens // 3, True)):
        cfg = make_config(model_path=str(QWEN36), num_servers=1, output=str(tmp_path / f"out-{effective}"),
                          extra_server_args=["--sim-effective-max-running-requests", str(effective),
                                             "--sim-prefix-cache-tokens", str(tokens)])
        records = launch_servers(cfg, cfg.model_path)
        try:
            note = against_plan(cfg, records[0])
        finally:
            stop_records(records)
        if named:
            assert f"runs up to 7 requests, the plan {point.max_running_requests}" in note
            assert f"holds {tokens:,} tokens" in note and "limited by the request state pool" in note
        else:
            assert note is None


def test_weights_that_leave_no_room_are_refused_before_launch():
    shape = replace(capacity.ModelShape.of(QWEN36), weight_bytes=200 * capacity.GIB)
    with pytest.raises(ValueError, match="leave no memory for the KV cache"):
        capacity.plan(shape, capacity.gpu_memory_mib("H200"), capacity.LaunchFlags())
    assert capacity.plan(shape, capacity.gpu_memory_mib("H200"), capacity.LaunchFlags(tp_size=4)).kv_tokens > 0


@pytest.mark.skipif(not SGLANG_PYTHON.exists(), reason="SGLang's parser venv is built by `make test`")
def test_absent_hybrid_fields_are_read_as_sglangs_own_config_class_reads_them(tmp_path):
    """A Qwen3.6 config without its Gated-DeltaNet fields or the vision tower's hidden size was
    planned with 0 MiB of request state and no state pool; SGLang's Qwen3_5Config fills them with
    its defaults, and the plan now does the same. Without full_attention_interval SGLang cannot
    type the layers: the plan is refused, naming the field."""
    config = json.loads((QWEN36 / "config.json").read_text())
    for name in capacity.HYBRID_DEFAULTS:
        config["text_config"].pop(name)
    config["vision_config"].pop("hidden_size")
    model = tmp_path / "model"
    model.mkdir()
    (model / "model.safetensors.index.json").write_text((QWEN36 / "model.safetensors.index.json").read_text())

    def theirs() -> dict:
        (model / "config.json").write_text(json.dumps(config))
        out = subprocess.run([str(SGLANG_PYTHON), str(FIXTURES / "sglang_config.py"), str(model / "config.json")],
                             capture_output=True, text=True, timeout=300)
        assert out.returncode == 0, out.stderr[-3000:]
        return json.loads(out.stdout.strip().splitlines()[-1])

    sglang, shape = theirs(), capacity.ModelShape.of(model)
    ours = {"linear_conv_kernel_dim": shape.linear_conv_kernel, "linear_key_head_dim": shape.linear_key_head_dim,
            "linear_value_head_dim": shape.linear_value_head_dim, "linear_num_key_heads": shape.linear_key_heads,
            "linear_num_value_heads": shape.linear_value_heads, "linear_layers": shape.linear_attention_layers,
            "full_attention_layers": shape.full_attention_layers, "vision_hidden_size": shape.vision_hidden}
    assert ours == sglang
    point = capacity.plan(shape, capacity.gpu_memory_mib("B200"), capacity.LaunchFlags())
    assert point.state_mib_per_request > 0 and point.state_slots

    del config["text_config"]["full_attention_interval"]
    config["text_config"].pop("layer_types", None)
    assert "full_attention_interval" in theirs()["error"]
    with pytest.raises(ValueError, match="without full_attention_interval, which SGLang 0.5.23 cannot load"):
        capacity.ModelShape.of(model)


def test_a_model_folder_without_weights_is_refused_not_planned_on_zeros(make_config, tmp_path):
    """No weights and no index: the dry run's operating point names the gap instead of promising
    48 requests per server on 0.0 GiB of weights."""
    from regen.servers.plan import operating_point

    model = tmp_path / "empty"
    model.mkdir()
    (model / "config.json").write_text((QWEN36 / "config.json").read_text())
    with pytest.raises(ValueError, match="no weights to size"):
        capacity.ModelShape.of(model)
    point = operating_point(make_config(model_path=str(model)), "B200")
    assert point == {"problem": f"{model}: no operating point: {model}: no weights to size (no *.safetensors, "
                                "no model.safetensors.index.json with metadata.total_size)"}


def test_the_seeds_launch_is_planned_and_its_seven_requests_per_server_are_named_as_under_use(make_config, tmp_path):
    """The seed's B200 launch (MTP, --max-mamba-cache-size 80) runs 16 requests per server, and
    the seed sent 7 to each: the dry run warns, with the value to set; the canary says the same
    from what a launched server reports (/server_info)."""
    from regen.canary import canary

    seed = dict(model_path=str(QWEN36), engine="sglang", gpus=list(range(7)), max_tokens=32768,
                speculative_algorithm="NEXTN", speculative_num_steps=3, speculative_eagle_topk=1,
                speculative_num_draft_tokens=4, max_running_requests=48, max_mamba_cache_size=80)
    config = tmp_path / "run.yaml"
    config.write_text(make_config(concurrency_per_server=7, **seed).model_dump_json())
    out = subprocess.run([str(Path(sys.executable).parent / "regen"), "serve", "--config", str(config), "--dry-run", "--json",
                          "--gpu", "B200"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    point = json.loads(out.stdout)["operating_point"]
    assert point["max_running_requests"] == 16 and point["kv_tokens"] > 1_000_000
    warning = (f"warning: concurrency_per_server 7 keeps 7 of the 16 requests a server can run busy (44%, the plan): "
               f"set concurrency_per_server: 16")
    assert warning in out.stderr
    config.write_text(make_config(concurrency_per_server=16, **seed).model_dump_json())
    assert "warning" not in subprocess.run([str(Path(sys.executable).parent / "regen"), "serve", "--config", str(config),
                                            "--dry-run", "--gpu", "B200"], capture_output=True, text=True,
                                           timeout=120).stderr
    from regen.servers.lifecycle import launch_servers, stop_records

    cfg = make_config(num_servers=1, concurrency_per_server=7, max_tokens=256,
                      extra_server_args=["--sim-effective-max-running-requests", "16"])
    records = launch_servers(cfg, cfg.model_path)
    try:
        report = canary(cfg)
    finally:
        stop_records(records)
    assert report.estimate["under_use"].startswith(
        f"concurrency_per_server 7 keeps 7 of the 16 requests a server can run busy (44%, as server {records[0].url} reports)")
