"""The OpenAI chat-completions request, checked field by field, and its error bodies.

``parse_chat_request`` turns a decoded JSON body into a frozen ``ChatRequest``; any field
of the wrong type or out of range raises ``ApiError`` naming it (``param``), which the
server writes as OpenAI's error body ``{"error": {"message", "type", "param", "code"}}``
with a 4xx status. Fields the endpoint does not use (``user``, ``metadata``,
``parallel_tool_calls``, ...) are accepted and ignored, as OpenAI's clients may send them.

>>> request = parse_chat_request(
...     {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4})
>>> request.max_tokens, request.messages[0]["content"]
(4, 'hi')
>>> parse_chat_request({"model": "m", "messages": [{"role": "user"}], "temperature": "hot"})
Traceback (most recent call last):
...
rlaxkit.serve.protocol.ApiError: temperature: must be a number, got 'hot'
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

__all__ = ["ApiError", "ChatRequest", "error_body", "parse_chat_request"]

ROLES = ("system", "developer", "user", "assistant", "tool")


class ApiError(Exception):
    """A request the endpoint refuses: ``status`` (4xx, or 503/500 for the server's
    own trouble), ``param`` the field at fault, ``kind`` OpenAI's error ``type``."""

    def __init__(
        self,
        message: str,
        *,
        param: str | None = None,
        status: int = 400,
        kind: str = "invalid_request_error",
        code: str | None = None,
    ):
        super().__init__(message)
        self.message, self.param, self.status, self.kind, self.code = (
            message,
            param,
            status,
            kind,
            code,
        )

    def __str__(self) -> str:
        return self.message


def error_body(error: ApiError) -> dict[str, object]:
    """OpenAI's error body for ``error``."""
    return {
        "error": {
            "message": error.message,
            "type": error.kind,
            "param": error.param,
            "code": error.code,
        }
    }


@dataclass(frozen=True)
class ChatRequest:
    """A checked chat-completions request. ``messages`` are normalised: ``content`` a
    string, an assistant's ``tool_calls`` with ``arguments`` parsed from JSON (left a
    string when it is not JSON); ``session`` from ``extra_body`` (the header wins, in the
    server)."""

    model: str
    messages: tuple[dict[str, object], ...]
    tools: tuple[dict[str, object], ...] = ()
    tool_choice: str | dict[str, object] = "auto"
    max_tokens: int | None = None
    temperature: float | None = None
    n: int = 1
    stop: tuple[str, ...] = ()
    logprobs: bool = False
    seed: int | None = None
    session: str | None = None
    stream: bool = False


def _fail(param: str, what: str, value: object) -> ApiError:
    return ApiError(f"{param}: must be {what}, got {value!r}", param=param)


def _optional(body: Mapping[str, object], name: str) -> object:
    return body.get(name)


def _int(body: Mapping[str, object], name: str, minimum: int) -> int | None:
    value = _optional(body, name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise _fail(name, f"an integer >= {minimum}", value)
    return value


def _content(value: object, param: str) -> str:
    """A message's content: a string, null, or a list of text parts."""
    if value is None or isinstance(value, str):
        return value or ""
    if isinstance(value, list):
        texts = []
        for k, part in enumerate(value):
            if not isinstance(part, dict) or part.get("type") != "text":
                raise _fail(f"{param}[{k}]", 'a {"type": "text", "text": ...} part', part)
            if not isinstance(part.get("text"), str):
                raise _fail(f"{param}[{k}].text", "a string", part.get("text"))
            texts.append(part["text"])
        return "".join(texts)
    raise _fail(param, "a string, null or a list of text parts", value)


def _tool_calls(value: object, param: str) -> list[dict[str, Any]]:
    if not isinstance(value, list):
        raise _fail(param, "a list of tool calls", value)
    calls = []
    for k, call in enumerate(value):
        where = f"{param}[{k}]"
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise _fail(where, 'a {"type": "function", "function": {"name", "arguments"}}', call)
        arguments = function.get("arguments", "{}")
        if isinstance(arguments, str):
            with contextlib.suppress(ValueError):  # else rendered as the client sent it
                arguments = json.loads(arguments)
        calls.append(
            {
                "id": str(call.get("id") or ""),
                "type": "function",
                "function": {"name": function["name"], "arguments": arguments},
            }
        )
    return calls


def _message(value: object, index: int) -> dict[str, object]:
    param = f"messages[{index}]"
    if not isinstance(value, dict):
        raise _fail(param, "an object with role and content", value)
    role = value.get("role")
    if role not in ROLES:
        raise _fail(f"{param}.role", f"one of {', '.join(ROLES)}", role)
    message: dict[str, object] = {
        "role": role,
        "content": _content(value.get("content"), f"{param}.content"),
    }
    if role == "assistant" and value.get("tool_calls"):
        message["tool_calls"] = _tool_calls(value["tool_calls"], f"{param}.tool_calls")
    if role == "tool":
        call_id = value.get("tool_call_id")
        if call_id is not None and not isinstance(call_id, str):
            raise _fail(f"{param}.tool_call_id", "a string", call_id)
        message["tool_call_id"] = call_id or ""
    return message


def _tools(value: object) -> tuple[dict[str, object], ...]:
    if value is None:
        return ()
    if not isinstance(value, list):
        raise _fail("tools", "a list of function tools", value)
    for k, tool in enumerate(value):
        function = tool.get("function") if isinstance(tool, dict) else None
        if (
            not isinstance(tool, dict)
            or tool.get("type", "function") != "function"
            or not isinstance(function, dict)
            or not isinstance(function.get("name"), str)
        ):
            raise _fail(f"tools[{k}]", 'a {"type": "function", "function": {"name", ...}}', tool)
    return tuple(value)


def _tool_choice(value: object, tools: tuple[dict[str, object], ...]) -> str | dict[str, object]:
    """``"auto"`` and ``"none"`` are taken as they are; ``"required"`` and a named
    function would need constrained decoding, which the sampler does not do."""
    if value is None:
        return "auto"
    if value in ("auto", "none"):
        return str(value)
    if value == "required" or isinstance(value, dict):
        raise ApiError(
            f"tool_choice: {value!r} needs constrained decoding, which this endpoint does not "
            "do; use 'auto' (the model chooses) or 'none'",
            param="tool_choice",
        )
    raise _fail("tool_choice", "'auto' or 'none'", value)


def parse_chat_request(body: object) -> ChatRequest:
    """Checks a decoded request body; raises ``ApiError`` naming the first bad field."""
    if not isinstance(body, dict):
        raise ApiError("the request body must be a JSON object", param=None)
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise _fail("model", "the name of a served model (GET /v1/models)", model)
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise _fail("messages", "a non-empty list of messages", messages)
    temperature = body.get("temperature")
    if temperature is not None and (
        isinstance(temperature, bool) or not isinstance(temperature, int | float)
    ):
        raise _fail("temperature", "a number", temperature)
    stop = body.get("stop")
    if isinstance(stop, str):
        stop = [stop]
    if stop is not None and (
        not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop)
    ):
        raise _fail("stop", "a non-empty string or a list of them", stop)
    logprobs = body.get("logprobs")
    if logprobs is not None and not isinstance(logprobs, bool):
        raise _fail("logprobs", "true or false", logprobs)
    if _int(body, "top_logprobs", 0):
        raise ApiError(
            "top_logprobs: the sampler keeps each sampled token's log-prob only; pass 0",
            param="top_logprobs",
        )
    stream = body.get("stream")
    if stream not in (None, False):
        raise ApiError("stream: streaming is not served; pass false", param="stream")
    session = body.get("session_id")
    if session is not None and not isinstance(session, str):
        raise _fail("session_id", "a string", session)
    tools = _tools(body.get("tools"))
    max_tokens = _int(body, "max_completion_tokens", 1)
    return ChatRequest(
        model=model,
        messages=tuple(_message(m, i) for i, m in enumerate(messages)),
        tools=tools,
        tool_choice=_tool_choice(body.get("tool_choice"), tools),
        max_tokens=_int(body, "max_tokens", 1) if max_tokens is None else max_tokens,
        temperature=None if temperature is None else float(temperature),
        n=_int(body, "n", 1) or 1,
        stop=tuple(stop or ()),
        logprobs=bool(logprobs),
        seed=_int(body, "seed", 0),
        session=session,
    )
