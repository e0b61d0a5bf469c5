"""The labeler service's wire format, protocol version 1 (JSON over HTTP): the one definition
the server (:mod:`alignzoo.labeling.service`) and its client (the ``http`` labeler) share.

- ``POST /v1/score``: a :class:`ScoreRequest` body ``{"version": 1, "requests": [{"prompt",
  "response", "extra"}, ...]}``, answered ``{"version": 1, "labeler": <identity>, "scores":
  [...]}`` with one :func:`score_to_json` object per request, in order (a value's step
  scores, when it has them, as ``"steps": [[start, end, score], ...]``).
- ``GET /health``: ``{"status": "ok", "labeler": <identity>, "version": 1}``.

Bodies are read with :func:`loads_limited`: UTF-8 JSON nested at most :data:`MAX_JSON_DEPTH`
levels, checked before parsing and without recursion (any JSON body a server reads can use it).
"""

from __future__ import annotations

import json
import math
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from alignzoo.labeling.interface import LabelRequest, Outcome, Score, StepScore

PROTOCOL_VERSION = 1

MAX_JSON_DEPTH = 64
"""Deepest nesting of arrays and objects a JSON body may have (``[[1]]`` is 2 levels); a
protocol body needs 4 (the body, ``requests``, an item, its ``extra``)."""


class JSONLimitError(ValueError):
    """A body that is not UTF-8 JSON, or is nested deeper than allowed (a 400, one line)."""


def json_depth(body: bytes) -> int:
    """How deep the arrays and objects of the JSON text ``body`` (UTF-8) nest, counting the
    brackets outside strings, without recursion and without parsing (numpy, linear time).

    For a body that is not JSON the count is still at least the depth a JSON parser reaches
    before it fails: up to a parser's first error the text is valid JSON, where a quote not
    escaped by an odd run of backslashes opens or closes a string. UTF-8 only (a byte of a
    multi-byte UTF-8 character is never a quote, backslash or bracket)."""
    import numpy as np

    data = np.frombuffer(body, dtype=np.uint8)
    quotes = np.flatnonzero(data == 0x22)
    slashes = np.flatnonzero(data == 0x5C)
    if quotes.size and slashes.size:  # drop the quotes an odd run of backslashes escapes
        new_run = np.empty(slashes.size, dtype=bool)
        new_run[0] = True
        np.not_equal(slashes[1:], slashes[:-1] + 1, out=new_run[1:])
        run_start = slashes[new_run][np.cumsum(new_run) - 1]  # per backslash: its run's start
        last = np.searchsorted(slashes, quotes) - 1  # the last backslash before each quote
        safe = np.maximum(last, 0)
        touching = (last >= 0) & (slashes[safe] == quotes - 1)
        run = np.where(touching, quotes - run_start[safe], 0)
        quotes = quotes[run % 2 == 0]
    steps = np.zeros(256, dtype=np.int8)  # +1 for an opening bracket, -1 for a closing one
    steps[[ord("["), ord("{")]] = 1
    steps[[ord("]"), ord("}")]] = -1
    brackets = np.flatnonzero(steps[data])
    if quotes.size:  # outside strings: an even number of string quotes before the bracket
        brackets = brackets[np.searchsorted(quotes, brackets) % 2 == 0]
    if not brackets.size:
        return 0
    return max(0, int(np.cumsum(steps[data[brackets]], dtype=np.int64).max()))


def loads_limited(body: bytes | str, max_depth: int = MAX_JSON_DEPTH) -> Any:
    """``json.loads`` of a request body that refuses, with :class:`JSONLimitError` (a
    ``ValueError`` with a one-line message), a body that is not UTF-8, is nested deeper than
    ``max_depth`` levels (checked first, by :func:`json_depth`, so the parser never recurses
    deeper: no ``RecursionError``) or is not JSON."""
    raw = body.encode() if isinstance(body, str) else bytes(body)
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise JSONLimitError(f"the body is not UTF-8 ({exc.reason} at byte {exc.start})") from None
    if json_depth(raw) > max_depth:
        raise JSONLimitError(f"the body is nested deeper than {max_depth} levels")
    try:
        return json.loads(text)
    except RecursionError:  # only if the interpreter's recursion limit is below max_depth
        raise JSONLimitError("the body is nested too deep for this server") from None
    except ValueError as exc:  # JSONDecodeError, an integer too long to convert
        raise JSONLimitError(f"the body is not JSON: {' '.join(str(exc).split())}") from None


class RequestItem(BaseModel):
    """One request on the wire: a :class:`~alignzoo.labeling.interface.LabelRequest`."""

    model_config = ConfigDict(extra="forbid")

    prompt: str
    response: str
    extra: dict[str, Any] = Field(default_factory=dict)


class ScoreRequest(BaseModel):
    """The body of ``POST /v1/score``."""

    model_config = ConfigDict(extra="forbid")

    version: int = PROTOCOL_VERSION
    requests: list[RequestItem]


def request_body(requests: list[LabelRequest]) -> dict[str, Any]:
    """The JSON body of ``POST /v1/score`` for ``requests``."""
    return {
        "version": PROTOCOL_VERSION,
        "requests": [
            {"prompt": r.prompt, "response": r.response, "extra": r.extra} for r in requests
        ],
    }


def score_to_json(score: Score) -> dict[str, Any]:
    """One score on the wire (a value only for a ``value`` outcome; JSON has no NaN)."""
    value = float(score.value) if score.outcome == Outcome.VALUE else None
    if value is not None and not math.isfinite(value):
        value = None  # JSON has no NaN; the client sees a value-less 'value' outcome: rejected
    out = {
        "value": value,
        "valid": bool(score.valid),
        "outcome": score.outcome.value,
        "info": score.info,
    }
    if score.steps and value is not None:  # a value's step scores: [[start, end, score], ...]
        out["steps"] = [[s.start, s.end, float(s.score)] for s in score.steps]
    return out


def score_from_json(item: Any) -> Any:
    """The :class:`Score` a wire object stands for; anything that is not an object is returned
    as it is, for the labeling stage to reject. An unknown outcome reads as ``value``, and a
    null value of a ``value`` outcome as NaN (rejected by the stage)."""
    if not isinstance(item, dict):
        return item
    known = {o.value for o in Outcome}
    outcome = Outcome(item["outcome"]) if item.get("outcome") in known else Outcome.VALUE
    info = dict(item.get("info") or {})
    if outcome != Outcome.VALUE:
        return Score(math.nan, False, info, outcome)
    value = item.get("value")
    steps = item.get("steps") or []
    if isinstance(steps, list) and all(
        isinstance(step, list) and len(step) == 3 for step in steps
    ):  # anything else is handed on as it is, for the labeling stage to reject
        steps = [StepScore(*step) for step in steps]
    return Score(
        math.nan if value is None else value, bool(item.get("valid", True)), info, steps=steps
    )
