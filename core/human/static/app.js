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
