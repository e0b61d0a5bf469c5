"""``alignzoo annotate QUEUE_DIR``: the web app annotators judge queued samples in (Starlette
on uvicorn, one HTML page with a little JavaScript).

An annotator signs in with the token ``alignzoo annotate add-annotator QUEUE_DIR NAME``
issued, then judges one item after another: a rating on the item's scale (keys 1-9 for the
scale's steps), or the better of two responses (``a``, ``b``, ``t`` for a tie); ``x`` is
"cannot judge" for either. Each item goes to as many annotators as it wants, never twice to
the same one. The page shows the annotator's progress and the queue's agreement.

JSON API (every call but ``GET /`` needs ``Authorization: Bearer <token>``):

- ``GET /api/me``: ``{"annotator": name, "progress": {"judged": n, "open": m}}``;
- ``GET /api/next``: ``{"item": {...} | null, "progress": {...}}``, the next item for this
  annotator (``id``, ``kind`` "rating" or "pair", ``prompt``, ``response``, ``other`` for a
  pair's response B, ``low`` and ``high`` of the scale);
- ``POST /api/judge`` with ``{"item": id, "value": number | null}``: stores the judgement
  (null: cannot judge; for a pair 1 = A better, 0 = B better, 0.5 = a tie);
- ``GET /api/stats``: the queue's progress and agreement (:func:`alignzoo.human.export.agreement`).

Refusals are JSON ``{"error": ...}`` with a 4xx status, and change nothing stored: 401 for a
missing or unknown token, 400 for a body that is not JSON, 422 for one that does not say
``item`` (an integer) and ``value`` (a number or null) or a value off the item's scale, 404
for an unknown item, 409 for an item this annotator judged already or one that has all its
judgements, 413 for a body over 16 KiB. Every judgement is committed to the SQLite queue (WAL)
before the answer goes out, so a restart of the app loses none.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import HTMLResponse, JSONResponse, Response
from starlette.routing import Route

from alignzoo.human.queue import (
    AlreadyJudged,
    HumanQueue,
    Item,
    ItemComplete,
    OffScale,
    UnknownItem,
)

MAX_BODY = 16 * 1024


def _error(status: int, message: str) -> JSONResponse:
    return JSONResponse({"error": message}, status_code=status)


def _item_json(item: Item) -> dict[str, Any]:
    return {
        "id": item.id,
        "kind": item.kind,
        "prompt": item.prompt,
        "response": item.response,
        "other": item.other,
        "low": item.low,
        "high": item.high,
    }


def create_app(queue_dir: str | Path) -> Starlette:
    """The annotation app over the queue in ``queue_dir``."""
    queue = HumanQueue(queue_dir)

    def annotator(request: Request) -> str | None:
        header = request.headers.get("authorization", "")
        scheme, _, token = header.partition(" ")
        if scheme.lower() != "bearer" or not token.strip():
            return None
        return queue.annotator(token.strip())

    def signed_in(handler: Any) -> Any:
        async def wrapped(request: Request) -> Response:
            name = annotator(request)
            if name is None:
                return _error(401, "sign in: send the token add-annotator issued as a Bearer token")
            return await handler(request, name)

        return wrapped

    async def page(request: Request) -> Response:
        return HTMLResponse(PAGE)

    @signed_in
    async def me(request: Request, name: str) -> Response:
        return JSONResponse({"annotator": name, "progress": queue.progress_of(name)})

    @signed_in
    async def next_item(request: Request, name: str) -> Response:
        item = queue.next_for(name)
        return JSONResponse(
            {
                "item": None if item is None else _item_json(item),
                "progress": queue.progress_of(name),
            }
        )

    @signed_in
    async def judge(request: Request, name: str) -> Response:
        length = request.headers.get("content-length")
        if length is not None and (not length.isdigit() or int(length) > MAX_BODY):
            return _error(413, f"the body is over {MAX_BODY} bytes")
        body = b""
        async for chunk in request.stream():
            body += chunk
            if len(body) > MAX_BODY:
                return _error(413, f"the body is over {MAX_BODY} bytes")
        try:
            data = json.loads(body)
        except (json.JSONDecodeError, UnicodeDecodeError):
            return _error(400, "the body is not JSON")
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
            queue.submit(item, name, number)
        except UnknownItem as exc:
            return _error(404, str(exc))
        except (AlreadyJudged, ItemComplete) as exc:
            return _error(409, str(exc))
        except OffScale as exc:
            return _error(422, str(exc))
        return JSONResponse({"stored": True, "progress": queue.progress_of(name)})

    @signed_in
    async def stats(request: Request, name: str) -> Response:
        from alignzoo.human.export import agreement

        return JSONResponse({"progress": queue.progress(), "agreement": agreement(queue)})

    routes = [
        Route("/", page),
        Route("/api/me", me),
        Route("/api/next", next_item),
        Route("/api/judge", judge, methods=["POST"]),
        Route("/api/stats", stats),
    ]

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        yield
        queue.close()

    app = Starlette(routes=routes, lifespan=lifespan)
    app.state.queue = queue
    return app


def serve(queue_dir: str | Path, host: str = "127.0.0.1", port: int = 8766) -> None:
    """Run the app until interrupted (127.0.0.1 unless told otherwise)."""
    import uvicorn

    uvicorn.run(create_app(queue_dir), host=host, port=port, log_level="warning")


PAGE = """<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>alignzoo annotate</title>
<meta name="viewport" content="width=device-width, initial-scale=1">
<style>
body { font: 16px/1.45 system-ui, sans-serif; max-width: 60rem; margin: 2rem auto; padding: 0 1rem; }
pre { white-space: pre-wrap; background: #f4f4f4; padding: .75rem; border-radius: 4px; }
.cols { display: grid; grid-template-columns: 1fr 1fr; gap: 1rem; }
button { font-size: 1rem; margin: .2rem; padding: .4rem .8rem; }
kbd { border: 1px solid #999; border-radius: 3px; padding: 0 .3rem; font-size: .85rem; }
#status { color: #555; } .error { color: #b00; } [hidden] { display: none; }
</style></head><body>
<h1>alignzoo annotate</h1>
<form id="signin"><label>Token <input id="token" type="password" autocomplete="off" size="40"></label>
<button type="submit">Sign in</button></form>
<div id="work" hidden>
  <p id="status"></p>
  <div id="item" hidden>
    <h3>Prompt</h3><pre id="prompt"></pre>
    <div id="single"><h3>Response</h3><pre id="response"></pre></div>
    <div id="pair" class="cols" hidden>
      <div><h3>A</h3><pre id="a"></pre></div><div><h3>B</h3><pre id="b"></pre></div>
    </div>
    <div id="buttons"></div>
  </div>
  <p id="done" hidden>Nothing is waiting for you. Thank you!</p>
  <p id="agreement"></p>
</div>
<p id="message" class="error"></p>
<script>
"use strict";
let token = sessionStorage.getItem("alignzoo-token") || "";
let current = null;
const $ = (id) => document.getElementById(id);

async function api(path, body) {
  const init = {headers: {"Authorization": "Bearer " + token}};
  if (body !== undefined) {
    init.method = "POST";
    init.headers["Content-Type"] = "application/json";
    init.body = JSON.stringify(body);
  }
  const response = await fetch(path, init);
  const data = await response.json();
  if (!response.ok) throw new Error(data.error || response.statusText);
  return data;
}

function choices(item) {
  if (item.kind === "pair") {
    return [["a", "A is better", 1], ["b", "B is better", 0], ["t", "Tie", 0.5], ["x", "Cannot judge", null]];
  }
  const out = [];
  const steps = item.high - item.low;
  if (Number.isInteger(item.low) && Number.isInteger(item.high) && steps <= 8) {
    for (let v = item.low; v <= item.high; v++) out.push([String(v - item.low + 1), String(v), v]);
  } else {
    for (let k = 0; k <= 4; k++) {
      const v = k === 4 ? item.high : item.low + k * steps / 4;
      out.push([String(k + 1), v.toFixed(2), v]);
    }
  }
  out.push(["x", "Cannot judge", null]);
  return out;
}

function show(data) {
  const p = data.progress;
  $("status").textContent = "Signed in as " + who + ": " + p.judged + " judged, " + p.open + " open";
  current = data.item;
  $("item").hidden = current === null;
  $("done").hidden = current !== null;
  if (current === null) return;
  $("prompt").textContent = current.prompt;
  const pair = current.kind === "pair";
  $("pair").hidden = !pair;
  $("single").hidden = pair;
  if (pair) { $("a").textContent = current.response; $("b").textContent = current.other; }
  else $("response").textContent = current.response;
  const box = $("buttons");
  box.replaceChildren();
  for (const [key, label, value] of choices(current)) {
    const button = document.createElement("button");
    button.dataset.key = key;
    button.innerHTML = "<kbd></kbd> ";
    button.firstChild.textContent = key;
    button.append(label);
    button.addEventListener("click", () => send(value));
    box.append(button);
  }
}

let who = "";
async function refresh() {
  show(await api("/api/next"));
  const stats = await api("/api/stats");
  const r = stats.agreement.ratings, q = stats.agreement.pairs;
  const fmt = (x) => x === null ? "n/a" : x.toFixed(2);
  $("agreement").textContent = "Agreement: ratings alpha " + fmt(r.krippendorff_alpha) +
    " (" + r.items + " items); pairs " + fmt(q.raw_agreement) + " raw, alpha " +
    fmt(q.krippendorff_alpha) + " (" + q.items + " items)";
}

let busy = false;
async function send(value) {
  if (current === null || busy) return;
  busy = true;  // one judgement at a time: the next item is shown before the next key counts
  try {
    await api("/api/judge", {item: current.id, value: value});
    $("message").textContent = "";
  } catch (error) {
    $("message").textContent = error.message;
  }
  try { await refresh(); } finally { busy = false; }
}

async function signIn() {
  try {
    const me = await api("/api/me");
    who = me.annotator;
    sessionStorage.setItem("alignzoo-token", token);
    $("signin").hidden = true;
    $("work").hidden = false;
    $("message").textContent = "";
    await refresh();
  } catch (error) {
    $("message").textContent = error.message;
  }
}

$("signin").addEventListener("submit", (event) => {
  event.preventDefault();
  token = $("token").value.trim();
  signIn();
});
document.addEventListener("keydown", (event) => {
  if (current === null || busy || event.target.tagName === "INPUT") return;
  if (event.ctrlKey || event.metaKey || event.altKey || event.repeat) return;
  const button = document.querySelector('#buttons button[data-key="' + event.key.toLowerCase() + '"]');
  if (button) { event.preventDefault(); button.click(); }
});
if (token) signIn();
</script></body></html>
"""
