"""An OpenAI-compatible HTTP gateway over the policy, for agents that run outside the process.

An arm whose environment is an ``agent`` (:mod:`alignzoo.plugins.environments.agent`) starts a
program per episode and points its ``OPENAI_BASE_URL`` here. This module is the HTTP side
only: it reads and checks requests, and writes answers the way the OpenAI API does, so the
``openai`` SDK and the frameworks built on it (the OpenAI Agents SDK, LangGraph, smolagents)
talk to the policy unchanged. What a call samples, and how it is recorded for training, is the
hub's (:class:`alignzoo.rollout.agents.AgentHub`).

Routes (every one needs ``Authorization: Bearer <the episode's key>``):

- ``GET /v1/models``: the one model, ``policy``.
- ``POST /v1/chat/completions``: ``messages``, ``tools`` / ``tool_choice``, ``max_tokens`` (or
  ``max_completion_tokens``), ``n``, ``stop``, ``logprobs``, ``stream`` (server-sent events,
  with ``stream_options.include_usage``). ``temperature``, ``top_p`` and ``seed`` are read and
  checked, but the arm's ``training.sampling`` decides how tokens are drawn: it is the behaviour
  policy the trainer corrects for. ``top_logprobs`` answers empty lists (only the sampled
  token's log-prob is recorded).
- ``POST /v1/reward`` (also ``/reward``): ``{"reward": 0.5}``, the episode's own reward (the
  last one posted counts), which the ``episode_reward`` labeler returns.

A request that is wrong gets a 4xx and an OpenAI-style JSON error (``{"error": {"message",
"type", "param", "code"}}``), never a 5xx: a missing or unknown key (401), a body that is not
JSON, is truncated or nested too deeply (400), a field of the wrong type or range (400), a
prompt beyond the model's context (400, ``context_length_exceeded``), a call past the
episode's limits (429). A 5xx means the engine itself failed.
"""

from __future__ import annotations

import json
import secrets
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

from pydantic import BaseModel, ConfigDict, Field, ValidationError

MAX_BODY_BYTES = 4 * 1024 * 1024
"""Largest request body read; a longer one is refused (413)."""
MODEL_NAME = "policy"
"""The name ``/v1/models`` lists (any ``model`` a request names is served by the policy)."""


class FunctionCall(BaseModel):
    """A tool call's function: its name and arguments (a JSON string, as the API writes it)."""

    model_config = ConfigDict(extra="allow")

    name: str
    arguments: str | dict[str, Any] = "{}"


class ToolCallMessage(BaseModel):
    """A tool call of an assistant message, as the agent sends it back."""

    model_config = ConfigDict(extra="allow")

    id: str | None = None
    type: str = "function"
    function: FunctionCall


class FunctionSpec(BaseModel):
    """A tool's function: its name, description and JSON-schema parameters."""

    model_config = ConfigDict(extra="allow")

    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None


class ToolSpec(BaseModel):
    """A tool a request offers (``{"type": "function", "function": {...}}``)."""

    model_config = ConfigDict(extra="allow")

    type: str = "function"
    function: FunctionSpec


class ChatMessage(BaseModel):
    """One message of a chat request, as the OpenAI API takes it."""

    model_config = ConfigDict(extra="allow")

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    tool_calls: list[ToolCallMessage] | None = None
    tool_call_id: str | None = None


class ChatRequest(BaseModel):
    """A ``/v1/chat/completions`` request (fields the gateway does not use are allowed)."""

    model_config = ConfigDict(extra="allow")

    model: str = MODEL_NAME
    messages: list[ChatMessage] = Field(min_length=1)
    tools: list[ToolSpec] | None = None
    tool_choice: str | dict[str, Any] | None = None
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    seed: int | None = None
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    n: int = Field(1, ge=1, le=16)
    stop: str | list[str] | None = None
    logprobs: bool | None = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    stream: bool | None = False
    stream_options: dict[str, Any] | None = None

    def stops(self) -> list[str]:
        """The stop strings (at most 4, as the API allows)."""
        if self.stop is None:
            return []
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop)
        return [s for s in stops if s]

    def token_cap(self) -> int | None:
        """The request's own limit on sampled tokens per choice, if any."""
        return self.max_completion_tokens or self.max_tokens


@dataclass
class Choice:
    """One sampled completion, as the hub hands it to the gateway."""

    text: str  # the content: the turn's text around its tool calls
    tool_calls: list[dict[str, Any]]  # OpenAI's shape: id, type, function {name, arguments}
    finish_reason: str  # stop | length | tool_calls
    tokens: list[str]  # each sampled token's text
    logprobs: list[float]  # each sampled token's log-prob
    deltas: list[str]  # per sampled token, what it adds to ``text`` (streamed content)


@dataclass
class Completion:
    """What one request sampled: its choices and the token counts of its usage."""

    choices: list[Choice]
    prompt_tokens: int
    id: str = field(default_factory=lambda: f"chatcmpl-{secrets.token_hex(12)}")
    created: int = field(default_factory=lambda: int(time.time()))

    @property
    def completion_tokens(self) -> int:
        return sum(len(c.tokens) for c in self.choices)


class Refused(Exception):
    """A request the gateway answers with a 4xx: its status, OpenAI-style code and message."""

    def __init__(self, status: int, code: str, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status, self.code, self.message, self.param = status, code, message, param


class Hub(Protocol):
    """What the gateway serves from (the agent runner's :class:`AgentHub`)."""

    def episode_for(self, key: str) -> Any | None:
        """The live episode ``key`` belongs to; None for a key unknown or closed."""

    async def complete(self, episode: Any, request: ChatRequest) -> Completion:
        """Sample and record one request of ``episode``; raises :class:`Refused`."""

    def reward(self, episode: Any, value: float) -> None:
        """Record the reward ``episode``'s agent reports."""

    def refused(self, episode: Any | None, status: int, code: str) -> None:
        """Count a refused request (``episode`` None when the key was not known)."""


def _error(status: int, code: str, message: str, param: str | None = None) -> Any:
    from starlette.responses import JSONResponse

    kind = {401: "authentication_error", 429: "rate_limit_error"}.get(
        status, "invalid_request_error" if status < 500 else "server_error"
    )
    body = {"error": {"message": message, "type": kind, "param": param, "code": code}}
    return JSONResponse(body, status_code=status)


def _key(request: Any) -> str | None:
    header = request.headers.get("authorization", "")
    scheme, _, value = header.partition(" ")
    return value.strip() if scheme.lower() == "bearer" and value.strip() else None


async def _json_body(request: Any) -> Any:
    """The request's JSON, or :class:`Refused` saying what is wrong with it."""
    length = request.headers.get("content-length")
    if length is not None and length.isdigit() and int(length) > MAX_BODY_BYTES:
        raise Refused(413, "body_too_large", f"the body is over {MAX_BODY_BYTES} bytes")
    body = b""
    async for chunk in request.stream():
        body += chunk
        if len(body) > MAX_BODY_BYTES:
            raise Refused(413, "body_too_large", f"the body is over {MAX_BODY_BYTES} bytes")
    try:
        return json.loads(body)
    except RecursionError:
        raise Refused(400, "invalid_json", "the JSON body is nested too deeply") from None
    except ValueError as exc:  # not JSON, not UTF-8, or a number past Python's digit limit
        raise Refused(400, "invalid_json", f"the body is not valid JSON: {exc}") from None


def _validation_message(exc: ValidationError) -> tuple[str, str | None]:
    first = exc.errors()[0]
    param = ".".join(str(p) for p in first.get("loc", ())) or None
    return f"{param or 'body'}: {first.get('msg', 'invalid')}", param


def _logprobs(choice: Choice, start: int = 0, stop: int | None = None) -> dict[str, Any]:
    entries = [
        {"token": t, "logprob": lp, "bytes": list(t.encode()), "top_logprobs": []}
        for t, lp in zip(choice.tokens[start:stop], choice.logprobs[start:stop], strict=True)
    ]
    return {"content": entries}


def completion_body(
    completion: Completion, request: ChatRequest, model: str = MODEL_NAME
) -> dict[str, Any]:
    """The ``chat.completion`` object of a non-streaming answer."""
    choices = []
    for index, choice in enumerate(completion.choices):
        message: dict[str, Any] = {"role": "assistant", "content": choice.text or None}
        if choice.tool_calls:
            message["tool_calls"] = choice.tool_calls
        elif message["content"] is None:
            message["content"] = ""
        choices.append(
            {
                "index": index,
                "message": message,
                "logprobs": _logprobs(choice) if request.logprobs else None,
                "finish_reason": choice.finish_reason,
            }
        )
    return {
        "id": completion.id,
        "object": "chat.completion",
        "created": completion.created,
        "model": model,
        "choices": choices,
        "usage": _usage(completion),
    }


def _usage(completion: Completion) -> dict[str, int]:
    return {
        "prompt_tokens": completion.prompt_tokens,
        "completion_tokens": completion.completion_tokens,
        "total_tokens": completion.prompt_tokens + completion.completion_tokens,
    }


def completion_chunks(
    completion: Completion, request: ChatRequest, model: str = MODEL_NAME
) -> list[dict[str, Any]]:
    """The ``chat.completion.chunk`` objects of a streamed answer: per choice its role, its
    content token by token (each with its log-prob when asked), its tool calls whole, and its
    finish reason; then the usage when ``stream_options.include_usage`` asks for it."""

    def chunk(index: int, delta: dict[str, Any], **more: Any) -> dict[str, Any]:
        choice = {"index": index, "delta": delta, "logprobs": None, "finish_reason": None}
        choice.update(more)
        return {
            "id": completion.id,
            "object": "chat.completion.chunk",
            "created": completion.created,
            "model": model,
            "choices": [choice],
        }

    chunks = []
    for index, choice in enumerate(completion.choices):
        chunks.append(chunk(index, {"role": "assistant", "content": ""}))
        if choice.tool_calls:
            if choice.text:
                chunks.append(chunk(index, {"content": choice.text}))
            calls = [{"index": k, **call} for k, call in enumerate(choice.tool_calls)]
            chunks.append(chunk(index, {"tool_calls": calls}))
        else:
            for k, delta in enumerate(choice.deltas):  # the content as the answer gives it
                logprobs = _logprobs(choice, k, k + 1) if request.logprobs else None
                chunks.append(chunk(index, {"content": delta}, logprobs=logprobs))
        chunks.append(chunk(index, {}, finish_reason=choice.finish_reason))
    if (request.stream_options or {}).get("include_usage"):
        last = chunks[-1] if chunks else chunk(0, {})
        chunks.append({**last, "choices": [], "usage": _usage(completion)})
    return chunks


async def _stream(chunks: list[dict[str, Any]]) -> AsyncIterator[bytes]:
    for item in chunks:
        yield f"data: {json.dumps(item)}\n\n".encode()
    yield b"data: [DONE]\n\n"


def gateway_app(hub: Hub) -> Any:
    """The Starlette app of the gateway, serving from ``hub``."""
    from starlette.applications import Starlette
    from starlette.exceptions import HTTPException
    from starlette.responses import JSONResponse, StreamingResponse
    from starlette.routing import Route

    def authorised(
        handler: Callable[[Any, Any], Awaitable[Any]],
    ) -> Callable[[Any], Awaitable[Any]]:
        async def route(request: Any) -> Any:
            key = _key(request)
            episode = hub.episode_for(key) if key else None
            if episode is None:
                code = "missing_api_key" if key is None else "invalid_api_key"
                hub.refused(None, 401, code)
                what = "no API key" if key is None else "an API key of no running episode"
                return _error(401, code, f"{what}: use the key in OPENAI_API_KEY")
            try:
                return await handler(request, episode)
            except Refused as refused:
                hub.refused(episode, refused.status, refused.code)
                return _error(refused.status, refused.code, refused.message, refused.param)

        return route

    async def models(request: Any, episode: Any) -> Any:
        card = {"id": MODEL_NAME, "object": "model", "created": 0, "owned_by": "alignzoo"}
        return JSONResponse({"object": "list", "data": [card]})

    async def chat(request: Any, episode: Any) -> Any:
        data = await _json_body(request)
        if not isinstance(data, dict):
            raise Refused(400, "invalid_request", "the body must be a JSON object")
        try:
            parsed = ChatRequest.model_validate(data)
        except ValidationError as exc:
            message, param = _validation_message(exc)
            raise Refused(400, "invalid_request", message, param) from None
        except RecursionError:
            raise Refused(400, "invalid_json", "the JSON body is nested too deeply") from None
        if len(parsed.stops()) > 4:
            raise Refused(400, "invalid_request", "stop: at most 4 sequences", "stop")
        completion = await hub.complete(episode, parsed)
        if parsed.stream:
            chunks = completion_chunks(completion, parsed, parsed.model)
            return StreamingResponse(_stream(chunks), media_type="text/event-stream")
        return JSONResponse(completion_body(completion, parsed, parsed.model))

    async def reward(request: Any, episode: Any) -> Any:
        data = await _json_body(request)
        value = data.get("reward") if isinstance(data, dict) else None
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise Refused(400, "invalid_request", "reward: expected a number", "reward")
        if value != value or value in (float("inf"), float("-inf")):
            raise Refused(400, "invalid_request", "reward: expected a finite number", "reward")
        hub.reward(episode, float(value))
        return JSONResponse({"ok": True})

    async def http_error(request: Any, exc: Exception) -> Any:
        status = exc.status_code if isinstance(exc, HTTPException) else 400
        code = {404: "not_found", 405: "method_not_allowed"}.get(status, "invalid_request")
        return _error(status, code, f"{request.method} {request.url.path}: {code}")

    return Starlette(
        routes=[
            Route("/v1/models", authorised(models), methods=["GET"]),
            Route("/v1/chat/completions", authorised(chat), methods=["POST"]),
            Route("/v1/reward", authorised(reward), methods=["POST"]),
            Route("/reward", authorised(reward), methods=["POST"]),
        ],
        exception_handlers={HTTPException: http_error},
    )


def gateway_server(hub: Hub) -> Any:
    """An uvicorn server of :func:`gateway_app` (serve it with ``server.serve(sockets=[s])``),
    without uvicorn's signal handlers: the run, not the gateway, owns Ctrl-C."""
    import uvicorn

    class Server(uvicorn.Server):
        @contextmanager
        def capture_signals(self) -> Any:
            yield

    config = uvicorn.Config(
        gateway_app(hub),
        log_level="warning",
        access_log=False,
        lifespan="off",
        timeout_graceful_shutdown=5,  # a connection an agent left open never holds up the step
    )
    return Server(config)
