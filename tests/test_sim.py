"""The simulator over real HTTP: SGLang's API shape, thinking on and off, and its fault knobs."""

from __future__ import annotations

import subprocess
import sys

import httpx
import pytest

from regen.servers.lifecycle import wait_healthy
from regen.servers.probe import port_is_free
from regen.servers.records import ServerRecord
from support.paths import BIN
from regen.servers.probe import free_port_base
from support.processes import wait_until

MESSAGES = [{"role": "user", "content": "What is 2 + 2?"}]


@pytest.fixture
def sim(tiny_model):
    """`regen sim --port PORT` exactly as DESIGN.md writes it, plus knobs; stopped afterwards."""
    procs = []

    def start(*flags: str) -> str:
        port = free_port_base(1)
        argv = [str(BIN / "regen"), "sim", "--port", str(port), "--model-path", str(tiny_model), *flags]
        proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        procs.append(proc)
        record = ServerRecord(0, None, "127.0.0.1", port, proc.pid, "/dev/null", None)
        wait_healthy([(record, proc)], timeout_s=30)
        return f"http://127.0.0.1:{port}"

    yield start
    for proc in procs:
        proc.terminate()
        proc.wait(timeout=10)


def chat(url, **body):
    payload = {"model": "m", "messages": MESSAGES, "max_tokens": 512, **body}
    return httpx.post(f"{url}/v1/chat/completions", json=payload, timeout=30,
                      headers=body.pop("headers", {}))


def test_thinking_on_splits_reasoning_from_content(sim):
    url = sim()
    body = chat(url, chat_template_kwargs={"enable_thinking": True}).json()
    message = body["choices"][0]["message"]
    assert len(message["reasoning_content"].split()) >= 40
    assert message["content"] and "<think>" not in message["content"]
    assert body["choices"][0]["finish_reason"] == "stop"
    usage = body["usage"]
    assert usage["completion_tokens"] == len(message["reasoning_content"].split()) + 1 + len(
        message["content"].split())
    # Deterministic per prompt and seed.
    again = chat(url, chat_template_kwargs={"enable_thinking": True}).json()
    assert again["choices"][0]["message"] == message
    other = chat(url, chat_template_kwargs={"enable_thinking": True}, seed=7).json()
    assert other["choices"][0]["message"] != message


def test_thinking_off_gives_the_short_answer_without_reasoning(sim):
    url = sim()
    message = chat(url, chat_template_kwargs={"enable_thinking": False}).json()["choices"][0]["message"]
    assert message["reasoning_content"] is None
    assert message["content"] == "OK."


def test_a_server_that_ignores_enable_thinking(sim):
    url = sim("--sim-ignore-thinking")
    message = chat(url, chat_template_kwargs={"enable_thinking": True}).json()["choices"][0]["message"]
    assert message["reasoning_content"] is None


def test_max_tokens_cuts_with_finish_reason_length(sim):
    url = sim()
    body = chat(url, max_tokens=10).json()
    assert body["choices"][0]["finish_reason"] == "length"
    assert body["usage"]["completion_tokens"] == 10
    assert body["choices"][0]["message"]["content"] == ""  # cut inside the thinking: SGLang answers ""


def test_prompt_over_the_context_is_a_400(sim):
    url = sim("--context-length", "600")
    response = chat(url, max_tokens=590)
    assert response.status_code == 400
    assert "maximum context length" in response.json()["message"]


def test_api_key_guards_the_api_but_not_health_and_metrics(sim):
    url = sim("--api-key", "secret-key-123")
    assert chat(url).status_code == 401
    assert chat(url, headers={"Authorization": "Bearer secret-key-123"}).status_code == 200
    assert httpx.get(f"{url}/health").status_code == 200
    assert httpx.get(f"{url}/metrics").status_code == 200


def test_metrics_models_and_server_info_use_sglang_names(sim):
    url = sim("--max-running-requests", "7", "--speculative-algorithm", "NEXTN")
    chat(url)
    metrics = httpx.get(f"{url}/metrics").text
    for name in ("sglang:num_running_reqs", "sglang:num_queue_reqs", "sglang:gen_throughput",
                 "sglang:spec_accept_length", "sglang:num_requests_total",
                 "sglang:generation_tokens_total"):
        assert name in metrics
    assert "sglang:num_requests_total{" in metrics and metrics.count("} 1\n") >= 1
    assert httpx.get(f"{url}/v1/models").json()["data"][0]["id"] == "tiny-qwen3"
    info = httpx.get(f"{url}/server_info").json()
    assert info["max_running_requests"] == 7
    assert info["speculative_algorithm"] == "NEXTN"


def test_failure_rate_returns_http_500(sim):
    url = sim("--sim-failure-rate", "1.0")
    assert chat(url).status_code == 500


def test_health_is_503_while_warming_up(sim, tiny_model):
    port = free_port_base(1)
    proc = subprocess.Popen([sys.executable, "-m", "regen", "sim", "--port", str(port),
                             "--model-path", str(tiny_model), "--sim-startup-delay", "60"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        url = f"http://127.0.0.1:{port}"
        wait_until(lambda: not port_is_free("127.0.0.1", port), timeout=30)
        status = httpx.get(f"{url}/health", timeout=5).status_code
        assert status == 503
        assert httpx.get(f"{url}/v1/models").status_code == 200  # answers before warm-up ends
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def test_a_bad_model_path_exits_with_a_message(tmp_path):
    out = subprocess.run([str(BIN / "regen"), "sim", "--port", "1", "--model-path", str(tmp_path)],
                         capture_output=True, text=True, timeout=30)
    assert out.returncode == 1
    assert "no config.json" in out.stderr


def test_the_readmes_form_serves_generate_without_a_model_directory(tmp_path):
    """`regen sim --port PORT` as README shows it (no --model-path, so no token ids): `regen
    generate --endpoints` against it writes every row."""
    import pandas as pd

    from support.data import write_prompts

    port = free_port_base(1)
    proc = subprocess.Popen([str(BIN / "regen"), "sim", "--port", str(port)], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    try:
        url = f"http://127.0.0.1:{port}"
        wait_until(lambda: not port_is_free("127.0.0.1", port), timeout=30)
        prompts = write_prompts(tmp_path / "p.jsonl", 6)
        out = subprocess.run([str(BIN / "regen"), "--no-progress-bar", "generate", "--prompts", str(prompts),
                              "--endpoints", url, "--output", str(tmp_path / "out"), "--num-shards", "1"],
                             capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr[-2000:]
        rows = pd.read_parquet(tmp_path / "out" / "data")
        assert len(rows) == 6 and rows["error"].isna().all()
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def test_tool_calls_as_sglang_returns_them_by_the_prompts_plan_with_a_knob_to_diverge(sim):
    """With its tool-call parser: the calls the prompt asks for, at once, as SGLang's `tool_calls`
    (finish_reason tool_calls, empty content), the same ones again for the same prompt; without
    the parser, their raw text as the answer; with `--sim-tool-divergence 1`, another tool."""
    from support.data import TOOLS

    asks = [{"role": "user", "content": "Both, please. [tools: get_weather+get_time; get_date]"}]
    parsed = sim("--tool-call-parser", "qwen25")
    choice = chat(parsed, messages=asks, tools=TOOLS).json()["choices"][0]
    calls = choice["message"]["tool_calls"]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] == ""
    assert [(c["index"], c["type"], c["function"]["name"]) for c in calls] == [
        (0, "function", "get_weather"), (1, "function", "get_time")]
    assert all(c["id"].startswith("call_") and len(c["id"]) == 29 for c in calls)
    assert chat(parsed, messages=asks, tools=TOOLS).json()["choices"][0]["message"]["tool_calls"] == calls
    assert chat(parsed, messages=asks).json()["choices"][0]["finish_reason"] == "stop"  # no tools, no call
    raw = chat(sim(), messages=asks, tools=TOOLS).json()["choices"][0]
    assert raw["finish_reason"] == "stop" and raw["message"]["content"].startswith('<tool_call>\n{"name": "get_weather"')
    diverging = chat(sim("--tool-call-parser", "qwen25", "--sim-tool-divergence", "1"), messages=asks, tools=TOOLS)
    assert [c["function"]["name"] for c in diverging.json()["choices"][0]["message"]["tool_calls"]] == ["get_date"]


def _metric(url: str, name: str) -> float:
    for line in httpx.get(f"{url}/metrics").text.splitlines():
        if line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"no {name}")


def test_the_prefix_cache_saves_what_an_earlier_request_sent_and_forgets_the_oldest(sim):
    """A conversation's next turn finds its earlier turns cached on the server that answered them,
    as SGLang's radix cache keeps them (reported as SGLang reports it: usage, /metrics); a full
    cache evicts the least recently used prefix."""
    url = sim("--enable-cache-report", "--sim-prefix-cache-tokens", "120")
    system = {"role": "system", "content": "You are terse. " * 20}
    first = [system, {"role": "user", "content": "What is 2 + 2?"}]
    body = chat(url, messages=first).json()
    assert body["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    answer = body["choices"][0]["message"]["content"]
    second = [*first, {"role": "assistant", "content": answer}, {"role": "user", "content": "And 3 + 3?"}]
    body = chat(url, messages=second).json()
    cached = body["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached == sum(len(m["content"].split()) + 4 for m in first)  # every message of the first turn
    assert _metric(url, "sglang:cached_tokens_total") == cached
    assert 0 < _metric(url, "sglang:cache_hit_rate") < 1
    other = [{"role": "system", "content": "Something else entirely. " * 25}, {"role": "user", "content": "Hi"}]
    chat(url, messages=other)  # 120 tokens hold one of the two systems: the older one goes
    body = chat(url, messages=second).json()
    assert body["usage"]["prompt_tokens_details"]["cached_tokens"] == 0


def test_trace_lengths_are_long_tailed_around_the_median(sim):
    url = sim("--sim-reasoning-median", "60", "--sim-length-sigma", "0.77")
    lengths = sorted(len(chat(url, messages=[{"role": "user", "content": f"question {i}"}], max_tokens=1500)
                         .json()["choices"][0]["message"]["reasoning_content"].split()) for i in range(200))
    median, p99 = lengths[100], lengths[197]
    assert 45 <= median <= 75
    assert p99 >= 3.5 * median
