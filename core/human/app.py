"""``alignzoo annotate QUEUE_DIR``: the web app annotators judge queued samples in (Starlette
on uvicorn, one HTML page, its script and its style sheet).

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

    async def page(request: Request) -> Response:
        return HTMLResponse(PAGE)

    async def script(request: Request) -> Response:
        return Response(SCRIPT, media_type="text/javascript; charset=utf-8")

    async def style(request: Request) -> Response:
        return Response(STYLE, media_type="text/css; charset=utf-8")

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


PAGE = """<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>alignzoo annotate</title>
<meta name="viewport" content="width=device-width, initial-scale=1">
<link rel="stylesheet" href="/app.css"><script src="/app.js" defer></script>
</head><body>
<header><h1>alignzoo annotate</h1><span id="who"></span>
<button id="helpbutton" type="button" title="Keyboard help">Keys <kbd>?</kbd></button>
<button id="signout" type="button" hidden>Sign out</button></header>
<form id="signin"><label>Token <input id="token" type="password" autocomplete="off" size="40"></label>
<button type="submit">Sign in</button></form>
<main id="work" hidden>
  <p id="status"></p>
  <section id="item" hidden>
    <h2 id="question"></h2>
    <ul id="guide"></ul>
    <h3>Prompt</h3><pre id="prompt" class="text"></pre>
    <div id="single"><h3>Response</h3><pre id="response" class="text"></pre></div>
    <div id="pair" class="cols" hidden>
      <div><h3>A</h3><pre id="a" class="text"></pre></div><div><h3>B</h3><pre id="b" class="text"></pre></div>
    </div>
  </section>
  <p id="done" hidden>Nothing is waiting for you. Thank you!</p>
  <p id="agreement"></p>
</main>
<div id="controls">
  <div id="buttons"></div>
  <div id="slider" hidden>
    <span id="slow"></span><input id="scale" type="range" aria-label="rating"><span id="shigh"></span>
    <output id="scalevalue" for="scale"></output>
    <button id="send" type="button">Send <kbd>Enter</kbd></button>
    <button id="cannot" type="button" data-key="x">Cannot judge <kbd>x</kbd></button>
  </div>
  <button id="undo" type="button" hidden>Undo <kbd>u</kbd> <span id="undoleft"></span></button>
  <p id="message" class="error" role="alert"></p>
</div>
<dialog id="help" aria-labelledby="helptitle">
  <h2 id="helptitle">Keys</h2>
  <dl>
    <dt><kbd>0</kbd>-<kbd>9</kbd></dt><dd>a rating: the point of the scale with that key (each button shows its key)</dd>
    <dt><kbd>a</kbd> <kbd>b</kbd> <kbd>t</kbd></dt><dd>two responses: A is better, B is better, a tie</dd>
    <dt><kbd>x</kbd></dt><dd>cannot judge (you cannot tell, or it is outside what you know)</dd>
    <dt><kbd>&larr;</kbd> <kbd>&rarr;</kbd> <kbd>Home</kbd> <kbd>End</kbd></dt><dd>a slider: move it (<kbd>0</kbd>-<kbd>9</kbd>: to 0%-90% of the scale); <kbd>Enter</kbd> sends it</dd>
    <dt><kbd>u</kbd></dt><dd>undo your last judgement (for <span id="undosecs">30</span> seconds after it)</dd>
    <dt><kbd>Tab</kbd> <kbd>Enter</kbd></dt><dd>move between the buttons and press one</dd>
    <dt><kbd>?</kbd></dt><dd>show or hide this help; <kbd>Esc</kbd> closes it</dd>
  </dl>
  <button id="helpclose" type="button">Close</button>
</dialog>
</body></html>
"""

STYLE = """
body { font: 16px/1.45 system-ui, sans-serif; max-width: 60rem; margin: 0 auto; padding: 0 1rem; }
header { display: flex; align-items: center; gap: .75rem; flex-wrap: wrap; }
header h1 { font-size: 1.3rem; margin: .6rem 0; flex: 1; }
h2 { font-size: 1.15rem; margin: .6rem 0 .3rem; } h3 { font-size: 1rem; margin: .6rem 0 .2rem; }
.text { white-space: pre-wrap; overflow-wrap: anywhere; word-break: break-word; overflow: auto;
        max-height: 30vh; background: #f4f4f4; padding: .6rem; border-radius: 4px; margin: 0; }
.cols { display: grid; grid-template-columns: minmax(0, 1fr) minmax(0, 1fr); gap: 1rem; }
@media (max-width: 40rem) { .cols { grid-template-columns: minmax(0, 1fr); } }
#guide { margin: 0; padding-left: 1.2rem; color: #333; } #guide li { overflow-wrap: anywhere; }
#controls { position: sticky; bottom: 0; background: #fff; border-top: 1px solid #ddd;
            padding: .4rem 0; }
#buttons, #slider { display: flex; flex-wrap: wrap; align-items: center; gap: .3rem; }
button { font-size: 1rem; padding: .35rem .7rem; }
#buttons button small { display: block; font-size: .7rem; color: #555; max-width: 9rem; }
#scale { flex: 1; min-width: 8rem; } #scalevalue { min-width: 3rem; font-weight: bold; }
kbd { border: 1px solid #999; border-radius: 3px; padding: 0 .3rem; font-size: .85rem; }
#status, #who { color: #555; } .error { color: #b00; margin: .2rem 0; } [hidden] { display: none !important; }
dialog { max-width: 36rem; } dt { font-weight: bold; margin-top: .4rem; } dd { margin-left: 1rem; }
"""

SCRIPT = r"""
"use strict";
let token = sessionStorage.getItem("alignzoo-token") || "";
let who = "";
let current = null;    // the item on screen
let busy = false;      // one request at a time: the next item is shown before the next key counts
let undoSeconds = 30;
let lastJudged = null; // {item, until}: what "undo" takes back, and until when
let undoTimer = null;
const $ = (id) => document.getElementById(id);

class ApiError extends Error {
  constructor(message, status) { super(message); this.status = status; }
}

async function api(path, body) {
  const init = {headers: {"Authorization": "Bearer " + token}};
  if (body !== undefined) {
    init.method = "POST";
    init.headers["Content-Type"] = "application/json";
    init.body = JSON.stringify(body);
  }
  const response = await fetch(path, init);
  let data = {};
  try { data = await response.json(); } catch (error) { data = {}; }
  if (!response.ok) throw new ApiError(data.error || response.statusText, response.status);
  return data;
}

function isShortScale(item) {
  const span = item.high - item.low;
  return Number.isInteger(item.low) && Number.isInteger(item.high) && span >= 2 && span <= 10;
}

function labelOf(item, value) {
  for (const [v, text] of item.labels) if (v === value) return text;
  return "";
}

function choices(item) {
  // [key, text, value, meaning] per button
  if (item.kind === "pair") {
    return [["a", "A is better", 1, ""], ["b", "B is better", 0, ""],
            ["t", "Tie", 0.5, ""], ["x", "Cannot judge", null, ""]];
  }
  const out = [];
  const digits = item.low >= 0 && item.high <= 10;
  let n = 0;
  for (let v = item.low; v <= item.high; v++) {
    n++;
    let key = "";
    if (digits) key = v <= 9 ? String(v) : "";
    else if (n <= 10) key = String(n % 10);
    out.push([key, String(v), v, labelOf(item, v)]);
  }
  out.push(["x", "Cannot judge", null, ""]);
  return out;
}

function fmt(value, item) {
  const v = Number(value), span = item.high - item.low;
  if (Number.isInteger(v) && Number.isInteger(item.low) && Number.isInteger(item.high) && span >= 2) {
    return String(v);
  }
  return v.toFixed(span >= 100 ? 0 : span >= 10 ? 1 : 2);
}

function showGuide(item) {
  $("question").textContent = item.question;
  const guide = $("guide");
  guide.replaceChildren();
  for (const [value, text] of item.labels) {
    const li = document.createElement("li");
    li.textContent = (item.kind === "pair" ? "" : fmt(value, item) + ": ") + text;
    guide.append(li);
  }
}

function makeButton(key, text, value, meaning) {
  const button = document.createElement("button");
  button.type = "button";
  button.dataset.key = key;
  if (value !== null) button.dataset.value = String(value);
  if (key) {
    const kbd = document.createElement("kbd");
    kbd.textContent = key;
    button.append(kbd, " ");
  }
  button.append(text);
  if (meaning) {
    button.title = meaning;
    const small = document.createElement("small");
    small.textContent = meaning;
    button.append(small);
  }
  button.addEventListener("click", () => send(value));
  return button;
}

function showControls(item) {
  const box = $("buttons");
  box.replaceChildren();
  const slider = item !== null && item.kind !== "pair" && !isShortScale(item);
  $("slider").hidden = !slider;
  box.hidden = item === null || slider;
  if (item === null) return;
  if (slider) {
    const input = $("scale");
    const span = item.high - item.low;
    input.min = String(item.low);
    input.max = String(item.high);
    input.step = Number.isInteger(item.low) && Number.isInteger(item.high) && span > 10 ? "1" : String(span / 100);
    input.value = String(item.low + span / 2);
    const end = (v) => fmt(v, item) + (labelOf(item, v) ? " (" + labelOf(item, v) + ")" : "");
    $("slow").textContent = end(item.low);
    $("shigh").textContent = end(item.high);
    $("scalevalue").textContent = fmt(input.value, item);
    return;
  }
  for (const [key, text, value, meaning] of choices(item)) box.append(makeButton(key, text, value, meaning));
}

function showProgress(p) {
  $("status").textContent = "Signed in as " + who + ": " + p.judged + " judged, " + p.open + " open";
}

function show(data) {
  showProgress(data.progress);
  current = data.item;
  $("item").hidden = current === null;
  $("done").hidden = current !== null;
  if (current !== null) {
    showGuide(current);
    $("prompt").textContent = current.prompt;
    const pair = current.kind === "pair";
    $("pair").hidden = !pair;
    $("single").hidden = pair;
    if (pair) { $("a").textContent = current.response; $("b").textContent = current.other; }
    else $("response").textContent = current.response;
    for (const id of ["prompt", "response", "a", "b"]) $(id).scrollTop = 0;
  }
  showControls(current);
}

async function refresh() {
  show(await api("/api/next"));
  updateStats();  // not awaited: keys count again as soon as the next item is shown
}

let statsAsked = 0;
async function updateStats() {
  const asked = ++statsAsked;
  try {
    const stats = await api("/api/stats");
    if (asked !== statsAsked) return;  // a later answer is on its way
    const r = stats.agreement.ratings, q = stats.agreement.pairs;
    const f = (x) => x === null ? "n/a" : x.toFixed(2);
    $("agreement").textContent = "Agreement: ratings alpha " + f(r.krippendorff_alpha) +
      " (" + r.items + " items); pairs " + f(q.raw_agreement) + " raw, alpha " +
      f(q.krippendorff_alpha) + " (" + q.items + " items)";
  } catch (error) {
    if (error instanceof ApiError && error.status === 401) failed(error);
  }
}

function failed(error) {
  if (error instanceof ApiError && error.status === 401) signOut(error.message);
  else $("message").textContent = error.message;
}

function showUndo() {
  const left = lastJudged === null ? 0 : Math.ceil((lastJudged.until - Date.now()) / 1000);
  $("undo").hidden = left <= 0;
  $("undoleft").textContent = left > 0 ? "(" + left + " s)" : "";
  if (left <= 0 && undoTimer !== null) { clearInterval(undoTimer); undoTimer = null; lastJudged = null; }
}

async function send(value) {
  if (current === null || busy) return;
  busy = true;
  const item = current.id;
  try {
    const answer = await api("/api/judge", {item: item, value: value});
    $("message").textContent = "";
    lastJudged = {item: item, until: Date.now() + 1000 * answer.undo_seconds};
    if (undoTimer === null) undoTimer = setInterval(showUndo, 1000);
    showUndo();
  } catch (error) {
    failed(error);
  }
  try { if (token) await refresh(); } catch (error) { failed(error); } finally { busy = false; }
}

async function undo() {
  if (busy || lastJudged === null || lastJudged.until <= Date.now()) return;
  busy = true;
  try {
    const answer = await api("/api/undo", {item: lastJudged.item});
    lastJudged = null;
    showUndo();
    show(answer);
    updateStats();
    $("message").textContent = "Your judgement of that item is taken back: judge it again.";
  } catch (error) {
    lastJudged = null;
    showUndo();
    failed(error);
  } finally { busy = false; }
}

function sendSlider() {
  const input = $("scale");
  const value = Math.min(current.high, Math.max(current.low, Number(input.value)));
  send(value);
}

function nudgeSlider(key, shift) {
  const input = $("scale");
  const lo = Number(input.min), hi = Number(input.max), step = Number(input.step);
  let value = Number(input.value);
  if (key === "Home") value = lo;
  else if (key === "End") value = hi;
  else if (/^[0-9]$/.test(key)) value = lo + (hi - lo) * Number(key) / 10;
  else {
    const sign = key === "ArrowRight" || key === "ArrowUp" ? 1 : -1;
    value += sign * step * (shift ? 10 : 1);
  }
  input.value = String(Math.min(hi, Math.max(lo, value)));
  $("scalevalue").textContent = fmt(input.value, current);
}

function signOut(message) {
  sessionStorage.removeItem("alignzoo-token");
  token = ""; who = ""; current = null; lastJudged = null; showUndo();
  $("work").hidden = true;
  $("signout").hidden = true;
  $("who").textContent = "";
  showControls(null);
  $("signin").hidden = false;
  $("token").value = "";
  $("message").textContent = message || "Signed out.";
  $("token").focus();
}

async function signIn() {
  try {
    const me = await api("/api/me");
    who = me.annotator;
    undoSeconds = me.undo_seconds;
    $("undosecs").textContent = String(undoSeconds);
    sessionStorage.setItem("alignzoo-token", token);
    $("signin").hidden = true;
    $("work").hidden = false;
    $("signout").hidden = false;
    $("who").textContent = who;
    $("message").textContent = "";
    await refresh();
  } catch (error) {
    $("message").textContent = error.message;
  }
}

function toggleHelp() {
  const help = $("help");
  if (help.open) help.close(); else help.showModal();
}

document.addEventListener("DOMContentLoaded", () => {
  $("signin").addEventListener("submit", (event) => {
    event.preventDefault();
    token = $("token").value.trim();
    signIn();
  });
  $("signout").addEventListener("click", () => signOut());
  $("helpbutton").addEventListener("click", toggleHelp);
  $("helpclose").addEventListener("click", () => $("help").close());
  $("undo").addEventListener("click", undo);
  $("send").addEventListener("click", sendSlider);
  $("cannot").addEventListener("click", () => send(null));
  $("scale").addEventListener("input", () => { $("scalevalue").textContent = fmt($("scale").value, current); });
  document.addEventListener("keydown", onKey);
  if (token) signIn();
});

function onKey(event) {
  if (event.ctrlKey || event.metaKey || event.altKey) return;
  const target = event.target;
  const tag = target && target.tagName ? target.tagName : "";
  if ((tag === "INPUT" && target.type !== "range") || tag === "TEXTAREA") return;  // typing
  const key = typeof event.key === "string" ? event.key : "";
  if (key === "?") { event.preventDefault(); toggleHelp(); return; }
  if ($("help").open || token === "" || $("work").hidden) return;  // Esc closes the help itself
  if (event.repeat) return;
  if (key === "u" || key === "U") { event.preventDefault(); undo(); return; }
  if (current === null || busy) return;
  const lower = key.length === 1 ? key.toLowerCase() : key;
  if (!$("slider").hidden) {
    if (lower === "x") { event.preventDefault(); send(null); }
    else if (key === "Enter" && tag !== "BUTTON") { event.preventDefault(); sendSlider(); }
    else if (/^([0-9]|Home|End|Arrow(Left|Right|Up|Down))$/.test(key)) {
      if (tag !== "INPUT") { event.preventDefault(); nudgeSlider(key, event.shiftKey); }
      else if (/^[0-9]$/.test(key)) { event.preventDefault(); nudgeSlider(key, false); }
    }
    return;
  }
  if (lower === "") return;
  for (const button of $("buttons").querySelectorAll("button")) {
    if (button.dataset.key === lower) { event.preventDefault(); button.click(); return; }
  }
}
"""
