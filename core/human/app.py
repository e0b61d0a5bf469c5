"""``alignzoo annotate QUEUE_DIR``: the web app annotators judge queued samples in (Starlette
on uvicorn, one HTML page, its script and its style sheet: ``static/app.html``, ``app.js`` and
``app.css`` beside this module, package data).

An annotator signs in with the token ``alignzoo annotate add-annotator QUEUE_DIR NAME``
issued, then judges one item after another, each under the queue's question and what its
scale's points mean (``HumanQueue.set_instructions``): a rating on the item's scale (a button
per point for an integer scale of 3 to 11 points, keys 0-9; a slider otherwise, Enter sends
it), or the better of two responses (``a``, ``b``, ``t`` for a tie); ``x`` is "cannot judge"
for either. ``?`` shows the keys, ``u`` takes back the last judgement within
:data:`UNDO_SECONDS`. Each item goes to as many annotators as it wants, never twice to the
same one. The page shows the annotator's progress and the queue's agreement.

JSON API (every call but the page, its script and style needs ``Authorization: Bearer
<token>``):

- ``GET /api/me``: ``{"annotator": name, "progress": {"judged": n, "open": m},
  "undo_seconds": s}``;
- ``GET /api/next``: ``{"item": {...} | null, "progress": {...}}``, the item this annotator is
  to judge now (``id``, ``kind`` "rating" or "pair", ``prompt``, ``response``, ``other`` for a
  pair's response B, ``low`` and ``high`` of the scale, ``question``, ``labels``: [value,
  meaning] pairs); the same one again until it is judged (or no longer open to them);
- ``POST /api/judge`` with ``{"item": id, "value": number | null}``: stores the judgement of
  the item ``/api/next`` served (null: cannot judge; for a pair 1 = A better, 0 = B better,
  0.5 = a tie);
- ``POST /api/undo`` (body empty, or ``{"item": id}`` to make sure of which): takes back this
  annotator's last judgement if it is at most :data:`UNDO_SECONDS` old and serves its item
  again: ``{"undone": id, "item": {...}, "progress": {...}}``. A run waiting on the queue or
  an export may have read the judgement in those seconds; what they read stays read;
- ``GET /api/stats``: the queue's progress and agreement (the figures of
  :func:`alignzoo.human.export.agreement`, kept up to date from the queue's log of changes by
  :class:`alignzoo.human.agreement.AgreementTracker`: a request costs what changed since the
  last one, not the size of the queue).

Refusals are JSON ``{"error": ...}`` (one line) with a 4xx status, and change nothing stored:
401 for a missing, unknown or revoked token, 400 for a body that is not JSON or is nested
deeper than :data:`MAX_DEPTH`, 422 for one that does not say ``item`` (an integer) and
``value`` (a number or null) or a value off the item's scale, 404 for an unknown item, 409 for
an item this annotator judged already, one that has all its judgements, one that is not the
item served to them, or nothing to undo, 413 for a body over 16 KiB. Every judgement is
committed to the SQLite queue (WAL) before the answer goes out, so a restart of the app loses
none.

Every response carries a Content-Security-Policy without inline script or style (the page
loads ``/app.js`` and ``/app.css``), ``X-Frame-Options: DENY``, ``X-Content-Type-Options:
nosniff``, ``Referrer-Policy: no-referrer`` and ``Cache-Control: no-store``.
"""

from __future__ import annotations

import contextlib
import json
import math
from collections.abc import AsyncIterator, Awaitable, Callable
from importlib import resources
from pathlib import Path
from typing import Any

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import HTMLResponse, JSONResponse, Response
from starlette.routing import Route
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from alignzoo.human.agreement import AgreementTracker, normalise
from alignzoo.human.queue import (
    AlreadyJudged,
    HumanQueue,
    Item,
    ItemComplete,
    NothingToUndo,
    NotServed,
    OffScale,
    UnknownItem,
)

MAX_BODY = 16 * 1024
MAX_DEPTH = 32
"""Brackets a body may nest (``{"item": 1, "value": 2}`` needs one)."""
UNDO_SECONDS = 30.0
"""How long after a judgement its annotator may take it back."""
_MAX_DIGITS = 4000  # an integer literal longer than this is read as infinity (Python refuses it)

CSP = (
    "default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; "
    "img-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
)
SECURITY_HEADERS = {
    "content-security-policy": CSP,
    "x-frame-options": "DENY",
    "x-content-type-options": "nosniff",
    "referrer-policy": "no-referrer",
    "cache-control": "no-store",
    "cross-origin-opener-policy": "same-origin",
}
_HEADERS = [(k.encode(), v.encode()) for k, v in SECURITY_HEADERS.items()]


class SecurityHeaders:
    """ASGI middleware: :data:`SECURITY_HEADERS` on every HTTP response (errors included)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def send_with_headers(message: Message) -> None:
            if message["type"] == "http.response.start":
                kept = [
                    (k, v)
                    for k, v in message.get("headers", [])
                    if k.decode("latin-1").lower() not in SECURITY_HEADERS
                ]
                message = {**message, "headers": kept + _HEADERS}
            await send(message)

        await self.app(scope, receive, send_with_headers)


class _App(Starlette):
    """Starlette with :class:`SecurityHeaders` outside everything, its own error pages too."""

    def build_middleware_stack(self) -> ASGIApp:
        return SecurityHeaders(super().build_middleware_stack())


def _error(status: int, message: str) -> JSONResponse:
    return JSONResponse({"error": " ".join(message.split())}, status_code=status)


def nested_too_deep(body: bytes, limit: int = MAX_DEPTH) -> bool:
    """Whether the JSON text ``body`` opens more than ``limit`` brackets ([ or {) inside one
    another, outside strings (:func:`alignzoo.labeling.protocol.json_depth`: one pass, no
    recursion, before any parser sees it)."""
    from alignzoo.labeling.protocol import json_depth

    return body.count(b"[") + body.count(b"{") > limit and json_depth(body) > limit


def _parse_int(text: str) -> int | float:
    return int(text) if len(text) <= _MAX_DIGITS else math.inf


async def _read_json(request: Request, empty: Any = ...) -> Any:
    """The request's JSON body, or a refusal (a :class:`Response`): 413 over
    :data:`MAX_BODY`, 400 for one that is not JSON or nests deeper than :data:`MAX_DEPTH`.
    ``empty``, when given, stands for an empty body."""
    length = request.headers.get("content-length")
    if length is not None and (not length.isdigit() or int(length) > MAX_BODY):
        return _error(413, f"the body is over {MAX_BODY} bytes")
    body = b""
    async for chunk in request.stream():
        body += chunk
        if len(body) > MAX_BODY:
            return _error(413, f"the body is over {MAX_BODY} bytes")
    if not body.strip() and empty is not ...:
        return empty
    if nested_too_deep(body):
        return _error(400, f"the body is not JSON this app reads: nested over {MAX_DEPTH} deep")
    try:
        return json.loads(body, parse_int=_parse_int)
    except (ValueError, RecursionError):  # JSONDecodeError, UnicodeDecodeError are ValueErrors
        return _error(400, "the body is not JSON")


def _item_json(queue: HumanQueue, item: Item) -> dict[str, Any]:
    instructions = queue.instructions(item.kind)
    return {
        "id": item.id,
        "kind": item.kind,
        "prompt": item.prompt,
        "response": item.response,
        "other": item.other,
        "low": item.low,
        "high": item.high,
        "question": instructions.question,
        "labels": [[v, t] for v, t in queue.labels_for(item, instructions)],
    }


class _LiveAgreement:
    """The queue's agreement, brought up to date from its log of changes when asked."""

    def __init__(self, queue: HumanQueue) -> None:
        self.queue = queue
        self.tracker = AgreementTracker()
        self.seq = 0

    def summary(self) -> dict[str, Any]:
        changes, self.seq = self.queue.changes(self.seq)
        for item, _, value, stored, kind, low, high in changes:
            if value is not None and kind != "pair":
                value = normalise(value, low, high)
            (self.tracker.add if stored else self.tracker.remove)(item, kind, value)
        return self.tracker.summary()


def _static_file(name: str) -> str:
    """A file of the app's page, script or style sheet: package data in ``static/``."""
    return (resources.files("alignzoo.human") / "static" / name).read_text(encoding="utf-8")


def create_app(queue_dir: str | Path, undo_seconds: float = UNDO_SECONDS) -> Starlette:
    """The annotation app over the queue in ``queue_dir``."""
    queue = HumanQueue(queue_dir)
    live = _LiveAgreement(queue)

    def annotator(request: Request) -> str | None:
        header = request.headers.get("authorization", "")
        scheme, _, token = header.partition(" ")
        if scheme.lower() != "bearer" or not token.strip():
            return None
        return queue.annotator(token.strip())

    Handler = Callable[[Request, str], Awaitable[Response]]

    def signed_in(handler: Handler) -> Callable[[Request], Awaitable[Response]]:
        async def wrapped(request: Request) -> Response:
            name = annotator(request)
            if name is None:
                return _error(401, "sign in: send the token add-annotator issued as a Bearer token")
            return await handler(request, name)

        return wrapped

    html, script_js, style_css = (_static_file(name) for name in ("app.html", "app.js", "app.css"))

    async def page(request: Request) -> Response:
        return HTMLResponse(html)

    async def script(request: Request) -> Response:
        return Response(script_js, media_type="text/javascript; charset=utf-8")

    async def style(request: Request) -> Response:
        return Response(style_css, media_type="text/css; charset=utf-8")

    async def no_icon(request: Request) -> Response:
        return Response(status_code=204)

    @signed_in
    async def me(request: Request, name: str) -> Response:
        return JSONResponse(
            {"annotator": name, "progress": queue.progress_of(name), "undo_seconds": undo_seconds}
        )

    @signed_in
    async def next_item(request: Request, name: str) -> Response:
        item = queue.serve(name)
        return JSONResponse(
            {
                "item": None if item is None else _item_json(queue, item),
                "progress": queue.progress_of(name),
            }
        )

    @signed_in
    async def judge(request: Request, name: str) -> Response:
        data = await _read_json(request)
        if isinstance(data, Response):
            return data
        if not isinstance(data, dict) or set(data) != {"item", "value"}:
            return _error(422, 'send {"item": <id>, "value": <number or null>}')
        item, value = data["item"], data["value"]
        if not isinstance(item, int) or isinstance(item, bool):
            return _error(422, f"item must be an integer id, not {item!r}")
        if value is not None and (not isinstance(value, (int, float)) or isinstance(value, bool)):
            return _error(422, f"value must be a number or null, not {value!r}")
        if abs(item) > 2**62:
            return _error(404, f"no queued item {item}")
        try:
            number = None if value is None else float(value)
        except OverflowError:
            return _error(422, "value is too large to be a rating")
        try:
            queue.submit(item, name, number, served_only=True)
        except UnknownItem as exc:
            return _error(404, str(exc))
        except (AlreadyJudged, ItemComplete, NotServed) as exc:
            return _error(409, str(exc))
        except OffScale as exc:
            return _error(422, str(exc))
        return JSONResponse(
            {"stored": True, "progress": queue.progress_of(name), "undo_seconds": undo_seconds}
        )

    @signed_in
    async def undo(request: Request, name: str) -> Response:
        data = await _read_json(request, empty={})
        if isinstance(data, Response):
            return data
        if not isinstance(data, dict) or not set(data) <= {"item"}:
            return _error(422, 'send nothing, or {"item": <id>} (the item judged last)')
        item = data.get("item")
        if item is not None and (not isinstance(item, int) or isinstance(item, bool)):
            return _error(422, f"item must be an integer id, not {item!r}")
        try:
            again = queue.undo(name, undo_seconds, item)
        except NothingToUndo as exc:
            return _error(409, str(exc))
        return JSONResponse(
            {
                "undone": again.id,
                "item": _item_json(queue, again),
                "progress": queue.progress_of(name),
            }
        )

    @signed_in
    async def stats(request: Request, name: str) -> Response:
        return JSONResponse({"progress": queue.progress(), "agreement": live.summary()})

    routes = [
        Route("/", page),
        Route("/app.js", script),
        Route("/app.css", style),
        Route("/favicon.ico", no_icon),
        Route("/api/me", me),
        Route("/api/next", next_item),
        Route("/api/judge", judge, methods=["POST"]),
        Route("/api/undo", undo, methods=["POST"]),
        Route("/api/stats", stats),
    ]

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        live.summary()  # read the log once before the first annotator waits for it
        yield
        queue.close()

    app = _App(routes=routes, lifespan=lifespan)
    app.state.queue = queue
    return app


def serve(queue_dir: str | Path, host: str = "127.0.0.1", port: int = 8766) -> None:
    """Run the app until interrupted (127.0.0.1 unless told otherwise)."""
    import uvicorn

    uvicorn.run(create_app(queue_dir), host=host, port=port, log_level="warning")
