"""``alignzoo serve-labeler``: any labeler plugin over HTTP (Starlette on uvicorn).

Protocol, version 1 (JSON; the wire format is :mod:`alignzoo.labeling.protocol`; the ``http``
labeler is its client):

- ``POST /v1/score`` with ``{"version": 1, "requests": [{"prompt": str, "response": str,
  "extra": {...}}, ...]}`` answers ``{"version": 1, "labeler": <identity>, "scores":
  [{"value": float | null, "valid": bool, "outcome": "value" | "abstain" | ..., "info": {}}]}``,
  one score per request, in order. 400 (a one-line JSON error) for a body that is not UTF-8
  JSON, is nested deeper than :data:`~alignzoo.labeling.protocol.MAX_JSON_DEPTH` levels or
  does not validate, 401 without the bearer token (when one is configured), 413 for a body
  over the size limit, 503 while the labeler is failing (with ``Retry-After``).
- ``GET /health``: ``{"status": "ok", "labeler": <identity>, "version": 1}``.
- ``GET /metrics``: Prometheus text (requests, items, batch sizes, latency, failures).

Requests are stateless, so replicas behind a load balancer scale labeling out. Items of
concurrent requests are batched together on the server (up to ``max_batch_size``, waiting at
most ``max_wait_ms`` for more) and scored in a worker thread. When a batched call raises, its
items are retried alone until one is scored (the labeler works), then the rest in halves down to
single items, so every item that makes the labeler raise gets the ``error`` outcome (the reason
in ``info``) and the other items, other clients' included, their scores; once
:data:`DOWN_AFTER_FAILED_CALLS` items failed alone before any succeeded (or the labeler raised
:class:`~alignzoo.errors.LabelerUnavailable`), the labeler is taken to be failing and the
batch's requests get 503, as before. The token is read from the
environment variable the YAML names, never from the YAML itself; the server binds 127.0.0.1
unless told otherwise, and refuses an address other than loopback without a token unless
``--insecure`` (:func:`binding_notice`).
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import math
import os
import sys
import time
from collections import deque
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from alignzoo.config.schema import ComponentRef
from alignzoo.errors import LabelerUnavailable, UserError
from alignzoo.labeling.protocol import (
    PROTOCOL_VERSION,
    JSONLimitError,
    ScoreRequest,
    loads_limited,
    score_to_json,
)
from alignzoo.types import LabelRequest, Outcome, Score

DOWN_AFTER_FAILED_CALLS = 3
"""A batch whose labeler call raised is retried item by item until one item is scored; once this
many items failed alone before any succeeded, the labeler is taken to be failing (not a few bad
items) and the whole batch fails (503): a failing labeler costs at most this many extra calls.
Once one succeeded, the rest is retried in halves, however many of its items are bad."""


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
    from alignzoo.config.yamlfile import load_yaml_model

    cfg: ServeConfig = load_yaml_model(path, ServeConfig, "labeler server")
    return cfg


class Batcher:
    """Collects items of concurrent requests into batches for one labeler, and isolates the
    items that make it raise (see the module docstring)."""

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
            await self._score(await self._collect())

    async def _collect(self) -> list[tuple[LabelRequest, asyncio.Future[Any]]]:
        """The next batch: what is queued, and what comes within ``max_wait_ms``."""
        batch = [await self.queue.get()]
        deadline = time.monotonic() + self.cfg.max_wait_ms / 1000
        while len(batch) < self.cfg.max_batch_size:
            with contextlib.suppress(asyncio.QueueEmpty):
                batch.append(self.queue.get_nowait())
                continue
            timeout = deadline - time.monotonic()
            if timeout <= 0:
                break
            try:
                batch.append(await asyncio.wait_for(self.queue.get(), timeout))
            except asyncio.TimeoutError:
                break
        return batch

    async def _call(self, requests: list[LabelRequest]) -> list[Any]:
        """One labeler call, in a worker thread: one score per request, or it raises."""
        self.metrics["batch"].observe(len(requests))
        begin = time.perf_counter()
        try:
            scores = await asyncio.to_thread(self.score, requests)
            if not isinstance(scores, (list, tuple)) or len(scores) != len(requests):
                got = (
                    f"{len(scores)} scores"
                    if isinstance(scores, (list, tuple))
                    else type(scores).__name__
                )
                raise ValueError(f"the labeler returned {got} for {len(requests)} requests")
        except Exception:
            self.metrics["failures"].inc()
            raise
        finally:
            self.metrics["latency"].observe(time.perf_counter() - begin)
        return list(scores)

    async def _score(self, batch: list[tuple[LabelRequest, asyncio.Future[Any]]]) -> None:
        """Score a batch; when the call raises, score its items alone one by one until one
        succeeds (the labeler works), then the rest in halves until each failure is one item,
        which gets an ``error`` Score. The labeler is taken to be failing, and every item left
        fails, when :data:`DOWN_AFTER_FAILED_CALLS` items alone failed before one succeeded, or
        when it raised :class:`LabelerUnavailable`."""

        def settle(part: list[int], scores: list[Any]) -> None:
            for i, score in zip(part, scores, strict=True):
                if not batch[i][1].done():
                    batch[i][1].set_result(score)

        everything = list(range(len(batch)))
        try:
            settle(everything, await self._call([item for item, _ in batch]))
            return
        except Exception as exc:
            first: Exception = exc
        gave_up = len(batch) == 1 or isinstance(first, LabelerUnavailable)
        bad: dict[int, Exception] = {}
        pending = [] if gave_up else everything
        alive = False  # a retry succeeded: the labeler works, the failures are the items'
        while pending and not alive:  # single items, until one is scored: does it work at all?
            i, pending = pending[0], pending[1:]
            try:
                settle([i], await self._call([batch[i][0]]))
                alive = True
            except LabelerUnavailable as exc:  # the labeler says it is failing as a whole
                first, gave_up = exc, True
            except Exception as exc:
                bad[i] = exc
                gave_up = len(bad) >= DOWN_AFTER_FAILED_CALLS
            if gave_up:
                break
        parts = deque([pending] if alive and pending else [])
        while parts:  # the labeler works: the rest in halves until each failure is one item
            part = parts.popleft()
            try:
                settle(part, await self._call([batch[i][0] for i in part]))
            except LabelerUnavailable as exc:
                first, gave_up = exc, True
                break
            except Exception as exc:
                if len(part) == 1:
                    bad[part[0]] = exc
                else:
                    parts.extend(_halves(part))
        if alive and not gave_up:
            self.metrics["item_errors"].inc(len(bad))
            for i, error in bad.items():
                settle([i], [_error_score(error)])
            return
        for _, future in batch:  # the labeler is failing: every request left gets a 503
            if not future.done():
                future.set_exception(first)


def _halves(part: list[int]) -> list[list[int]]:
    """Two parts of a part of two or more items (requests' items stay mostly together)."""
    middle = (len(part) + 1) // 2
    return [part[:middle], part[middle:]]


def _error_score(exc: Exception) -> Score:
    reason = " ".join(f"{type(exc).__name__}: {exc}".split())
    if len(reason) > 500:
        reason = reason[:499] + "…"
    return Score(math.nan, False, {"reason": reason}, Outcome.ERROR)


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
        "item_errors": Counter(
            "alignzoo_labeler_item_errors",
            "Items answered with the error outcome (their call alone raised)",
            registry=registry,
        ),
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
            body = ScoreRequest.model_validate(loads_limited(raw))
        except JSONLimitError as exc:
            return reply(400, {"error": f"invalid body: {exc}"})
        except ValidationError as exc:
            return reply(400, {"error": f"invalid body: {_one_line(exc)}"})
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
            wait = exc.retry_after if isinstance(exc, LabelerUnavailable) else None
            retry_after = "1"
            if wait is not None and math.isfinite(wait):
                retry_after = str(max(0, math.ceil(wait)))
            return reply(
                503, {"error": _error_score(exc).info["reason"]}, {"Retry-After": retry_after}
            )
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


def _one_line(exc: ValidationError) -> str:
    """A validation error on one line: ``requests.0.prompt: Input should be a valid string``."""
    problems = [
        f"{'.'.join(str(p) for p in error['loc']) or 'body'}: {' '.join(error['msg'].split())}"
        for error in exc.errors()
    ]
    return "; ".join(problems[:5]) + (
        f"; and {len(problems) - 5} more" if len(problems) > 5 else ""
    )


def is_loopback(host: str) -> bool:
    """``localhost`` or an address of 127.0.0.0/8 or ``::1`` (IPv4-mapped included)."""
    if host.lower() == "localhost":
        return True
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        return False  # a name other than localhost, or "" (every interface)
    mapped = getattr(address, "ipv4_mapped", None)
    return bool(address.is_loopback or (mapped is not None and mapped.is_loopback))


def binding_notice(host: str, port: int, token_env: str | None, insecure: bool) -> str | None:
    """What to print before serving on ``host``: nothing with a token; one line on a loopback
    address without one; a warning with ``--insecure``. Any other address without a token is
    refused (:class:`UserError`, exit 2): anyone who can reach it could use the labeler."""
    if token_env is not None:
        return None
    if is_loopback(host):
        return (
            f"serving unauthenticated on {host}, port {port} (loopback only; set token_env in "
            "the YAML to require a bearer token)"
        )
    if insecure:
        return (
            f"warning: serving on {host}, port {port}, without authentication (--insecure): "
            "anyone who can reach this address can use the labeler; set token_env in the YAML to "
            "require a bearer token"
        )
    raise UserError(
        f"refusing to serve on {host!r} without authentication: anyone who can reach this "
        "address could use the labeler. Set token_env in the YAML (the name of an environment "
        "variable holding a bearer token), bind a loopback address (--host 127.0.0.1), or pass "
        "--insecure if the network is trusted"
    )


def serve(
    path: Path,
    host: str = "127.0.0.1",
    port: int = 8765,
    insecure: bool = False,
    say: Callable[[str], None] | None = None,
) -> None:
    """Run the server until interrupted (the binding rule is :func:`binding_notice`; ``say``
    prints its notice, on stderr by default)."""
    import uvicorn

    cfg = load_config(path)
    notice = binding_notice(host, port, cfg.token_env, insecure)  # before a model loads
    app = build_app(cfg)
    if notice is not None:
        (say or (lambda line: print(line, file=sys.stderr)))(notice)
    uvicorn.run(app, host=host, port=port, log_level="warning")
