"""The wire shapes regen speaks: the chat request it sends, the chat response an engine answers
(SGLang 0.5.23's, which the simulator produces and the client reads), SGLang's error body and
its ``/server_info``. The contract tests judge these against SGLang's and vLLM's own models."""

from __future__ import annotations

import secrets
import time
from dataclasses import dataclass
from typing import Any, Protocol


class ReadsResponses(Protocol):
    """What the client needs of an engine adapter to read its response (regen.engines)."""

    def reasoning(self, message: dict) -> str | None: ...

    def token_ids(self, body: dict, choice: dict) -> tuple[list[int] | None, list[int] | None]: ...


SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "min_p", "presence_penalty", "repetition_penalty", "seed")


def chat_request(model: str, messages: list[dict], sampling: dict[str, Any],
                 engine_fields: dict[str, Any], tools: list[dict] | None = None,
                 reasoning_field: str = "reasoning_content") -> dict[str, Any]:
    """A non-streamed chat completion: ``sampling`` as RunConfig.sampling_settings() gives it,
    ``engine_fields`` what the engine needs besides (its reasoning split, its token ids), and an
    agentic row's ``tools`` (the engine's tool-call parser returns the calls as ``tool_calls``).
    An earlier step's reasoning is sent under ``reasoning_field``, the key the engine hands its
    chat template."""
    if reasoning_field != "reasoning_content":
        messages = [{(reasoning_field if k == "reasoning_content" else k): v for k, v in m.items()}
                    if "reasoning_content" in m else m for m in messages]
    body: dict[str, Any] = {
        "model": model,
        "messages": messages,
        "max_tokens": sampling["max_tokens"],
        "chat_template_kwargs": {**(sampling.get("chat_template_kwargs") or {}),
                                 "enable_thinking": sampling["enable_thinking"]},
        "stream": False,
    }
    for name in SAMPLING_FIELDS:  # a field left empty is not sent: the model's generation_config decides
        if sampling.get(name) is not None:
            body[name] = sampling[name]
    if tools:
        body["tools"] = tools
    body.update(engine_fields)
    return body


@dataclass
class ChatReply:
    """One choice of a chat completion, as regen keeps it."""

    content: str | None
    reasoning_content: str | None
    finish_reason: str | None
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    prompt_token_ids: list[int] | None = None
    completion_token_ids: list[int] | None = None
    model: str | None = None
    tool_calls: list[dict] | None = None  # regen.toolcalls' shape
    cached_tokens: int | None = None  # of the prompt, from the server's prefix cache (where it reports them)


def read_tool_calls(message: dict) -> list[dict] | None:
    """A reply's structured calls in regen's shape (arguments a JSON string, as OpenAI sends
    them; SGLang may send an object)."""
    from regen.toolcalls import normalize_calls

    calls = message.get("tool_calls")
    return normalize_calls(calls, "the reply's tool_calls", 0) if calls else None


def read_chat_response(body: dict, engine: ReadsResponses) -> ChatReply:
    """The first choice of an engine's answer; KeyError/IndexError/TypeError when it is not one."""
    choice = body["choices"][0]
    message = choice["message"]
    usage = body.get("usage") or {}
    prompt_ids, completion_ids = engine.token_ids(body, choice)
    return ChatReply(content=message.get("content"), reasoning_content=engine.reasoning(message),
                     finish_reason=choice.get("finish_reason"), prompt_tokens=usage.get("prompt_tokens"),
                     completion_tokens=usage.get("completion_tokens"), prompt_token_ids=prompt_ids,
                     completion_token_ids=completion_ids, model=body.get("model"),
                     tool_calls=read_tool_calls(message))


def chat_response(model: str, reply: ChatReply) -> dict[str, Any]:
    """SGLang's ``ChatCompletionResponse`` for one choice (token ids where they were asked for)."""
    choice: dict[str, Any] = {
        "index": 0,
        "message": {"role": "assistant", "content": reply.content,
                    "reasoning_content": reply.reasoning_content,
                    "tool_calls": [{**call, "index": i} for i, call in enumerate(reply.tool_calls)]
                    if reply.tool_calls else None},
        "finish_reason": reply.finish_reason,
    }
    if reply.prompt_token_ids is not None:
        choice["prompt_token_ids"] = reply.prompt_token_ids
    if reply.completion_token_ids is not None:
        choice["response_token_ids"] = reply.completion_token_ids
    prompt, completion = reply.prompt_tokens or 0, reply.completion_tokens or 0
    return {"id": secrets.token_hex(8), "object": "chat.completion", "created": int(time.time()),
            "model": model, "choices": [choice],
            "usage": {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
                      **({"prompt_tokens_details": {"cached_tokens": reply.cached_tokens}}
                         if reply.cached_tokens is not None else {})}}


def error_body(message: str, code: int, kind: str = "BadRequestError") -> dict[str, Any]:
    """SGLang's ``ErrorResponse``."""
    return {"object": "error", "message": message, "type": kind, "code": code}


def server_info(args: dict[str, Any], ranks: int, internal: dict[str, Any]) -> dict[str, Any]:
    """SGLang 0.5.23's ``/server_info``: the resolved server arguments at the top level and in
    each internal state (one per data parallel rank), beside the scheduler's own values
    (internal_state.py)."""
    return {**args, "version": "regen-sim", "internal_states": [{**args, **internal} for _ in range(ranks)]}
