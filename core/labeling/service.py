"""``alignzoo serve-labeler``: any labeler plugin over HTTP (Starlette on uvicorn).

Protocol, version 1 (JSON; the wire format is :mod:`alignzoo.labeling.protocol`; the ``http``
labeler is its client):

- ``POST /v1/score`` with ``{"version": 1, "requests": [{"prompt": str, "response": str,
  "extra": {...}}, ...]}`` answers ``{"version": 1, "labeler": <identity>, "scores":
  [{"value": float | null, "valid": bool, "outcome": "value" | "abstain" | ..., "info": {}}]}``,
  one score per request, in order. 400 for a body that does not validate, 401 without the
  bearer token (when one is configured), 413 for a body over the size limit, 503 while the
  labeler is failing (with ``Retry-After``).
- ``GET /health``: ``{"status": "ok", "labeler": <identity>, "version": 1}``.
- ``GET /metrics``: Prometheus text (requests, items, batch sizes, latency, failures).

Requests are stateless, so replicas behind a load balancer scale labeling out. Items of
concurrent requests are batched together on the server (up to ``max_batch_size``, waiting at
most ``max_wait_ms`` for more) and scored in a worker thread. The token is read from the
environment variable the YAML names, never from the YAML itself; the server binds 127.0.0.1
unless told otherwise.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from alignzoo.config.schema import ComponentRef
from alignzoo.errors import UserError
from alignzoo.labeling.protocol import PROTOCOL_VERSION, ScoreRequest, score_to_json
from alignzoo.types import LabelRequest, Score


class BatchingConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    max_batch_size: int = Field(64, ge=1, description="Most items scored in one labeler call.")
    max_wait_ms: float = Field(5.0, ge=0, description="How long a batch waits to fill up.")


class ServeConfig(BaseModel):
    """A labeler server's YAML."""

    model_config = ConfigDict(extra="forbid")

    labeler: ComponentRef
    batching: BatchingConfig = Field(default_factory=BatchingConfig)
    token_env: str | None = Field(
        None, description="Environment variable holding the bearer token (never the token)."
    )
    max_request_bytes: int = Field(4 << 20, ge=1024)
    max_items: int = Field(4096, ge=1, description="Most requests in one POST.")


def load_config(path: Path) -> ServeConfig:
    """The server's YAML, validated."""
    from alignzoo.config.loader import load_yaml_model

    cfg: ServeConfig = load_yaml_model(path, ServeConfig, "labeler server")
    return cfg


class Batcher:
    """Collects items of concurrent requests into batches for one labeler."""

    def __init__(self, score: Any, cfg: BatchingConfig, metrics: Any) -> None:
        self.score, self.cfg, self.metrics = score, cfg, metrics
        self.queue: asyncio.Queue[tuple[LabelRequest, asyncio.Future[Any]]] = asyncio.Queue()
        self.task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self.task = asyncio.get_running_loop().create_task(self._run())

    async def submit(self, items: list[LabelRequest]) -> list[Any]:
        loop = asyncio.get_running_loop()
        futures = [loop.create_future() for _ in items]
        for item, future in zip(items, futures, strict=True):
            self.queue.put_nowait((item, future))
        return list(await asyncio.gather(*futures))

    async def _run(self) -> None:
        while True:
            first = await self.queue.get()
            batch = [first]
            deadline = time.monotonic() + self.cfg.max_wait_ms / 1000
            while len(batch) < self.cfg.max_batch_size:
                timeout = deadline - time.monotonic()
                if timeout <= 0:
                    break
                try:
                    batch.append(await asyncio.wait_for(self.queue.get(), timeout))
                except asyncio.TimeoutError:
                    break
            requests = [item for item, _ in batch]
            self.metrics["batch"].observe(len(batch))
            begin = time.perf_counter()
            try:
                scores = await asyncio.to_thread(self.score, requests)
                if not isinstance(scores, list) or len(scores) != len(batch):
                    raise ValueError(f"the labeler returned {len(scores)} scores for {len(batch)}")
            except Exception as exc:
                self.metrics["failures"].inc()
                for _, future in batch:
                    if not future.done():
                        future.set_exception(exc)
                continue
            finally:
                self.metrics["latency"].observe(time.perf_counter() - begin)
            for (_, future), score in zip(batch, scores, strict=True):
                if not future.done():
                    future.set_result(score)


def build_app(cfg: ServeConfig) -> Any:
    """The Starlette application serving ``cfg.labeler`` (see the module docstring)."""
    from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import JSONResponse, PlainTextResponse, Response
    from starlette.routing import Route

    from alignzoo.labeling.interface import start_labeler
    from alignzoo.labeling.store import labeler_identity
    from alignzoo.registry import build_plugin_manager, get_registry

    cls = get_registry().get("labeler", cfg.labeler.name)
    try:
        component = cls(cls.Params.model_validate(cfg.labeler.params))
    except ValidationError as exc:
        raise UserError(f"labeler.params of {cfg.labeler.name!r}: {exc}") from None
    pm = build_plugin_manager([component])
    start_labeler(pm)
    identity = labeler_identity(component)
    token = None
    if cfg.token_env is not None:
        token = os.environ.get(cfg.token_env)
        if not token:
            raise UserError(f"token_env: the environment variable {cfg.token_env} is not set")

    registry = CollectorRegistry()
    metrics: dict[str, Any] = {
        "requests": Counter(
            "alignzoo_labeler_requests", "POSTs by status", ["status"], registry=registry
        ),
        "items": Counter("alignzoo_labeler_items", "Items scored", registry=registry),
        "batch": Histogram(
            "alignzoo_labeler_batch_size",
            "Items per labeler call",
            buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256, 512),
            registry=registry,
        ),
        "latency": Histogram(
            "alignzoo_labeler_call_seconds", "Labeler call latency", registry=registry
        ),
        "failures": Counter("alignzoo_labeler_failures", "Failed labeler calls", registry=registry),
    }
    batcher = Batcher(lambda reqs: pm.hook.score_batch(requests=reqs), cfg.batching, metrics)

    def reply(status: int, body: dict[str, Any], headers: dict[str, str] | None = None) -> Any:
        metrics["requests"].labels(str(status)).inc()
        return JSONResponse(body, status_code=status, headers=headers)

    async def score(request: Request) -> Response:
        if token is not None and request.headers.get("authorization") != f"Bearer {token}":
            return reply(401, {"error": "a valid bearer token is required"})
        size = request.headers.get("content-length")
        if size is not None and size.isdigit() and int(size) > cfg.max_request_bytes:
            return reply(413, {"error": f"body over {cfg.max_request_bytes} bytes"})
        raw = await request.body()
        if len(raw) > cfg.max_request_bytes:
            return reply(413, {"error": f"body over {cfg.max_request_bytes} bytes"})
        try:
            body = ScoreRequest.model_validate(json.loads(raw))
        except (ValueError, ValidationError) as exc:
            return reply(400, {"error": f"invalid body: {exc}"})
        if body.version != PROTOCOL_VERSION:
            return reply(400, {"error": f"protocol version {body.version}; this server speaks 1"})
        if len(body.requests) > cfg.max_items:
            return reply(413, {"error": f"more than {cfg.max_items} requests in one body"})
        items = [
            LabelRequest(prompt=r.prompt, response=r.response, extra=r.extra) for r in body.requests
        ]
        try:
            scores = await batcher.submit(items)
        except Exception as exc:
            return reply(503, {"error": f"{type(exc).__name__}: {exc}"}, {"Retry-After": "1"})
        metrics["items"].inc(len(items))
        out = []
        for s in scores:
            out.append(
                score_to_json(s)
                if isinstance(s, Score)
                else {"value": None, "valid": False, "outcome": "rejected", "info": {}}
            )
        return reply(200, {"version": PROTOCOL_VERSION, "labeler": identity, "scores": out})

    async def health(request: Request) -> Response:
        return JSONResponse({"status": "ok", "labeler": identity, "version": PROTOCOL_VERSION})

    async def prometheus(request: Request) -> Response:
        return PlainTextResponse(generate_latest(registry).decode())

    @contextlib.asynccontextmanager
    async def lifespan(app: Any) -> AsyncIterator[None]:
        batcher.start()
        yield

    return Starlette(
        routes=[
            Route("/v1/score", score, methods=["POST"]),
            Route("/health", health),
            Route("/metrics", prometheus),
        ],
        lifespan=lifespan,
    )


def serve(path: Path, host: str = "127.0.0.1", port: int = 8765) -> None:
    """Run the server until interrupted."""
    import uvicorn

    app = build_app(load_config(path))
    uvicorn.run(app, host=host, port=port, log_level="warning")
